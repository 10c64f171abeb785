"""Whole models give the same numbers with the kernels (tinyvit/kernels/, the fused_encoder of
kernels/cpu/encoder.py included) and with the reference ops alone (tinyvit/ops/).

For the ViT (class token and average pooling, every position embedding, qkv without bias, the tanh
GELU), the hybrid and the masked-patch model, in train and eval mode, with and without the attention
maps: the outputs and the gradient of every parameter and of the images, under a random upstream
gradient, are equal on both paths: to 1e-10 in float64 and to float32 round-off in float32. Train
mode with dropout and stochastic depth draws the same seeded masks on both paths.
"""
import numpy as np
import pytest

import tinyvit as tv
from tinyvit import functional as F
from tinyvit import nn
from tinyvit.backend import default_dtype
from tinyvit.kernels.cpu import encoder
from tinyvit.models import ViT, ViTConfig
from tinyvit.models.hybrid import HybridConfig, HybridViT
from tinyvit.models.masked import MaskedConfig, MaskedPatchViT

# image 8, patch 4 (N = 4 tokens + the class token), D = 8, two blocks of two heads, MLP 12
TINY = dict(image_size=8, patch_size=4, in_channels=3, dim=8, depth=2, num_heads=2, mlp_dim=12)
TOLERANCE = {np.float64: dict(rtol=1e-10, atol=1e-12), np.float32: dict(rtol=2e-4, atol=2e-5)}


def randomize(model, seed=0):
    """Every parameter random (the zero head and unit LayerNorms would hide misplaced terms)."""
    rng = np.random.default_rng(seed + 100)
    for name, p in model.named_parameters():
        values = rng.standard_normal(p.shape) * 0.4
        if ".norm" in name or name.startswith("norm"):
            values = (1.0 if name.endswith("weight") else 0.0) + 0.2 * values
        p.data[...] = values.astype(p.dtype)
    return model


def make(kind, dtype, **overrides):
    tv.manual_seed(0)
    with default_dtype(dtype):
        if kind == "vit":
            model = ViT(ViTConfig(**{**TINY, "num_classes": 3, **overrides}))
        elif kind == "hybrid":
            model = HybridViT(HybridConfig(**{**TINY, "num_classes": 3, "depth": 2, "resnet_layers": (1, 1),
                                              "resnet_width_factor": 1 / 8, "resnet_root": "light",
                                              "resnet_groups": 4, **overrides}))
        else:
            model = MaskedPatchViT(MaskedConfig(**{**TINY, **overrides}))
    return randomize(model)


def outputs(kind, model, x, return_attention):
    """The tensors a user reads: logits (and attention maps), or the masked model's prediction."""
    if kind == "masked":
        out, _ = model.encode_corrupted(x, rng=np.random.default_rng(5))
        return [model.predict(out)]
    out = model(x, return_attention=return_attention)
    return [out[0], *out[1]] if return_attention else [out]


def run(kind, model, path, dtype, train, return_attention, batch=3):
    """Outputs, the images' gradient and every parameter's gradient on one path, with a random
    upstream gradient on every output and the same seed for every random draw."""
    x = tv.Tensor(np.random.default_rng(1).standard_normal((batch, 3, 8, 8)).astype(dtype), requires_grad=True)
    model.train(train)
    for p in model.parameters():
        p.grad = None
    tv.manual_seed(7)                                   # the dropout and stochastic-depth masks
    with tv.use_kernels(path == "kernels"):
        outs = outputs(kind, model, x, return_attention)
        g = np.random.default_rng(2)
        loss = sum(F.sum(o * g.standard_normal(o.shape).astype(dtype)) for o in outs)
        loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return [o.numpy() for o in outs], x.grad, grads


def assert_paths_equal(kind, model, dtype, train, return_attention):
    fast = run(kind, model, "kernels", dtype, train, return_attention)
    plain = run(kind, model, "reference", dtype, train, return_attention)
    tol = TOLERANCE[dtype]
    for i, (a, b) in enumerate(zip(fast[0], plain[0])):
        np.testing.assert_allclose(a, b, err_msg=f"output {i}", **tol)
    scale = max(np.abs(plain[1]).max(), 1e-30)
    np.testing.assert_allclose(fast[1] / scale, plain[1] / scale, err_msg="images' gradient", **tol)
    assert fast[2].keys() == plain[2].keys()
    assert len(plain[2]) == len(list(model.parameters())), "a parameter got no gradient"
    for name in plain[2]:
        scale = max(np.abs(plain[2][name]).max(), 1e-30)  # relative to the largest entry of that gradient
        np.testing.assert_allclose(fast[2][name] / scale, plain[2][name] / scale, err_msg=name, **tol)


VIT_CASES = [
    dict(pool="token", posemb="learned-1d"),
    dict(pool="gap", posemb="learned-2d"),
    dict(pool="token", posemb="sincos-2d", qkv_bias=False),
    dict(pool="token", posemb="none", gelu_approximate="tanh", representation_size=6),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("return_attention", [False, True], ids=["logits", "attention"])
@pytest.mark.parametrize("case", VIT_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_vit_equal_on_both_paths(case, return_attention, train, dtype):
    assert_paths_equal("vit", make("vit", dtype, **case), dtype, train, return_attention)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_vit_with_dropout_and_stochastic_depth_equal_on_both_paths(dtype):
    """Train mode draws the same seeded masks on both paths (dropout everywhere, stochastic depth)."""
    model = make("vit", dtype, dropout=0.2, attn_dropout=0.3, drop_path=0.4)
    assert_paths_equal("vit", model, dtype, train=True, return_attention=False)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_hybrid_equal_on_both_paths(train, dtype):
    assert_paths_equal("hybrid", make("hybrid", dtype, drop_path=0.2), dtype, train, return_attention=False)
    assert_paths_equal("hybrid", make("hybrid", dtype), dtype, train, return_attention=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_masked_model_equal_on_both_paths(train, dtype):
    assert_paths_equal("masked", make("masked", dtype), dtype, train, return_attention=False)


def test_gradcheck_through_the_fused_encoder():
    """The finite-difference check of the whole model, on the kernel path (the fused encoder with
    its class-token-only last block), every parameter and the images."""
    model = make("vit", np.float64)
    x = tv.Tensor(np.random.default_rng(1).standard_normal((2, 3, 8, 8)), requires_grad=True)
    with tv.use_kernels(True):
        assert F.fused_encoder(x, model.blocks, model.norm) is not None
        tv.gradcheck(lambda x, *ps: model(x), [x] + list(model.parameters()), max_full=24)


def test_the_fused_encoder_runs_for_standard_blocks_only():
    """The kernel path does use the fused encoder (so the equality above is not vacuous), and any
    block that is not the standard one sends the model to the reference, which still works."""
    model = make("vit", np.float64)
    x = tv.Tensor(np.random.default_rng(1).standard_normal((2, 3, 8, 8)))
    assert F.fused_encoder(x, model.blocks, model.norm) is not None
    with tv.use_kernels(False):
        assert F.fused_encoder(x, model.blocks, model.norm) is None
        expected = model(x).numpy()
    assert F.fused_encoder(x.astype(np.float32), model.blocks, model.norm) is None, "dtypes differ"

    class ScaledNorm(nn.LayerNorm):                       # a user's replacement for LN1
        def forward(self, x):
            return super().forward(x) * 2.0

    with default_dtype(np.float64):
        replaced = ScaledNorm(8)
    replaced.weight.data[...] = model.blocks[0].norm1.weight.data
    replaced.bias.data[...] = model.blocks[0].norm1.bias.data
    model.blocks[0].norm1 = replaced
    assert F.fused_encoder(x, model.blocks, model.norm) is None
    changed = model(x).numpy()
    with tv.use_kernels(False):
        np.testing.assert_allclose(changed, model(x).numpy(), rtol=1e-12)
    assert not np.allclose(changed, expected), "the replaced LayerNorm must take effect"


def test_a_wrapped_forward_falls_back_to_the_reference():
    """A module whose forward was replaced on the instance (a hook, a probe) is not standard."""
    model = make("vit", np.float64)
    seen = []
    mlp = model.blocks[1].mlp
    original = mlp.forward
    object.__setattr__(mlp, "forward", lambda x: seen.append(x.shape) or original(x))
    x = tv.Tensor(np.random.default_rng(1).standard_normal((2, 3, 8, 8)))
    assert encoder.fused_encoder(x, model.blocks, model.norm) is None
    model(x)
    assert seen == [(2, 5, 8)]
