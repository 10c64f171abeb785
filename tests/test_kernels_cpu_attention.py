"""kernels/cpu/attention.py (MultiHeadAttention with num_outputs, the block softmax) against
ops/attention.py's MultiHeadAttention: outputs, attention maps and every gradient, float64 and float32,
blocks of 2 samples, 1 and 2 threads, with and without dropout (the shared helpers and the meta-test
are in test_kernels_cpu.py).

float32 tolerance: rtol 1e-4 and atol 1e-5 times the array's largest magnitude. The kernel folds
1/sqrt(D_h) into a copy of U_q (the reference scales the logits), shifts a block's softmax by one
number (the reference, each row by its own max), and takes db_v from W_proj sum(gy) (the reference
sums dv): equal in exact arithmetic, each rounding differently, and the differences pass through up
to four products and a softmax (measured: at most 1.2e-6 of |reference| + scale).
"""
import numpy as np
import pytest

import tinyvit as tv
from tinyvit.backend import random_uniform
from tinyvit.kernels.cpu import attention as k_attention
from tinyvit.ops import attention

from helpers import torch_parity
from kernel_checks import F64, assert_kernel_equals_reference, cpu_kernel
from test_ops_attention import arrays, torch_attention

TOL = {np.float64: (F64["rtol"], F64["atol"]), np.float32: (1e-4, 1e-5)}
NAMES = ["x", "w_qkv", "b_qkv", "w_proj", "b_proj"]

# (B, N, D, heads): odd batches over blocks of 2 (2 + 2 + 1, 2 + 2 + 2 + 1), one token, D_h = 1
CASES = [(5, 6, 8, 2), (7, 3, 6, 3), (1, 1, 4, 1), (3, 5, 6, 6)]


def attend(function, heads, p=0.0, return_attention=False, seed=7, **extra):
    """Inputs -> function.apply(..., heads, p, training=p > 0, return_attention) after
    tinyvit.manual_seed(seed), so that both paths draw the same dropout mask."""
    def fn(*t):
        tv.manual_seed(seed)
        return function.apply(*t, heads, p, p > 0, return_attention=return_attention, **extra)
    return fn


def upstream_for(rng, b, n, d, heads, m, outputs):
    """Random upstream gradients: [g_out] or [g_out, g_attn], with None for an output left unused."""
    g_out, g_attn = rng.standard_normal((b, m, d)), rng.standard_normal((b, heads, m, n))
    return {"out": [g_out], "both": [g_out, g_attn], "out only": [g_out, None], "map only": [None, g_attn]}[outputs]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("b,n,d,heads", CASES)
@pytest.mark.parametrize("biases", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("outputs", ["out", "both", "out only"])
def test_attention_equals_reference(small_blocks, dtype, b, n, d, heads, biases, p, outputs):
    """The "multi_head_attention" kernel: the output, the attention map and the gradients of x, U_qkv,
    b_qkv, U_msa and b_proj equal the reference's, with and without biases, with dropout (the same
    seeded mask on both paths), and with an upstream gradient on the output alone, on the output and
    the map, or on the output while the returned map is left unused."""
    rng = np.random.default_rng(b * n + d)
    data = arrays(rng, b, n, d)
    if not biases:
        data[2] = data[4] = None
    kernel = cpu_kernel("multi_head_attention")
    ra = outputs != "out"
    assert_kernel_equals_reference(attend(kernel, heads, p, ra), attend(attention.MultiHeadAttention, heads, p, ra),
                                   data, upstream_for(rng, b, n, d, heads, n, outputs), dtype, TOL[dtype], names=NAMES)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("b,n,d,heads", CASES[:2])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_attention_map_alone_equals_reference(small_blocks, dtype, b, n, d, heads, p):
    """The "multi_head_attention" kernel when only the attention map feeds the loss (return_attention,
    no gradient reaches the output): every input's gradient equals the reference's (U_msa and b_proj
    get none on both paths)."""
    rng = np.random.default_rng(n + d)
    kernel = cpu_kernel("multi_head_attention")
    _, grads = assert_kernel_equals_reference(
        attend(kernel, heads, p, True), attend(attention.MultiHeadAttention, heads, p, True), arrays(rng, b, n, d),
        upstream_for(rng, b, n, d, heads, n, "map only"), dtype, TOL[dtype], names=NAMES)
    assert grads[3] is None and grads[4] is None and grads[0] is not None


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("which", range(6))
def test_attention_one_input_at_a_time_equals_reference(small_blocks, dtype, which):
    """The "multi_head_attention" kernel's shortcuts when only some inputs want a gradient: each input
    alone, then all the weights with x as a constant; dropout on, both outputs used."""
    rng = np.random.default_rng(which)
    b, n, d, heads = 5, 4, 6, 2
    wants = [int(i == which) for i in range(5)] if which < 5 else [0, 1, 1, 1, 1]
    kernel = cpu_kernel("multi_head_attention")
    assert_kernel_equals_reference(attend(kernel, heads, 0.2, True), attend(attention.MultiHeadAttention, heads, 0.2, True),
                                   arrays(rng, b, n, d), upstream_for(rng, b, n, d, heads, n, "both"), dtype,
                                   TOL[dtype], wants_grad=wants, names=NAMES)


# ---------------------------------------------------------------- num_outputs: only the first M tokens ask


def first_rows(function, heads, m, p, return_attention):
    """The reference's full attention, cut to its first m tokens' outputs (and attention rows)."""
    full = attend(function, heads, p, return_attention)

    def fn(*t):
        out = full(*t)
        if return_attention:
            return out[0][:, :m], out[1][:, :, :m]
        return out[:, :m]
    return fn


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("outputs", ["out", "both", "map only"])
def test_fewer_outputs_equal_the_first_rows_of_the_reference(small_blocks, monkeypatch, dtype, m, p, outputs):
    """The "multi_head_attention" kernel with num_outputs=M < N (q from the first M tokens only; every
    token is still a key and a value): out (B, M, D), attn (B, H, M, N) and every input's gradient
    equal the first M rows of the reference's full attention. With dropout, the reference draws its
    (B, H, N, N) mask and the kernel gets that mask's first M rows (its own draw has another shape)."""
    b, n, d, heads = 5, 6, 6, 3
    rng = np.random.default_rng(m)
    if p:
        tv.manual_seed(11)
        u = random_uniform(np, (b, heads, n, n), dtype)
        monkeypatch.setattr(attention, "random_uniform", lambda xp, shape, dt: u.copy())
        monkeypatch.setattr(k_attention, "random_uniform", lambda xp, shape, dt: u[:, :, :shape[2]].copy())
    ra = outputs != "out"
    kernel = cpu_kernel("multi_head_attention")
    outs, _ = assert_kernel_equals_reference(
        attend(kernel, heads, p, ra, num_outputs=m), first_rows(attention.MultiHeadAttention, heads, m, p, ra),
        arrays(rng, b, n, d), upstream_for(rng, b, n, d, heads, m, outputs), dtype, TOL[dtype], names=NAMES)
    assert outs[0].shape == (b, m, d)


def test_key_bias_gradient_is_exactly_zero(small_blocks, rng):
    """The kernel's db_qkv shortcut: b_k adds q . b_k to a whole row of logits, which softmax ignores,
    so its gradient is exactly 0 (not rounding noise), with all queries or the first 2, with dropout
    or without (db_v is then summed from dv instead of taken from W_proj sum(gy))."""
    b, n, d, heads = 5, 5, 6, 3
    for m in (None, 2):
        for p in (0.0, 0.3):
            inputs = [tv.Tensor(a, requires_grad=True) for a in arrays(rng, b, n, d)]
            out = attend(k_attention.MultiHeadAttention, heads, p, num_outputs=m)(*inputs)
            out.backward(rng.standard_normal(out.shape))
            db = inputs[2].grad
            assert np.all(db[d:2 * d] == 0) and np.any(db[:d] != 0) and np.any(db[2 * d:] != 0), (m, p)


@pytest.mark.parametrize("b,n,d,heads,m", [(3, 5, 6, 2, 1), (1, 4, 8, 4, 3), (3, 3, 3, 1, 2)])
def test_gradcheck_with_fewer_outputs(small_blocks, rng, b, n, d, heads, m):
    """num_outputs=M: only the first M tokens ask; every token still gets a gradient (as key and
    value). Finite differences agree for the output alone, with the attention map, and with dropout."""
    inputs = [tv.Tensor(a, requires_grad=True) for a in arrays(rng, b, n, d)]
    kernel = k_attention.MultiHeadAttention
    tv.gradcheck(attend(kernel, heads, num_outputs=m), inputs)
    tv.gradcheck(attend(kernel, heads, return_attention=True, num_outputs=m), inputs)
    tv.gradcheck(attend(kernel, heads, 0.3, seed=3, num_outputs=m), inputs)


@pytest.mark.parametrize("which", range(5))
def test_gradcheck_fewer_outputs_one_input_at_a_time(rng, which):
    """M < N takes its own path (q from the M asking rows, k and v from all N): each input alone."""
    inputs = [tv.Tensor(a, requires_grad=(i == which)) for i, a in enumerate(arrays(rng, 2, 4, 6))]
    tv.gradcheck(attend(k_attention.MultiHeadAttention, 2, num_outputs=2), inputs)
    for i, t in enumerate(inputs):
        assert (t.grad is None) == (i != which)


@pytest.mark.parametrize("m", [1, 2])
def test_gradcheck_fewer_outputs_without_biases(rng, m):
    """M < N with b_qkv = b_proj = None."""
    x, w_qkv, _, w_proj, _ = [tv.Tensor(a, requires_grad=True) for a in arrays(rng, 2, 4, 6)]
    tv.gradcheck(lambda x, wq, wp: k_attention.MultiHeadAttention.apply(x, wq, None, wp, None, 3, num_outputs=m),
                 [x, w_qkv, w_proj])


def test_gradcheck_fewer_outputs_attention_map_alone(rng):
    """Only the (B, H, M, N) map feeds the loss: no output gradient reaches backward."""
    inputs = [tv.Tensor(a, requires_grad=True) for a in arrays(rng, 2, 5, 6)]
    fn = attend(k_attention.MultiHeadAttention, 2, return_attention=True, num_outputs=2)
    tv.gradcheck(lambda *t: fn(*t)[1], inputs)


def test_fewer_outputs_torch_parity(torch, rng):
    """num_outputs=2 against the first two rows of a hand-written PyTorch attention (float64)."""
    def reference(x, w_qkv, b_qkv, w_proj, b_proj):
        return torch_attention(torch, 2)(x, w_qkv, b_qkv, w_proj, b_proj)[:, :2]

    torch_parity(torch, attend(k_attention.MultiHeadAttention, 2, num_outputs=2), reference,
                 arrays(rng, 3, 6, 8), np.float64, 1e-6)


# ---------------------------------------------------------------- the block softmax's shift


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("spread", [3.0, 40.0, 200.0])
def test_block_softmax_matches_a_per_row_reference(rng, dtype, spread):
    """_softmax_block_ shifts a whole block by its largest logit when the block's logits span less
    than _ONE_SHIFT_SPAN, else each row by its own; either way each row equals the plain float64
    softmax. spread 200: rows of very different levels (the per-row path); smaller: one shift."""
    z = rng.standard_normal((50, 65)) + rng.uniform(-spread / 2, spread / 2, size=(50, 1))
    want = np.exp(z - z.max(axis=1, keepdims=True))
    want /= want.sum(axis=1, keepdims=True)
    got = z.astype(dtype)
    k_attention._softmax_block_(got)
    assert got.dtype == dtype
    tol = 1e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(got, want, rtol=tol * 10, atol=tol)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=tol * 10)


def test_one_shift_for_a_wide_block_would_lose_rows(rng, monkeypatch):
    """Why the span guard exists: shifting a block whose rows differ by 200 by its overall max
    underflows the low rows' exp to zero (0/0: NaN); with the guard those rows are exact."""
    z = rng.standard_normal((4, 65)).astype(np.float32)
    z[:2] += 200.0
    guarded = z.copy()
    k_attention._softmax_block_(guarded)
    assert np.isfinite(guarded).all()
    monkeypatch.setattr(k_attention, "_ONE_SHIFT_SPAN", np.inf)
    unguarded = z.copy()
    with np.errstate(invalid="ignore", divide="ignore"):
        k_attention._softmax_block_(unguarded)
    assert not np.isfinite(unguarded[2:]).all()
    np.testing.assert_allclose(unguarded[:2], guarded[:2], rtol=1e-6)


def test_block_softmax_keeps_nan_and_infinite_logits_to_their_rows(rng):
    """A NaN (or +inf) logit takes the per-row path: it spoils its own row only."""
    z = rng.standard_normal((3, 6))
    z[0, 2] = np.nan
    z[1, 4] = -np.inf                                     # a masked-out logit: weight exactly 0
    got = z.copy()
    with np.errstate(invalid="ignore"):
        k_attention._softmax_block_(got)
    assert np.isnan(got[0]).all()
    assert got[1, 4] == 0.0 and np.isclose(got[1].sum(), 1.0)
    want = np.exp(z[2] - z[2].max())
    np.testing.assert_allclose(got[2], want / want.sum(), rtol=1e-13)
