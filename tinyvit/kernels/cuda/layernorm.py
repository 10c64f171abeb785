"""LayerNorm on an NVIDIA GPU: the same numbers as ops/norm.py's LayerNorm, in three CUDA kernels,
plus AddLayerNorm (the residual add of Eq. 2-3 fused in front, for the fused CUDA encoder).

With x_hat = (x - mean) * rstd, rstd = 1 / sqrt(var + eps) (biased variance over the row of n = D
elements) and g = dL/dy * gamma, the reference's formulas:

    forward    y = x_hat * gamma + beta
    backward   dL/dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))
               dL/dgamma = sum over rows of dL/dy * x_hat,   dL/dbeta = sum over rows of dL/dy

The kernels (SOURCE; each a template, with an extern "C" entry point per dtype, <name>_f32 and
<name>_f64, so that float32 accumulates in float32 and float64 in float64):

    layer_norm_forward       one warp (32 threads) per row, WARPS_PER_BLOCK rows per block. Lane k
                             reads elements k, k + 32, ...; three passes over the row (the later
                             ones re-read it from L1/L2): the mean, the variance of x - mean, y.
                             Each statistic is summed per lane, then across the warp with
                             __shfl_xor_sync (a butterfly: every lane ends with the total). The
                             variance from x - mean, not from the sum of squares in one pass,
                             because x may sit far from zero mean, where E[x^2] - E[x]^2 cancels
                             in float32. Writes y and each row's mean and rstd (saved for
                             backward: 2 numbers per row instead of x_hat).
                             With a branch, lane k first writes s = x + branch for its elements and
                             the later passes read s back (the same thread wrote them).
    layer_norm_backward_dx   the same layout: per row, two warp sums (g and g * x_hat, x_hat
                             rebuilt from x, mean and rstd), then dL/dx (+ the residual's gradient
                             dL/ds for AddLayerNorm) in a second pass.
    layer_norm_param_grads   dL/dgamma and dL/dbeta are sums over ROWS, i.e. down columns: blocks of
                             32 x COLUMN_LANES threads, thread (c, l) of a block owns column c of a
                             tile of 32 columns and rows l, l + COLUMN_LANES, ... of its chunk of
                             rows (a warp reads 32 adjacent columns of one row: coalesced). The
                             block adds its COLUMN_LANES partial sums in shared memory in a fixed
                             order and writes one partial sum per chunk; sum_chunks then adds the
                             chunks' partials in chunk order. Deterministic: no atomics, the same
                             bits on every run (the chunking depends on the number of rows only).

Both gradients read x (or s) again instead of a saved x_hat: the forward saves nothing of the size
of x but what it already has. One more pass over memory than a fully fused backward (llm.c
accumulates dgamma and dbeta inside its dx kernel), bought for two simple kernels.
Tests: tests/test_kernels_cuda_layernorm.py (on a GPU: `pytest -m gpu`; on the CPU the Python side
runs against NumPy emulations of the kernels).
"""
from __future__ import annotations

import math

import numpy as np

from ...autograd import Function
from ...backend import get_array_module
from . import entry, kernel, load_source

WARPS_PER_BLOCK = 8          # rows per block of the row kernels (256 threads)
COLUMN_TILE = 32             # columns per block of layer_norm_param_grads (one warp wide)
COLUMN_LANES = 8             # rows read at once per block of layer_norm_param_grads (256 threads)
MIN_ROWS_PER_CHUNK = 64      # layer_norm_param_grads: a chunk of rows is at least this long ...
MAX_CHUNKS = 256             # ... and there are at most this many chunks (partial sums per column)

SOURCE = load_source("layernorm.cu")          # the CUDA C++ of the kernels below

# ---------------------------------------------------------------- launch configurations (pure)

SUM_CHUNKS_THREADS = 256


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def row_launch(rows: int):
    """(grid, block) of the one-warp-per-row kernels: WARPS_PER_BLOCK rows per block, the last
    block's extra warps return at once."""
    return (_ceil_div(rows, WARPS_PER_BLOCK),), (32 * WARPS_PER_BLOCK,)


def column_chunks(rows: int):
    """(chunks, rows_per_chunk) for layer_norm_param_grads: rows split into at most MAX_CHUNKS
    chunks of at least MIN_ROWS_PER_CHUNK rows (but one chunk for fewer rows), every chunk
    non-empty. A function of the row count alone: the same sums in the same order on every GPU."""
    chunks = min(MAX_CHUNKS, max(1, rows // MIN_ROWS_PER_CHUNK))
    per_chunk = max(1, _ceil_div(rows, chunks))
    return max(1, _ceil_div(rows, per_chunk)), per_chunk


def column_launch(rows: int, d: int):
    """(grid, block, chunks, rows_per_chunk) of layer_norm_param_grads: one block per tile of
    COLUMN_TILE columns and chunk of rows (grid.y, at most MAX_CHUNKS <= 65535)."""
    chunks, per_chunk = column_chunks(rows)
    return (_ceil_div(d, COLUMN_TILE), chunks), (COLUMN_TILE, COLUMN_LANES), chunks, per_chunk


def sum_chunks_launch(d: int):
    """(grid, block) of sum_chunks: one thread per column."""
    return (_ceil_div(d, SUM_CHUNKS_THREADS),), (SUM_CHUNKS_THREADS,)


def _launch(name, dtype, grid, block, args):
    """Run entry point ``name`` for ``dtype`` (tests on the CPU replace this with an emulation)."""
    kernel(SOURCE, entry(name, dtype))(grid, block, args)


# ---------------------------------------------------------------- the Functions


def _rows(a, d):
    """a as a C-contiguous (R, d) array (a copy only if a is not contiguous, e.g. a broadcast
    upstream gradient)."""
    return get_array_module(a).ascontiguousarray(a).reshape(math.prod(a.shape[:-1]), d)


def _check_dtypes(op, dtype, **arrays):
    for name, a in arrays.items():
        if a is not None and a.dtype != dtype:
            raise TypeError(f"{op}: {name} is {a.dtype}, x is {dtype} (the CUDA kernel takes one dtype)")


class LayerNorm(Function):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta over the last axis (the LN of Eq. 2-4), on
    the GPU: layer_norm_forward, then layer_norm_backward_dx and layer_norm_param_grads (module
    docstring).

    x: (..., D)   gamma, beta: (D,) or None   ->   y: (..., D)
    Saves x, each row's mean and rstd = 1/sqrt(var + eps), and gamma.
    """

    def forward(self, x, gamma, beta, eps):
        d = x.shape[-1]
        _, y = self._normalize(_rows(x, d), None, gamma, beta, eps)
        return y.reshape(x.shape)

    def backward(self, gy):
        s2 = self.saved[0]
        dx, dgamma, dbeta = self._grads(_rows(gy, s2.shape[1]), None, self.needs_input_grad[:3])
        return (None if dx is None else dx.reshape(gy.shape)), dgamma, dbeta

    def _normalize(self, x2, branch2, gamma, beta, eps):
        """s = x2 (+ branch2) and y = LN(s), both (R, D); saves (s, mean, rstd, gamma)."""
        xp = get_array_module(x2)
        dtype = x2.dtype
        _check_dtypes(type(self).__name__, dtype, branch=branch2, gamma=gamma, beta=beta)
        # the kernels index gamma[i], beta[i]: a strided view (w[::2]) gets a contiguous copy
        gamma = None if gamma is None else xp.ascontiguousarray(gamma)
        beta = None if beta is None else xp.ascontiguousarray(beta)
        rows, d = x2.shape
        s = x2 if branch2 is None else xp.empty_like(x2)
        y = xp.empty_like(x2)
        mean = xp.empty(rows, dtype=dtype)
        rstd = xp.empty(rows, dtype=dtype)
        if rows and d:
            grid, block = row_launch(rows)
            _launch("layer_norm_forward", dtype, grid, block, (
                x2, x2 if branch2 is None else branch2, s, y, mean, rstd,   # unused pointers: x2
                x2 if gamma is None else gamma, x2 if beta is None else beta,
                np.int32(branch2 is not None), np.int32(gamma is not None), np.int32(beta is not None),
                np.int64(rows), np.int32(d), dtype.type(eps)))
        self.save(s, mean, rstd, gamma)
        return s, y

    def _grads(self, g2, g_add, need):
        """(dL/ds (+ g_add), dL/dgamma, dL/dbeta) from g2 = dL/dy, all (R, D) and C-contiguous;
        need: which of the three are wanted (None for the others)."""
        s2, mean, rstd, gamma = self.saved
        xp = get_array_module(s2)
        dtype = s2.dtype
        rows, d = s2.shape
        need_x, need_gamma, need_beta = need[0], need[1] and gamma is not None, need[2]
        dx = dgamma = dbeta = None
        if need_x:
            dx = xp.empty_like(s2)
            if rows and d:
                grid, block = row_launch(rows)
                _launch("layer_norm_backward_dx", dtype, grid, block, (
                    g2, s2, mean, rstd, s2 if gamma is None else gamma, s2 if g_add is None else g_add,
                    dx, np.int32(gamma is not None), np.int32(g_add is not None), np.int64(rows), np.int32(d)))
        if need_gamma or need_beta:
            dgamma = xp.zeros(d, dtype=dtype) if need_gamma else None
            dbeta = xp.zeros(d, dtype=dtype) if need_beta else None
            if rows and d:
                grid, block, chunks, per_chunk = column_launch(rows, d)
                part_gamma = xp.empty((chunks, d), dtype=dtype) if need_gamma else s2   # unused: s2
                part_beta = xp.empty((chunks, d), dtype=dtype) if need_beta else s2
                _launch("layer_norm_param_grads", dtype, grid, block, (
                    g2, s2, mean, rstd, part_gamma, part_beta, np.int32(need_gamma), np.int32(need_beta),
                    np.int64(rows), np.int32(d), np.int64(per_chunk)))
                grid, block = sum_chunks_launch(d)
                for part, out in ((part_gamma, dgamma), (part_beta, dbeta)):
                    if out is not None:
                        _launch("sum_chunks", dtype, grid, block, (part, out, np.int32(chunks), np.int32(d)))
        return dx, dgamma, dbeta


class AddLayerNorm(LayerNorm):
    """The residual add of Eq. 2 (or 3) and the LayerNorm that reads its result, in one kernel
    (layer_norm_forward with a branch): the signature of kernels/cpu/layernorm.py's AddLayerNorm.

    x, branch: (..., D)   gamma, beta: (D,) or None   ->   s = x + branch,  y = LN(s) * gamma + beta
    Backward, from gs = dL/ds and gy = dL/dy (either may be None):
        dL/dx = dL/dbranch = gs + LayerNorm's dL/ds from gy (added inside layer_norm_backward_dx),
        dL/dgamma, dL/dbeta as LayerNorm's.
    """

    def forward(self, x, branch, gamma, beta, eps):
        if branch.shape != x.shape:
            raise ValueError(f"AddLayerNorm: branch must have x's shape {x.shape}, got {branch.shape}")
        d = x.shape[-1]
        s, y = self._normalize(_rows(x, d), _rows(branch, d), gamma, beta, eps)
        return s.reshape(x.shape), y.reshape(x.shape)

    def backward(self, gs, gy):
        if gy is None:                                    # only the residual stream carries a gradient
            return gs, gs, None, None
        s2 = self.saved[0]
        need_x = self.needs_input_grad[0] or self.needs_input_grad[1]
        g_add = None if gs is None else _rows(gs, s2.shape[1])
        dx, dgamma, dbeta = self._grads(_rows(gy, s2.shape[1]), g_add, (need_x,) + tuple(self.needs_input_grad[2:4]))
        if dx is not None:
            dx = dx.reshape(gy.shape)
        return dx, dx, dgamma, dbeta
