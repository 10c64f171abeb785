"""Softmax cross-entropy on the GPU: the same function as ops/loss.py's CrossEntropy, with log-softmax,
the loss and its gradient fused into two CUDA kernels, one block per row of logits.

    forward    m_i = max_k x_ik,  s_i = log sum_k exp(x_ik - m_i)      (stable log-sum-exp)
               z_ik = (x_ik - m_i) - s_i                 log-probabilities, never stored
               loss_i = -(1 - eps) sum_k t_ik z_ik - (eps / K) sum_k z_ik
                        (t: one-hot labels, sum_k t_ik z_ik = z_i,label; or probabilities)
               loss = mean_i loss_i                       a device scalar: no host synchronisation
    backward   dx_ik = (g / n) (exp(z_ik) - (1 - eps) t_ik - eps / K)
               dt_ik = -(g / n) (1 - eps) z_ik            (probability targets that want a gradient)

Saved for backward: the logits (the input itself, no copy), m and s (two numbers per row), where
the reference keeps all of z: the gradient recomputes exp(z) as it writes. z is formed as the
reference forms it, (x - m) - s, not x - (m + s), which would round m + s to the precision of large
logits. g, the upstream gradient, stays on the GPU: the backward kernel reads it from device
memory, so a training step never waits for the loss to reach the host. Labels are int64 (others
are converted); probabilities have the logits' dtype. float32 (accumulating in float32) and float64.

Tests: tests/test_kernels_cuda_loss.py (GPU: equal to the reference, loss and every gradient).
"""
from __future__ import annotations

import numpy as np

from ...autograd import Function
from ...backend import get_array_module
from . import MATH_HELPERS, MATH_HELPERS_LINE, entry, kernel

WARP = 32
MAX_THREADS = 512          # threads per block (a row): 16 warps
PER_THREAD = 4             # aim for about this many classes per thread before adding warps
MAX_GRID_X = 2 ** 31 - 1

SOURCE = r"""
// Softmax cross-entropy, fused (tinyvit/kernels/cuda/loss.py; reference: tinyvit/ops/loss.py).
//
// Thread layout: one block per row i of the (n, K) logits, blockDim.x a multiple of 32; thread t
// takes classes t, t + blockDim.x, ... (neighbouring threads read neighbouring classes). A row's
// max and sums are reduced over the block: within each warp by shuffles, then the warps' results
// through a small static shared array (32 numbers), reduced again by every warp.

constexpr int WARP = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;

// #include MATH_HELPERS (kernels/cuda/__init__.py): exp_, log_, minus_infinity, warp_sum, warp_max

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
        if (labels != nullptr) target_dot = (x[labels[i]] - top) - log_sum;
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
    for (int c = threadIdx.x; c < k; c += blockDim.x) {
        const long long at = i * k + c;
        const T z = (logits[at] - top) - log_sum;
        if (dlogits != nullptr) {
            const T t = labels != nullptr ? (c == label ? keep : T(0)) : keep * probs[at];
            dlogits[at] = (exp_(z) - t - uniform) * g;
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
""".replace(MATH_HELPERS_LINE, MATH_HELPERS)

NULL = np.uintp(0)     # a null pointer argument (CuPy passes a NumPy scalar by value: 8 bytes, as a pointer)


def launch_config(n: int, k: int):
    """(grid, block) for n rows of K classes: a block per row, of a whole number of warps giving each
    thread about PER_THREAD classes, at least one warp and at most MAX_THREADS threads."""
    if not 1 <= n <= MAX_GRID_X:
        raise ValueError(f"cross_entropy kernel: {n} rows, at most {MAX_GRID_X}")
    warps = -(-k // (PER_THREAD * WARP))
    threads = min(MAX_THREADS, max(1, warps) * WARP)
    return (n,), (threads,)


def _launch(name, dtype, n, k, args):
    grid, block = launch_config(n, k)
    kernel(SOURCE, entry(name, dtype))(grid, block, args)


class CrossEntropy(Function):
    """Mean cross-entropy between softmax(logits) and a target, fused with log-softmax (the
    reference's signature and formulas; see the module docstring for the kernels).

    logits: (..., K)   target: (...) integer labels in [0, K), or (..., K) probabilities  ->  loss: ()
    label_smoothing eps: t' = (1 - eps) t + eps / K. The loss is a 0-d array on the GPU.
    """

    def forward(self, logits, target, label_smoothing):
        xp = get_array_module(logits)
        k = logits.shape[-1]
        x = xp.ascontiguousarray(logits).reshape(-1, k)              # (n, K)
        n, dtype = x.shape[0], x.dtype
        labels = probs = None
        if target.dtype.kind == "f":                                 # probabilities (..., K)
            probs = xp.ascontiguousarray(target, dtype=dtype).reshape(n, k)
        else:                                                        # labels (...)
            labels = xp.ascontiguousarray(target.reshape(n), dtype=np.int64)
        eps = dtype.type(label_smoothing)
        row_loss = xp.empty(n, dtype)
        row_max = xp.empty(n, dtype)                                 # m_i = max_k x_ik
        row_log_sum = xp.empty(n, dtype)                             # s_i = log sum_k exp(x_ik - m_i)
        _launch("cross_entropy_forward", dtype, n, k,
                (x, NULL if labels is None else labels, NULL if probs is None else probs, row_loss, row_max,
                 row_log_sum, np.int32(k), eps))
        self.save(x, labels, probs, row_max, row_log_sum, eps, logits.shape, target.shape)
        return row_loss.mean()                                       # 0-d, on the device

    def backward(self, gy):
        x, labels, probs, row_max, row_log_sum, eps, logits_shape, target_shape = self.saved
        xp = get_array_module(x)
        n, k = x.shape
        want_logits = self.needs_input_grad[0]
        want_target = probs is not None and self.needs_input_grad[1]
        if not (want_logits or want_target):
            return None, None, None
        g = xp.ascontiguousarray(xp.asarray(gy, dtype=x.dtype)).reshape(1)   # stays on the device
        dlogits = xp.empty_like(x) if want_logits else None
        dtarget = xp.empty_like(x) if want_target else None
        _launch("cross_entropy_backward", x.dtype, n, k,
                (x, NULL if labels is None else labels, NULL if probs is None else probs, row_max, row_log_sum,
                 g, NULL if dlogits is None else dlogits, NULL if dtarget is None else dtarget,
                 np.int32(k), np.int64(n), eps))
        return (None if dlogits is None else dlogits.reshape(logits_shape),
                None if dtarget is None else dtarget.reshape(target_shape), None)
