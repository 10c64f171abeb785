// Device helpers the kernels of tinyvit/kernels/cuda/*.cu share. Each .cu file includes it with
// #include "common.cuh"; kernels/cuda/__init__.py (load_source) splices it into the source text that
// NVRTC compiles, so CuPy's kernel cache, keyed on that text, sees every change of this file too.

constexpr int WARP = 32;                       // threads per warp
constexpr unsigned FULL_MASK = 0xffffffffu;    // every lane of a warp takes part in a shuffle

__device__ __forceinline__ float exp_(float x) { return expf(x); }
__device__ __forceinline__ double exp_(double x) { return exp(x); }
__device__ __forceinline__ float log_(float x) { return logf(x); }
__device__ __forceinline__ double log_(double x) { return log(x); }

template <typename T> __device__ __forceinline__ T minus_infinity();
template <> __device__ __forceinline__ float minus_infinity<float>() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double minus_infinity<double>() {
    return -__longlong_as_double(0x7ff0000000000000LL);
}
template <typename T> __device__ __forceinline__ T quiet_nan();
template <> __device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fc00000); }
template <> __device__ __forceinline__ double quiet_nan<double>() { return __longlong_as_double(0x7ff8000000000000LL); }

// Sum and max over the 32 lanes of a warp (butterfly: lane i adds lane i ^ offset, so every lane
// ends with the same bits). All 32 lanes must be active: no lane may have returned before.
template <typename T> __device__ __forceinline__ T warp_sum(T v) {
    for (int offset = WARP / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}
template <typename T> __device__ __forceinline__ T warp_max(T v) {
    for (int offset = WARP / 2; offset > 0; offset /= 2) {
        const T other = __shfl_xor_sync(FULL_MASK, v, offset);
        v = other > v ? other : v;
    }
    return v;
}
