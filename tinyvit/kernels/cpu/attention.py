"""Multi-head self-attention on the CPU, fast: the same function as ops/attention.py (Eq. 5-8), plus
``num_outputs``, for ViT's last block, whose output only the class token's row is read from.

    1/sqrt(D_h) folded   Eq. 6's scale goes into a copy of U_q (3D^2 numbers), so the qkv GEMM gives
                         s q at once and neither the logits nor dS needs a pass of its own
    blocks of samples    between the GEMMs, each block of SAMPLES_PER_BLOCK samples runs bias add,
                         logits, softmax and A v (backward: dv, dA, dS, dq, dk) while it is in the cache,
                         the blocks shared among threads (kernels/cpu/threads.py)
    one softmax shift    per block, not per row, when that is safe (_ONE_SHIFT_SPAN)
    db_k = 0, db_v free  softmax ignores a per-row shift, and rows of A sum to 1 (see the docstring)
    num_outputs = M < N  only the first M tokens ask: q from their rows only, outputs (B, M, D)

Tests: tests/test_kernels_cpu_attention.py proves it equal to the reference, forward and every gradient.
"""
from __future__ import annotations

import math

import numpy as np

from ...autograd import Function
from ...backend import get_array_module, random_uniform
from .linear import weight_gradient
from .threads import add_row_vector_, aligned_matmul, column_sums, empty, for_each_block, scratch


class MultiHeadAttention(Function):
    """Fused multi-head self-attention (Eq. 5-8), optionally with dropout on the attention weights.

    x: (B, N, D)   w_qkv: (D, 3D)   b_qkv: (3D,) or None   w_proj: (D, D)   b_proj: (D,) or None
    ->  out: (B, M, D), and with return_attention also attn: (B, H, M, N) (softmax, before dropout),
    where only the first M = num_outputs tokens ask (M = N by default: full self-attention). Every
    token still gives its key and value; ViT's last block needs just the class token's row (M = 1).

    Forward, with dh = D / H and s = 1 / sqrt(dh):
        [s q | k | v] = x [s U_q | U_k | U_v] + [s b_q | b_k | b_v]    Eq. 5, split to (B, H, ., dh)
                 M = N: one GEMM over (B*N, D);  M < N: s q from the (B*M, D) asking rows only,
                 k and v from all (B*N, D) rows (the other N - M queries would be wasted work)
        A = softmax((s q) k^T)                (B, H, M, N)   Eq. 6, s folded into a copy of U_q
        A' = A * mask / (1 - p)               dropout (training only; mask = uniform >= p)
        ctx = A' v                            (B, H, M, dh), heads merged back to (B*M, D)
        out = ctx W_proj + b_proj
    Backward, from gy = dL/dout (and gA = dL/dattn when the attention map feeds a loss):
        dW_proj = ctx^T gy,  db_proj = sum gy,  dctx = gy W_proj^T
        dA' = dctx v^T,  dv = A'^T dctx,  dA = dA' * mask / (1 - p) + gA
        dS = A * (dA - sum(dA * A, last axis))          softmax backward
        d(s q) = dS k,  dk = dS^T (s q)
        M = N: dqkv = [d(s q) | dk | dv],  dx = dqkv [s U_q | U_k | U_v]^T,  dW_qkv = x^T dqkv,
               and then s times the q columns: dU_q = s x^T d(s q)
        M < N: the same with x^T split: x_M^T d(s q) for the q columns, x^T [dk | dv] for the
               others; dx gets d(s q) (s U_q)^T in the first M tokens' rows only
        db_qkv = [s sum d(s q) | 0 | db_v]: b_k adds q . b_k to a whole row of logits, which softmax
               ignores, so db_k = 0 exactly; b_v adds (sum_j A'_ij) b_v to ctx_i, and without dropout
               each row of A sums to 1, so db_v = sum_i dctx_i = W_proj sum_i gy_i (with dropout:
               sum dv). Only the columns of d(s q) (and of dv under dropout) are summed.

    Layout: q, k, v are strided views into the (B, N, 3, H, dh) GEMM output (M < N: q into
    (B, M, H, dh), k and v into (B, N, 2, H, dh)), and the batched matmuls write ctx and dq, dk, dv
    straight into the rows the next GEMM reads, so no head split or merge is ever copied (NumPy's
    matmul hands such views to BLAS as they are). On NumPy everything between the GEMMs runs on
    blocks of SAMPLES_PER_BLOCK samples shared among the kernels' threads (threads.for_each_block):
    a block's qkv bias add, logits, softmax and A' v follow one another while its arrays are in the
    cache, and backward's dv, dA', dS, dq, dk and the block's share of db_qkv likewise (dS lives
    only in a per-thread scratch block). The (B, H, M, N) arrays then cross memory once, not once
    per step (measured: 1.5 ms less forward and 2 ms less backward per vit-cifar block, 2 threads).
    """

    def forward(self, x, w_qkv, b_qkv, w_proj, b_proj, num_heads, attn_dropout=0.0, training=False,
                return_attention=False, num_outputs=None):
        xp = get_array_module(x)
        b, n, d = x.shape
        m = n if num_outputs is None else num_outputs
        if not 1 <= m <= n:
            raise ValueError(f"multi_head_attention kernel: num_outputs must be in [1, N={n}], got {num_outputs}")
        h = num_heads
        dh = d // h
        scale = 1.0 / math.sqrt(dh)                       # a Python float: float32 stays float32
        # Eq. 6's 1/sqrt(dh) goes into the q columns of a copy of the weights (3D^2 numbers), so that
        # the GEMM gives the scaled query s q at once: neither the (B, H, M, N) logits here nor dS in
        # backward needs a pass of its own to be scaled (measured at vit-cifar/4's size: 0.5 ms less
        # per full block's forward + backward on 2 threads, 0.9 ms on one).
        w_qkv, b_qkv = _scale_queries(w_qkv, b_qkv, scale)

        rows = x.reshape(b * n, d)                        # (B*N, D): every token gives k and v
        if m == n:
            q_rows = rows
            qkv = aligned_matmul(rows, w_qkv)             # (B*N, 3D), Eq. 5 for all heads at once
            biased = [(qkv.reshape(b, n, 3 * d), b_qkv)]  # each sample's rows, to add b_qkv to
            q, k, v = _heads(qkv.reshape(b, n, 3, h, dh))  # each (B, H, N, dh), views
        else:
            # Only the first M tokens ask, so only their rows meet W_q: the N - M other queries
            # would be 1/3 of the largest GEMM (and of two in backward) computed for nothing.
            q_rows = x[:, :m].reshape(b * m, d)           # (B*M, D); a view when M = 1
            q2 = aligned_matmul(q_rows, w_qkv[:, :d])     # (B*M, D)  s q = z (s U_q)
            kv = aligned_matmul(rows, w_qkv[:, d:])       # (B*N, 2D) [k, v] = z [U_k, U_v]
            biased = [(q2.reshape(b, m, d), None if b_qkv is None else b_qkv[:d]),
                      (kv.reshape(b, n, 2 * d), None if b_qkv is None else b_qkv[d:])]
            q = _heads_of(q2.reshape(b, m, h, dh))        # (B, H, M, dh), a view
            k, v = _heads(kv.reshape(b, n, 2, h, dh))     # each (B, H, N, dh), views

        a = empty((b, h, m, n), x.dtype, xp)              # A, kept for backward (and returned)
        mask, keep_scale = None, 1.0
        if training and attn_dropout > 0.0:
            mask = random_uniform(xp, a.shape, a.dtype) >= attn_dropout
            keep_scale = 1.0 / (1.0 - attn_dropout) if attn_dropout < 1.0 else 0.0
        merged = empty((b, m, h, dh), x.dtype, xp)        # heads side by side: (B*M, D) rows
        ctx = _heads_of(merged)

        def attend(r):
            """Eq. 5's bias, Eq. 6 and Eq. 7 for the samples r, one after the other while their
            rows, logits and weights are in the cache."""
            for rows_of_samples, bias in biased:
                if bias is not None:
                    xp.add(rows_of_samples[r], bias, out=rows_of_samples[r])
            xp.matmul(q[r], k[r].swapaxes(-1, -2), out=a[r])            # logits s q k^T
            _softmax_block_(a[r].reshape(-1, n))                        # A = softmax(s q k^T), Eq. 6
            a_drop = a[r] if mask is None else _dropped(a[r], mask[r], keep_scale)
            xp.matmul(a_drop, v[r], out=ctx[r])                         # ctx = A' v, Eq. 7

        for_each_block(attend, _sample_blocks(xp, b))
        merged = merged.reshape(b * m, d)
        out = aligned_matmul(merged, w_proj)              # Eq. 8
        if b_proj is not None:
            add_row_vector_(out, b_proj)

        self.save(rows, q_rows, w_qkv, q, k, v, a, mask, keep_scale,
                  merged if self.needs_input_grad[3] else None, w_proj, scale)
        out = out.reshape(b, m, d)
        return (out, a) if return_attention else out

    def backward(self, gy, g_attn=None):
        rows, q_rows, w_qkv, q, k, v, a, mask, keep_scale, merged, w_proj, scale = self.saved
        xp = get_array_module(a)
        need = self.needs_input_grad
        b, h, m, n = a.shape
        dh = q.shape[-1]
        d = h * dh
        dw_proj = db_proj = None
        if gy is not None:
            g2 = gy.reshape(b * m, d)                     # (B*M, D)
            if need[3]:
                dw_proj = weight_gradient(merged, g2)
            if need[4]:
                db_proj = column_sums(g2)
        if not (need[0] or need[1] or need[2]):
            return None, None, None, dw_proj, db_proj

        # dq, dk, dv are written as views into arrays laid out like the forward's GEMM outputs, so
        # the GEMMs at the end read them as plain rows.
        if m == n:
            dqkv = empty((b, n, 3, h, dh), a.dtype, xp)        # the (B*N, 3D) rows of [dq | dk | dv]
            dq, dk, dv = _heads(dqkv)
        else:
            dq2 = empty((b, m, h, dh), a.dtype, xp)            # the (B*M, D) rows of dq
            dkv = empty((b, n, 2, h, dh), a.dtype, xp)         # the (B*N, 2D) rows of [dk | dv]
            dq = _heads_of(dq2)
            dk, dv = _heads(dkv)
        dctx = None if gy is None else _heads_of(aligned_matmul(g2, w_proj.T).reshape(b, m, h, dh))  # (B,H,M,dh)
        # The columns of [dq | dk | dv] that db_qkv sums, per sample as (B, rows, D) views: d(s q)'s, and
        # dv's only under dropout (see the docstring: db_k = 0, and db_v follows from gy otherwise).
        summed = []
        if need[2]:
            if m == n:
                rows_q = rows_v = dqkv.reshape(b, n, 3 * d)
            else:
                rows_q, rows_v = dq2.reshape(b, m, d), dkv.reshape(b, n, 2 * d)
            summed.append(rows_q[..., :d])
            if mask is not None and dctx is not None:
                summed.append(rows_v[..., -d:])

        def grads(r):
            """The backward of Eq. 7, 6 and 5's products for the samples r, in the cache; returns
            their share of db_qkv (the column sums of their rows of each array of summed)."""
            a_r = a[r]
            (da,) = scratch("attention_da", 1, a_r)       # dA, then dS, for these samples only
            if dctx is not None:
                a_drop = a_r if mask is None else _dropped(a_r, mask[r], keep_scale)
                xp.matmul(a_drop.swapaxes(-1, -2), dctx[r], out=dv[r])     # dv = A'^T dctx
                xp.matmul(dctx[r], v[r].swapaxes(-1, -2), out=da)          # dA'
                if mask is not None:
                    da *= mask[r]
                    da *= keep_scale
                if g_attn is not None:
                    da += g_attn[r]
            else:                                         # only the attention map feeds the loss
                dv[r] = 0
                da[...] = g_attn[r]
            _softmax_backward_block_(da.reshape(-1, n), a_r.reshape(-1, n))  # dS, in place
            xp.matmul(da, k[r], out=dq[r])                # d(s q) = dS k
            xp.matmul(da.swapaxes(-1, -2), q[r], out=dk[r])  # dk = dS^T (s q)
            return [column_sums(cols[r].reshape(-1, d)) for cols in summed]

        parts = for_each_block(grads, _sample_blocks(xp, b))
        db_qkv = None
        if need[2]:
            sums = [sum(part[i] for part in parts) for i in range(len(summed))]   # in block order
            db_q = sums[0]
            if len(sums) > 1:                             # dropout: dv's own column sums
                db_v = sums[1]
            elif dctx is None:                            # no gy: dv = 0
                db_v = xp.zeros_like(db_q)
            else:                                         # sum_i dctx_i = W_proj sum_i gy_i
                db_v = w_proj @ (db_proj if db_proj is not None else column_sums(g2))
            db_qkv = xp.concatenate([db_q * scale, xp.zeros_like(db_q), db_v])

        dx = dw_qkv = None
        if m == n:
            dqkv = dqkv.reshape(b * n, 3 * d)             # back to (B*N, 3D) columns q | k | v
            dx = aligned_matmul(dqkv, w_qkv.T).reshape(b, n, d) if need[0] else None   # w_qkv: the scaled copy
            dw_qkv = weight_gradient(rows, dqkv) if need[1] else None
        else:
            # M < N: k and v came from all B*N rows, q from the B*M asking rows only
            dq2, dkv = dq2.reshape(b * m, d), dkv.reshape(b * n, 2 * d)
            if need[0]:
                dx = aligned_matmul(dkv, w_qkv[:, d:].T).reshape(b, n, d)   # every token as key and value
                dx[:, :m] += (dq2 @ w_qkv[:, :d].T).reshape(b, m, d)    # the asking tokens as queries
            if need[1]:
                dw_qkv = xp.empty_like(w_qkv)
                dw_qkv[:, :d] = weight_gradient(q_rows, dq2)
                dw_qkv[:, d:] = weight_gradient(rows, dkv)
        # The GEMMs gave the gradients of s U_q and s b_q; U_q's and b_q's are s times those (chain rule).
        if dw_qkv is not None:
            dw_qkv[:, :d] *= scale
        return dx, dw_qkv, db_qkv, dw_proj, db_proj


def _sample_blocks(xp, b):
    """Slices of SAMPLES_PER_BLOCK samples (one slice of all on CuPy, where each step is a kernel)."""
    if xp is not np:
        return [slice(None)]
    return [slice(start, start + SAMPLES_PER_BLOCK) for start in range(0, b, SAMPLES_PER_BLOCK)]


# Samples per block of the per-sample work: 8 samples x 3 heads of vit-cifar's (65, 65) weights are
# 0.4 MB of float32, which stay in a core's cache from the logits to A v (and from dA to dk). (8 was
# ~5% faster than 16 or 32 for the op's forward + backward at batch 128 on 2 threads: more blocks
# share out more evenly.)
SAMPLES_PER_BLOCK = 8


def _dropped(a, mask, keep_scale):
    """A' = A * mask / (1 - p): dropout on attention weights, a fresh array."""
    a_drop = a * mask
    a_drop *= keep_scale
    return a_drop


# Softmax is unchanged by subtracting any number from a row; exp needs that number to be at least the
# row's largest logit (no overflow) and less than about 87 above its smallest (no float32 underflow to
# zero or denormals, which would lose precision or the whole row). One shift for a whole block, its
# largest logit, meets both when the block's logits span less than _ONE_SHIFT_SPAN (exp(-80) = 2e-35),
# as they do in practice: two fast whole-block reductions instead of a max along each short row
# (1.2 ns per element on vit-cifar's rows of 65, more than exp itself) and a broadcast subtraction.
_ONE_SHIFT_SPAN = 80.0


def _softmax_block_(z):
    """z (R, n) <- softmax(z) along each row, in place: exp(z - c) / sum(exp(z - c)), with c the
    block's largest logit when the block's logits span less than _ONE_SHIFT_SPAN (NumPy), else each
    row's own largest (any NaN or infinity takes this path too)."""
    xp = get_array_module(z)
    top = z.max() if xp is np and z.size else None
    if top is not None and top - z.min() < _ONE_SHIFT_SPAN:
        z -= top
    else:
        z -= z.max(axis=-1, keepdims=True)
    xp.exp(z, out=z)
    # The row sums as the BLAS product z @ 1: NumPy's sum(axis=-1) over rows this short
    # (N = 65) took twice as long (0.8 vs 1.6 ms on (24960, 65) float32, one thread).
    z /= (z @ xp.ones(z.shape[-1], dtype=z.dtype))[:, None]


def _softmax_backward_block_(g, y):
    """g (R, n) <- dL/dz for y = softmax(z), given g = dL/dy:  y (g - sum(g y)), in place."""
    xp = get_array_module(g)
    g -= xp.einsum("ij,ij->i", g, y)[:, None]            # sum(g y) over the row
    g *= y


def _scale_queries(w_qkv, b_qkv, scale):
    """Copies of w_qkv (D, 3D) and b_qkv (3D,) or None with the q columns (the first D) times
    scale, so that z w_qkv + b_qkv gives [s q | k | v] (the inputs are not changed)."""
    d = w_qkv.shape[0]
    w_qkv = w_qkv.copy()
    w_qkv[:, :d] *= scale
    if b_qkv is not None:
        b_qkv = b_qkv.copy()
        b_qkv[:d] *= scale
    return w_qkv, b_qkv


def _heads_of(t):
    """(B, N, H, dh) -> the view (B, H, N, dh): one (N, dh) matrix per sample and head."""
    return t.transpose(0, 2, 1, 3)


def _heads(t):
    """(B, N, P, H, dh) -> P views, each (B, H, N, dh): q, k, v of the qkv GEMM (P = 3) or k, v (P = 2)."""
    return tuple(_heads_of(t[:, :, i]) for i in range(t.shape[2]))
