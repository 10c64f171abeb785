"""Relative position embeddings (appendix D.4, Table 8's fourth row): nn.RelativeMultiHeadAttention
against a plain loop over (query, key) pairs, against the standard attention when the table is zero,
finite differences in float64 on every input, PyTorch's autograd through a gather (another way to
read the same equation), and the ViT that carries it: parameters, saving and loading, a refused new
image size, training through the CLI."""
import math

import numpy as np
import pytest
from helpers import cli, one_line

import tinyvit as tv
from tinyvit import backend, io, nn
from tinyvit.backend import to_numpy
from tinyvit.gradcheck import gradcheck
from tinyvit.kernels.fusion import why_not
from tinyvit.models import ViTConfig, create
from tinyvit.nn.relative import relative_logits


def attention_by_pairs(x, w_qkv, b_qkv, table, heads):
    """The plain reference: for every head, query i and key j, (q_i . k_j + q_i . r_{i-j}) / sqrt(D_h),
    the embedding of offset o = i - j at row T - 1 + o; softmax over j. -> A: (B, H, T, T), ctx."""
    b, t, d = x.shape
    dh = d // heads
    qkv = x @ w_qkv + b_qkv
    q, k, v = (qkv[..., s * d:(s + 1) * d].reshape(b, t, heads, dh) for s in range(3))
    logits = np.empty((b, heads, t, t))
    for h in range(heads):
        r = table[:, h * dh:(h + 1) * dh]
        for i in range(t):
            for j in range(t):
                logits[:, h, i, j] = ((q[:, i, h] * k[:, j, h]).sum(-1) + q[:, i, h] @ r[t - 1 + i - j]) / math.sqrt(dh)
    a = np.exp(logits - logits.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    ctx = np.einsum("bhij,bjhd->bihd", a, v).reshape(b, t, d)
    return a, ctx


def relative_attention(dim=8, heads=2, tokens=5, seed=0, dtype=np.float64):
    tv.manual_seed(seed)
    with backend.default_dtype(dtype):
        attn = nn.RelativeMultiHeadAttention(dim, heads, tokens)
    for p in attn.parameters():                        # non-zero biases and a table of weight
        p.data[...] += np.random.default_rng(seed + 1).standard_normal(p.shape).astype(dtype) * 0.3
    return attn


@pytest.mark.parametrize("tokens", [1, 2, 3, 7])
def test_relative_logits_puts_offset_i_minus_j_at_every_pair(rng, tokens):
    rel = rng.standard_normal((2, 3, tokens, 2 * tokens - 1))
    out = to_numpy(relative_logits(tv.Tensor(rel), tokens).data)
    expected = np.array([[[[rel[b, h, i, tokens - 1 + i - j] for j in range(tokens)] for i in range(tokens)]
                          for h in range(3)] for b in range(2)])
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("tokens,heads", [(1, 1), (5, 2), (9, 4)])
def test_forward_equals_the_pairs_loop(rng, tokens, heads):
    attn = relative_attention(dim=8, heads=heads, tokens=tokens)
    x = rng.standard_normal((3, tokens, 8))
    out, a = attn(x, return_attention=True)
    a_ref, ctx = attention_by_pairs(x, attn.qkv.weight.data, attn.qkv.bias.data, attn.rel_pos.data, heads)
    np.testing.assert_allclose(to_numpy(a.data), a_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(to_numpy(out.data), ctx @ attn.proj.weight.data + attn.proj.bias.data,
                               rtol=1e-11, atol=1e-13)


def test_a_zero_table_is_the_standard_attention_forward_and_backward(rng):
    """With r = 0 the bias vanishes: outputs and every gradient equal nn.MultiHeadAttention's."""
    rel = relative_attention()
    rel.rel_pos.data[...] = 0.0
    with backend.default_dtype(np.float64):
        std = nn.MultiHeadAttention(8, 2)
    for name in ("qkv.weight", "qkv.bias", "proj.weight", "proj.bias"):
        dict(std.named_parameters())[name].data[...] = dict(rel.named_parameters())[name].data
    x = rng.standard_normal((2, 5, 8))
    g = rng.standard_normal((2, 5, 8))
    grads = []
    for module in (rel, std):
        xt = tv.Tensor(x.copy(), requires_grad=True)
        (module(xt) * g).sum().backward()
        grads.append([to_numpy(xt.grad)] + [to_numpy(dict(module.named_parameters())[n].grad)
                                            for n in ("qkv.weight", "qkv.bias", "proj.weight", "proj.bias")])
    for mine, theirs in zip(*grads):
        np.testing.assert_allclose(mine, theirs, rtol=1e-10, atol=1e-12)
    assert np.any(to_numpy(rel.rel_pos.grad))          # the table learns even from zero


@pytest.mark.parametrize("tokens", [1, 4])
def test_gradcheck_every_input(rng, tokens, xp):
    """Finite differences in float64, a random upstream gradient, on x and every parameter (on the
    CPU, on the CuPy stand-in, and on a GPU where there is one)."""
    attn = relative_attention(tokens=tokens)
    attn.to(device="cpu" if xp is np else "cuda")
    x = tv.Tensor(xp.asarray(rng.standard_normal((2, tokens, 8))), requires_grad=True)
    params = list(attn.parameters())
    result = gradcheck(lambda x_, *ps: attn(x_), [x, *params])
    assert result.ok and result.checked == x.size + sum(p.size for p in params)


def test_attention_dropout_in_training(rng):
    attn = relative_attention()
    attn.attn_drop.p = 0.5
    x = rng.standard_normal((2, 5, 8))
    attn.eval()
    assert np.array_equal(to_numpy(attn(x).data), to_numpy(attn(x).data))
    attn.train()
    tv.manual_seed(3)
    a = to_numpy(attn(x).data)
    tv.manual_seed(4)
    assert not np.allclose(a, to_numpy(attn(x).data))


def test_pytorch_autograd_through_a_gather_agrees(torch, rng):
    """The same equation in PyTorch, the bias gathered by an index array (not skewed): outputs and
    every gradient."""
    attn = relative_attention(tokens=6)
    x = rng.standard_normal((3, 6, 8))
    g = rng.standard_normal((3, 6, 8))
    xt = tv.Tensor(x.copy(), requires_grad=True)
    (attn(xt) * g).sum().backward()

    T, H, dh = 6, 2, 4
    tp = {n: torch.tensor(to_numpy(p.data), requires_grad=True) for n, p in attn.named_parameters()}
    xtorch = torch.tensor(x, requires_grad=True)
    q, k, v = (xtorch @ tp["qkv.weight"] + tp["qkv.bias"]).reshape(3, T, 3, H, dh).permute(2, 0, 3, 1, 4)
    keys = tp["rel_pos"].reshape(2 * T - 1, H, dh).permute(1, 0, 2)                  # (H, 2T - 1, D_h)
    offsets = torch.arange(T)[:, None] - torch.arange(T)[None, :] + T - 1          # T - 1 + i - j
    bias = torch.einsum("bhid,hijd->bhij", q, keys[:, offsets])
    a = torch.softmax((q @ k.transpose(-1, -2) + bias) / math.sqrt(dh), dim=-1)
    out = (a @ v).permute(0, 2, 1, 3).reshape(3, T, 8) @ tp["proj.weight"] + tp["proj.bias"]
    (out * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(to_numpy(attn(x).data), out.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(to_numpy(xt.grad), xtorch.grad.numpy(), rtol=1e-9, atol=1e-11)
    for name, p in attn.named_parameters():
        np.testing.assert_allclose(to_numpy(p.grad), tp[name].grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=name)


def test_a_sequence_of_another_length_is_refused(rng):
    attn = relative_attention(tokens=5)
    with pytest.raises(ValueError, match="cover sequences of 5 tokens, got 6"):
        attn(rng.standard_normal((1, 6, 8)))
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        nn.RelativeMultiHeadAttention(8, 2, 0)


# ---------------------------------------------------------------- the ViT with relative embeddings


@pytest.mark.parametrize("pool", ["token", "gap"])
def test_vit_with_relative_embeddings(pool, rng):
    """A table of 2T - 1 offsets in every block (T counting the class token), no absolute table,
    the parameter count and FLOPs the config computes, not fused (no kernel has the bias)."""
    model = create("vit-mnist/7", dim=16, depth=2, num_heads=2, mlp_dim=32, pool=pool, posemb="relative")
    tokens = 16 + (pool == "token")
    assert [b.attn.rel_pos.shape for b in model.blocks] == [(2 * tokens - 1, 16)] * 2
    assert model.position_embedding(np, np.float32) is None and not hasattr(model, "pos_embed")
    assert model.num_parameters() == model.config.count_parameters()
    plain = ViTConfig(**{**model.config.__dict__, "posemb": "none"})
    assert model.config.forward_flops() - plain.forward_flops() == 2 * 2 * tokens * (2 * tokens - 1) * 16
    assert "relative position embeddings" in why_not(model)
    x = rng.standard_normal((2, 1, 28, 28)).astype(np.float32)
    assert model(x).shape == (2, 10)


def test_saved_and_loaded_and_read_from_its_weights(tmp_path, rng):
    model = create("vit-mnist/7", dim=16, depth=2, num_heads=2, mlp_dim=32, posemb="relative")
    x = rng.standard_normal((2, 1, 28, 28)).astype(np.float32)
    io.save(model, tmp_path / "rel.safetensors")
    loaded = tv.load(tmp_path / "rel.safetensors")
    assert loaded.config.posemb == "relative"
    np.testing.assert_array_equal(to_numpy(loaded(x).data), to_numpy(model(x).data))
    from tinyvit.io.config import config_from_state_dict
    state = {k: to_numpy(v.data if hasattr(v, "data") else v) for k, v in model.state_dict().items()}
    cfg = config_from_state_dict(state, 7, 1, num_heads=2)
    assert (cfg.posemb, cfg.image_size) == ("relative", 28)
    with pytest.raises(ValueError, match="cannot be carried to a 8x8 grid: keep image_size=28"):
        io.load_pretrained(tmp_path / "rel.safetensors", image_size=56)


def test_relative_tables_get_no_weight_decay():
    """Like every position embedding (and the 2-D row and column tables): timm's no_weight_decay."""
    from tinyvit import optim
    for posemb in ("relative", "learned-2d", "learned-1d"):
        model = create("vit-mnist/7", dim=16, depth=2, num_heads=2, mlp_dim=32, posemb=posemb)
        no_decay, _ = optim.param_groups_weight_decay(model, 0.05)
        names = {n for n, p in model.named_parameters() if any(p is q for q in no_decay["params"])}
        tables = {n for n in dict(model.named_parameters()) if n.rsplit(".", 1)[-1].startswith(("rel_pos", "pos_"))}
        assert tables and tables <= names, posemb


def test_trains_through_the_cli(tmp_path, capsys):
    """`tinyvit train --model-arg posemb=relative`: trains, saves, and says it is not fused."""
    (tmp_path / "data.toml").write_text("[dataset]\ntrain_size = 64\ntest_size = 16\nimage_size = 8\n"
                                        "channels = 3\nnum_classes = 2\n")
    code, out, err = cli(capsys, "train", "--dataset", "synthetic", "--config", tmp_path / "data.toml",
                         "--model", "vit-cifar/4", "--model-arg", "dim=8", "--model-arg", "depth=1",
                         "--model-arg", "num_heads=2", "--model-arg", "mlp_dim=16", "--model-arg", "posemb=relative",
                         "--epochs", "1", "--batch-size", "16", "--out", tmp_path / "run")
    assert code == 0, err
    assert tv.load(tmp_path / "run" / "latest.safetensors").config.posemb == "relative"
    code, out, err = cli(capsys, "finetune", tmp_path / "run" / "best.safetensors", "--dataset", "synthetic",
                         "--config", tmp_path / "data.toml", "--image-size", "16", "--epochs", "1",
                         "--out", tmp_path / "ft")
    assert code != 0 and "keep image_size=8" in one_line(err)
