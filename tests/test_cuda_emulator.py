"""The CUDA emulator itself (tests/cuda_emulator): what it does as a GPU does (fused multiply-adds,
float32 denormals flushed), what it refuses that a GPU leaves undefined (threads at different
__syncthreads, lanes at different shuffles, a full-mask shuffle after a lane exited, an argument of
the wrong type), and that a broken kernel fails the comparison with the reference. The kernels
against their references are tests/test_kernels_cuda_emulated.py; the sanitizer builds
tests/test_cuda_emulator_sanitizers.py.
"""
import numpy as np
import pytest
from cuda_emulator import emulator
from cuda_emulator.harness import DTYPES, compare, emulate, libraries, plain_only  # noqa: F401 (fixtures)

import tinyvit as tv
from tinyvit.kernels.cuda import gelu as k_gelu
from tinyvit.kernels.cuda import layernorm as k_layernorm
from tinyvit.kernels.cuda import loss as k_loss
from tinyvit.ops import activation, norm



@plain_only
def test_a_mutated_kernel_fails(libraries, emulate, monkeypatch):
    """A wrong constant in gelu's SOURCE (tanh GELU's 0.044715 -> 0.04471) fails the comparison."""
    source = k_gelu.SOURCE.replace("#define TANH_C 0.044715", "#define TANH_C 0.04471")
    assert source != k_gelu.SOURCE
    monkeypatch.setattr(k_gelu, "SOURCE", source)
    emulate("gelu", emulator.build(source, libraries[1]))
    rng = np.random.default_rng(6)
    with pytest.raises(AssertionError, match="GELUTanh"):
        compare(lambda x: k_gelu.GELUTanh.apply(x), lambda x: activation.GELUTanh.apply(x),
                [rng.standard_normal((3, 7)) * 3], [rng.standard_normal((3, 7))], np.float64, "GELUTanh")


@plain_only
def test_a_missing_syncthreads_fails(libraries, emulate, monkeypatch):
    """Without the __syncthreads after which layer_norm_param_grads's block adds its 8 partial sums
    per column from shared memory, the threads that add (the first warp, started first) read sums
    not yet written: dgamma and dbeta come out wrong, where the intact source passes the same case."""
    rng = np.random.default_rng(7)
    data = [rng.standard_normal((40, 7)), rng.standard_normal(7), rng.standard_normal(7)]
    upstream = [rng.standard_normal((40, 7))]

    def check(what):
        compare(lambda *t: k_layernorm.LayerNorm.apply(*t, 1e-5), lambda *t: norm.LayerNorm.apply(*t, 1e-5),
                data, upstream, np.float64, what)

    emulate("layernorm")
    check("LayerNorm (40 rows)")
    source = k_layernorm.SOURCE
    assert source.count("__syncthreads();") == 1
    mutated = source.replace("__syncthreads();", "", 1)
    monkeypatch.setattr(k_layernorm, "SOURCE", mutated)
    emulate("layernorm", emulator.build(mutated, libraries[1]))
    with pytest.raises(AssertionError, match="gradient [12]"):
        check("LayerNorm without __syncthreads")


CONTRACTION = r"""
extern "C" __global__ void product_minus_rounded_product(const float* a, float* out) {
    const float rounded = __fmul_rn(a[0], a[1]);
    out[0] = a[0] * a[1] - rounded;               // contracted: fma(a0, a1, -rounded), the rounding error
    out[1] = __fmul_rn(a[0], a[1]) - rounded;     // an _rn product is never fused: exactly 0
}
"""


def test_the_emulator_fuses_multiply_adds_as_a_gpu_does(tmp_path):
    """a * b - round(a * b) is the product's rounding error where the compiler fuses it into an FMA
    (NVRTC does, and the emulator's build, on a CPU with FMA instructions), 0 with __fmul_rn."""
    if not emulator.FMA:
        pytest.skip("this CPU has no FMA instructions: the emulator cannot fuse multiply-adds here")
    library = emulator.build(CONTRACTION, tmp_path)
    kernel = emulator.Emulation(library).kernel(CONTRACTION, "product_minus_rounded_product")
    a, out = np.array([1 + 2 ** -12, 1 + 2 ** -13], np.float32), np.full(2, np.nan, np.float32)
    kernel((1,), (1,), (a, out))
    assert out[0] == np.float32(2 ** -25) and out[1] == 0, out


@pytest.mark.parametrize("dtype", DTYPES)
def test_float32_denormals_are_flushed_as_on_a_gpu(emulate, dtype):
    """CuPy compiles with -ftz=true: a float32 kernel reads a denormal as 0 and writes 0 for one, a
    float64 kernel keeps them. GELU(1e-39) = 5e-40: 0 in float32, as a GPU gives; in float64 (where
    1e-39 is normal) 5e-40; 1e-310 (a float64 denormal) stays too."""
    emulate("gelu")
    x = np.array([1e-39, -1e-39, 1e-310, 1.0], dtype)
    y = k_gelu.GELU.apply(tv.Tensor(x)).data
    if dtype == np.float32:
        np.testing.assert_array_equal(y[:3], 0.0)
    else:
        np.testing.assert_allclose(y[:3], x[:3] / 2, rtol=1e-6)
        assert y[2] != 0
    np.testing.assert_allclose(y[3], 0.8413447460685429, rtol=1e-6)


SYNCHRONISATION = r"""
extern "C" __global__ void divergent_barrier(float* x) {      // half the block at each __syncthreads
    if (threadIdx.x < 32) { __syncthreads(); x[threadIdx.x] = 1.0f; }
    else { x[threadIdx.x] = 2.0f; __syncthreads(); }
}
extern "C" __global__ void divergent_shuffle(float* x) {      // half the warp at each shuffle
    float v = x[threadIdx.x];
    if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
    else v = __shfl_xor_sync(0xffffffffu, v, 2);
    x[threadIdx.x] = v;
}
extern "C" __global__ void shuffle_after_exit(float* x) {     // lane 5 gone, the mask still names it
    if (threadIdx.x == 5) return;
    x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], 1);
}
extern "C" __global__ void whole_warps_leave(float* x) {      // the kernels' pattern: allowed
    if (threadIdx.x >= 32) return;
    x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], 1);
    __syncthreads();
}
"""


@plain_only
@pytest.mark.parametrize("name,problem", [
    ("divergent_barrier", r"wait at different __syncthreads calls, kernels.cu:3 and kernels.cu:4"),
    ("divergent_shuffle", r"wait at different shuffle calls, kernels.cu:8 and kernels.cu:9"),
    ("shuffle_after_exit", r"a full-mask shuffle at kernels.cu:14 after lane 5 of its warp exited"),
    ("whole_warps_leave", None)])
def test_the_emulator_checks_barrier_and_shuffle_call_sites(libraries, name, problem):
    """Undefined on a GPU, and passed unnoticed by an emulator that only counts arrivals: threads of a
    block at two different __syncthreads, lanes of a warp at two different shuffles, a full-mask
    shuffle after a lane returned. Whole warps returning before a barrier is fine (sm_70+)."""
    source = '#line 1 "kernels.cu"\n' + SYNCHRONISATION
    kernel = emulator.Emulation(emulator.build(source, libraries[1])).kernel(source, name)   # built once
    x = np.arange(64, dtype=np.float32)
    if problem is None:
        kernel((1,), (64,), (x,))
        np.testing.assert_array_equal(x[:32], np.arange(32) ^ 1)
    else:
        with pytest.raises(RuntimeError, match=problem):
            kernel((1,), (64,), (x,))


@plain_only
def test_a_lane_that_leaves_before_a_warp_sum_fails(libraries, emulate, monkeypatch):
    """layer_norm_forward with lanes that have no element of a row returning early (d = 7: lanes 7-31)
    then shuffling with the full mask: refused, where the intact kernel passes (test_layernorm)."""
    source = k_layernorm.SOURCE
    line = "    if (row >= rows) return;                               // the whole warp: row is the same in it\n"
    assert source.count(line) == 1
    mutated = source.replace(line, "    if (row >= rows || lane >= d) return;\n")
    monkeypatch.setattr(k_layernorm, "SOURCE", mutated)
    emulate("layernorm", emulator.build(mutated, libraries[1]))
    x = np.random.default_rng(8).standard_normal((3, 7))
    problem = r"layer_norm_forward_f64: a full-mask shuffle at common.cuh:\d+ after lane 7"
    with pytest.raises(RuntimeError, match=problem):
        k_layernorm.LayerNorm.apply(tv.Tensor(x), None, None, 1e-5)


def test_a_wrong_argument_type_is_reported(libraries):
    """An int parameter given a NumPy int64 (CuPy would pass 8 bytes where the kernel reads 4)."""
    kernel = emulator.Emulation(libraries[0]["loss"]).kernel(k_loss.SOURCE, "cross_entropy_forward_f64")
    x = np.zeros((1, 4))
    row = np.zeros(1)
    with pytest.raises(AssertionError, match=r"cross_entropy_forward_f64\(k\): int64 for int"):
        kernel((1,), (32,), (x, np.uintp(0), np.zeros((1, 4)), row, row, row, np.int64(4), np.float64(0.0)))
