"""Multi-head self-attention, appendix A Eq. 5-8, as one Function with its backward written out.

    [q, k, v] = z U_qkv                      U_qkv in R^{D x 3 D_h}          (Eq. 5)
    A = softmax(q k^T / sqrt(D_h))           A in R^{N x N}                  (Eq. 6)
    SA(z) = A v                                                              (Eq. 7)
    MSA(z) = [SA_1(z); ...; SA_k(z)] U_msa   U_msa in R^{k D_h x D}          (Eq. 8)

With k = H heads of width D_h = D / H, all heads' U_qkv side by side form one (D, 3D) matrix whose
columns are ordered q | k | v, each split by head: q's columns [h*D_h, (h+1)*D_h) belong to head h
(timm's qkv layout, transposed to our (in, out) convention). The fast version (cache blocks,
threads, the scale folded into U_q, fewer queries for the last block) is kernels/cpu/attention.py.
"""
from __future__ import annotations

import math

from ..autograd import Function
from ..backend import get_array_module, random_uniform
from .common import require_float, require_ndim, require_same_dtype, shape_of


class MultiHeadAttention(Function):
    """Multi-head self-attention (Eq. 5-8), optionally with dropout on the attention weights.

    x: (B, N, D)   w_qkv: (D, 3D)   b_qkv: (3D,) or None   w_proj: (D, D)   b_proj: (D,) or None
    ->  out: (B, N, D), and with return_attention also attn: (B, H, N, N) (softmax, before dropout).

    Forward, with D_h = D / H:
        [q | k | v] = x U_qkv + b_qkv         Eq. 5, all heads in one GEMM, split to (B, H, N, D_h)
        A = softmax(q k^T / sqrt(D_h))        Eq. 6, (B, H, N, N)
        A' = A * mask / (1 - p)               dropout (training only; mask = uniform >= p)
        ctx = A' v                            Eq. 7, (B, H, N, D_h), heads side by side: (B*N, D)
        out = ctx U_msa + b_proj              Eq. 8
    Backward, from gy = dL/dout (and gA = dL/dattn when the attention map feeds a loss):
        dU_msa = ctx^T gy,  db_proj = sum gy,  dctx = gy U_msa^T
        dA' = dctx v^T,  dv = A'^T dctx,  dA = dA' * mask / (1 - p) + gA
        dS = A * (dA - sum(dA * A, last axis))          softmax backward (S: the scaled logits)
        dq = dS k / sqrt(D_h),  dk = dS^T q / sqrt(D_h)
        dqkv = [dq | dk | dv],  dx = dqkv U_qkv^T,  dU_qkv = x^T dqkv,  db_qkv = sum dqkv
    """

    float16_in_float32 = True            # the scores q k^T of ordinary activations overflow float16

    def forward(self, x, w_qkv, b_qkv, w_proj, b_proj, num_heads, attn_dropout=0.0, training=False,
                return_attention=False):
        xp = get_array_module(x)
        b, n, d = x.shape
        h, dh = num_heads, d // num_heads

        rows = x.reshape(b * n, d)                        # (B*N, D)
        qkv = rows @ w_qkv                                # (B*N, 3D), Eq. 5 for all heads at once
        if b_qkv is not None:
            qkv = qkv + b_qkv
        q, k, v = _split_heads(qkv.reshape(b, n, 3, h, dh))   # each (B, H, N, D_h)

        logits = (q @ k.swapaxes(-1, -2)) / math.sqrt(dh)          # (B, H, N, N), Eq. 6
        a = xp.exp(logits - logits.max(axis=-1, keepdims=True))   # softmax, shifted against overflow
        a /= a.sum(axis=-1, keepdims=True)

        mask, keep_scale, a_drop = None, 1.0, a
        if training and attn_dropout > 0.0:
            mask = random_uniform(xp, a.shape, a.dtype) >= attn_dropout
            keep_scale = 1.0 / (1.0 - attn_dropout) if attn_dropout < 1.0 else 0.0
            a_drop = a * mask * keep_scale

        ctx = a_drop @ v                                  # (B, H, N, D_h), Eq. 7
        merged = _merge_heads(ctx)                        # (B*N, D): [SA_1, ..., SA_k]
        out = merged @ w_proj                             # Eq. 8
        if b_proj is not None:
            out = out + b_proj

        self.save(rows, w_qkv, q, k, v, a, mask, keep_scale, merged, w_proj)
        out = out.reshape(b, n, d)
        return (out, a) if return_attention else out

    def backward(self, gy, g_attn=None):
        rows, w_qkv, q, k, v, a, mask, keep_scale, merged, w_proj = self.saved
        xp = get_array_module(a)
        b, h, n, dh = q.shape
        d = h * dh
        dw_proj = db_proj = None
        dv = xp.zeros_like(v)
        da = xp.zeros_like(a)
        if gy is not None:
            g2 = gy.reshape(b * n, d)                     # (B*N, D)
            dw_proj = merged.T @ g2
            db_proj = g2.sum(axis=0)
            dctx = _split_heads_of((g2 @ w_proj.T).reshape(b, n, h, dh))     # (B, H, N, D_h)
            a_drop = a if mask is None else a * mask * keep_scale
            dv = a_drop.swapaxes(-1, -2) @ dctx                              # dv = A'^T dctx
            da = dctx @ v.swapaxes(-1, -2)                                   # dA' (B, H, N, N)
            if mask is not None:
                da = da * mask * keep_scale
        if g_attn is not None:
            da = da + g_attn

        ds = a * (da - (da * a).sum(axis=-1, keepdims=True))   # softmax backward
        dq = (ds @ k) / math.sqrt(dh)
        dk = (ds.swapaxes(-1, -2) @ q) / math.sqrt(dh)

        dqkv = xp.stack([dq, dk, dv], axis=2)            # (B, H, 3, N, D_h)
        dqkv = dqkv.transpose(0, 3, 2, 1, 4).reshape(b * n, 3 * d)   # (B*N, 3D), columns q | k | v
        dx = (dqkv @ w_qkv.T).reshape(b, n, d)
        dw_qkv = rows.T @ dqkv
        db_qkv = dqkv.sum(axis=0)
        return dx, dw_qkv, db_qkv, dw_proj, db_proj


def _split_heads_of(t):
    """(B, N, H, D_h) -> (B, H, N, D_h): one (N, D_h) matrix per sample and head (a view)."""
    return t.transpose(0, 2, 1, 3)


def _split_heads(qkv):
    """(B, N, 3, H, D_h) -> q, k, v, each (B, H, N, D_h) (views)."""
    return tuple(_split_heads_of(qkv[:, :, i]) for i in range(3))


def _merge_heads(ctx):
    """(B, H, N, D_h) -> (B*N, H*D_h): each token's heads side by side, as Eq. 8 concatenates them."""
    b, h, n, dh = ctx.shape
    return ctx.transpose(0, 2, 1, 3).reshape(b * n, h * dh)


# ---------------------------------------------------------------- the function users call


def multi_head_attention(x, w_qkv, b_qkv, w_proj, b_proj, num_heads, attn_dropout=0.0, training=False,
                         return_attention=False, function=None):
    """Multi-head self-attention (appendix A, Eq. 5-8) on tokens x: (B, N, D) -> (B, N, D).

    w_qkv: (D, 3D) with columns q | k | v, heads split within each; b_qkv: (3D,) or None;
    w_proj: (D, D); b_proj: (D,) or None; D must be divisible by num_heads.
    attn_dropout: dropout probability on the attention weights, applied only when training.
    return_attention: also return the softmax attention weights (B, H, N, N) (before dropout).
    function: the Function that computes it, this module's reference unless tinyvit.functional
    passes a kernel.
    """
    op = "multi_head_attention"
    require_float(op, x=x, w_qkv=w_qkv, b_qkv=b_qkv, w_proj=w_proj, b_proj=b_proj)
    require_same_dtype(op, x=x, w_qkv=w_qkv, b_qkv=b_qkv, w_proj=w_proj, b_proj=b_proj)
    require_ndim(op, "x", x, 3, "tokens (B, N, D)")
    if w_qkv is None or w_proj is None:
        raise ValueError(f"{op}: w_qkv and w_proj are required (only the biases may be None)")
    d = shape_of(x)[-1]
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"{op}: num_heads must be a positive integer, got {num_heads!r}")
    if d % num_heads:
        raise ValueError(f"{op}: the embedding size D={d} is not divisible by num_heads={num_heads}")
    expected = {"w_qkv": (w_qkv, (d, 3 * d)), "b_qkv": (b_qkv, (3 * d,)),
                "w_proj": (w_proj, (d, d)), "b_proj": (b_proj, (d,))}
    for name, (value, shape) in expected.items():
        if value is not None and shape_of(value) != shape:
            raise ValueError(f"{op}: {name} must have shape {shape} for x of shape {shape_of(x)} "
                             f"(D={d}; weights are (in, out)), got {shape_of(value)}")
    if not 0.0 <= attn_dropout <= 1.0:
        raise ValueError(f"{op}: attn_dropout must be a probability in [0, 1], got {attn_dropout!r}")
    return (function or MultiHeadAttention).apply(x, w_qkv, b_qkv, w_proj, b_proj, num_heads, float(attn_dropout),
                                    bool(training), return_attention=bool(return_attention))
