"""The ViT model end to end: a gradient check of every parameter for every option, parity with an
independent PyTorch ViT (tinyvit/bench/torch_vit.py), attention maps, the paper's initialisation and dropout
placement, Table 1's parameter counts, FLOPs, head replacement, input errors, and overfitting."""
import math
from dataclasses import asdict, replace

import numpy as np
import pytest

import tinyvit as tv
from tinyvit.kernels import fusion
import tinyvit.functional as F
from tinyvit import nn
from tinyvit.backend import default_dtype, to_numpy
from tinyvit.models import ViT, ViTConfig, config_for, count_parameters, create, known_names, training_flops

from helpers import assert_close

BOTH_PATHS = True   # every test runs with the kernels and with the reference ops (conftest.py)

# image 8, patch 4 (a 2x2 grid, N = 4), C = 3, D = 8, two blocks of two heads, MLP 12, K = 3
TINY = dict(image_size=8, patch_size=4, in_channels=3, num_classes=3, dim=8, depth=2, num_heads=2, mlp_dim=12)


def build(xp=np, dtype=np.float64, seed=0, **overrides):
    """A ViT of TINY (with overrides) in ``dtype`` on xp's device, every parameter drawn at random.

    Random, not the paper's init: the zero head would make every other gradient zero, and zero
    biases / unit LayerNorm weights would hide transposed or misplaced terms."""
    tv.manual_seed(seed)
    with default_dtype(dtype):
        model = ViT(ViTConfig(**{**TINY, **overrides}))
    if xp is not np:
        model.to(device="cuda")
    randomize(model, xp, seed)
    return model


def randomize(model, xp=np, seed=0, scale=0.4):
    rng = np.random.default_rng(seed + 100)
    for name, p in model.named_parameters():
        values = rng.standard_normal(p.shape) * scale
        if ".norm" in name or name.startswith("norm"):
            values = (1.0 if name.endswith("weight") else 0.0) + 0.2 * values
        p.data[...] = xp.asarray(values, dtype=p.dtype)


def images(xp, cfg, batch=2, seed=1, dtype=np.float64, requires_grad=False):
    x = np.random.default_rng(seed).standard_normal((batch, cfg.in_channels, cfg.image_size, cfg.image_size))
    return tv.Tensor(xp.asarray(x, dtype=dtype), requires_grad=requires_grad)


# ====================================================================== 1. full-model gradient check

# Every option appears at least once: pool, each posemb, representation_size, qkv_bias, gelu.
GRAD_CASES = [
    dict(pool="token", posemb="learned-1d"),
    dict(pool="gap", posemb="learned-1d"),
    dict(pool="token", posemb="learned-2d"),
    dict(pool="gap", posemb="learned-2d", in_channels=2),
    dict(pool="token", posemb="sincos-2d"),
    dict(pool="gap", posemb="sincos-2d"),
    dict(pool="token", posemb="none"),
    dict(pool="gap", posemb="none"),
    dict(pool="token", representation_size=6),
    dict(pool="gap", posemb="learned-2d", representation_size=6, qkv_bias=False),
    dict(pool="token", qkv_bias=False),
    dict(pool="token", posemb="learned-2d", gelu_approximate="tanh", in_channels=2),
]


def _case_id(case):
    return "-".join(f"{v}" if k in ("pool", "posemb") else f"{k}={v}" for k, v in case.items())


def _gradcheck_model(xp, model, max_full):
    cfg = model.config
    x = images(xp, cfg, requires_grad=True)
    params = list(model.parameters())
    assert all(p.dtype == np.float64 for p in params)
    result = tv.gradcheck(lambda x, *ps: model(x), [x] + params, mode="auto", max_full=max_full, directions=6)
    # every parameter and the images got a nonzero gradient: nothing is cut off the graph
    for name, p in [("images", x)] + list(model.named_parameters()):
        assert p.grad is not None and float(abs(to_numpy(p.grad)).max()) > 0, f"{name} got no gradient"
    return result


def test_gradcheck_full_every_element():
    """The base model (class token, learned 1-D posemb), every element of every input perturbed
    (CPU only: ~4000 forward passes; the GPU runs the per-option checks below)."""
    model = build()
    result = _gradcheck_model(np, model, max_full=10**6)
    assert result.checked == sum(p.size for p in model.parameters()) + 2 * 3 * 8 * 8


@pytest.mark.parametrize("case", GRAD_CASES, ids=_case_id)
def test_gradcheck_every_option(xp, case):
    """Small inputs element by element, the larger weights and the images along random directions."""
    _gradcheck_model(xp, build(xp, **case), max_full=24)


def test_gradcheck_catches_a_wrong_gradient(monkeypatch):
    """The whole-model check can fail: a patch-embedding backward whose weight gradient is 1% off
    (everything else right) is caught, and the report names that weight."""
    from tinyvit.kernels.cpu.linear import PatchEmbed as KernelPatchEmbed
    from tinyvit.ops.patch import PatchEmbed

    for cls in (PatchEmbed, KernelPatchEmbed):                  # whichever path runs
        def wrong(self, gy, right=cls.backward):
            dimages, dw, db = right(self, gy)
            return dimages, None if dw is None else 1.01 * dw, db

        monkeypatch.setattr(cls, "backward", wrong)
    model = build()
    x = images(np, model.config, requires_grad=True)
    res = tv.gradcheck(lambda x, *ps: model(x), [x] + list(model.parameters()), max_full=24,
                       raise_on_failure=False)
    assert not res.ok and "(48, 8)" in res.where, str(res)


# ====================================================================== 2. PyTorch parity


def to_torch_state(model, torch):
    """Our parameters in torch_vit.TorchViT's names and layouts."""
    cfg = model.config
    out = {}
    for name, p in model.named_parameters():
        a = to_numpy(p.data)
        if name == "patch_embed.proj.weight":      # E: (C*P*P, D) -> conv kernel (D, C, P, P)
            a = a.T.reshape(cfg.dim, cfg.in_channels, cfg.patch_size, cfg.patch_size)
        elif name == "pos_embed_col":              # indexed by column: the X table of D.4
            name = "pos_embed_x"
        elif name == "pos_embed_row":
            name = "pos_embed_y"
        elif a.ndim == 2:                          # Linear (in, out) -> torch (out, in)
            a = a.T
        out[name] = torch.tensor(np.ascontiguousarray(a))
    return out


def from_torch_layout(name, g, cfg):
    """A TorchViT gradient in our parameter's layout (the inverse of to_torch_state)."""
    g = g.detach().numpy()
    if name == "patch_embed.proj.weight":
        return g.reshape(cfg.dim, -1).T
    if g.ndim == 2 and name not in ("pos_embed_row", "pos_embed_col"):
        return g.T
    return g


PARITY_CASES = [
    dict(pool="token", posemb="learned-1d"),
    dict(pool="gap", posemb="learned-1d"),
    dict(pool="token", posemb="learned-2d", representation_size=12),
    dict(pool="gap", posemb="learned-2d", qkv_bias=False),
    dict(pool="token", posemb="sincos-2d", qkv_bias=False, representation_size=12),
    dict(pool="gap", posemb="none", gelu_approximate="tanh"),
]
# a larger model than TINY: 4x4 grid, several heads, rectangular-ish MLP
PARITY_BASE = dict(image_size=16, patch_size=4, in_channels=3, num_classes=5, dim=16, depth=2, num_heads=4,
                   mlp_dim=24)


@pytest.mark.parametrize("dtype,rtol,atol", [(np.float64, 1e-6, 1e-10), (np.float32, 1e-4, 1e-5)],
                         ids=["float64", "float32"])
@pytest.mark.parametrize("case", PARITY_CASES, ids=_case_id)
def test_matches_pytorch_vit(torch, case, dtype, rtol, atol):
    from tinyvit.bench.torch_vit import TorchViT

    model = build(dtype=dtype, seed=3, **{**PARITY_BASE, **case})
    cfg = model.config
    ref = TorchViT(**asdict(cfg)).to(torch.float64 if dtype == np.float64 else torch.float32)
    state = to_torch_state(model, torch)
    ref_names = dict(ref.named_parameters())
    assert set(state) == set(ref_names), f"parameter names differ: {set(state) ^ set(ref_names)}"
    ref.load_state_dict(state, strict=True)

    x_np = np.random.default_rng(4).standard_normal((3, cfg.in_channels, cfg.image_size, cfg.image_size))
    x = tv.Tensor(x_np.astype(dtype), requires_grad=True)
    xt = torch.tensor(x_np.astype(dtype), requires_grad=True)
    y, attn = model(x, return_attention=True)
    yt, attn_t = ref(xt, return_attention=True)
    assert y.dtype == dtype
    assert_close(y, yt, rtol, atol, what="logits")
    for i, (a, b) in enumerate(zip(attn, attn_t)):
        assert_close(a, b, rtol, atol, what=f"attention of block {i}")

    g = np.random.default_rng(5).standard_normal(y.shape).astype(dtype)   # random upstream, not ones
    y.backward(g)
    yt.backward(torch.tensor(g))
    assert_close(x.grad, xt.grad, rtol, atol, what="gradient of the images")
    torch_name = {"pos_embed_col": "pos_embed_x", "pos_embed_row": "pos_embed_y"}
    for name, p in model.named_parameters():
        expected = from_torch_layout(name, ref_names[torch_name.get(name, name)].grad, cfg)
        assert p.grad.dtype == dtype, f"{name}: gradient dtype {p.grad.dtype}"
        assert_close(p.grad, expected, rtol, atol * max(1.0, float(abs(expected).max())),
                     what=f"gradient of {name}")


# ====================================================================== 3. attention maps


@pytest.mark.parametrize("pool", ["token", "gap"])
def test_return_attention(xp, pool):
    model = build(xp, pool=pool, depth=3, dtype=np.float32)
    cfg = model.config
    x = images(xp, cfg, batch=3, dtype=np.float32)
    plain = model(x)
    logits, attentions = model(x, return_attention=True)
    # Equal up to float32 rounding: without return_attention a class-token model's last block
    # computes only the class token's row (smaller GEMMs sum in another order).
    np.testing.assert_allclose(to_numpy(plain.data), to_numpy(logits.data), rtol=1e-5, atol=1e-6)
    assert isinstance(attentions, list) and len(attentions) == cfg.depth
    t = cfg.num_patches + (1 if pool == "token" else 0)
    for a in attentions:
        a = to_numpy(getattr(a, "data", a))
        assert a.shape == (3, cfg.num_heads, t, t)
        assert (a >= 0).all()
        np.testing.assert_allclose(a.sum(-1), 1.0, rtol=1e-5)
    # different layers attend differently (not one map returned depth times)
    assert not np.allclose(to_numpy(getattr(attentions[0], "data", attentions[0])),
                           to_numpy(getattr(attentions[1], "data", attentions[1])))


def test_last_block_computes_only_the_class_token_with_the_same_result():
    """A class-token model's forward skips the other tokens' outputs in its last block; logits and
    every parameter's gradient equal those of the whole encoder followed by picking the class token."""
    grads = []
    for whole in (False, True):
        model = build(depth=3)
        x = images(np, model.config, batch=3)
        if whole:
            tokens = model.encode(model.add_position(model.embed_patches(x)))
            assert tokens.shape[1] == model.config.num_patches + 1
            logits = model.head(model.pre_logits(model.pool(tokens)))
        else:
            logits = model(x)
        (logits * tv.Tensor(np.random.default_rng(5).standard_normal(logits.shape))).sum().backward()
        grads.append((logits.data, {name: p.grad for name, p in model.named_parameters()}))
    np.testing.assert_allclose(grads[0][0], grads[1][0], rtol=1e-12, atol=1e-14)
    assert grads[0][1].keys() == grads[1][1].keys()
    for name in grads[0][1]:
        np.testing.assert_allclose(grads[0][1][name], grads[1][1][name], rtol=1e-10, atol=1e-13, err_msg=name)


def _plain_encoder(model, tokens):
    """Eq. 2-4 written plainly, with no fused op: x = x + MSA(LN(x)); x = x + MLP(LN(x)); LN(x)."""
    x = tokens
    for block in model.blocks:
        ln1 = F.layer_norm(x, block.norm1.weight, block.norm1.bias, eps=block.norm1.eps)
        x = x + F.multi_head_attention(ln1, block.attn.qkv.weight, block.attn.qkv.bias, block.attn.proj.weight,
                                       block.attn.proj.bias, block.attn.num_heads)
        ln2 = F.layer_norm(x, block.norm2.weight, block.norm2.bias, eps=block.norm2.eps)
        mlp = block.mlp
        x = x + F.linear(F.gelu(F.linear(ln2, mlp.fc1.weight, mlp.fc1.bias)), mlp.fc2.weight, mlp.fc2.bias)
    return F.layer_norm(x, model.norm.weight, model.norm.bias, eps=model.norm.eps)


@pytest.mark.parametrize("which", ["encode", "block", "fused"])
def test_encoder_equals_the_plain_equations(which):
    """ViT.encode (float64, kernels on), its blocks one by one ("block": Block.forward, then the
    final norm) and the fused encoder of kernels.fuse ("fused": each residual add fused with the
    LayerNorm after it, the LNs' scale and shift folded into qkv and fc1): the output and every
    parameter's gradient equal Eq. 2-4 written with separate ops."""
    rng = np.random.default_rng(7)
    results = []
    for plain in (True, False):
        model = build(depth=3)
        for p in model.parameters():                 # non-trivial LN affines and biases
            p.data[...] = rng.standard_normal(p.shape) * 0.5 + (1.0 if p.ndim == 1 else 0.0)
        tokens = tv.Tensor(rng.standard_normal((2, model.config.num_patches + 1, model.config.dim)),
                           requires_grad=True)
        if plain:
            out = _plain_encoder(model, tokens)
        elif which == "encode":
            out = model.encode(tokens)
        elif which == "fused":
            out = fusion.encode(model, tokens)
        else:
            x = tokens
            for block in model.blocks:
                x = block(x)
            out = model.norm(x)
        out.backward(rng.standard_normal(out.shape))
        encoder = [(n, p) for n, p in model.named_parameters() if n.startswith(("blocks.", "norm."))]
        assert all(p.grad is not None for _, p in encoder)
        results.append([("output", out.data), ("d tokens", tokens.grad)] + [(n, p.grad) for n, p in encoder])
        rng = np.random.default_rng(7)               # the same parameters and inputs for both
    assert [n for n, _ in results[0]] == [n for n, _ in results[1]]
    for (name, a), (_, b) in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)


# ====================================================================== 4. the paper's initialisation


@pytest.fixture(scope="module")
def vit_s():
    """ViT-S/16 at 224 px, two blocks (D = 384, MLP 1536), as built: the paper's init."""
    tv.manual_seed(0)
    return create("vit-s/16", depth=2)


def _uniform_with_bound(w, bound, what):
    w = to_numpy(w.data)
    assert abs(w).max() <= bound * (1 + 1e-6), f"{what}: values beyond the bound {bound:.4g}"
    assert abs(w).max() >= 0.99 * bound, f"{what}: max |w| {abs(w).max():.4g} well inside the bound {bound:.4g}"
    assert abs(w.std() - bound / math.sqrt(3)) < 0.02 * bound, f"{what}: std {w.std():.4g} is not U(-a, a)'s"
    assert abs(w.mean()) < 0.01 * bound


def test_initialisation_follows_the_paper(vit_s):
    m, d, mlp = vit_s, 384, 1536
    cfg = m.config
    assert m.cls_token.shape == (1, 1, d) and not to_numpy(m.cls_token.data).any()
    pos = to_numpy(m.pos_embed.data)
    assert pos.shape == (1, cfg.num_patches + 1, d)
    assert abs(pos.std() - 0.02) < 0.0005 and abs(pos.mean()) < 0.0005
    assert not to_numpy(m.head.weight.data).any() and not to_numpy(m.head.bias.data).any()
    assert tuple(m.head.weight.shape) == (d, 1000)
    # patch embedding: LeCun normal (the official conv's default: flax's variance-scaling truncated
    # normal), std 1 / sqrt(C P P), cut at two standard deviations of the underlying normal; zero bias
    e = to_numpy(m.patch_embed.proj.weight.data)
    assert e.shape == (3 * 16 * 16, d)
    assert abs(e.std() * math.sqrt(3 * 16 * 16) - 1.0) < 0.02
    assert abs(e).max() <= 2 / 0.87962566103423978 / math.sqrt(3 * 16 * 16) * (1 + 1e-6), "not truncated"
    assert not to_numpy(m.patch_embed.proj.bias.data).any()
    for i, blk in enumerate(m.blocks):
        # q, k, v are separate (D, D) Dense layers in the official code: bound sqrt(6 / (D + D))
        _uniform_with_bound(blk.attn.qkv.weight, math.sqrt(6.0 / (2 * d)), f"block {i} qkv")
        _uniform_with_bound(blk.attn.proj.weight, math.sqrt(6.0 / (2 * d)), f"block {i} proj")
        assert not to_numpy(blk.attn.qkv.bias.data).any() and not to_numpy(blk.attn.proj.bias.data).any()
        for fc, shape in ((blk.mlp.fc1, (d, mlp)), (blk.mlp.fc2, (mlp, d))):
            assert tuple(fc.weight.shape) == shape
            _uniform_with_bound(fc.weight, math.sqrt(6.0 / (d + mlp)), f"block {i} mlp")
            b = to_numpy(fc.bias.data)
            assert b.any() and abs(b).max() < 1e-5 and 0.5e-6 < b.std() < 2e-6, "MLP biases ~ N(0, 1e-6)"
        for ln in (blk.norm1, blk.norm2):
            assert (to_numpy(ln.weight.data) == 1).all() and not to_numpy(ln.bias.data).any()
            assert ln.eps == 1e-6
    assert (to_numpy(m.norm.weight.data) == 1).all() and not to_numpy(m.norm.bias.data).any()
    assert all(p.dtype == np.float32 for p in m.parameters())


def test_zero_head_gives_zero_logits(vit_s):
    x = tv.Tensor(np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32))
    with tv.no_grad():
        assert not to_numpy(vit_s(x).data).any()


# ====================================================================== 4b. dropout placement


def _features(model, x):
    return to_numpy(model.forward_features(x).data)


def test_dropout_random_in_train_deterministic_in_eval():
    model = build(dtype=np.float32, dropout=0.5)
    x = images(np, model.config, dtype=np.float32)
    model.train()
    a, b = model(x).data, model(x).data
    assert not np.allclose(a, b), "train mode: two calls should draw different dropout masks"
    model.eval()
    a, b = model(x).data, model(x).data
    assert np.array_equal(a, b)
    plain = build(dtype=np.float32, dropout=0.0)           # same weights (same seeds), no dropout
    np.testing.assert_array_equal(a, plain(x).data)


def test_dropout_after_every_dense_layer_but_qkv(monkeypatch):
    """Appendix B.1: dropout after every dense layer except the qkv projections, and after adding
    the position embeddings. F.dropout is recorded: which tensors it sees, in which order."""
    d, mlp, depth = 8, 12, 2
    model = build(dtype=np.float32, dropout=0.3, depth=depth)
    # remember the outputs of the layers that must be followed by dropout
    produced = {}

    def watch(module, label):
        forward = module.forward

        def wrapped(*args, **kwargs):
            out = forward(*args, **kwargs)
            produced[id(out)] = label
            return out
        object.__setattr__(module, "forward", wrapped)

    for i, blk in enumerate(model.blocks):
        watch(blk.mlp.act, f"{i}.gelu(fc1)")
        watch(blk.mlp.fc2, f"{i}.fc2")
    real_mha = F.multi_head_attention

    def attention(*args, **kwargs):                        # the fused qkv -> softmax -> proj op
        out = real_mha(*args, **kwargs)
        produced[id(out[0] if isinstance(out, tuple) else out)] = "proj"
        return out

    monkeypatch.setattr(F, "multi_head_attention", attention)
    calls = []
    real = F.dropout

    def recording(x, p, training):
        calls.append((produced.get(id(x), "?"), tuple(x.shape), p))
        return real(x, p, training)

    monkeypatch.setattr(F, "dropout", recording)
    x = images(np, model.config, batch=2, dtype=np.float32)
    model.train()
    with tv.use_kernels(False):                            # the reference: one module after the other
        model(x)
    t = model.config.num_patches + 1
    # pos, then proj, fc1, fc2 per block
    expected_shapes = [(2, t, d)] + [(2, t, d), (2, t, mlp), (2, t, d)] * depth
    assert [c[1] for c in calls] == expected_shapes, calls
    assert all(c[2] == 0.3 for c in calls)
    assert not any(c[1][-1] == 3 * d for c in calls), "the qkv projection must not be followed by dropout"
    assert [c[0] for c in calls[1::3]] == ["proj"] * depth
    assert [c[0] for c in calls[2::3]] == [f"{i}.gelu(fc1)" for i in range(depth)]
    assert [c[0] for c in calls[3::3]] == [f"{i}.fc2" for i in range(depth)]
    # the structure says the same: dropout modules behind proj, fc1 and fc2 and after the position
    for blk in model.blocks:
        assert blk.attn.proj_drop.p == blk.mlp.drop1.p == blk.mlp.drop2.p == 0.3
        assert blk.attn.attn_dropout == 0.0
    assert model.pos_drop.p == 0.3
    calls.clear()
    model.eval()
    model(x)
    assert not calls, "eval mode must not call dropout"


# ====================================================================== 4c. Table 1 parameter counts, FLOPs


@pytest.mark.parametrize("name,expected,paper", [
    ("vit-b/16", 86_567_656, 86e6),       # timm vit_base_patch16_224
    ("vit-l/16", 304_326_632, 307e6),     # timm vit_large_patch16_224 (304M)
    ("vit-l/32", 306_535_400, 307e6),     # timm vit_large_patch32_224 (306.5M, Table 1's "307M")
    ("vit-h/14", None, 632e6),
])
def test_table1_parameter_counts(torch, name, expected, paper):
    cfg = config_for(name)
    n = count_parameters(cfg)
    if expected is not None:
        assert n == expected
    assert abs(n - paper) / paper < 0.012, f"{name}: {n / 1e6:.1f}M parameters, Table 1 says {paper / 1e6:.0f}M"
    # the independent PyTorch ViT, built without memory on the meta device, counts the same
    from tinyvit.bench.torch_vit import TorchViT
    with torch.device("meta"):
        ref = TorchViT(**asdict(cfg))
    assert n == sum(p.numel() for p in ref.parameters())


COUNT_CASES = [dict(pool=p, posemb=e, representation_size=r, qkv_bias=q, num_classes=k)
               for p in ("token", "gap") for e in ("learned-1d", "learned-2d", "sincos-2d", "none")
               for r, q, k in ((None, True, 3), (6, False, 3), (None, False, 0), (5, True, 0))]


def test_count_parameters_matches_built_models():
    for case in COUNT_CASES:
        for extra in ({}, dict(image_size=12, patch_size=2, in_channels=1, dim=12, num_heads=3, depth=1)):
            cfg = ViTConfig(**{**TINY, **case, **extra})
            with default_dtype(np.float32):
                model = ViT(cfg)
            assert count_parameters(cfg) == model.num_parameters(), (case, extra)


def test_training_flops_of_vit_b16():
    """ViT-B/16 at 224: 17.6 GMACs forward (fvcore / timm), so ~3 * 2 * 17.6e9 per training image."""
    cfg = config_for("vit-b/16")
    reference = 3 * 2 * 17.58e9
    assert abs(training_flops(cfg) - reference) / reference < 0.02
    # quadratic attention: doubling the resolution more than quadruples the cost
    big = replace(cfg, image_size=448)
    assert training_flops(big) > 4.2 * training_flops(cfg)


# ====================================================================== 5. reset_head


@pytest.mark.parametrize("representation_size", [None, 6])
def test_reset_head(xp, representation_size):
    model = build(xp, representation_size=representation_size, num_classes=3)
    model.reset_head(7)
    assert isinstance(model.head, nn.Linear) and tuple(model.head.weight.shape) == (8, 7)
    assert isinstance(model.pre_logits, nn.Identity)
    assert not any(k.startswith("pre_logits") for k in model.state_dict())
    assert model.config.num_classes == 7 and model.config.representation_size is None
    assert model.head.weight.dtype == np.float64
    assert not to_numpy(model.head.weight.data).any() and not to_numpy(model.head.bias.data).any()
    x = images(xp, model.config, batch=2)
    y = model(x)
    assert y.shape == (2, 7) and not to_numpy(y.data).any()
    assert count_parameters(model.config) == model.num_parameters()
    # the new head trains: its gradient is the features' outer product with the upstream
    y.backward(xp.ones((2, 7)))
    assert float(abs(to_numpy(model.head.weight.grad)).max()) > 0


# ====================================================================== 6. errors


def test_wrong_channels_names_both():
    model = build(in_channels=3)
    x = tv.Tensor(np.zeros((2, 1, 8, 8)))
    with pytest.raises(ValueError) as err:
        model(x)
    msg = str(err.value)
    assert "3" in msg and "(2, 1, 8, 8)" in msg


def test_image_size_not_divisible_names_both():
    model = build()
    with pytest.raises(ValueError) as err:
        model(tv.Tensor(np.zeros((2, 3, 10, 10))))
    msg = str(err.value)
    assert "10" in msg and "4" in msg and "divisible" in msg


def test_other_image_size_points_at_resize():
    model = build()                                        # built for 8 x 8
    with pytest.raises(ValueError, match="resize_pos_embed"):
        model(tv.Tensor(np.zeros((1, 3, 12, 12))))


def test_unknown_variant_lists_known_ones():
    with pytest.raises(ValueError) as err:
        create("vit-xl/16")
    msg = str(err.value)
    assert "vit-xl/16" in msg
    for name in known_names():
        assert name in msg
    with pytest.raises(ValueError):
        config_for("resnet50")


@pytest.mark.parametrize("bad,word", [
    (dict(image_size=10), "divisible"),
    (dict(dim=9), "num_heads"),
    (dict(pool="cls"), "pool"),
    (dict(posemb="learned"), "posemb"),
    (dict(posemb="learned-2d", dim=9, num_heads=3), "even"),
    (dict(posemb="sincos-2d", dim=6, num_heads=2), "sincos"),
    (dict(gelu_approximate="fast"), "gelu_approximate"),
    (dict(dropout=1.0), "dropout"),
    (dict(attn_dropout=-0.1), "attn_dropout"),
    (dict(drop_path=1.5), "drop_path"),
    (dict(patch_size=0), "patch_size must be a whole number >= 1, got 0"),       # once a ZeroDivisionError
    (dict(num_heads=0), "num_heads must be a whole number >= 1, got 0"),
    (dict(mlp_dim=0), "mlp_dim must be a whole number >= 1"),                    # once "cannot reshape"
    (dict(dim=-8), "dim must be a whole number >= 1, got -8"),
    (dict(depth="12"), "depth must be a whole number >= 1, got '12'"),           # once a TypeError
    (dict(image_size=32.0), "image_size must be a whole number"),
    (dict(num_classes=-1), "num_classes must be a whole number >= 0"),
    (dict(representation_size=True), "representation_size"),
    (dict(dropout="0.1"), "dropout must be in"),
    (dict(ln_eps=0.0), "ln_eps must be a positive number"),
])
def test_invalid_config(bad, word):
    with pytest.raises(ValueError, match=word):
        ViTConfig(**{**TINY, **bad})


def test_config_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="hidden_size"):
        ViTConfig.from_dict({**TINY, "hidden_size": 8})
    assert ViTConfig.from_dict(asdict(ViTConfig(**TINY))) == ViTConfig(**TINY)


# ====================================================================== 7. it learns


def _fit(steps, head_only=False, target_loss=0.05):
    """Adam on 16 random images with 16 random labels (of 16 classes) until every one is right and
    the loss is below target_loss. Returns (steps taken, accuracy, loss, first loss)."""
    from tinyvit.optim import Adam

    tv.manual_seed(0)
    cfg = ViTConfig(image_size=8, patch_size=4, in_channels=3, num_classes=16, dim=8, depth=2, num_heads=2,
                    mlp_dim=16)
    model = ViT(cfg)
    rng = np.random.default_rng(0)
    x = tv.Tensor(rng.standard_normal((16, 3, 8, 8)).astype(np.float32))
    labels = rng.integers(0, 16, 16)
    opt = Adam(list(model.head.parameters()) if head_only else list(model.parameters()), lr=1e-2)
    first = None
    for step in range(steps + 1):
        logits = model(x)
        loss = F.cross_entropy(logits, labels)
        acc, value = (to_numpy(logits.data).argmax(-1) == labels).mean(), float(loss.data)
        first = value if first is None else first
        if step == steps or (acc == 1.0 and value < target_loss):
            return step, acc, value, first
        model.zero_grad()
        loss.backward()
        opt.step()


def test_overfits_16_random_images():
    steps, acc, loss, first = _fit(300)
    assert first == pytest.approx(math.log(16), rel=1e-4), "zero head: the first loss is log K"
    assert acc == 1.0 and loss < 0.05, f"train accuracy {acc}, loss {loss:.3g} after {steps} steps"
    # the encoder is learning too: the head alone, trained as long, does not get there (D = 8 features)
    _, acc_head, loss_head, _ = _fit(steps, head_only=True)
    assert acc_head < 1.0 or loss_head > 0.05


def test_cli_stops_quietly_when_its_reader_goes_away(monkeypatch):
    """`tinyvit models | head -1`: a closed pipe ends the command with status 0, no traceback."""
    import os
    import sys

    from tinyvit.cli import main
    read_end, write_end = os.pipe()
    os.close(read_end)

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):
            return write_end

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    try:
        assert main(["models"]) == 0
    finally:
        os.close(write_end)
