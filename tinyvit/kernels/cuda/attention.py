"""Multi-head self-attention on the GPU: the same function as ops/attention.py (Eq. 5-8), with Eq. 6
and 7 fused into CUDA kernels in the style of flash attention, and num_outputs as in kernels/cpu/.

    [q | k | v] = x U_qkv + b_qkv        Eq. 5: one 2-D cuBLAS GEMM over the (B*N, D) rows
    ctx = softmax(s q k^T) v             Eq. 6-7, s = 1/sqrt(D_h): attention_forward, one kernel; the
                                         (B, H, N, N) logits never reach global memory
    out = ctx U_msa + b_proj             Eq. 8: one 2-D GEMM; ctx is written with the heads side by
                                         side, already the (B*N, D) rows this GEMM reads

What backward needs of the softmax: the row logsumexp L_i = log sum_j exp(s q_i . k_j), (B, H, N)
numbers, not A, (B, H, N, N). Backward recomputes A_ij = exp(s q_i . k_j - L_i) tile by tile where it
needs it. Why not keep A, which ViT's N <= 577 would allow: A costs a write in forward, a read in
backward and the memory held in between (ViT-B/16 at batch 128, float32: 240 MB per layer), where
recomputing costs one dot product per entry, on q and k rows the backward kernels load anyway. A is
written only when the caller asks for it (return_attention): attention_probabilities, from L.

Backward (the reference's formulas, regrouped as in flash attention):
    dctx = gy U_msa^T                                     (2-D GEMM)
    delta_i = sum_j dA_ij A_ij = dctx_i . ctx_i (+ sum_j gA_ij A_ij)      attention_delta
              (sum_j A_ij dctx_i . v_j = dctx_i . ctx_i: no N x N array needed)
              In float32 this identity cancels where the softmax saturates on huge logits (inputs of
              1e4 and more, e.g. float16's 6e4 widened): the reference's sum_j A_ij dA_ij is exact for
              a one-hot row, dctx_i . ctx_i is off by its rounding, times |k| in dq. Flash attention
              takes the same risk; float64 is exact (tests/test_ops_float16.py says where it was seen).
    dS_ij = A_ij (dctx_i . v_j + gA_ij - delta_i)          recomputed where used
    dq_i = s sum_j dS_ij k_j                              attention_backward_dq (a block per queries)
    dk_j = s sum_i dS_ij q_i,  dv_j = sum_i A_ij dctx_i   attention_backward_dkdv (a block per keys)
    dx, dU_qkv, db_qkv from dqkv = [dq | dk | dv], dU_msa, db_proj from gy: 2-D GEMMs and sums
dq and dk, dv come from two kernels, each summing over its own axis inside one block, so no atomics
and the same result on every run.

Kernels read q, k, v in place in the GEMM's (B*N, 3D) output (row stride 3D; head h at columns
h*D_h) and write ctx and dq, dk, dv into the rows the next GEMM reads: no head split or merge is
ever copied. Thread layout: see attention.cu. float32 (accumulating in float32) and float64; head
sizes up to MAX_HEAD_DIM = 128, the kernels that keep rows of a head in registers (forward, dq, dkdv)
compiled once per head-size class (HEAD_CLASSES: up to 32, 64, 128 columns; a lane holds 1, 2 or 4
of them), so that ViT's heads of 32 and 64 pay no multiply-adds on padding. Attention dropout
(training with attn_dropout > 0) and head sizes the kernels do not fit run the reference instead
(ops/attention.py, the same random numbers).

Tests: tests/test_kernels_cuda_attention.py (GPU: equal to the reference, every output and gradient).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ...autograd import Function
from ...backend import get_array_module
from ...ops import attention as reference
from . import entry, kernel, load_source

# The block shape, the same numbers as SOURCE's constants (a test compares them).
WARP = 32
WARPS = 4                      # warps per block of the tiled kernels: 128 threads
ROWS = 4                       # rows each warp owns: queries (forward, dq) or keys (dkdv)
BLOCK_ROWS = WARPS * ROWS      # 16 rows per block
TILE = WARP                    # keys (forward, dq) or queries (dkdv) per tile: one per lane
MAX_HEAD_DIM = 128             # at most 4 columns of a head per lane
HEAD_CLASSES = (32, 64, 128)   # the instantiations of the tiled kernels: 1, 2, 4 columns per lane
DELTA_WARPS = 8                # attention_delta: a warp per row, 8 rows per block
STATIC_SHARED_LIMIT = 48 * 1024    # above this, a kernel must opt in to more dynamic shared memory
MAX_GRID_Y = 65535

SOURCE = load_source("attention.cu")          # the CUDA C++ of the kernels below

KERNEL_NAMES = ("attention_forward", "attention_probabilities", "attention_delta", "attention_backward_dq",
                "attention_backward_dkdv")
BY_HEAD_CLASS = ("attention_forward", "attention_backward_dq", "attention_backward_dkdv")   # templates on COLS
NULL = np.uintp(0)     # a null pointer argument (CuPy passes a NumPy scalar by value: 8 bytes, as a pointer)


# ---------------------------------------------------------------- launch configuration (pure arithmetic)


def shared_bytes(name: str, head_dim: int, itemsize: int) -> int:
    """Bytes of dynamic shared memory kernel ``name`` uses for heads of ``head_dim`` numbers of
    ``itemsize`` bytes: the arrays listed in each kernel's comment in SOURCE."""
    dh, padded = head_dim, head_dim + 1
    elements = {
        "attention_forward": BLOCK_ROWS * dh + TILE * padded + TILE * dh,         # qs, ks, vs
        "attention_probabilities": BLOCK_ROWS * dh + TILE * padded,               # qs, ks
        "attention_delta": 0,
        "attention_backward_dq": 2 * BLOCK_ROWS * dh + 2 * TILE * padded,         # qs, dos, ks, vs
        "attention_backward_dkdv": 2 * BLOCK_ROWS * dh + 2 * TILE * padded + 2 * TILE,  # kb, vb, qs, dos, L, delta
    }[name]
    return elements * itemsize


def launch_config(name: str, batch: int, heads: int, m: int, n: int, head_dim: int, itemsize: int):
    """(grid, block, shared bytes) of kernel ``name`` for B = batch, H = heads, M queries, N keys.

    The tiled kernels: grid (B*H, blocks of BLOCK_ROWS rows: M queries, or N keys for dkdv), the
    (sample, head) on x, which allows 2^31 - 1 blocks (y allows 65535); WARPS warps per block.
    attention_delta: a warp per (b, h, i) row, DELTA_WARPS rows per block."""
    if name == "attention_delta":
        return (-(-batch * heads * m // DELTA_WARPS),), (DELTA_WARPS * WARP,), 0
    rows = n if name == "attention_backward_dkdv" else m
    grid = (batch * heads, -(-rows // BLOCK_ROWS))
    return grid, (WARPS * WARP,), shared_bytes(name, head_dim, itemsize)


def kernels_fit(head_dim: int, itemsize: int, max_shared: int) -> bool:
    """Whether every kernel runs for this head size: at most MAX_HEAD_DIM columns (4 per lane) and
    shared memory within ``max_shared``, the device's per-block limit for kernels that opt in."""
    return 1 <= head_dim <= MAX_HEAD_DIM and all(
        shared_bytes(name, head_dim, itemsize) <= max_shared for name in KERNEL_NAMES)


@functools.lru_cache(maxsize=None)
def _shared_limit(device_id: int) -> int:
    from cupy.cuda import runtime
    return runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id)


def max_shared_bytes() -> int:
    """The current GPU's limit of shared memory per block for a kernel that opts in (A100: 163 KB,
    H100: 227 KB)."""
    import cupy
    return _shared_limit(cupy.cuda.Device().id)


def head_class(head_dim: int) -> int:
    """The smallest of HEAD_CLASSES that holds a head of ``head_dim`` columns."""
    for size in HEAD_CLASSES:
        if head_dim <= size:
            return size
    raise ValueError(f"attention kernels: head size {head_dim} is beyond MAX_HEAD_DIM = {MAX_HEAD_DIM}")


def entry_name(name: str, dtype, head_dim: int) -> str:
    """The entry point that runs kernel ``name`` for this dtype and head size: attention_forward_d64_f32
    for a head of 33 to 64 float32 numbers; attention_delta_f64 (no class) and so on."""
    return entry(f"{name}_d{head_class(head_dim)}" if name in BY_HEAD_CLASS else name, dtype)


def entry_names() -> list:
    """Every entry point of SOURCE: each kernel for float32 and float64, and in each head-size class."""
    return [entry_name(name, dtype, size) for name in KERNEL_NAMES for dtype in (np.float32, np.float64)
            for size in (HEAD_CLASSES if name in BY_HEAD_CLASS else HEAD_CLASSES[:1])]


def _launch(name, dtype, shape, args):
    """Launch kernel ``name`` for this dtype on shape = (B, H, M, N, D_h), in the head size's class,
    opting in to more than 48 KB of dynamic shared memory where it needs it."""
    grid, block, shared = launch_config(name, *shape, np.dtype(dtype).itemsize)
    function = kernel(SOURCE, entry_name(name, dtype, shape[4]))
    if shared > STATIC_SHARED_LIMIT and function.max_dynamic_shared_size_bytes < shared:
        function.max_dynamic_shared_size_bytes = shared
    function(grid, block, args, shared_mem=shared)


def _at(buffer, offset=0):
    """The contiguous buffer seen from element ``offset`` on: what a kernel gets as a pointer there."""
    return buffer.reshape(-1)[offset:]


i32 = np.int32
_NO_SAMPLES = "no samples"     # saved[0] of a forward with B = 0 (nothing launched, nothing to recompute)


# ---------------------------------------------------------------- the Function


class MultiHeadAttention(Function):
    """Fused multi-head self-attention (Eq. 5-8); the reference's signature, plus num_outputs.

    x: (B, N, D)   w_qkv: (D, 3D)   b_qkv: (3D,) or None   w_proj: (D, D)   b_proj: (D,) or None
    ->  out: (B, M, D), and with return_attention also attn: (B, H, M, N) (softmax, before dropout),
    where only the first M = num_outputs tokens ask (default M = N); every token is a key and value.

    Forward: qkv GEMM(s), attention_forward (ctx and the row logsumexp L), attention_probabilities
    (only for return_attention), the projection GEMM. M < N: s q from the first M tokens' rows only
    (x_M U_q), k and v from all rows (x [U_k | U_v]), as in kernels/cpu/attention.py.
    Saved for backward: x's rows, the q, k, v GEMM outputs, ctx, L (B, H, M), and A only when it
    was returned (its gradient needs it); the weights (references, no copies).
    Backward: module docstring. Dropout on the attention weights while training, and head sizes
    beyond MAX_HEAD_DIM or the GPU's shared memory, run the reference (ops/attention.py) instead.
    Weights and biases must have x's dtype (TypeError); B = 0 gives empty outputs, an empty dL/dx and
    zero weight gradients, without a launch.
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
        for name, a in (("w_qkv", w_qkv), ("b_qkv", b_qkv), ("w_proj", w_proj), ("b_proj", b_proj)):
            if a is not None and a.dtype != x.dtype:      # the kernels read every array as x's dtype
                raise TypeError(f"multi_head_attention kernel: {name} is {a.dtype}, x is {x.dtype}")
        if b == 0:                                        # no sample: nothing to launch (CUDA refuses an empty grid)
            self.save(_NO_SAMPLES, x.shape, w_qkv, b_qkv, w_proj, b_proj)
            out = xp.zeros((0, m, d), x.dtype)
            return (out, xp.zeros((0, h, m, n), x.dtype)) if return_attention else out
        if (training and attn_dropout > 0.0) or not kernels_fit(dh, x.dtype.itemsize, max_shared_bytes()):
            return self._reference_forward(x, w_qkv, b_qkv, w_proj, b_proj, num_heads, attn_dropout, training,
                                           return_attention, m)

        rows = x.reshape(b * n, d)                        # (B*N, D): every token gives k and v
        if m == n:
            q_rows = rows
            qkv = rows @ w_qkv                            # (B*N, 3D), Eq. 5 for all heads at once
            if b_qkv is not None:
                qkv += b_qkv
            q_buf, kv_buf, ldq, k_at = qkv, qkv, 3 * d, d     # q at column 0, k at D, v at 2D
        else:
            q_rows = x[:, :m].reshape(b * m, d)           # (B*M, D): only these tokens ask
            q_buf = q_rows @ w_qkv[:, :d]                 # (B*M, D)  q
            kv_buf = rows @ w_qkv[:, d:]                  # (B*N, 2D) [k | v]
            if b_qkv is not None:
                q_buf += b_qkv[:d]
                kv_buf += b_qkv[d:]
            ldq, k_at = d, 0                              # k at column 0 of kv_buf, v at D
        ldkv = kv_buf.shape[1]
        shape = (b, h, m, n, dh)
        scale = x.dtype.type(1.0 / math.sqrt(dh))
        q, k, v = _at(q_buf), _at(kv_buf, k_at), _at(kv_buf, k_at + d)

        ctx = xp.empty((b * m, d), x.dtype)               # heads side by side: the rows Eq. 8 reads
        lse = xp.empty((b, h, m), x.dtype)                # L_i = log sum_j exp(s q_i . k_j)
        _launch("attention_forward", x.dtype, shape,
                (q, i32(ldq), k, v, i32(ldkv), ctx, i32(d), lse, i32(h), i32(m), i32(n), i32(dh), scale))
        attn = None
        if return_attention:
            attn = xp.empty((b, h, m, n), x.dtype)        # A = exp(s q k^T - L), Eq. 6
            _launch("attention_probabilities", x.dtype, shape,
                    (q, i32(ldq), k, i32(ldkv), lse, attn, i32(h), i32(m), i32(n), i32(dh), scale))

        out = ctx @ w_proj                                # Eq. 8
        if b_proj is not None:
            out += b_proj
        self.save(None, rows, q_rows, w_qkv, q_buf, kv_buf, ldq, k_at, ctx, lse, attn, w_proj, shape, scale)
        out = out.reshape(b, m, d)
        return (out, attn) if return_attention else out

    def backward(self, gy, g_attn=None):
        if self.saved[0] is _NO_SAMPLES:                  # B = 0: dL/dx is empty, the weights' gradients 0
            _, x_shape, *weights = self.saved
            xp = get_array_module(weights[0])
            grads = [xp.zeros(x_shape, weights[0].dtype)] + [None if w is None else xp.zeros_like(w) for w in weights]
            return tuple(g if need else None for g, need in zip(grads, self.needs_input_grad))
        if self.saved[0] is not None:
            return self._reference_backward(gy, g_attn)
        _, rows, q_rows, w_qkv, q_buf, kv_buf, ldq, k_at, ctx, lse, attn, w_proj, shape, scale = self.saved
        xp = get_array_module(ctx)
        need = self.needs_input_grad
        b, h, m, n, dh = shape
        d = h * dh
        dtype = ctx.dtype
        dw_proj = db_proj = None
        if gy is not None:
            g2 = xp.ascontiguousarray(gy).reshape(b * m, d)   # (B*M, D); a broadcast gradient gets its own copy
            if need[3]:
                dw_proj = ctx.T @ g2
            if need[4]:
                db_proj = g2.sum(axis=0)
        if not (need[0] or need[1] or need[2]):
            return None, None, None, dw_proj, db_proj

        dctx = g2 @ w_proj.T if gy is not None else xp.zeros((b * m, d), dtype)   # (B*M, D)
        dattn = NULL if g_attn is None else xp.ascontiguousarray(g_attn)         # (B, H, M, N)
        delta = xp.empty((b, h, m), dtype)
        _launch("attention_delta", dtype, shape,
                (ctx, dctx, i32(d), NULL if g_attn is None else attn, dattn, delta, i32(b), i32(h), i32(m),
                 i32(n), i32(dh)))

        if m == n:
            dqkv = xp.empty((b * n, 3 * d), dtype)        # [dq | dk | dv], the rows of the qkv GEMM
            dq_buf, dkv_buf, lddq, dk_at = dqkv, dqkv, 3 * d, d
        else:
            dq_buf = xp.empty((b * m, d), dtype)
            dkv_buf = xp.empty((b * n, 2 * d), dtype)
            lddq, dk_at = d, 0
        lddkv = dkv_buf.shape[1]
        q, k, v = _at(q_buf), _at(kv_buf, k_at), _at(kv_buf, k_at + d)
        ldkv = kv_buf.shape[1]
        common = (i32(h), i32(m), i32(n), i32(dh), scale)
        _launch("attention_backward_dq", dtype, shape,
                (q, i32(ldq), k, v, i32(ldkv), dctx, i32(d), lse, delta, dattn, _at(dq_buf), i32(lddq)) + common)
        _launch("attention_backward_dkdv", dtype, shape,
                (q, i32(ldq), k, v, i32(ldkv), dctx, i32(d), lse, delta, dattn, _at(dkv_buf, dk_at),
                 _at(dkv_buf, dk_at + d), i32(lddkv)) + common)

        dx = dw_qkv = db_qkv = None
        if m == n:
            dx = (dqkv @ w_qkv.T).reshape(b, n, d) if need[0] else None
            dw_qkv = rows.T @ dqkv if need[1] else None
            db_qkv = dqkv.sum(axis=0) if need[2] else None
        else:                                             # q came from the first M tokens' rows only
            if need[0]:
                dx = (dkv_buf @ w_qkv[:, d:].T).reshape(b, n, d)
                dx[:, :m] += (dq_buf @ w_qkv[:, :d].T).reshape(b, m, d)
            if need[1]:
                dw_qkv = xp.empty_like(w_qkv)
                dw_qkv[:, :d] = q_rows.T @ dq_buf
                dw_qkv[:, d:] = rows.T @ dkv_buf
            if need[2]:
                db_qkv = xp.concatenate([dq_buf.sum(axis=0), dkv_buf.sum(axis=0)])
        return dx, dw_qkv, db_qkv, dw_proj, db_proj

    # The cases the kernels leave to the reference: the same Function, on all N queries, cut to M.

    def _reference_forward(self, x, w_qkv, b_qkv, w_proj, b_proj, num_heads, attn_dropout, training,
                           return_attention, m):
        fallback = reference.MultiHeadAttention()
        fallback.needs_input_grad = self.needs_input_grad
        result = fallback.forward(x, w_qkv, b_qkv, w_proj, b_proj, num_heads, attn_dropout, training,
                                  return_attention)
        n = x.shape[1]
        self.save(fallback, m, n)
        if m == n:
            return result
        xp = get_array_module(x)
        if return_attention:
            return xp.ascontiguousarray(result[0][:, :m]), xp.ascontiguousarray(result[1][:, :, :m])
        return xp.ascontiguousarray(result[:, :m])

    def _reference_backward(self, gy, g_attn):
        fallback, m, n = self.saved
        if m < n:                                          # the rows past M got no gradient: zeros
            xp = get_array_module(gy if gy is not None else g_attn)
            if gy is not None:
                full = xp.zeros((gy.shape[0], n, gy.shape[2]), gy.dtype)
                full[:, :m] = gy
                gy = full
            if g_attn is not None:
                full = xp.zeros(g_attn.shape[:2] + (n, n), g_attn.dtype)
                full[:, :, :m] = g_attn
                g_attn = full
        return fallback.backward(gy, g_attn)
