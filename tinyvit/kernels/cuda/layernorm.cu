// LayerNorm and the residual add fused in front of it (tinyvit/kernels/cuda/layernorm.py; reference:
// tinyvit/ops/norm.py). Layout and formulas: layernorm.py's docstring.

#include "common.cuh"     // WARP, warp_sum (the kernels return whole warps only)

// ---------------------------------------------------------------- helpers

__device__ __forceinline__ float inv_sqrt(float v) { return rsqrtf(v); }
__device__ __forceinline__ double inv_sqrt(double v) { return rsqrt(v); }

// g = dL/dy * gamma, rounded once (an _rn product is never fused into an FMA): the two passes of
// layer_norm_backward_dx must see the same g, bit for bit. A plain product would be fused into the
// second pass's g - mean(g) (the exact product minus the rounded one), and a row of one element,
// where that difference must be exactly 0, would get the product's rounding error times rstd =
// 1/sqrt(eps) (1e-5 in float32 on an H100).
__device__ __forceinline__ float scaled(float g, float gamma) { return __fmul_rn(g, gamma); }
__device__ __forceinline__ double scaled(double g, double gamma) { return __dmul_rn(g, gamma); }

// ---------------------------------------------------------------- forward: one warp per row

// s = x + branch (if has_branch; s is then written), y = (s - mean) * rstd * gamma + beta.
// mean, rstd: one per row, saved for backward.
template <typename T>
__device__ void layer_norm_forward(const T* x, const T* branch, T* s, T* y, T* mean, T* rstd,
                                   const T* gamma, const T* beta, int has_branch, int has_gamma,
                                   int has_beta, long long rows, int d, T eps) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;                               // the whole warp: row is the same in it
    const long long start = row * d;
    const T* src = has_branch ? s + start : x + start;     // the row that is normalised

    T sum = 0;                                             // pass 1: the mean (and s = x + branch)
    for (int i = lane; i < d; i += 32) {
        T v = x[start + i];
        if (has_branch) {
            v += branch[start + i];
            s[start + i] = v;
        }
        sum += v;
    }
    const T mu = warp_sum(sum) / (T)d;

    T sq = 0;                                              // pass 2: the variance of s - mean
    for (int i = lane; i < d; i += 32) {
        const T c = src[i] - mu;
        sq += c * c;
    }
    const T r = inv_sqrt(warp_sum(sq) / (T)d + eps);

    for (int i = lane; i < d; i += 32) {                   // pass 3: y
        T v = (src[i] - mu) * r;
        if (has_gamma) v *= gamma[i];
        if (has_beta) v += beta[i];
        y[start + i] = v;
    }
    if (lane == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

// ---------------------------------------------------------------- backward dL/dx: one warp per row

// dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) (+ gs if has_gs), g = gy * gamma.
template <typename T>
__device__ void layer_norm_backward_dx(const T* gy, const T* x, const T* mean, const T* rstd,
                                       const T* gamma, const T* gs, T* dx, int has_gamma,
                                       int has_gs, long long rows, int d) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const long long start = row * d;
    const T mu = mean[row], r = rstd[row];

    T sum_g = 0, sum_gx = 0;
    for (int i = lane; i < d; i += 32) {
        const T g = has_gamma ? scaled(gy[start + i], gamma[i]) : gy[start + i];
        const T x_hat = (x[start + i] - mu) * r;
        sum_g += g;
        sum_gx += g * x_hat;
    }
    const T mean_g = warp_sum(sum_g) / (T)d;
    const T mean_gx = warp_sum(sum_gx) / (T)d;

    for (int i = lane; i < d; i += 32) {
        const T g = has_gamma ? scaled(gy[start + i], gamma[i]) : gy[start + i];
        const T x_hat = (x[start + i] - mu) * r;
        T v = r * (g - mean_g - x_hat * mean_gx);
        if (has_gs) v += gs[start + i];
        dx[start + i] = v;
    }
}

// ---------------------------------------------------------------- dL/dgamma, dL/dbeta: down columns

// Block (32, COLUMN_LANES): thread (c, l) sums column blockIdx.x * 32 + c over rows l,
// l + COLUMN_LANES, ... of chunk blockIdx.y (rows [chunk * rows_per_chunk, (chunk + 1) *
// rows_per_chunk)); the block adds its COLUMN_LANES sums in lane order and writes
// part_gamma / part_beta[chunk * d + column].
#define COLUMN_LANES 8            // = COLUMN_LANES of the Python side (a test checks)
template <typename T>
__device__ void layer_norm_param_grads(const T* gy, const T* x, const T* mean, const T* rstd,
                                       T* part_gamma, T* part_beta, int need_gamma, int need_beta,
                                       long long rows, int d, long long rows_per_chunk) {
    __shared__ T tile_gamma[COLUMN_LANES][32];
    __shared__ T tile_beta[COLUMN_LANES][32];
    const int c = threadIdx.x, l = threadIdx.y;
    const long long column = (long long)blockIdx.x * 32 + c;
    const long long first = (long long)blockIdx.y * rows_per_chunk;
    const long long last = min(rows, first + rows_per_chunk);

    T acc_gamma = 0, acc_beta = 0;
    if (column < d) {
        for (long long row = first + l; row < last; row += COLUMN_LANES) {
            const T g = gy[row * d + column];
            acc_beta += g;
            if (need_gamma) acc_gamma += g * ((x[row * d + column] - mean[row]) * rstd[row]);
        }
    }
    tile_gamma[l][c] = acc_gamma;
    tile_beta[l][c] = acc_beta;
    __syncthreads();
    if (l == 0 && column < d) {
        T total_gamma = 0, total_beta = 0;
        for (int k = 0; k < COLUMN_LANES; ++k) {
            total_gamma += tile_gamma[k][c];
            total_beta += tile_beta[k][c];
        }
        if (need_gamma) part_gamma[blockIdx.y * (long long)d + column] = total_gamma;
        if (need_beta) part_beta[blockIdx.y * (long long)d + column] = total_beta;
    }
}

// out[column] = sum over chunks k = 0, 1, ... of part[k * d + column], in that order; one thread
// per column.
template <typename T>
__device__ void sum_chunks(const T* part, T* out, int chunks, int d) {
    const int column = blockIdx.x * blockDim.x + threadIdx.x;
    if (column >= d) return;
    T total = 0;
    for (int k = 0; k < chunks; ++k) total += part[(long long)k * d + column];
    out[column] = total;
}

// ---------------------------------------------------------------- entry points, one per dtype

extern "C" __global__ void layer_norm_forward_f32(
        const float* x, const float* branch, float* s, float* y, float* mean, float* rstd,
        const float* gamma, const float* beta, int has_branch, int has_gamma, int has_beta,
        long long rows, int d, float eps) {
    layer_norm_forward<float>(x, branch, s, y, mean, rstd, gamma, beta, has_branch, has_gamma,
                              has_beta, rows, d, eps);
}
extern "C" __global__ void layer_norm_forward_f64(
        const double* x, const double* branch, double* s, double* y, double* mean, double* rstd,
        const double* gamma, const double* beta, int has_branch, int has_gamma, int has_beta,
        long long rows, int d, double eps) {
    layer_norm_forward<double>(x, branch, s, y, mean, rstd, gamma, beta, has_branch, has_gamma,
                               has_beta, rows, d, eps);
}

extern "C" __global__ void layer_norm_backward_dx_f32(
        const float* gy, const float* x, const float* mean, const float* rstd, const float* gamma,
        const float* gs, float* dx, int has_gamma, int has_gs, long long rows, int d) {
    layer_norm_backward_dx<float>(gy, x, mean, rstd, gamma, gs, dx, has_gamma, has_gs, rows, d);
}
extern "C" __global__ void layer_norm_backward_dx_f64(
        const double* gy, const double* x, const double* mean, const double* rstd,
        const double* gamma, const double* gs, double* dx, int has_gamma, int has_gs,
        long long rows, int d) {
    layer_norm_backward_dx<double>(gy, x, mean, rstd, gamma, gs, dx, has_gamma, has_gs, rows, d);
}

extern "C" __global__ void layer_norm_param_grads_f32(
        const float* gy, const float* x, const float* mean, const float* rstd, float* part_gamma,
        float* part_beta, int need_gamma, int need_beta, long long rows, int d,
        long long rows_per_chunk) {
    layer_norm_param_grads<float>(gy, x, mean, rstd, part_gamma, part_beta, need_gamma, need_beta,
                                  rows, d, rows_per_chunk);
}
extern "C" __global__ void layer_norm_param_grads_f64(
        const double* gy, const double* x, const double* mean, const double* rstd,
        double* part_gamma, double* part_beta, int need_gamma, int need_beta, long long rows,
        int d, long long rows_per_chunk) {
    layer_norm_param_grads<double>(gy, x, mean, rstd, part_gamma, part_beta, need_gamma, need_beta,
                                   rows, d, rows_per_chunk);
}

extern "C" __global__ void sum_chunks_f32(const float* part, float* out, int chunks, int d) {
    sum_chunks<float>(part, out, chunks, d);
}
extern "C" __global__ void sum_chunks_f64(const double* part, double* out, int chunks, int d) {
    sum_chunks<double>(part, out, chunks, d);
}
