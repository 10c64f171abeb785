// The AdamW step of every parameter in one launch (tinyvit/kernels/cuda/optim.py; reference:
// tinyvit/optim.py's Adam._update). The table and the order of operations: optim.py's docstring.

// One parameter of the step: 14 fields of 8 bytes, no padding; the host builds the same layout
// (kernels/cuda/optim.py TENSOR, checked against this struct by a test).
struct AdamWTensor {
    unsigned long long param, grad, exp_avg, exp_avg_sq;   // device addresses of T arrays
    long long size;                                         // elements
    long long first_block;                                  // the first block of the grid on it
    double decay;                                           // 1 - lr * weight_decay
    double beta1, one_minus_beta1, beta2, one_minus_beta2;
    double bias_correction2_sqrt;                           // sqrt(1 - beta2^t)
    double eps;
    double step_size;                                       // lr / (1 - beta1^t)
};

// Correctly rounded operations that the compiler keeps apart (no fused multiply-add).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double sqrt_rn(double a) { return __dsqrt_rn(a); }

template <typename T>
__device__ void adamw_step(const AdamWTensor* tensors, int count, int elements_per_block) {
    int lo = 0, hi = count - 1;                  // the last tensor whose first_block <= blockIdx.x
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tensors[mid].first_block <= (long long)blockIdx.x) lo = mid; else hi = mid - 1;
    }
    const AdamWTensor t = tensors[lo];
    T* p = reinterpret_cast<T*>(t.param);
    const T* g = reinterpret_cast<const T*>(t.grad);
    T* m = reinterpret_cast<T*>(t.exp_avg);
    T* v = reinterpret_cast<T*>(t.exp_avg_sq);
    // the per-tensor numbers, rounded to T as the reference's CuPy kernels round Python floats
    const T decay = (T)t.decay, beta1 = (T)t.beta1, one_minus_beta1 = (T)t.one_minus_beta1;
    const T beta2 = (T)t.beta2, one_minus_beta2 = (T)t.one_minus_beta2;
    const T bias_correction2_sqrt = (T)t.bias_correction2_sqrt, eps = (T)t.eps;
    const T step_size = (T)t.step_size;

    const long long first = ((long long)blockIdx.x - t.first_block) * elements_per_block;
    const long long last = min(first + elements_per_block, t.size);
    for (long long i = first + threadIdx.x; i < last; i += blockDim.x) {
        const T gi = g[i];
        const T pi = mul_rn(p[i], decay);                                  // p *= 1 - lr wd
        const T mi = add_rn(mul_rn(m[i], beta1), mul_rn(gi, one_minus_beta1));
        const T vi = add_rn(mul_rn(v[i], beta2), mul_rn(mul_rn(gi, gi), one_minus_beta2));
        const T denom = add_rn(div_rn(sqrt_rn(vi), bias_correction2_sqrt), eps);
        m[i] = mi;
        v[i] = vi;
        p[i] = sub_rn(pi, mul_rn(div_rn(mi, denom), step_size));
    }
}

extern "C" __global__ void adamw_step_f32(const AdamWTensor* tensors, int count,
                                          int elements_per_block) {
    adamw_step<float>(tensors, count, elements_per_block);
}
extern "C" __global__ void adamw_step_f64(const AdamWTensor* tensors, int count,
                                          int elements_per_block) {
    adamw_step<double>(tensors, count, elements_per_block);
}
