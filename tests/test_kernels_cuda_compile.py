"""Every CUDA kernel compiles, without a GPU: NVRTC (from the cupy-cuda12x and nvidia-cuda-nvrtc-cu12
wheels, which install and run on a CPU-only machine) compiles each kernels/cuda/<op>.py module's
SOURCE for every architecture of kernels.cuda.SM_ARCHS, so a kernel that does not compile fails CI.

CI sets TINYVIT_REQUIRE_NVRTC=1: there a missing NVRTC is a failure, not a skip. Whether the kernels
compute the right numbers is for the GPU tests (tests/test_kernels_cuda_*.py, `pytest -m gpu`).
"""
import fnmatch
import functools
import importlib
import os
import pkgutil
import re
from pathlib import Path

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


# Modules of kernels/cuda whose kernels are CuPy calls only (cuBLAS GEMMs), with no CUDA C++ of their own.
PURE_CUPY = {"linear"}


def test_every_cuda_kernel_lives_in_a_module_with_source():
    """Each entry of the switchboard's CUDA table names a kernels/cuda module that has SOURCE (the
    CUDA C++ compiled here), or one of the pure-CuPy modules, which has none."""
    for name, where in kernels.CUDA_KERNELS.items():
        module, attribute = where.split(":")
        assert module in MODULES or module in PURE_CUPY, f"{name}: no kernels/cuda/{module}.py with SOURCE"
        loaded = importlib.import_module(f"tinyvit.kernels.cuda.{module}")
        assert hasattr(loaded, attribute), f"{name}: kernels/cuda/{module}.py has no {attribute}"
        assert (module in PURE_CUPY) != isinstance(getattr(loaded, "SOURCE", None), str), module


@pytest.mark.parametrize("arch", cuda.SM_ARCHS)
@pytest.mark.parametrize("module", MODULES)
def test_kernel_source_compiles(module, arch):
    nvrtc = _nvrtc()
    source = importlib.import_module(f"tinyvit.kernels.cuda.{module}").SOURCE
    assert len(compile_source(nvrtc, source, module, arch)) > 0


def test_each_kernel_module_reads_its_cu_file():
    """kernels/cuda/<op>.py's SOURCE is <op>.cu beside it, read at import, with the headers it
    includes spliced in (no #include of a project file is left for NVRTC to look up), and no CUDA
    C++ is left in a Python string."""
    here = Path(cuda.__file__).parent
    for module in MODULES:
        loaded = importlib.import_module(f"tinyvit.kernels.cuda.{module}")
        assert (here / f"{module}.cu").is_file(), f"no kernels/cuda/{module}.cu"
        assert loaded.SOURCE == cuda.load_source(f"{module}.cu")
        assert not re.search(r'^#include "', loaded.SOURCE, re.MULTILINE), module
        python = (here / f"{module}.py").read_text()
        assert "__global__" not in python and "__device__" not in python, f"CUDA C++ left in {module}.py"
    assert {p.stem for p in here.glob("*.cu")} == set(MODULES)


def test_load_source_keeps_file_and_line_for_messages(tmp_path, monkeypatch):
    """A spliced header sits between #line directives: after it, the .cu file's own line numbers."""
    (tmp_path / "h.cuh").write_text("// header line 1\n// header line 2\n")
    (tmp_path / "k.cu").write_text('// line 1\n#include "h.cuh"   // why\n// line 3\n')
    monkeypatch.setattr(cuda, "HERE", tmp_path)
    assert cuda.load_source("k.cu") == ('#line 1 "k.cu"\n// line 1\n#line 1 "h.cuh"\n// header line 1\n'
                                        '// header line 2\n\n#line 3 "k.cu"\n// line 3\n')


def test_the_cuda_sources_are_package_data():
    """An installed wheel carries every .cu and .cuh file (and passed.json): each matches a pattern of
    pyproject.toml's package data for tinyvit.kernels.cuda."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "tinyvit.kernels.cuda"]
    here = Path(cuda.__file__).parent
    files = [p.name for p in here.iterdir() if p.suffix in (".cu", ".cuh", ".json")]
    assert {"common.cuh", "passed.json"} <= set(files)
    for name in files:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), f"{name} is not package data"


def test_ci_compiles_with_the_options_cupy_adds():
    """CuPy compiles every kernel with -ftz=true (float32 denormals flushed): CI compiles with it too,
    so the PTX it checks is the PTX a GPU runs (float32 arithmetic as .ftz instructions)."""
    assert "-ftz=true" in cuda.NVRTC_OPTIONS
    from cuda_checks import ptx_by_entry
    from tinyvit.kernels.cuda import gelu
    ptx = ptx_by_entry(gelu.SOURCE)["gelu_forward_f32"]
    assert ".ftz.f32" in ptx and ".ftz.f64" not in ptx


def test_one_raw_kernel_per_source_name_and_device(monkeypatch):
    """kernel(source, name) compiles a source once per device and makes one RawKernel per entry point
    and device, handed out again at every launch (not a new one per launch)."""
    made = []

    class Module:
        def __init__(self, source, device):
            self.source, self.device = source, device

        def get_function(self, name):
            made.append((self.source, name, self.device))
            return object()

    device = [0]
    monkeypatch.setattr(cuda, "_module", lambda source, device_id: Module(source, device_id))
    monkeypatch.setattr(cuda, "_current_device", lambda: device[0])
    monkeypatch.setattr(cuda, "_function", functools.lru_cache(maxsize=None)(cuda._function.__wrapped__))
    first = cuda.kernel("source a", "k_f32")
    assert cuda.kernel("source a", "k_f32") is first and made == [("source a", "k_f32", 0)]
    cuda.kernel("source a", "k_f64")
    cuda.kernel("source b", "k_f32")
    device[0] = 1
    assert cuda.kernel("source a", "k_f32") is not first
    assert len(made) == 4 and cuda.kernel("source a", "k_f32") is cuda.kernel("source a", "k_f32") and len(made) == 4


def test_the_gpu_extras_bring_the_cuda_headers():
    """CuPy 14 compiles every kernel, its own included, against the CUDA headers: the extras that
    install CuPy bring them too (CuPy's ctk extra: the CUDA toolkit's runtime with its headers, NVRTC,
    cuBLAS ... from PyPI), for CUDA 12 and for CUDA 13."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.fullmatch(r"cupy-cuda12x\[ctk\]>=14.*", r) for r in extras["gpu"]), extras["gpu"]
    assert any(re.fullmatch(r"cupy-cuda13x\[ctk\]>=14.*", r) for r in extras["gpu-cuda13"]), extras["gpu-cuda13"]


def test_a_broken_kernel_fails_to_compile():
    """The check can fail: a kernel with a type error is reported with NVRTC's log."""
    nvrtc = _nvrtc()
    broken = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_name; }'
    with pytest.raises(AssertionError, match="undefined_name"):
        compile_source(nvrtc, broken, "broken", cuda.SM_ARCHS[0])
