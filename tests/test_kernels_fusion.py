"""tinyvit.kernels.fuse(model), the explicit cross-layer fusion, gives the same numbers as the model,
and the model itself runs its own code with the kernels on.

For the ViT (class token and average pooling, every position embedding, qkv without bias, the tanh
GELU), the hybrid and the masked-patch model, in train and eval mode: the outputs and the gradient of
every parameter and of the images, under a random upstream gradient, are equal on three paths: the
reference ops alone (use_kernels(False)), the model with its per-op kernels (the default), and
fuse(model): to 1e-10 in float64 and to float32 round-off in float32. With the attention maps asked
for, the first two. Train mode with dropout and stochastic depth draws the same seeded masks on all.
"""
import numpy as np
import pytest

import tinyvit as tv
from tinyvit import functional as F
from tinyvit import kernels, nn
from tinyvit.backend import default_dtype
from tinyvit.kernels import fusion
from tinyvit.models import ViT, ViTConfig, create, known_names
from tinyvit.models.hybrid import HybridConfig, HybridViT
from tinyvit.models.masked import MaskedConfig, MaskedPatchViT
from tinyvit.models.vit import Block

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


def outputs(kind, forward, x, return_attention):
    """The tensors a user reads: logits (and attention maps), or the masked model's loss and predictions."""
    if kind == "masked":
        targets = np.random.default_rng(6).integers(0, 512, (x.shape[0], 4))
        loss, pred, _ = forward.loss(x, targets, rng=np.random.default_rng(5))
        return [loss, pred]
    out = forward(x, return_attention=True) if return_attention else forward(x)
    return [out[0], *out[1]] if return_attention else [out]


def run(kind, model, path, dtype, train, return_attention, batch=3):
    """Outputs, the images' gradient and every parameter's gradient on one path ("reference",
    "kernels": the model with its per-op kernels, "fused": kernels.fuse(model)), with a random
    upstream gradient on every output and the same seed for every random draw."""
    x = tv.Tensor(np.random.default_rng(1).standard_normal((batch, 3, 8, 8)).astype(dtype), requires_grad=True)
    model.train(train)
    for p in model.parameters():
        p.grad = None
    tv.manual_seed(7)                                   # the dropout and stochastic-depth masks
    with tv.use_kernels(path != "reference"):
        forward = kernels.fuse(model) if path == "fused" else model
        assert (forward is not model) == (path == "fused"), "fuse() must fuse these models"
        outs = outputs(kind, forward, x, return_attention)
        g = np.random.default_rng(2)
        loss = sum(F.sum(o * g.standard_normal(o.shape).astype(dtype)) for o in outs)
        loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return [o.numpy() for o in outs], x.grad, grads


def assert_paths_equal(kind, model, dtype, train, return_attention):
    plain = run(kind, model, "reference", dtype, train, return_attention)
    paths = ["kernels"] if return_attention else ["kernels", "fused"]
    tol = TOLERANCE[dtype]
    for path in paths:
        fast = run(kind, model, path, dtype, train, return_attention)
        for i, (a, b) in enumerate(zip(fast[0], plain[0])):
            np.testing.assert_allclose(a, b, err_msg=f"{path}: output {i}", **tol)
        scale = max(np.abs(plain[1]).max(), 1e-30)
        np.testing.assert_allclose(fast[1] / scale, plain[1] / scale, err_msg=f"{path}: images' gradient", **tol)
        assert fast[2].keys() == plain[2].keys()
        assert len(plain[2]) == len(list(model.parameters())), "a parameter got no gradient"
        for name in plain[2]:
            scale = max(np.abs(plain[2][name]).max(), 1e-30)  # relative to the largest entry of that gradient
            np.testing.assert_allclose(fast[2][name] / scale, plain[2][name] / scale, err_msg=f"{path}: {name}", **tol)


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


def test_gradcheck_through_the_fused_model():
    """The finite-difference check of the whole fused model (the class-token-only last block
    included), every parameter and the images."""
    model = make("vit", np.float64)
    x = tv.Tensor(np.random.default_rng(1).standard_normal((2, 3, 8, 8)), requires_grad=True)
    fast = kernels.fuse(model)
    assert isinstance(fast, fusion.Fused)
    tv.gradcheck(lambda x, *ps: fast(x), [x] + list(model.parameters()), max_full=24)


def test_fuse_leaves_what_it_does_not_know_to_the_model():
    """fuse() fuses the standard blocks only; a block that is not standard (a user's LayerNorm
    subclass), kernels off, or another model class: the model itself comes back, and it runs."""
    model = make("vit", np.float64)
    x = tv.Tensor(np.random.default_rng(1).standard_normal((2, 3, 8, 8)))
    assert kernels.fuse(model) is not model and fusion.why_not(model) is None
    with tv.use_kernels(False):
        assert kernels.fuse(model) is model and "off" in fusion.why_not(model)
        expected = model(x).numpy()

    class ScaledNorm(nn.LayerNorm):                       # a user's replacement for LN1
        def forward(self, x):
            return super().forward(x) * 2.0

    with default_dtype(np.float64):
        replaced = ScaledNorm(8)
    replaced.weight.data[...] = model.blocks[0].norm1.weight.data
    replaced.bias.data[...] = model.blocks[0].norm1.bias.data
    model.blocks[0].norm1 = replaced
    assert kernels.fuse(model) is model and "standard" in fusion.why_not(model)
    changed = model(x).numpy()
    with tv.use_kernels(False):
        np.testing.assert_allclose(changed, model(x).numpy(), rtol=1e-12)
    assert not np.allclose(changed, expected), "the replaced LayerNorm must take effect"
    mlp = nn.Sequential(nn.Linear(3, 4))
    assert kernels.fuse(mlp) is mlp and "not a ViT" in fusion.why_not(mlp)


def test_a_fused_model_runs_the_model_where_the_kernels_cannot():
    """The kernels switched off after fusing: the fused model gives the model's own numbers (its
    encode); images of another dtype than the parameters': the model's own error."""
    model = make("vit", np.float64)
    fast = kernels.fuse(model)
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8))
    with tv.use_kernels(False):
        expected = model(x).numpy()
        np.testing.assert_allclose(fast(x).numpy(), expected, rtol=1e-12)
    with pytest.raises(TypeError, match="share one floating dtype"):
        fast(x.astype(np.float32))


def test_a_wrapped_forward_is_not_fused():
    """A module whose forward was replaced on the instance (a hook, a probe) is not standard."""
    model = make("vit", np.float64)
    seen = []
    mlp = model.blocks[1].mlp
    original = mlp.forward
    object.__setattr__(mlp, "forward", lambda x: seen.append(x.shape) or original(x))
    x = tv.Tensor(np.random.default_rng(1).standard_normal((2, 3, 8, 8)))
    assert kernels.fuse(model) is model
    model(x)
    assert seen == [(2, 5, 8)]


# ---------------------------------------------------------------- the code you read is the code that runs


@pytest.mark.parametrize("name", [n for n in known_names() if n.startswith(("vit-cifar", "vit-mnist", "r14+"))]
                         + ["masked"])
def test_calling_a_model_runs_its_own_forward_methods(name, monkeypatch):
    """With the kernels on (the default), model(x) executes ViT.forward, every Block.forward,
    nn.MultiHeadAttention.forward and nn.MLP.forward: a learner's breakpoint or edit there takes
    effect. Counted by wrapping the classes' forward methods, and shown by an edit: Block.forward
    patched to scale its output changes the logits."""
    tv.manual_seed(0)
    if name == "masked":
        model = MaskedPatchViT(MaskedConfig(image_size=8, patch_size=4, in_channels=3, dim=8, depth=2,
                                            num_heads=2, mlp_dim=12))
        vit, call = model.vit, lambda x: model(x, rng=np.random.default_rng(0))[0]
    else:
        cfg = dict(depth=2) if name.startswith("r14") else dict(depth=2, dim=16, num_heads=2, mlp_dim=32)
        model = vit = create(name, **cfg)
        call = model
    randomize(model)
    size, channels = vit.config.image_size, vit.config.in_channels
    x = np.random.default_rng(0).standard_normal((2, channels, size, size)).astype(np.float32)
    counts = {}
    for cls in (ViT, Block, nn.MultiHeadAttention, nn.MLP):
        original = cls.forward

        def counted(self, *args, _original=original, _name=cls.__name__, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(cls, "forward", counted)
    assert tv.kernels.kernels_enabled()
    before = call(x).numpy()
    depth = vit.config.depth
    expected = {"Block": depth, "MultiHeadAttention": depth, "MLP": depth}
    assert counts == (expected if name == "masked" else {"ViT": 1, **expected})   # the masked model: vit.encode

    original_block = Block.forward                       # the counting wrapper, itself calling the original
    monkeypatch.setattr(Block, "forward", lambda self, x, **kw: original_block(self, x, **kw) * 1.5)
    assert not np.allclose(call(x).numpy(), before), "an edit of Block.forward must change the output"
