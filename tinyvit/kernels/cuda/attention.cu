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
// the accumulators of columns lane, lane + 32, ..., lane + 32 (COLS - 1) of its warp's rows, COLS =
// ceil(dh / 32) rounded up to the head-size class: the kernels forward, dq and dkdv are templates on
// COLS, compiled for the classes dh <= 32, 64 and 128 (entry points *_d32_*, *_d64_*, *_d128_*), so
// that a head of 32 or 64 spends no multiply-add on columns it does not have.
// Softmax statistics are reduced across a warp with shuffles, never through memory. Why this shape:
// ROWS = 4 rows per warp use each number a lane reads from shared memory 4 times; blocks of only 16
// rows give even small batches many blocks (ViT-B/16 at batch 8: 96 heads x 13 blocks).
// q is multiplied by s as it is loaded, so S = (s q) . k needs no pass of its own, and dk = dS^T (s q).
//
// Shared memory is dynamic, sized by the launcher (attention.py: shared_bytes) from dh.

#include "common.cuh"     // WARP, FULL_MASK, exp_, log_, minus_infinity, warp_sum, warp_max

constexpr int WARPS = 4;
constexpr int ROWS = 4;
constexpr int BLOCK_ROWS = WARPS * ROWS;
constexpr int TILE = WARP;
constexpr int MAX_HEAD_DIM = 128;
constexpr int DELTA_WARPS = 8;

extern __shared__ __align__(16) unsigned char shared_memory[];

// Rows [first, first + count) of a head's (tokens, dh) matrix, row r at src + r * ld, times factor,
// into dst with row pitch `pitch`; rows at or past `tokens` become zeros (a tile's padding then
// adds nothing to any sum). The whole block loads, a warp per row (warp w: rows w, w + WARPS, ...),
// its lanes on neighbouring columns: coalesced reads, and no division per element to find them.
template <typename T>
__device__ __forceinline__ void load_rows(T* dst, int pitch, const T* __restrict__ src, int ld, int first,
                                          int count, int tokens, int dh, T factor) {
    const int lane = threadIdx.x % WARP;
    for (int r = threadIdx.x / WARP; r < count; r += blockDim.x / WARP) {
        const int row = first + r;
        for (int c = lane; c < dh; c += WARP)
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
template <typename T, int COLS>
__device__ void attention_forward(const T* __restrict__ q, int ldq, const T* __restrict__ k,
                                  const T* __restrict__ v, int ldkv, T* __restrict__ out, int ldo,
                                  T* __restrict__ lse, int heads, int m, int n, int dh, T scale) {
    T* qs = reinterpret_cast<T*>(shared_memory);
    T* ks = qs + BLOCK_ROWS * dh;
    T* vs = ks + TILE * (dh + 1);
    const int bh = blockIdx.x, b = bh / heads, h = bh - b * heads;
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
    const int bh = blockIdx.x, b = bh / heads, h = bh - b * heads;
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
template <typename T, int COLS>
__device__ void attention_backward_dq(const T* __restrict__ q, int ldq, const T* __restrict__ k,
                                      const T* __restrict__ v, int ldkv, const T* __restrict__ dout, int ldo,
                                      const T* __restrict__ lse, const T* __restrict__ delta,
                                      const T* __restrict__ dattn, T* __restrict__ dq, int lddq, int heads,
                                      int m, int n, int dh, T scale) {
    T* qs = reinterpret_cast<T*>(shared_memory);
    T* dos = qs + BLOCK_ROWS * dh;
    T* ks = dos + BLOCK_ROWS * dh;
    T* vs = ks + TILE * (dh + 1);
    const int bh = blockIdx.x, b = bh / heads, h = bh - b * heads;
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
template <typename T, int COLS>
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
    const int bh = blockIdx.x, b = bh / heads, h = bh - b * heads;
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
// C names (no C++ mangling) for each element type, and for the tiled kernels that accumulate rows of
// the head in registers also each head-size class: attention_forward_d64_f32 (COLS = 2 columns per
// lane, heads of 33 to 64), attention_probabilities_f32, ..._f64, and so on.
#define ATTENTION_TILED_KERNELS(T, SUFFIX, COLS, CLASS)                                                      \
extern "C" __global__ void __launch_bounds__(WARPS * WARP) attention_forward_d##CLASS##_##SUFFIX(          \
        const T* q, int ldq, const T* k, const T* v, int ldkv, T* out, int ldo, T* lse, int heads, int m,  \
        int n, int dh, T scale) {                                                                           \
    attention_forward<T, COLS>(q, ldq, k, v, ldkv, out, ldo, lse, heads, m, n, dh, scale);                  \
}                                                                                                           \
extern "C" __global__ void __launch_bounds__(WARPS * WARP) attention_backward_dq_d##CLASS##_##SUFFIX(      \
        const T* q, int ldq, const T* k, const T* v, int ldkv, const T* dout, int ldo, const T* lse,       \
        const T* delta, const T* dattn, T* dq, int lddq, int heads, int m, int n, int dh, T scale) {      \
    attention_backward_dq<T, COLS>(q, ldq, k, v, ldkv, dout, ldo, lse, delta, dattn, dq, lddq, heads, m, n, \
                                   dh, scale);                                                              \
}                                                                                                           \
extern "C" __global__ void __launch_bounds__(WARPS * WARP) attention_backward_dkdv_d##CLASS##_##SUFFIX(    \
        const T* q, int ldq, const T* k, const T* v, int ldkv, const T* dout, int ldo, const T* lse,       \
        const T* delta, const T* dattn, T* dk, T* dv, int lddkv, int heads, int m, int n, int dh,          \
        T scale) {                                                                                          \
    attention_backward_dkdv<T, COLS>(q, ldq, k, v, ldkv, dout, ldo, lse, delta, dattn, dk, dv, lddkv, heads, \
                                     m, n, dh, scale);                                                      \
}

#define ATTENTION_KERNELS(T, SUFFIX)                                                                        \
ATTENTION_TILED_KERNELS(T, SUFFIX, 1, 32)                                                                   \
ATTENTION_TILED_KERNELS(T, SUFFIX, 2, 64)                                                                   \
ATTENTION_TILED_KERNELS(T, SUFFIX, 4, 128)                                                                  \
extern "C" __global__ void __launch_bounds__(WARPS * WARP) attention_probabilities_##SUFFIX(               \
        const T* q, int ldq, const T* k, int ldkv, const T* lse, T* attn, int heads, int m, int n, int dh, \
        T scale) {                                                                                          \
    attention_probabilities<T>(q, ldq, k, ldkv, lse, attn, heads, m, n, dh, scale);                         \
}                                                                                                           \
extern "C" __global__ void __launch_bounds__(DELTA_WARPS * WARP) attention_delta_##SUFFIX(                 \
        const T* out, const T* dout, int ldo, const T* attn, const T* dattn, T* delta, int batch,         \
        int heads, int m, int n, int dh) {                                                                  \
    attention_delta<T>(out, dout, ldo, attn, dattn, delta, batch, heads, m, n, dh);                         \
}

ATTENTION_KERNELS(float, f32)
ATTENTION_KERNELS(double, f64)
