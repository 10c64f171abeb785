// GELU, exact and tanh, with the bias fused in front (tinyvit/kernels/cuda/gelu.py; reference:
// tinyvit/ops/activation.py). Layout and formulas: gelu.py's docstring.

#include "common.cuh"     // exp_

// Double-precision constants, cast to T where used: in float32 nothing is promoted to double.
#define SQRT1_2 0.70710678118654752440       // 1 / sqrt(2)
#define INV_SQRT_2PI 0.39894228040143267794  // 1 / sqrt(2 pi)
#define SQRT_2_OVER_PI 0.79788456080286535588
#define TANH_C 0.044715

__device__ __forceinline__ float erfc_(float v) { return erfcf(v); }
__device__ __forceinline__ double erfc_(double v) { return erfc(v); }
__device__ __forceinline__ float tanh_(float v) { return tanhf(v); }
__device__ __forceinline__ double tanh_(double v) { return tanh(v); }

// y = h Phi(h); *slope = dy/dh = Phi(h) + h phi(h).
template <typename T>
__device__ __forceinline__ T gelu(T h, T* slope) {
    const T cdf = (T)0.5 * erfc_(-h * (T)SQRT1_2);
    *slope = cdf + h * exp_((T)-0.5 * h * h) * (T)INV_SQRT_2PI;
    return h * cdf;
}

// y = h (1 + t) / 2, t = tanh(sqrt(2/pi) (h + 0.044715 h^3)); *slope = dy/dh.
template <typename T>
__device__ __forceinline__ T gelu_tanh(T h, T* slope) {
    const T t = tanh_((T)SQRT_2_OVER_PI * (h + (T)TANH_C * h * h * h));
    const T du_dh = (T)SQRT_2_OVER_PI * ((T)1 + (T)(3.0 * TANH_C) * h * h);
    *slope = (T)0.5 * ((T)1 + t) + (T)0.5 * h * ((T)1 - t * t) * du_dh;
    return (T)0.5 * h * ((T)1 + t);
}

// x, y, slope: (rows, cols), C order; bias: (cols,). Thread: column blockIdx.x * blockDim.x +
// threadIdx.x, rows blockIdx.y, blockIdx.y + gridDim.y, ...  h = x (+ bias); y = f(h);
// slope = dy/dh if want_slope.
template <typename T, bool TANH>
__device__ void gelu_forward(const T* x, const T* bias, T* y, T* slope, int has_bias,
                             int want_slope, long long rows, long long cols) {
    const long long column = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (column >= cols) return;
    const T b = has_bias ? bias[column] : (T)0;
    for (long long row = blockIdx.y; row < rows; row += gridDim.y) {
        const long long i = row * cols + column;
        const T h = has_bias ? x[i] + b : x[i];
        T d;
        y[i] = TANH ? gelu_tanh(h, &d) : gelu(h, &d);
        if (want_slope) slope[i] = d;
    }
}

extern "C" __global__ void gelu_forward_f32(const float* x, const float* bias, float* y,
        float* slope, int has_bias, int want_slope, long long rows, long long cols) {
    gelu_forward<float, false>(x, bias, y, slope, has_bias, want_slope, rows, cols);
}
extern "C" __global__ void gelu_forward_f64(const double* x, const double* bias, double* y,
        double* slope, int has_bias, int want_slope, long long rows, long long cols) {
    gelu_forward<double, false>(x, bias, y, slope, has_bias, want_slope, rows, cols);
}
extern "C" __global__ void gelu_tanh_forward_f32(const float* x, const float* bias, float* y,
        float* slope, int has_bias, int want_slope, long long rows, long long cols) {
    gelu_forward<float, true>(x, bias, y, slope, has_bias, want_slope, rows, cols);
}
extern "C" __global__ void gelu_tanh_forward_f64(const double* x, const double* bias, double* y,
        double* slope, int has_bias, int want_slope, long long rows, long long cols) {
    gelu_forward<double, true>(x, bias, y, slope, has_bias, want_slope, rows, cols);
}
