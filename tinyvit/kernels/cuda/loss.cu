// Softmax cross-entropy, fused (tinyvit/kernels/cuda/loss.py; reference: tinyvit/ops/loss.py).
//
// Thread layout: one block per row i of the (n, K) logits, blockDim.x a multiple of 32; thread t
// takes classes t, t + blockDim.x, ... (neighbouring threads read neighbouring classes). A row's
// max and sums are reduced over the block: within each warp by shuffles, then the warps' results
// through a small static shared array (32 numbers), reduced again by every warp.

#include "common.cuh"     // WARP, FULL_MASK, exp_, log_, minus_infinity, quiet_nan, warp_sum, warp_max

// The sum (max) of v over the block, returned to every thread. partial: WARP numbers of shared memory.
template <typename T> __device__ T block_sum(T v, T* partial) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();                        // every warp has read partial's previous contents
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? partial[lane] : T(0));
}
template <typename T> __device__ T block_max(T v, T* partial) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? partial[lane] : minus_infinity<T>());
}

// ------------------------------------------------------------------ forward
// row_loss[i] = -(1 - eps) sum_k t_ik z_ik - (eps / K) sum_k z_ik; row_max[i] = m_i and
// row_log_sum[i] = s_i for backward. labels (n,) or probs (n, K): the other is null. Three passes
// over the row (max; sum of exp; the z sums), which stays in L1/L2 between them.
template <typename T>
__device__ void cross_entropy_forward(const T* __restrict__ logits, const long long* __restrict__ labels,
                                      const T* __restrict__ probs, T* __restrict__ row_loss,
                                      T* __restrict__ row_max, T* __restrict__ row_log_sum, int k, T smoothing) {
    __shared__ T partial[WARP];
    const long long i = blockIdx.x;
    const T* x = logits + i * k;
    T top = minus_infinity<T>();
    for (int c = threadIdx.x; c < k; c += blockDim.x) top = x[c] > top ? x[c] : top;
    top = block_max(top, partial);
    T sum = T(0);
    for (int c = threadIdx.x; c < k; c += blockDim.x) sum += exp_(x[c] - top);
    const T log_sum = log_(block_sum(sum, partial));

    T target_dot = T(0), z_sum = T(0);      // sum_k t_ik z_ik (probabilities), sum_k z_ik
    for (int c = threadIdx.x; c < k; c += blockDim.x) {
        const T z = (x[c] - top) - log_sum;
        z_sum += z;
        if (probs != nullptr) target_dot += probs[i * k + c] * z;
    }
    z_sum = block_sum(z_sum, partial);
    if (probs != nullptr) target_dot = block_sum(target_dot, partial);
    if (threadIdx.x == 0) {
        if (labels != nullptr) {            // a label outside [0, K) reads nothing: the row's loss is NaN
            const long long label = labels[i];
            target_dot = 0 <= label && label < k ? (x[label] - top) - log_sum : quiet_nan<T>();
        }
        T loss = -(T(1) - smoothing) * target_dot;
        if (smoothing != T(0)) loss -= smoothing / T(k) * z_sum;   // (0 * -inf would be NaN)
        row_loss[i] = loss;
        row_max[i] = top;
        row_log_sum[i] = log_sum;
    }
}

// ------------------------------------------------------------------ backward
// dlogits = (g / n) (exp(z) - t'), t' = (1 - eps) t + eps / K;  dprobs = -(1 - eps) (g / n) z,
// z = (x - m) - s.
// gy: the upstream gradient, one number in device memory. Either output may be null (not wanted).
template <typename T>
__device__ void cross_entropy_backward(const T* __restrict__ logits, const long long* __restrict__ labels,
                                       const T* __restrict__ probs, const T* __restrict__ row_max,
                                       const T* __restrict__ row_log_sum, const T* __restrict__ gy,
                                       T* __restrict__ dlogits, T* __restrict__ dprobs, int k, long long n,
                                       T smoothing) {
    const long long i = blockIdx.x;
    const T g = gy[0] / T(n);
    const T top = row_max[i], log_sum = row_log_sum[i], keep = T(1) - smoothing, uniform = smoothing / T(k);
    const long long label = labels != nullptr ? labels[i] : -1;
    const bool invalid = labels != nullptr && (label < 0 || label >= k);   // the row's loss was NaN
    for (int c = threadIdx.x; c < k; c += blockDim.x) {
        const long long at = i * k + c;
        const T z = (logits[at] - top) - log_sum;
        if (dlogits != nullptr) {
            const T t = labels != nullptr ? (c == label ? keep : T(0)) : keep * probs[at];
            dlogits[at] = invalid ? quiet_nan<T>() : (exp_(z) - t - uniform) * g;
        }
        if (dprobs != nullptr) dprobs[at] = z * (-keep * g);
    }
}

#define CROSS_ENTROPY_KERNELS(T, SUFFIX)                                                                    \
extern "C" __global__ void __launch_bounds__(512) cross_entropy_forward_##SUFFIX(                          \
        const T* logits, const long long* labels, const T* probs, T* row_loss, T* row_max,                 \
        T* row_log_sum, int k, T smoothing) {                                                               \
    cross_entropy_forward<T>(logits, labels, probs, row_loss, row_max, row_log_sum, k, smoothing);          \
}                                                                                                           \
extern "C" __global__ void __launch_bounds__(512) cross_entropy_backward_##SUFFIX(                         \
        const T* logits, const long long* labels, const T* probs, const T* row_max,                        \
        const T* row_log_sum, const T* gy, T* dlogits, T* dprobs, int k, long long n, T smoothing) {       \
    cross_entropy_backward<T>(logits, labels, probs, row_max, row_log_sum, gy, dlogits, dprobs, k, n,      \
                              smoothing);                                                                   \
}

CROSS_ENTROPY_KERNELS(float, f32)
CROSS_ENTROPY_KERNELS(double, f64)
