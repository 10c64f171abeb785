"""CuPy kernels: CUDA C++ through cupy.RawModule, one op per file, each beside the reference op it
replaces (tinyvit/ops/) and with the same signature.

Each module kernels/cuda/<op>.py holds SOURCE, the CUDA C++ of its kernels, and the Functions that
launch them. CI has no GPU, but it compiles every SOURCE with NVRTC for SM_ARCHS
(tests/test_kernels_cuda_compile.py), so a kernel that does not compile fails CI. Whether a kernel
computes the right numbers only a GPU can tell: its `pytest -m gpu` tests (tests/test_kernels_cuda_*.py)
compare it with the reference, and passed.json records where they passed (GPU, CuPy and CUDA
versions, commit, date; `python -m tinyvit.kernels.cuda.record` runs them and writes it). The switchboard (tinyvit.kernels.kernel_for) runs a CUDA kernel only once
it is recorded there; `use_kernels("all")`, TINYVIT_KERNELS=all or `--kernels all` force the
unrecorded ones too, for testing them on a GPU. Until then CuPy arrays run the reference ops.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

SM_ARCHS = ("sm_80", "sm_90")          # A100 and H100/H200: what CI compiles every kernel for
RECORD = Path(__file__).with_name("passed.json")
NVRTC_OPTIONS = ("--std=c++14",)


def passed_kernels() -> dict:
    """{op name: [where its GPU tests passed: {"gpu", "cupy", "cuda", "commit", "date"}, ...]} from
    passed.json; an op that is not there has not passed on any GPU yet."""
    if not RECORD.is_file():
        return {}
    return json.loads(RECORD.read_text())


@functools.lru_cache(maxsize=None)
def _module(source: str, device_id: int):
    import cupy
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=source, options=NVRTC_OPTIONS)


def kernel(source: str, name: str):
    """The __global__ function ``name`` of ``source``, compiled (once per device) for the current GPU."""
    import cupy
    return _module(source, cupy.cuda.Device().id).get_function(name)


# Device functions several kernels share, put into a SOURCE where it has the line MATH_HELPERS_LINE
# (SOURCE = r"""...""".replace(MATH_HELPERS_LINE, MATH_HELPERS)); WARP and FULL_MASK come first there.
MATH_HELPERS_LINE = "// #include MATH_HELPERS (kernels/cuda/__init__.py): exp_, log_, minus_infinity, warp_sum, warp_max"
MATH_HELPERS = r"""
__device__ __forceinline__ float exp_(float x) { return expf(x); }
__device__ __forceinline__ double exp_(double x) { return exp(x); }
__device__ __forceinline__ float log_(float x) { return logf(x); }
__device__ __forceinline__ double log_(double x) { return log(x); }

template <typename T> __device__ __forceinline__ T minus_infinity();
template <> __device__ __forceinline__ float minus_infinity<float>() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double minus_infinity<double>() {
    return -__longlong_as_double(0x7ff0000000000000LL);
}

// Sum and max over the 32 lanes of a warp (butterfly: every lane gets the same bits).
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
"""

_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}


def entry(name: str, dtype) -> str:
    """The extern "C" entry point of kernel ``name`` for ``dtype``: layer_norm_forward_f32, ...
    (each kernel is a C++ template with one entry point per dtype)."""
    suffix = _SUFFIX.get(np.dtype(dtype))
    if suffix is None:
        raise TypeError(f"{name}: the CUDA kernels take float32 or float64, got {np.dtype(dtype)}")
    return f"{name}_{suffix}"
