"""Half precision: no op returns NaN or infinity in float16 where float32 gives a number float16 can
hold (|y| <= 65504), on the same inputs (float16 values, so both see exactly the same numbers).

Inputs are realistic activations: normal with a standard deviation from 1 to 8, and a few large
values (+-60000, near float16's limit) that a squared deviation or an exp would overflow. A whole
ViT in float16 gives finite logits too.
"""
import numpy as np
import pytest

import tinyvit as tv
from tinyvit.kernels import use_kernels
import tinyvit.functional as F
from tinyvit.models.vit import ViT, ViTConfig

HALF_MAX = float(np.finfo(np.float16).max)       # 65504


def activations(shape, std, seed=0, large=60000.0):
    """float16 values, normal(0, std), with +-large at one place in 50."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, std, shape)
    flat = x.reshape(-1)
    places = rng.choice(flat.size, size=max(1, flat.size // 50), replace=False)
    flat[places] = large * rng.choice([-1.0, 1.0], size=places.size)
    return x.astype(np.float16)


def weights(shape, fan_in, seed=1):
    """float16 weights of the usual scale, normal(0, 1 / fan_in)."""
    return (np.random.default_rng(seed).normal(0.0, 1.0, shape) / np.sqrt(fan_in)).astype(np.float16)


def vector(n, seed):
    """A norm's scale or a bias: n float16 values, normal(0, 1)."""
    return np.random.default_rng(seed).normal(0.0, 1.0, n).astype(np.float16)


def both(xp, op, *arrays):
    """op on ``arrays`` (the floating ones float16) and on the same values in float32, on the array
    module ``xp``: the two results as float64 NumPy arrays."""
    def run(dtype):
        out = op(*[xp.asarray(a.astype(dtype) if a.dtype.kind == "f" else a) for a in arrays])
        return np.asarray(tv.backend.to_numpy(out.data), dtype=np.float64)
    return run(np.float16), run(np.float32)


def check(half, single, op_name):
    """Wherever float32 gives a number float16 can hold, float16 gives a number (not NaN, not inf),
    and nearly the same one: within 1% of its size plus the largest result's (a normalisation whose
    variance overflowed would give zeros, finite but wrong)."""
    holdable = np.isfinite(single) & (np.abs(single) <= HALF_MAX)
    bad = holdable & ~np.isfinite(half)
    assert not bad.any(), (f"{op_name}: float16 gives {half[bad][:4]} where float32 gives {single[bad][:4]} "
                           f"({bad.sum()} of {bad.size} values)")
    scale = np.abs(single[holdable]).max(initial=0.0)
    off = holdable & (np.abs(half - single) > 0.01 * (np.abs(single) + scale))
    assert not off.any(), f"{op_name}: float16 gives {half[off][:4]} where float32 gives {single[off][:4]}"


# name -> (the op, its inputs for activations of standard deviation s)
D = 16
OPS = {
    "gelu": (lambda x: F.gelu(x), lambda s: [activations((4, 8, D), s)]),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), lambda s: [activations((4, 8, D), s)]),
    "layer_norm": (F.layer_norm, lambda s: [activations((4, 8, D), s), vector(D, 2), vector(D, 3)]),
    "softmax": (F.softmax, lambda s: [activations((4, 8, D), s)]),
    "log_softmax": (F.log_softmax, lambda s: [activations((4, 8, D), s)]),
    "cross_entropy": (F.cross_entropy, lambda s: [activations((8, D), s), np.arange(8)]),
    "cross_entropy_smoothed": (lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1),
                               lambda s: [activations((8, D), s), np.arange(8)]),
    "linear": (F.linear, lambda s: [activations((4, 8, D), s), weights((D, 24), D), vector(24, 4)]),
    "multi_head_attention": (
        lambda x, wq, bq, wp, bp: F.multi_head_attention(x, wq, bq, wp, bp, num_heads=4),
        lambda s: [activations((2, 8, D), s), weights((D, 3 * D), D), vector(3 * D, 5), weights((D, D), D, 6),
                   vector(D, 7)]),
    "patch_embed": (lambda x, w, b: F.patch_embed(x, w, b, 4),
                    lambda s: [activations((2, 3, 8, 8), s), weights((48, D), 48), vector(D, 8)]),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, stride=1, padding=1),
               lambda s: [activations((2, 4, 6, 6), s), weights((8, 4, 3, 3), 36), vector(8, 9)]),
    "group_norm": (lambda x, w, b: F.group_norm(x, 2, w, b),
                   lambda s: [activations((2, 8, 4, 4), s), vector(8, 10), vector(8, 11)]),
    "weight_standardize": (F.weight_standardize, lambda s: [activations((8, 4, 3, 3), s)]),
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, 2, 1), lambda s: [activations((2, 4, 8, 8), s)]),
    "dropout_eval": (lambda x: F.dropout(x, 0.5, training=False), lambda s: [activations((4, 8, D), s)]),
    "drop_path_eval": (lambda x: F.drop_path(x, 0.5, training=False), lambda s: [activations((4, 8, D), s)]),
    "mse": (F.mse,                                        # a few differences whose square overflows float16
            lambda s: [activations((4, 8, D), s, large=300.0), activations((4, 8, D), s, 12, large=300.0)]),
}


@pytest.mark.parametrize("std", [1.0, 4.0, 8.0])
@pytest.mark.parametrize("name", list(OPS))
def test_no_op_overflows_in_float16_where_float32_does_not(xp, name, std):
    op, inputs = OPS[name]
    half, single = both(xp, op, *inputs(std))
    check(half, single, name)


def test_a_vit_in_float16_gives_finite_logits(xp):
    tv.manual_seed(0)
    model = ViT(ViTConfig(image_size=16, patch_size=4, dim=32, depth=2, num_heads=4, mlp_dim=64, num_classes=10))
    model.to(device="cpu" if xp is np else "cuda", dtype=np.float16).eval()
    images = xp.asarray(np.random.default_rng(0).normal(0.0, 1.0, (4, 3, 16, 16)).astype(np.float16))
    with tv.no_grad():
        logits = model(images).numpy()
    assert logits.dtype == np.float16 and np.isfinite(logits).all()


# ---------------------------------------------------------------- backward, and the mechanism

# The ops that declare float16_in_float32 (autograd.Function), with their float16 gradients checked too.
WIDENED = ["gelu", "gelu_tanh", "layer_norm", "cross_entropy", "cross_entropy_smoothed", "multi_head_attention",
           "group_norm", "weight_standardize", "mse"]


def gradients_both(xp, op, *arrays):
    """The gradients of op's floating inputs for a random upstream gradient (float16 values), on the
    inputs in float16 and on the same values in float32: two lists of float64 NumPy arrays."""
    def run(dtype):
        inputs = [tv.Tensor(xp.asarray(a.astype(dtype)), requires_grad=True) if a.dtype.kind == "f"
                  else xp.asarray(a) for a in arrays]
        out = op(*inputs)
        g = np.random.default_rng(3).normal(0.0, 1.0, out.shape).astype(np.float16).astype(dtype)
        with np.errstate(over="ignore"):          # gradients float32 also puts beyond 65504 (check skips them)
            out.backward(xp.asarray(g))
        grads = [t.grad for t in inputs if isinstance(t, tv.Tensor)]
        assert all(gr.dtype == dtype for gr in grads), [gr.dtype for gr in grads]
        return [np.asarray(tv.backend.to_numpy(gr), dtype=np.float64) for gr in grads]
    return run(np.float16), run(np.float32)


@pytest.mark.parametrize("std", [1.0, 8.0])
@pytest.mark.parametrize("name", WIDENED)
def test_no_gradient_overflows_in_float16_where_float32_does_not(xp, name, std):
    """The ops computed in float32 for float16 inputs are differentiated in float32 too: float16
    gradients, a number wherever float32's is one float16 can hold, and nearly the same number.
    Both on the reference ops (the float16 mechanism is theirs; the kernels take float32 and
    float64 only): on a GPU the float32 attention would otherwise be the CUDA kernel, whose backward
    takes delta_i = dctx_i . ctx_i (flash attention's identity), which cancels in float32 for these
    inputs of up to 6e4 (logits ~1e9) where the reference's sum_j A_ij dA_ij is exact (seen on an
    H100, 2026-11-27: its float64 gradients match the reference's to 1e-7)."""
    op, inputs = OPS[name]
    with use_kernels(False):
        for i, (half, single) in enumerate(zip(*gradients_both(xp, op, *inputs(std)))):
            check(half, single, f"{name}: gradient of input {i}")


def test_float16_in_float32_widens_forward_and_backward_and_rounds_back():
    """A Function that declares float16_in_float32 sees float32 arrays in forward and backward when
    its floating inputs are all float16, and its outputs and gradients come back float16; with a
    float32 among its inputs, or without the declaration, it sees what it is given."""
    seen = []

    class ProductAndSum(tv.autograd.Function):
        float16_in_float32 = True

        def forward(self, x, y, factor):
            seen.append(("forward", x.dtype, y.dtype))
            self.save(x, y, factor)
            return x * y * factor, x + y

        def backward(self, g_prod, g_sum):
            seen.append(("backward", g_prod.dtype, g_sum.dtype))
            x, y, factor = self.saved
            return g_prod * y * factor + g_sum, g_prod * x * factor + g_sum

    x = tv.Tensor(np.array([300.0, -2.0], np.float16), requires_grad=True)
    y = tv.Tensor(np.array([400.0, 3.0], np.float16), requires_grad=True)
    with np.errstate(over="ignore"):
        prod, total = ProductAndSum.apply(x, y, 2.0)      # 300 * 400 * 2 = 240000 > 65504: inf in float16
    assert seen == [("forward", np.float32, np.float32)] and prod._ctx.widened
    assert prod.dtype == total.dtype == np.float16
    np.testing.assert_array_equal(prod.data, [np.inf, -12.0])
    (prod[1] + total[1]).backward()
    assert seen[1] == ("backward", np.float32, np.float32)
    assert x.grad.dtype == y.grad.dtype == np.float16
    np.testing.assert_array_equal(x.grad, [0.0, 3.0 * 2.0 + 1.0])
    np.testing.assert_array_equal(y.grad, [0.0, -2.0 * 2.0 + 1.0])

    seen.clear()
    ProductAndSum.apply(x, tv.Tensor(np.ones(2, np.float32)), 1.0)     # a float32 among the inputs
    ProductAndSum.float16_in_float32 = False
    ProductAndSum.apply(x, y / 1000.0, 1.0)                            # no declaration
    assert seen == [("forward", np.float16, np.float32), ("forward", np.float16, np.float16)]
