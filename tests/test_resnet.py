"""The hybrid's BiT ResNet (tinyvit/models/resnet.py): gradient checks of its layers in float64
(StdConv2d, GroupNorm, 'SAME' max-pooling, a bottleneck unit with and without projection), the
'SAME' padding arithmetic, the zero-initialised last norm, feature-map sizes of the paper's layouts,
parameter counts and FLOPs from the layout alone, and clear errors."""
import numpy as np
import pytest

import tinyvit as tv
from tinyvit import nn
from tinyvit.backend import default_dtype
from tinyvit.models import resnet
from tinyvit.models.resnet import (Bottleneck, ResNet, StdConv2d, count_parameters, max_pool2d_same,
                                   same_padding, without_last_stage)


def x64(*shape, seed=0, requires_grad=True):
    return tv.Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=requires_grad)


def randomize(module, seed=0):
    """Random weights everywhere, norms near 1/0 but not exactly (the zero-init GN3 scale would
    otherwise cut the residual branch off the graph)."""
    rng = np.random.default_rng(seed + 50)
    for name, p in module.named_parameters():
        values = rng.standard_normal(p.shape)
        if ".norm" in name or name.startswith("norm"):
            values = (1.0 if name.endswith("weight") else 0.0) + 0.3 * values
        p.data[...] = values
    return module


def gradcheck_module(module, x, **kw):
    params = list(module.parameters())
    assert all(p.dtype == np.float64 for p in params)
    result = tv.gradcheck(lambda x, *ps: module(x), [x] + params, **kw)
    for name, t in [("input", x)] + list(module.named_parameters()):
        assert t.grad is not None and np.abs(t.grad).max() > 0, f"{name} got no gradient"
    return result


# ====================================================================== 'SAME' padding


@pytest.mark.parametrize("size,kernel,stride,expected", [
    (224, 7, 2, (2, 3)),      # the root conv: one more pixel after than before
    (112, 3, 2, (0, 1)),      # the root max-pool
    (56, 3, 1, (1, 1)),       # a stride-1 3x3 conv: symmetric
    (56, 3, 2, (0, 1)),       # a stage's strided 3x3
    (56, 1, 2, (0, 0)),       # the strided 1x1 projection needs none
    (7, 3, 2, (1, 1)),        # odd sizes: symmetric again
    (32, 3, 1, (1, 1)),
])
def test_same_padding_as_tensorflow(size, kernel, stride, expected):
    assert same_padding(size, kernel, stride) == expected
    lo, hi = expected
    assert (size + lo + hi - kernel) // stride + 1 == -(-size // stride)   # output is ceil(size / stride)


def test_conv2d_same_matches_an_explicitly_padded_conv():
    """'SAME' on an even size pads (2, 3) for 7x7/2: compare with zero-padding by hand, then a VALID conv."""
    x = np.random.default_rng(0).standard_normal((2, 3, 10, 12))
    w = np.random.default_rng(1).standard_normal((4, 3, 7, 7))
    ours = resnet.conv2d_same(tv.Tensor(x), tv.Tensor(w), stride=2).numpy()
    padded = np.pad(x, ((0, 0), (0, 0), (2, 3), (2, 3)))
    expected = tv.functional.conv2d(tv.Tensor(padded), tv.Tensor(w), stride=2).numpy()
    assert ours.shape == (2, 4, 5, 6)
    np.testing.assert_allclose(ours, expected, rtol=1e-12, atol=1e-12)


# ====================================================================== gradient checks (float64)


@pytest.mark.parametrize("cin,cout,kernel,stride,size", [
    (3, 4, 7, 2, 8),          # root conv, asymmetric padding
    (4, 6, 3, 2, 6),          # strided 3x3, asymmetric padding
    (4, 5, 3, 1, 5),          # 3x3, symmetric padding
    (6, 4, 1, 2, 6),          # strided 1x1 projection
    (3, 4, 3, 2, 5),          # odd size
])
def test_stdconv2d_gradcheck(cin, cout, kernel, stride, size):
    with default_dtype(np.float64):
        conv = randomize(StdConv2d(cin, cout, kernel, stride))
    x = x64(2, cin, size, size)
    y = conv(x)
    assert y.shape == (2, cout, -(-size // stride), -(-size // stride))
    gradcheck_module(conv, x, max_full=200, directions=6)


def test_stdconv2d_standardizes_each_output_channel():
    """The conv sees (w - mean) / sqrt(var + eps) per output channel: scaling and shifting a
    channel's kernel changes nothing."""
    with default_dtype(np.float64):
        conv = StdConv2d(3, 4, 3)
    x = x64(1, 3, 5, 5, requires_grad=False)
    y = conv(x).numpy()
    conv.weight.data[...] = conv.weight.data * np.array([1, 3, 0.5, 10.0])[:, None, None, None] + 0.7
    np.testing.assert_allclose(conv(x).numpy(), y, rtol=1e-6, atol=1e-9)


def test_stdconv2d_gradcheck_catches_a_wrong_weight_standardization_backward(monkeypatch):
    from tinyvit.ops.norm import WeightStandardize
    right = WeightStandardize.backward
    monkeypatch.setattr(WeightStandardize, "backward", lambda self, gy: 1.01 * right(self, gy))
    with default_dtype(np.float64):
        conv = randomize(StdConv2d(3, 4, 3, 2))
    result = tv.gradcheck(lambda x, w: conv(x), [x64(2, 3, 6, 6), conv.weight], raise_on_failure=False)
    assert not result.ok and "(4, 3, 3, 3)" in result.where, str(result)


@pytest.mark.parametrize("groups,channels", [(2, 4), (4, 4), (1, 3)])
def test_group_norm_module_gradcheck(groups, channels):
    with default_dtype(np.float64):
        norm = randomize(nn.GroupNorm(groups, channels, eps=resnet.GN_EPS))
    gradcheck_module(norm, x64(2, channels, 3, 5))


@pytest.mark.parametrize("size,kernel,stride", [(8, 3, 2), (7, 3, 2), (6, 3, 1), (6, 2, 2), (5, 2, 1)])
def test_max_pool_same_gradcheck(size, kernel, stride):
    """Distinct values (a permutation) so that no window has a tie the finite differences could flip."""
    rng = np.random.default_rng(size + kernel + stride)
    x = tv.Tensor(rng.permutation(2 * 3 * size * size).reshape(2, 3, size, size) * 0.1, requires_grad=True)
    y = max_pool2d_same(x, kernel, stride)
    assert y.shape == (2, 3, -(-size // stride), -(-size // stride))
    tv.gradcheck(lambda x: max_pool2d_same(x, kernel, stride), [x], eps=1e-4)


def test_max_pool_same_pads_with_minus_infinity():
    """All-negative input: a zero padding would win the border windows, -inf never does."""
    x = -1.0 - np.arange(16.0).reshape(1, 1, 4, 4)
    y = max_pool2d_same(tv.Tensor(x), 3, 2).numpy()
    np.testing.assert_array_equal(y[0, 0], [[-1.0, -3.0], [-9.0, -11.0]])   # windows rows/cols {0..2}, {2, 3}


@pytest.mark.parametrize("cin,mid,stride", [(8, 2, 2), (8, 2, 1), (4, 2, 1)],
                         ids=["projection-strided", "identity", "projection-channels"])
def test_bottleneck_gradcheck(cin, mid, stride):
    with default_dtype(np.float64):
        unit = randomize(Bottleneck(cin, mid, stride, groups=2))
    assert (unit.downsample is None) == (cin == 4 * mid and stride == 1)
    x = x64(2, cin, 6, 6)
    assert unit(x).shape == (2, 4 * mid, 6 // stride, 6 // stride)
    gradcheck_module(unit, x, max_full=100, directions=6)


# ====================================================================== structure and init


def test_last_norm_scale_starts_at_zero_so_a_unit_starts_as_its_shortcut():
    with default_dtype(np.float64):
        unit = Bottleneck(8, 2, 1, groups=2)                 # identity shortcut
        proj = Bottleneck(4, 2, 2, groups=2)                 # projection shortcut
    for u in (unit, proj):
        np.testing.assert_array_equal(u.norm3.weight.data, 0.0)
        np.testing.assert_array_equal(u.norm3.bias.data, 0.0)
        for norm in (u.norm1, u.norm2):
            np.testing.assert_array_equal(norm.weight.data, 1.0)
    x = x64(2, 8, 4, 4, requires_grad=False)
    np.testing.assert_array_equal(unit(x).numpy(), np.maximum(x.numpy(), 0.0))
    x = x64(2, 4, 4, 4, requires_grad=False)
    np.testing.assert_array_equal(proj(x).numpy(), np.maximum(proj.downsample(x).numpy(), 0.0))
    net = ResNet((2, 1), width_factor=1 / 8, groups=4)
    zero = [n for n, p in net.named_parameters() if n.endswith("norm3.weight")]
    assert len(zero) == 3 and all(np.all(p.data == 0) for n, p in net.named_parameters() if n in zero)


def test_parameter_names_are_timms():
    net = ResNet((1, 2), width_factor=1 / 8, groups=4)
    names = [n for n, _ in net.named_parameters()]
    assert names[:3] == ["stem.conv.weight", "stem.norm.weight", "stem.norm.bias"]
    for expected in ("stages.0.blocks.0.downsample.conv.weight", "stages.0.blocks.0.downsample.norm.bias",
                     "stages.0.blocks.0.conv1.weight", "stages.0.blocks.0.norm1.weight",
                     "stages.1.blocks.1.conv3.weight", "stages.1.blocks.1.norm3.bias"):
        assert expected in names
    assert not any("stages.1.blocks.1.downsample" in n for n in names)   # only the first unit projects


def test_layout_helpers():
    assert without_last_stage(resnet.LAYOUTS["r50"]) == (3, 4, 9)      # the paper's R50 hybrid
    assert without_last_stage(resnet.LAYOUTS["r26"]) == (2, 2, 4)
    assert resnet.total_stride((3, 4, 9)) == 16 and resnet.total_stride((3, 4, 6, 3)) == 32
    assert resnet.total_stride((1, 1, 2), "light") == 4 and resnet.total_stride((), "bit") == 4
    assert resnet.out_channels((3, 4, 9)) == 1024 and resnet.out_channels((3, 4, 6, 3)) == 2048
    assert resnet.out_channels((3, 4, 9), 2) == 2048 and resnet.out_channels((), 1) == 64


@pytest.mark.parametrize("layers,side,channels", [((3, 4, 9), 14, 128), ((3, 4, 6, 3), 7, 256)],
                         ids=["r50-stage4-in-stage3", "r50"])
def test_feature_map_of_the_papers_layouts_at_224(layers, side, channels):
    """Section 4.1: the (3, 4, 9) layout gives 14x14 positions at 224 px (16 px each), the full R50
    7x7 (32 px each). A 1/8-width net (root 8 channels) keeps this cheap; the sizes do not depend on
    the width."""
    net = ResNet(layers, width_factor=1 / 8, groups=8)
    with tv.no_grad():
        y = net(tv.Tensor(np.zeros((1, 3, 224, 224), np.float32)))
    assert y.shape == (1, channels, side, side) and y.dtype == np.float32
    assert net.stride == 224 // side and net.out_channels == channels


@pytest.mark.parametrize("layers,wf,cin,root,groups", [
    ((1, 2), 1 / 8, 3, "bit", 4), ((2, 1, 1), 0.25, 1, "light", 8), ((), 0.5, 3, "bit", 32), ((1,), 1, 2, "light", 32)])
def test_count_parameters_matches_the_built_network(layers, wf, cin, root, groups):
    net = ResNet(layers, wf, cin, root, groups)
    assert count_parameters(layers, wf, cin, root) == net.num_parameters()


def test_r50_counts_and_flops_are_resnet50s():
    """The (3, 4, 6, 3) network without its 1000-class head: 25.557M - 2.049M (fc) = 23.508M
    parameters (torchvision's ResNet-50 layer for layer, GroupNorm in place of BatchNorm), and
    4.09 GMACs at 224 px (conv layers only, the fc is 2M)."""
    assert count_parameters((3, 4, 6, 3)) == 23_508_032
    assert abs(resnet.forward_flops((3, 4, 6, 3)) / 2 / 1e9 - 4.09) < 0.02


# ====================================================================== errors


def test_wrong_input_channels_name_the_shapes():
    net = ResNet((1,), width_factor=1 / 8, groups=4)
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\).*\(2, 1, 16, 16\)"):
        net(tv.Tensor(np.zeros((2, 1, 16, 16), np.float32)))
    with pytest.raises(ValueError, match=r"StdConv2d expects \(B, 3, H, W\), got \(2, 16, 16\)"):
        StdConv2d(3, 4, 3)(tv.Tensor(np.zeros((2, 16, 16), np.float32)))


def test_groups_that_do_not_divide_the_width_are_named():
    with pytest.raises(ValueError, match="12 channels cannot form 32 groups"):
        Bottleneck(8, 3, 1)
    with pytest.raises(ValueError, match="root must be one of"):
        ResNet((1,), root="deep")
