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
    dS_ij = A_ij (dctx_i . v_j + gA_ij - delta_i)          recomputed where used
    dq_i = s sum_j dS_ij k_j                              attention_backward_dq (a block per queries)
    dk_j = s sum_i dS_ij q_i,  dv_j = sum_i A_ij dctx_i   attention_backward_dkdv (a block per keys)
    dx, dU_qkv, db_qkv from dqkv = [dq | dk | dv], dU_msa, db_proj from gy: 2-D GEMMs and sums
dq and dk, dv come from two kernels, each summing over its own axis inside one block, so no atomics
and the same result on every run.

Kernels read q, k, v in place in the GEMM's (B*N, 3D) output (row stride 3D; head h at columns
h*D_h) and write ctx and dq, dk, dv into the rows the next GEMM reads: no head split or merge is
ever copied. Thread layout: see SOURCE. float32 (accumulating in float32) and float64; head sizes
up to MAX_HEAD_DIM = 128. Attention dropout (training with attn_dropout > 0) and head sizes the
kernels do not fit run the reference instead (ops/attention.py, the same random numbers).

Tests: tests/test_kernels_cuda_attention.py (GPU: equal to the reference, every output and gradient).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ...autograd import Function
from ...backend import get_array_module
from ...ops import attention as reference
from . import MATH_HELPERS, MATH_HELPERS_LINE, entry, kernel

# The block shape, the same numbers as SOURCE's constants (a test compares them).
WARP = 32
WARPS = 4                      # warps per block of the tiled kernels: 128 threads
ROWS = 4                       # rows each warp owns: queries (forward, dq) or keys (dkdv)
BLOCK_ROWS = WARPS * ROWS      # 16 rows per block
TILE = WARP                    # keys (forward, dq) or queries (dkdv) per tile: one per lane
MAX_HEAD_DIM = 128             # 4 columns of a head per lane
DELTA_WARPS = 8                # attention_delta: a warp per row, 8 rows per block
STATIC_SHARED_LIMIT = 48 * 1024    # above this, a kernel must opt in to more dynamic shared memory
MAX_GRID_Y = 65535

SOURCE = r"""
// Fused multi-head attention (tinyvit/kernels/cuda/attention.py; reference: tinyvit/ops/attention.py).
//
// One head of one sample at a time: q (M, dh), k and v (N, dh), each row i at base + i * ld (the
// rows of the qkv GEMM's output, so ld = 3D and head h starts at column h * dh). s = 1/sqrt(dh).
//
// Thread layout of the tiled kernels (forward, probabilities, dq, dkdv): a block of WARPS warps;
// each warp owns ROWS rows (queries, or keys in dkdv) held in registers, and the 32 lanes of a warp
// take the 32 rows of the other side of a tile (keys, or queries in dkdv), one each, staged in
// shared memory with rows padded to dh + 1 so that 32 lanes reading 32 rows hit 32 banks. The
// block's own rows sit in shared memory too, where a warp reads them as broadcasts. A lane keeps
// the accumulators of columns lane, lane + 32, lane + 64, lane + 96 of its warp's rows (dh <= 128).
// Softmax statistics are reduced across a warp with shuffles, never through memory. Why this shape:
// ROWS = 4 rows per warp use each number a lane reads from shared memory 4 times; blocks of only 16
// rows give even small batches many blocks (ViT-B/16 at batch 8: 96 heads x 13 blocks).
// q is multiplied by s as it is loaded, so S = (s q) . k needs no pass of its own, and dk = dS^T (s q).
//
// Shared memory is dynamic, sized by the launcher (attention.py: shared_bytes) from dh.

constexpr int WARP = 32;
constexpr int WARPS = 4;
constexpr int ROWS = 4;
constexpr int BLOCK_ROWS = WARPS * ROWS;
constexpr int TILE = WARP;
constexpr int MAX_HEAD_DIM = 128;
constexpr int COLS = MAX_HEAD_DIM / WARP;
constexpr int DELTA_WARPS = 8;
constexpr unsigned FULL_MASK = 0xffffffffu;

extern __shared__ __align__(16) unsigned char shared_memory[];

// #include MATH_HELPERS (kernels/cuda/__init__.py): exp_, log_, minus_infinity, warp_sum, warp_max

// Rows [first, first + count) of a head's (tokens, dh) matrix, row r at src + r * ld, times factor,
// into dst with row pitch `pitch`; rows at or past `tokens` become zeros (a tile's padding then
// adds nothing to any sum). The whole block loads; neighbouring threads read neighbouring columns.
template <typename T>
__device__ __forceinline__ void load_rows(T* dst, int pitch, const T* __restrict__ src, int ld, int first,
                                          int count, int tokens, int dh, T factor) {
    for (int e = threadIdx.x; e < count * dh; e += blockDim.x) {
        const int r = e / dh, c = e - r * dh, row = first + r;
        dst[r * pitch + c] = row < tokens ? src[(long long)row * ld + c] * factor : T(0);
    }
}

// Offset of head h of sample b in a (B * tokens, ld) matrix of rows.
__device__ __forceinline__ long long head_offset(int b, int h, int tokens, int ld, int dh) {
    return (long long)b * tokens * ld + (long long)h * dh;
}

// ------------------------------------------------------------------ forward: ctx and L
// Grid (B*H, ceil(M / BLOCK_ROWS)). For its BLOCK_ROWS queries, a block walks the keys tile by tile
// keeping, per query row i, the running max m_i, the running sum l_i = sum_j exp(S_ij - m_i) and
// acc_i = sum_j exp(S_ij - m_i) v_j; a new tile with a larger max rescales both by exp(m_old - m_new)
// (online softmax). At the end ctx_i = acc_i / l_i and L_i = m_i + log l_i.
// Shared: qs [BLOCK_ROWS][dh] (s q), ks [TILE][dh + 1], vs [TILE][dh].
template <typename T>
__device__ void attention_forward(const T* __restrict__ q, int ldq, const T* __restrict__ k,
                                  const T* __restrict__ v, int ldkv, T* __restrict__ out, int ldo,
                                  T* __restrict__ lse, int heads, int m, int n, int dh, T scale) {
    T* qs = reinterpret_cast<T*>(shared_memory);
    T* ks = qs + BLOCK_ROWS * dh;
    T* vs = ks + TILE * (dh + 1);
    const int bh = blockIdx.x, b = bh / heads, h = bh % heads;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int row0 = blockIdx.y * BLOCK_ROWS;
    q += head_offset(b, h, m, ldq, dh);
    k += head_offset(b, h, n, ldkv, dh);
    v += head_offset(b, h, n, ldkv, dh);
    out += head_offset(b, h, m, ldo, dh);

    load_rows(qs, dh, q, ldq, row0, BLOCK_ROWS, m, dh, scale);
    const T* my_q = qs + warp * ROWS * dh;          // this warp's ROWS query rows
    T row_max[ROWS], row_sum[ROWS], acc[ROWS][COLS];
    for (int r = 0; r < ROWS; ++r) {
        row_max[r] = minus_infinity<T>();
        row_sum[r] = T(0);
        for (int t = 0; t < COLS; ++t) acc[r][t] = T(0);
    }

    for (int key0 = 0; key0 < n; key0 += TILE) {
        __syncthreads();                            // every warp is done with the previous tile
        load_rows(ks, dh + 1, k, ldkv, key0, TILE, n, dh, T(1));
        load_rows(vs, dh, v, ldkv, key0, TILE, n, dh, T(1));
        __syncthreads();
        const bool valid = key0 + lane < n;         // lane = key key0 + lane

        T p[ROWS];                                  // logits S = s q k^T of this lane's key, then weights
        for (int r = 0; r < ROWS; ++r) p[r] = T(0);
        for (int c = 0; c < dh; ++c) {
            const T kc = ks[lane * (dh + 1) + c];
            for (int r = 0; r < ROWS; ++r) p[r] += my_q[r * dh + c] * kc;
        }
        for (int r = 0; r < ROWS; ++r) {            // online softmax update
            const T logit = valid ? p[r] : minus_infinity<T>();
            const T tile_max = warp_max(logit);
            const T new_max = tile_max > row_max[r] ? tile_max : row_max[r];
            const T correction = exp_(row_max[r] - new_max);       // 0 on the first tile
            p[r] = valid ? exp_(logit - new_max) : T(0);
            row_sum[r] = row_sum[r] * correction + warp_sum(p[r]);
            row_max[r] = new_max;
            for (int t = 0; t < COLS; ++t) acc[r][t] *= correction;
        }
        for (int j = 0; j < TILE; ++j) {            // acc += p_j v_j (lane: its columns)
            T vj[COLS];
            for (int t = 0; t < COLS; ++t) {
                const int c = lane + t * WARP;
                vj[t] = c < dh ? vs[j * dh + c] : T(0);
            }
            for (int r = 0; r < ROWS; ++r) {
                const T pj = __shfl_sync(FULL_MASK, p[r], j);
                for (int t = 0; t < COLS; ++t) acc[r][t] += pj * vj[t];
            }
        }
    }

    for (int r = 0; r < ROWS; ++r) {
        const int row = row0 + warp * ROWS + r;
        if (row >= m) continue;
        const T inverse = T(1) / row_sum[r];
        for (int t = 0; t < COLS; ++t) {
            const int c = lane + t * WARP;
            if (c < dh) out[(long long)row * ldo + c] = acc[r][t] * inverse;
        }
        if (lane == 0) lse[(long long)bh * m + row] = row_max[r] + log_(row_sum[r]);
    }
}

// ------------------------------------------------------------------ the attention map, when asked
// A_ij = exp(s q_i . k_j - L_i), written to attn (B, H, M, N). Same grid and layout as the forward.
// Shared: qs [BLOCK_ROWS][dh], ks [TILE][dh + 1].
template <typename T>
__device__ void attention_probabilities(const T* __restrict__ q, int ldq, const T* __restrict__ k, int ldkv,
                                        const T* __restrict__ lse, T* __restrict__ attn, int heads, int m,
                                        int n, int dh, T scale) {
    T* qs = reinterpret_cast<T*>(shared_memory);
    T* ks = qs + BLOCK_ROWS * dh;
    const int bh = blockIdx.x, b = bh / heads, h = bh % heads;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int row0 = blockIdx.y * BLOCK_ROWS;
    q += head_offset(b, h, m, ldq, dh);
    k += head_offset(b, h, n, ldkv, dh);

    load_rows(qs, dh, q, ldq, row0, BLOCK_ROWS, m, dh, scale);
    const T* my_q = qs + warp * ROWS * dh;
    T row_lse[ROWS];
    for (int r = 0; r < ROWS; ++r) {
        const int row = row0 + warp * ROWS + r;
        row_lse[r] = row < m ? lse[(long long)bh * m + row] : T(0);
    }
    for (int key0 = 0; key0 < n; key0 += TILE) {
        __syncthreads();
        load_rows(ks, dh + 1, k, ldkv, key0, TILE, n, dh, T(1));
        __syncthreads();
        T s[ROWS];
        for (int r = 0; r < ROWS; ++r) s[r] = T(0);
        for (int c = 0; c < dh; ++c) {
            const T kc = ks[lane * (dh + 1) + c];
            for (int r = 0; r < ROWS; ++r) s[r] += my_q[r * dh + c] * kc;
        }
        const int key = key0 + lane;
        for (int r = 0; r < ROWS; ++r) {
            const int row = row0 + warp * ROWS + r;
            if (row < m && key < n) attn[((long long)bh * m + row) * n + key] = exp_(s[r] - row_lse[r]);
        }
    }
}

// ------------------------------------------------------------------ backward, 1: delta
// delta_i = dctx_i . ctx_i (+ sum_j gA_ij A_ij when the attention map has a gradient gA), the
// row sums sum_j dA_ij A_ij of softmax's backward. A warp per row (b, h, i) of the B*H*M rows, in
// (B, H, M) order; no shared memory.
template <typename T>
__device__ void attention_delta(const T* __restrict__ out, const T* __restrict__ dout, int ldo,
                                const T* __restrict__ attn, const T* __restrict__ dattn, T* __restrict__ delta,
                                int batch, int heads, int m, int n, int dh) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const long long row = (long long)blockIdx.x * DELTA_WARPS + warp;
    if (row >= (long long)batch * heads * m) return;     // a whole warp leaves: no shuffle misses a lane
    const long long bh = row / m;
    const int i = (int)(row - bh * m), b = (int)(bh / heads), h = (int)(bh % heads);
    const long long at = head_offset(b, h, m, ldo, dh) + (long long)i * ldo;
    T sum = T(0);
    for (int c = lane; c < dh; c += WARP) sum += out[at + c] * dout[at + c];
    if (dattn != nullptr) {
        for (int j = lane; j < n; j += WARP) sum += attn[row * n + j] * dattn[row * n + j];
    }
    sum = warp_sum(sum);
    if (lane == 0) delta[row] = sum;
}

// ------------------------------------------------------------------ backward, 2: dq
// Grid (B*H, ceil(M / BLOCK_ROWS)), the forward's layout: a warp's ROWS queries against a tile of
// TILE keys, lane = key. dq_i = s sum_j dS_ij k_j accumulates in registers over the key tiles.
// Shared: qs, dos [BLOCK_ROWS][dh] (s q and dctx of the block's queries), ks, vs [TILE][dh + 1].
template <typename T>
__device__ void attention_backward_dq(const T* __restrict__ q, int ldq, const T* __restrict__ k,
                                      const T* __restrict__ v, int ldkv, const T* __restrict__ dout, int ldo,
                                      const T* __restrict__ lse, const T* __restrict__ delta,
                                      const T* __restrict__ dattn, T* __restrict__ dq, int lddq, int heads,
                                      int m, int n, int dh, T scale) {
    T* qs = reinterpret_cast<T*>(shared_memory);
    T* dos = qs + BLOCK_ROWS * dh;
    T* ks = dos + BLOCK_ROWS * dh;
    T* vs = ks + TILE * (dh + 1);
    const int bh = blockIdx.x, b = bh / heads, h = bh % heads;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int row0 = blockIdx.y * BLOCK_ROWS;
    q += head_offset(b, h, m, ldq, dh);
    k += head_offset(b, h, n, ldkv, dh);
    v += head_offset(b, h, n, ldkv, dh);
    dout += head_offset(b, h, m, ldo, dh);
    dq += head_offset(b, h, m, lddq, dh);

    load_rows(qs, dh, q, ldq, row0, BLOCK_ROWS, m, dh, scale);
    load_rows(dos, dh, dout, ldo, row0, BLOCK_ROWS, m, dh, T(1));
    const T* my_q = qs + warp * ROWS * dh;
    const T* my_do = dos + warp * ROWS * dh;
    T row_lse[ROWS], row_delta[ROWS], acc[ROWS][COLS];
    for (int r = 0; r < ROWS; ++r) {
        const int row = row0 + warp * ROWS + r;
        row_lse[r] = row < m ? lse[(long long)bh * m + row] : T(0);
        row_delta[r] = row < m ? delta[(long long)bh * m + row] : T(0);
        for (int t = 0; t < COLS; ++t) acc[r][t] = T(0);
    }

    for (int key0 = 0; key0 < n; key0 += TILE) {
        __syncthreads();
        load_rows(ks, dh + 1, k, ldkv, key0, TILE, n, dh, T(1));
        load_rows(vs, dh + 1, v, ldkv, key0, TILE, n, dh, T(1));
        __syncthreads();
        const int key = key0 + lane;
        T s[ROWS], dp[ROWS];                        // s q_i . k_j and dA'_ij = dctx_i . v_j
        for (int r = 0; r < ROWS; ++r) s[r] = dp[r] = T(0);
        for (int c = 0; c < dh; ++c) {
            const T kc = ks[lane * (dh + 1) + c], vc = vs[lane * (dh + 1) + c];
            for (int r = 0; r < ROWS; ++r) {
                s[r] += my_q[r * dh + c] * kc;
                dp[r] += my_do[r * dh + c] * vc;
            }
        }
        for (int r = 0; r < ROWS; ++r) {            // dS_ij = A_ij (dA_ij - delta_i), in s[r]
            const int row = row0 + warp * ROWS + r;
            const bool valid = key < n && row < m;
            const T p = valid ? exp_(s[r] - row_lse[r]) : T(0);
            T g = dp[r];
            if (dattn != nullptr && valid) g += dattn[((long long)bh * m + row) * n + key];
            s[r] = p * (g - row_delta[r]);
        }
        for (int j = 0; j < TILE; ++j) {            // acc += dS_ij k_j
            T kj[COLS];
            for (int t = 0; t < COLS; ++t) {
                const int c = lane + t * WARP;
                kj[t] = c < dh ? ks[j * (dh + 1) + c] : T(0);
            }
            for (int r = 0; r < ROWS; ++r) {
                const T dsj = __shfl_sync(FULL_MASK, s[r], j);
                for (int t = 0; t < COLS; ++t) acc[r][t] += dsj * kj[t];
            }
        }
    }

    for (int r = 0; r < ROWS; ++r) {
        const int row = row0 + warp * ROWS + r;
        if (row >= m) continue;
        for (int t = 0; t < COLS; ++t) {
            const int c = lane + t * WARP;
            if (c < dh) dq[(long long)row * lddq + c] = acc[r][t] * scale;
        }
    }
}

// ------------------------------------------------------------------ backward, 3: dk and dv
// Grid (B*H, ceil(N / BLOCK_ROWS)), the roles swapped: a warp owns ROWS keys, its lanes take a tile
// of TILE queries, one each. Over the query tiles, in registers:
//   dv_j = sum_i A_ij dctx_i,   dk_j = sum_i dS_ij (s q_i)
// Shared: kb, vb [BLOCK_ROWS][dh] (the block's keys and values), qs, dos [TILE][dh + 1] (s q and
// dctx of a query tile), tile_lse, tile_delta [TILE].
template <typename T>
__device__ void attention_backward_dkdv(const T* __restrict__ q, int ldq, const T* __restrict__ k,
                                        const T* __restrict__ v, int ldkv, const T* __restrict__ dout, int ldo,
                                        const T* __restrict__ lse, const T* __restrict__ delta,
                                        const T* __restrict__ dattn, T* __restrict__ dk, T* __restrict__ dv,
                                        int lddkv, int heads, int m, int n, int dh, T scale) {
    T* kb = reinterpret_cast<T*>(shared_memory);
    T* vb = kb + BLOCK_ROWS * dh;
    T* qs = vb + BLOCK_ROWS * dh;
    T* dos = qs + TILE * (dh + 1);
    T* tile_lse = dos + TILE * (dh + 1);
    T* tile_delta = tile_lse + TILE;
    const int bh = blockIdx.x, b = bh / heads, h = bh % heads;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int key_row0 = blockIdx.y * BLOCK_ROWS;
    q += head_offset(b, h, m, ldq, dh);
    k += head_offset(b, h, n, ldkv, dh);
    v += head_offset(b, h, n, ldkv, dh);
    dout += head_offset(b, h, m, ldo, dh);
    dk += head_offset(b, h, n, lddkv, dh);
    dv += head_offset(b, h, n, lddkv, dh);

    load_rows(kb, dh, k, ldkv, key_row0, BLOCK_ROWS, n, dh, T(1));
    load_rows(vb, dh, v, ldkv, key_row0, BLOCK_ROWS, n, dh, T(1));
    const T* my_k = kb + warp * ROWS * dh;          // this warp's ROWS keys
    const T* my_v = vb + warp * ROWS * dh;
    T acc_dk[ROWS][COLS], acc_dv[ROWS][COLS];
    for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < COLS; ++t) acc_dk[r][t] = acc_dv[r][t] = T(0);

    for (int q0 = 0; q0 < m; q0 += TILE) {
        __syncthreads();
        load_rows(qs, dh + 1, q, ldq, q0, TILE, m, dh, scale);
        load_rows(dos, dh + 1, dout, ldo, q0, TILE, m, dh, T(1));
        for (int e = threadIdx.x; e < TILE; e += blockDim.x) {
            const int row = q0 + e;
            tile_lse[e] = row < m ? lse[(long long)bh * m + row] : T(0);
            tile_delta[e] = row < m ? delta[(long long)bh * m + row] : T(0);
        }
        __syncthreads();
        const int query = q0 + lane;
        T s[ROWS], dp[ROWS];                        // s q_i . k_j and dA'_ij = dctx_i . v_j
        for (int r = 0; r < ROWS; ++r) s[r] = dp[r] = T(0);
        for (int c = 0; c < dh; ++c) {
            const T qc = qs[lane * (dh + 1) + c], dc = dos[lane * (dh + 1) + c];
            for (int r = 0; r < ROWS; ++r) {
                s[r] += qc * my_k[r * dh + c];
                dp[r] += dc * my_v[r * dh + c];
            }
        }
        T p[ROWS];                                  // A_ij; s[r] becomes dS_ij
        for (int r = 0; r < ROWS; ++r) {
            const int key = key_row0 + warp * ROWS + r;
            const bool valid = query < m && key < n;
            p[r] = valid ? exp_(s[r] - tile_lse[lane]) : T(0);
            T g = dp[r];
            if (dattn != nullptr && valid) g += dattn[((long long)bh * m + query) * n + key];
            s[r] = p[r] * (g - tile_delta[lane]);
        }
        for (int i = 0; i < TILE; ++i) {            // dv += A_ij dctx_i, dk += dS_ij (s q_i)
            T qi[COLS], di[COLS];
            for (int t = 0; t < COLS; ++t) {
                const int c = lane + t * WARP;
                qi[t] = c < dh ? qs[i * (dh + 1) + c] : T(0);
                di[t] = c < dh ? dos[i * (dh + 1) + c] : T(0);
            }
            for (int r = 0; r < ROWS; ++r) {
                const T pi = __shfl_sync(FULL_MASK, p[r], i), dsi = __shfl_sync(FULL_MASK, s[r], i);
                for (int t = 0; t < COLS; ++t) {
                    acc_dv[r][t] += pi * di[t];
                    acc_dk[r][t] += dsi * qi[t];
                }
            }
        }
    }

    for (int r = 0; r < ROWS; ++r) {
        const int key = key_row0 + warp * ROWS + r;
        if (key >= n) continue;
        for (int t = 0; t < COLS; ++t) {
            const int c = lane + t * WARP;
            if (c < dh) {
                dk[(long long)key * lddkv + c] = acc_dk[r][t];
                dv[(long long)key * lddkv + c] = acc_dv[r][t];
            }
        }
    }
}

// ------------------------------------------------------------------ the kernels CuPy launches
// C names (no C++ mangling) for each element type: attention_forward_f32, ..._f64, and so on.
#define ATTENTION_KERNELS(T, SUFFIX)                                                                        \
extern "C" __global__ void __launch_bounds__(WARPS * WARP) attention_forward_##SUFFIX(                     \
        const T* q, int ldq, const T* k, const T* v, int ldkv, T* out, int ldo, T* lse, int heads, int m,  \
        int n, int dh, T scale) {                                                                           \
    attention_forward<T>(q, ldq, k, v, ldkv, out, ldo, lse, heads, m, n, dh, scale);                        \
}                                                                                                           \
extern "C" __global__ void __launch_bounds__(WARPS * WARP) attention_probabilities_##SUFFIX(               \
        const T* q, int ldq, const T* k, int ldkv, const T* lse, T* attn, int heads, int m, int n, int dh, \
        T scale) {                                                                                          \
    attention_probabilities<T>(q, ldq, k, ldkv, lse, attn, heads, m, n, dh, scale);                         \
}                                                                                                           \
extern "C" __global__ void __launch_bounds__(DELTA_WARPS * WARP) attention_delta_##SUFFIX(                 \
        const T* out, const T* dout, int ldo, const T* attn, const T* dattn, T* delta, int batch,         \
        int heads, int m, int n, int dh) {                                                                  \
    attention_delta<T>(out, dout, ldo, attn, dattn, delta, batch, heads, m, n, dh);                         \
}                                                                                                           \
extern "C" __global__ void __launch_bounds__(WARPS * WARP) attention_backward_dq_##SUFFIX(                 \
        const T* q, int ldq, const T* k, const T* v, int ldkv, const T* dout, int ldo, const T* lse,       \
        const T* delta, const T* dattn, T* dq, int lddq, int heads, int m, int n, int dh, T scale) {      \
    attention_backward_dq<T>(q, ldq, k, v, ldkv, dout, ldo, lse, delta, dattn, dq, lddq, heads, m, n, dh,  \
                             scale);                                                                        \
}                                                                                                           \
extern "C" __global__ void __launch_bounds__(WARPS * WARP) attention_backward_dkdv_##SUFFIX(               \
        const T* q, int ldq, const T* k, const T* v, int ldkv, const T* dout, int ldo, const T* lse,       \
        const T* delta, const T* dattn, T* dk, T* dv, int lddkv, int heads, int m, int n, int dh,          \
        T scale) {                                                                                          \
    attention_backward_dkdv<T>(q, ldq, k, v, ldkv, dout, ldo, lse, delta, dattn, dk, dv, lddkv, heads, m,  \
                               n, dh, scale);                                                               \
}

ATTENTION_KERNELS(float, f32)
ATTENTION_KERNELS(double, f64)
""".replace(MATH_HELPERS_LINE, MATH_HELPERS)

KERNEL_NAMES = ("attention_forward", "attention_probabilities", "attention_delta", "attention_backward_dq",
                "attention_backward_dkdv")
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


def _launch(name, dtype, shape, args):
    """Launch kernel ``name`` for this dtype on shape = (B, H, M, N, D_h), opting in to more than
    48 KB of dynamic shared memory where it needs it."""
    grid, block, shared = launch_config(name, *shape, np.dtype(dtype).itemsize)
    function = kernel(SOURCE, entry(name, dtype))
    if shared > STATIC_SHARED_LIMIT and function.max_dynamic_shared_size_bytes < shared:
        function.max_dynamic_shared_size_bytes = shared
    function(grid, block, args, shared_mem=shared)


def _at(buffer, offset=0):
    """The contiguous buffer seen from element ``offset`` on: what a kernel gets as a pointer there."""
    return buffer.reshape(-1)[offset:]


i32 = np.int32


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
