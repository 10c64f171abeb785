"""multi_head_attention (Eq. 5-8): gradient checks, a per-head NumPy reference, PyTorch parity, errors.

Through tinyvit.functional on both paths (BOTH_PATHS): the reference op of tinyvit/ops/attention.py
and the kernel the switchboard picks (kernels/cpu/attention.py). The kernel's own features (fewer
queries, blocks of samples among threads, the block softmax, the db_qkv shortcuts) are tested in
tests/test_kernels_cpu_attention.py."""
import math

import numpy as np
import pytest

import tinyvit as tv
import tinyvit.functional as F
from tinyvit.backend import random_uniform, to_numpy

from helpers import assert_close, const, torch_parity

BOTH_PATHS = True   # every test runs with the kernels and with the reference ops (conftest.py)


# ---------------------------------------------------------------- a plain NumPy reference, head by head


def ref_attention(x, w_qkv, b_qkv, w_proj, b_proj, heads, drop_mask=None, keep_scale=1.0):
    """Eq. 5-8 with an explicit loop over heads and the q | k | v column blocks sliced by hand."""
    d = x.shape[-1]
    dh = d // heads
    qkv = x @ w_qkv + (0 if b_qkv is None else b_qkv)
    q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
    outs, attns = [], []
    for h in range(heads):
        cols = slice(h * dh, (h + 1) * dh)
        logits = q[..., cols] @ k[..., cols].transpose(0, 2, 1) / math.sqrt(dh)
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        a = e / e.sum(axis=-1, keepdims=True)
        attns.append(a)
        if drop_mask is not None:
            a = a * drop_mask[:, h] * keep_scale
        outs.append(a @ v[..., cols])
    out = np.concatenate(outs, axis=-1) @ w_proj + (0 if b_proj is None else b_proj)
    return out, np.stack(attns, axis=1)


def arrays(rng, b, n, d, scale=0.5):
    return [rng.standard_normal((b, n, d)), rng.standard_normal((d, 3 * d)) * scale, rng.standard_normal(3 * d) * 0.1,
            rng.standard_normal((d, d)) * scale, rng.standard_normal(d) * 0.1]


# (B, N, D, heads): 1 head, several heads, dh = 1, batch 1, N = 1, odd sizes
CASES = [(2, 3, 4, 1), (1, 1, 6, 3), (2, 5, 6, 2), (1, 4, 8, 4), (3, 2, 3, 3), (1, 7, 5, 1)]


# ---------------------------------------------------------------- gradient checks


@pytest.mark.parametrize("b,n,d,heads", CASES)
def test_gradcheck_every_input(xp, rng, b, n, d, heads):
    inputs = [tv.Tensor(xp.asarray(a), requires_grad=True) for a in arrays(rng, b, n, d)]
    tv.gradcheck(lambda *t: F.multi_head_attention(*t, heads), inputs)


@pytest.mark.parametrize("which", range(5))
def test_gradcheck_one_input_at_a_time(xp, rng, which):
    """Each input alone: exercises every needs_input_grad shortcut in backward."""
    inputs = [tv.Tensor(xp.asarray(a), requires_grad=(i == which)) for i, a in enumerate(arrays(rng, 2, 3, 6))]
    tv.gradcheck(lambda *t: F.multi_head_attention(*t, 2), inputs)
    for i, t in enumerate(inputs):
        assert (t.grad is None) == (i != which)


def test_gradcheck_without_biases(xp, rng):
    x, w_qkv, _, w_proj, _ = [tv.Tensor(xp.asarray(a), requires_grad=True) for a in arrays(rng, 2, 3, 4)]
    tv.gradcheck(lambda x, wq, wp: F.multi_head_attention(x, wq, None, wp, None, 2), [x, w_qkv, w_proj])


@pytest.mark.parametrize("b,n,d,heads", [(2, 3, 4, 2), (1, 1, 3, 1)])
def test_gradcheck_with_attention_output(xp, rng, b, n, d, heads):
    """When the attention map feeds the loss too (e.g. a regulariser), its gradient flows back."""
    inputs = [tv.Tensor(xp.asarray(a), requires_grad=True) for a in arrays(rng, b, n, d)]
    tv.gradcheck(lambda *t: F.multi_head_attention(*t, heads, return_attention=True), inputs)
    tv.gradcheck(lambda *t: F.multi_head_attention(*t, heads, return_attention=True)[1], inputs)
    # one loss of both outputs: backward receives both gradients in a single call
    g_out = const(xp, rng.standard_normal((b, n, d)))
    g_attn = const(xp, rng.standard_normal((b, heads, n, n)))

    def both(*t):
        out, attn = F.multi_head_attention(*t, heads, return_attention=True)
        return (out * g_out).sum() + (attn * g_attn).sum()

    tv.gradcheck(both, inputs)


@pytest.mark.parametrize("b,n,d,heads", [(2, 4, 4, 2), (1, 3, 6, 3)])
def test_gradcheck_with_attention_dropout(xp, rng, b, n, d, heads):
    tv.get_array_module(xp.zeros(1))       # let tinyvit load CuPy first, so manual_seed seeds it too
    inputs = [tv.Tensor(xp.asarray(a), requires_grad=True) for a in arrays(rng, b, n, d)]

    def fn(*t):
        tv.manual_seed(7)                   # the same dropout mask on every call
        return F.multi_head_attention(*t, heads, attn_dropout=0.4, training=True)

    tv.gradcheck(fn, inputs)


# ---------------------------------------------------------------- forward against the reference


@pytest.mark.parametrize("b,n,d,heads", CASES)
def test_forward_matches_per_head_reference(xp, rng, b, n, d, heads):
    a = arrays(rng, b, n, d, scale=1.0)
    out, attn = F.multi_head_attention(*[xp.asarray(t) for t in a], heads, return_attention=True)
    ref_out, ref_attn = ref_attention(*a, heads)
    assert out.shape == (b, n, d) and attn.shape == (b, heads, n, n)
    assert_close(out, ref_out, rtol=1e-10, atol=1e-12, what="output")
    assert_close(attn, ref_attn, rtol=1e-10, atol=1e-12, what="attention")


def test_forward_without_qkv_bias_matches_reference(xp, rng):
    x, w_qkv, _, w_proj, b_proj = arrays(rng, 2, 5, 6)
    out = F.multi_head_attention(xp.asarray(x), xp.asarray(w_qkv), None, xp.asarray(w_proj), xp.asarray(b_proj), 3)
    assert_close(out, ref_attention(x, w_qkv, None, w_proj, b_proj, 3)[0], rtol=1e-10, atol=1e-12)


def test_dropout_forward_matches_reference_with_the_same_mask(xp, rng):
    b, n, d, heads, p = 2, 6, 8, 2, 0.3
    a = arrays(rng, b, n, d)
    tv.get_array_module(xp.zeros(1))       # let tinyvit load CuPy first, so manual_seed seeds it too
    tv.manual_seed(11)
    out = F.multi_head_attention(*[xp.asarray(t) for t in a], heads, attn_dropout=p, training=True)
    tv.manual_seed(11)
    mask = to_numpy(random_uniform(xp, (b, heads, n, n), np.float64)) >= p
    assert 0 < mask.sum() < mask.size
    assert_close(out, ref_attention(*a, heads, drop_mask=mask, keep_scale=1 / (1 - p))[0], rtol=1e-10, atol=1e-12)
    # evaluation mode (training=False) ignores attn_dropout entirely
    plain = F.multi_head_attention(*[xp.asarray(t) for t in a], heads, attn_dropout=p, training=False)
    assert_close(plain, ref_attention(*a, heads)[0], rtol=1e-10, atol=1e-12)
    # p = 1 drops everything: only the output bias is left
    gone = F.multi_head_attention(*[xp.asarray(t) for t in a], heads, attn_dropout=1.0, training=True)
    assert_close(gone, np.broadcast_to(a[4], (b, n, d)), rtol=0, atol=0)


def test_return_attention(xp, rng):
    a = [xp.asarray(t) for t in arrays(rng, 3, 5, 6, scale=2.0)]
    out, attn = F.multi_head_attention(*a, 3, return_attention=True)
    alone = F.multi_head_attention(*a, 3)
    np.testing.assert_array_equal(to_numpy(out.data), to_numpy(alone.data))   # the same numbers, bit for bit
    probs = to_numpy(attn.data)
    assert probs.shape == (3, 3, 5, 5) and (probs >= 0).all()
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=1e-12)
    # the map returned is the one before dropout: still sums to 1 while training with dropout
    tv.manual_seed(0)
    _, attn_train = F.multi_head_attention(*a, 3, attn_dropout=0.5, training=True, return_attention=True)
    np.testing.assert_allclose(to_numpy(attn_train.data), probs, rtol=1e-12)


# ---------------------------------------------------------------- PyTorch parity


def torch_attention(torch, heads):
    """A hand-written torch version of Eq. 5-8 (timm's Attention.forward with our (in, out) weights)."""
    def fn(x, w_qkv, b_qkv, w_proj, b_proj):
        b, n, d = x.shape
        qkv = (x @ w_qkv + b_qkv).reshape(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        a = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // heads), dim=-1)
        return (a @ v).transpose(1, 2).reshape(b, n, d) @ w_proj + b_proj
    return fn


def torch_sdpa(torch, heads):
    """The same with torch.nn.functional.scaled_dot_product_attention for the Eq. 6-7 core."""
    def fn(x, w_qkv, b_qkv, w_proj, b_proj):
        b, n, d = x.shape
        qkv = torch.nn.functional.linear(x, w_qkv.T, b_qkv).reshape(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        ctx = torch.nn.functional.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return torch.nn.functional.linear(ctx.transpose(1, 2).reshape(b, n, d), w_proj.T, b_proj)
    return fn


def torch_nn_mha(torch, heads):
    """torch.nn.functional.multi_head_attention_forward: in_proj_weight (3D, D) holds q | k | v rows with
    heads split within each, i.e. our w_qkv transposed; it wants sequence-first (N, B, D) tokens."""
    def fn(x, w_qkv, b_qkv, w_proj, b_proj):
        d = x.shape[-1]
        t = x.transpose(0, 1)
        out, _ = torch.nn.functional.multi_head_attention_forward(
            t, t, t, d, heads, w_qkv.T, b_qkv, None, None, False, 0.0, w_proj.T, b_proj,
            training=False, need_weights=False)
        return out.transpose(0, 1)
    return fn


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float32, 1e-4)])
@pytest.mark.parametrize("reference", [torch_attention, torch_sdpa, torch_nn_mha])
@pytest.mark.parametrize("b,n,d,heads", [(2, 5, 8, 2), (1, 1, 6, 3), (3, 4, 6, 1)])
def test_torch_parity(torch, rng, dtype, rtol, reference, b, n, d, heads):
    torch_parity(torch, lambda *t: F.multi_head_attention(*t, heads), reference(torch, heads),
                 arrays(rng, b, n, d), dtype, rtol)


def test_attention_weights_match_torch_per_head(torch, rng):
    b, n, d, heads = 2, 5, 8, 4
    x, w_qkv, b_qkv, w_proj, b_proj = arrays(rng, b, n, d, scale=1.0)
    _, attn = F.multi_head_attention(x, w_qkv, b_qkv, w_proj, b_proj, heads, return_attention=True)
    tt = [torch.tensor(a) for a in (x, w_qkv, b_qkv, w_proj, b_proj)]
    t = tt[0].transpose(0, 1)
    _, weights = torch.nn.functional.multi_head_attention_forward(
        t, t, t, d, heads, tt[1].T, tt[2], None, None, False, 0.0, tt[3].T, tt[4],
        training=False, need_weights=True, average_attn_weights=False)
    assert_close(attn, weights, rtol=1e-10, atol=1e-12, what="attention weights (B, H, N, N)")


# ---------------------------------------------------------------- float32 stays float32


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_float32_in_float32_out(xp, rng, dropout):
    inputs = [tv.Tensor(xp.asarray(a, dtype=np.float32), requires_grad=True) for a in arrays(rng, 2, 4, 6)]
    out, attn = F.multi_head_attention(*inputs, 3, attn_dropout=dropout, training=True, return_attention=True)
    assert out.dtype == np.float32 and attn.dtype == np.float32
    (out * const(xp, rng.standard_normal(out.shape), np.float32)).sum().backward()
    for t in inputs:
        assert t.grad is not None and t.grad.dtype == np.float32


# ---------------------------------------------------------------- bad inputs


def test_errors():
    f = np.float32
    x = np.zeros((2, 3, 6), f)
    w_qkv, b_qkv, w_proj, b_proj = np.zeros((6, 18), f), np.zeros(18, f), np.zeros((6, 6), f), np.zeros(6, f)
    with pytest.raises(ValueError, match="D=6 is not divisible by num_heads=4"):
        F.multi_head_attention(x, w_qkv, b_qkv, w_proj, b_proj, 4)
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        F.multi_head_attention(x, w_qkv, b_qkv, w_proj, b_proj, 0)
    with pytest.raises(ValueError, match=r"tokens \(B, N, D\), got shape \(3, 6\)"):
        F.multi_head_attention(x[0], w_qkv, b_qkv, w_proj, b_proj, 2)
    with pytest.raises(ValueError, match=r"w_qkv must have shape \(6, 18\).*got \(18, 6\)"):
        F.multi_head_attention(x, w_qkv.T, b_qkv, w_proj, b_proj, 2)
    with pytest.raises(ValueError, match=r"b_proj must have shape \(6,\)"):
        F.multi_head_attention(x, w_qkv, b_qkv, w_proj, b_qkv, 2)
    with pytest.raises(ValueError, match="w_qkv and w_proj are required"):
        F.multi_head_attention(x, None, b_qkv, w_proj, b_proj, 2)
    with pytest.raises(ValueError, match=r"attn_dropout must be a probability in \[0, 1\]"):
        F.multi_head_attention(x, w_qkv, b_qkv, w_proj, b_proj, 2, attn_dropout=1.5)
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        F.multi_head_attention(x.astype(np.int32), w_qkv, b_qkv, w_proj, b_proj, 2)
    with pytest.raises(TypeError, match="one floating dtype.*w_proj float64"):
        F.multi_head_attention(x, w_qkv, b_qkv, w_proj.astype(np.float64), b_proj, 2)
