"""Every CUDA kernel compiles, without a GPU: NVRTC (from the cupy-cuda12x and nvidia-cuda-nvrtc-cu12
wheels, which install and run on a CPU-only machine) compiles each kernels/cuda/<op>.py module's
SOURCE for every architecture of kernels.cuda.SM_ARCHS, so a kernel that does not compile fails CI.

CI sets TINYVIT_REQUIRE_NVRTC=1: there a missing NVRTC is a failure, not a skip. Whether the kernels
compute the right numbers is for the GPU tests (tests/test_kernels_cuda_*.py, `pytest -m gpu`).
"""
import importlib
import os
import pkgutil

import pytest

from tinyvit import kernels
from tinyvit.kernels import cuda

# The kernel modules: those of kernels/cuda with a SOURCE (record.py, the passed.json tool, has none).
MODULES = sorted(m.name for m in pkgutil.iter_modules(cuda.__path__)
                 if hasattr(importlib.import_module(f"tinyvit.kernels.cuda.{m.name}"), "SOURCE"))


def _nvrtc():
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception as exc:  # CuPy or its NVRTC library missing
        if os.environ.get("TINYVIT_REQUIRE_NVRTC") == "1":
            pytest.fail(f"TINYVIT_REQUIRE_NVRTC=1 but NVRTC is not usable ({exc!r}): "
                        "pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12")
        pytest.skip(f"NVRTC is not usable here ({exc!r}): pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12")


def compile_source(nvrtc, source, name, arch):
    """CUBIN bytes of ``source`` for ``arch`` (e.g. "sm_90"); an NVRTCError carries the compiler's log."""
    program = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, [f"--gpu-architecture={arch}", *cuda.NVRTC_OPTIONS])
        except nvrtc.NVRTCError as exc:
            raise AssertionError(f"{name} does not compile for {arch}:\n{nvrtc.getProgramLog(program)}") from exc
        return nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)


def test_every_cuda_kernel_lives_in_a_module_with_source():
    """Each entry of the switchboard's CUDA table names a kernels/cuda module that has SOURCE."""
    for name, where in kernels.CUDA_KERNELS.items():
        module, attribute = where.split(":")
        assert module in MODULES, f"{name}: no kernels/cuda/{module}.py"
        loaded = importlib.import_module(f"tinyvit.kernels.cuda.{module}")
        assert hasattr(loaded, attribute), f"{name}: kernels/cuda/{module}.py has no {attribute}"
        assert isinstance(getattr(loaded, "SOURCE", None), str), f"kernels/cuda/{module}.py has no SOURCE"


@pytest.mark.parametrize("arch", cuda.SM_ARCHS)
@pytest.mark.parametrize("module", MODULES)
def test_kernel_source_compiles(module, arch):
    nvrtc = _nvrtc()
    source = importlib.import_module(f"tinyvit.kernels.cuda.{module}").SOURCE
    assert len(compile_source(nvrtc, source, module, arch)) > 0


def test_a_broken_kernel_fails_to_compile():
    """The check can fail: a kernel with a type error is reported with NVRTC's log."""
    nvrtc = _nvrtc()
    broken = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_name; }'
    with pytest.raises(AssertionError, match="undefined_name"):
        compile_source(nvrtc, broken, "broken", cuda.SM_ARCHS[0])
