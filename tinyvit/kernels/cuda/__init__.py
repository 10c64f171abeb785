"""CuPy kernels: CUDA C++ through cupy.RawModule, one op per file, each beside the reference op it
replaces (tinyvit/ops/) and with the same signature.

The layout of llm.c: the CUDA C++ of op <op> is kernels/cuda/<op>.cu, beside <op>.py, which holds
the docstring (shapes, formulas, thread layout), the launch arithmetic and the Functions; <op>.py
reads its .cu at import into SOURCE (load_source: device helpers the .cu files share, common.cuh,
spliced in where they #include it). CI has no GPU, but it compiles every SOURCE with NVRTC for
SM_ARCHS (tests/test_kernels_cuda_compile.py), so a kernel that does not compile fails CI, and runs
it on the CPU in an emulator (tests/cuda_emulator, tests/test_kernels_cuda_emulated.py). Whether a
kernel computes the right numbers on a GPU only a GPU can tell: its `pytest -m gpu` tests
(tests/test_kernels_cuda_*.py) compare it with the reference, and passed.json records where they
passed (GPU, CuPy and CUDA versions, commit, date; `python -m tinyvit.kernels.cuda.record` runs them
and writes it). The switchboard (tinyvit.kernels.kernel_for) runs a CUDA kernel only once
it is recorded there; `use_kernels("all")`, TINYVIT_KERNELS=all or `--kernels all` force the
unrecorded ones too, for testing them on a GPU. Until then CuPy arrays run the reference ops.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np

SM_ARCHS = ("sm_80", "sm_90")          # A100 and H100/H200: what CI compiles every kernel for
HERE = Path(__file__).resolve().parent
RECORD = HERE / "passed.json"
# What every kernel is compiled with, on a GPU and in CI. -ftz=true (float32 denormals flushed to zero)
# CuPy adds to every compilation itself (cupy/cuda/compiler.py, _compile_with_cache_cuda), its own
# element-wise kernels included; written here too so that CI compiles what a GPU runs (twice is harmless).
NVRTC_OPTIONS = ("--std=c++14", "-ftz=true")


_passed = None      # passed.json as read, once per process: the switchboard asks on every op


def passed_kernels() -> dict:
    """{op name: [where its GPU tests passed: {"gpu", "cupy", "cuda", "commit", "date"}, ...]} from
    passed.json; an op that is not there has not passed on any GPU yet. Read at the first call and
    kept (reading and parsing it per op cost 30 us, 1-2 ms a training step): reload_passed() reads it
    again, as the record command does after writing it. The dict is shared: do not change it."""
    global _passed
    if _passed is None:
        _passed = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    return _passed


def reload_passed() -> dict:
    """Read passed.json again (after it changed) and return what passed_kernels() now answers."""
    global _passed
    _passed = None
    return passed_kernels()


@functools.lru_cache(maxsize=None)
def _module(source: str, device_id: int):
    import cupy
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=source, options=NVRTC_OPTIONS)


@functools.lru_cache(maxsize=None)
def _function(source: str, name: str, device_id: int):
    return _module(source, device_id).get_function(name)


def _current_device() -> int:
    from cupy.cuda import runtime
    return runtime.getDevice()


def kernel(source: str, name: str):
    """The __global__ function ``name`` of ``source`` for the current GPU: compiled once per device,
    and one RawKernel per (source, name, device), kept (a launch looks it up; attributes set on it,
    such as max_dynamic_shared_size_bytes, stay set)."""
    return _function(source, name, _current_device())


_INCLUDE = re.compile(r'^#include "(\w+\.cuh)".*$', re.MULTILINE)


def load_source(filename: str) -> str:
    """The CUDA C++ of kernels/cuda/<filename> (e.g. "attention.cu"), each ``#include "<name>.cuh"``
    line replaced by that header's text (a file beside it), between #line directives so that
    compiler messages still name the file and line they come from.

    Spliced here rather than left to NVRTC's include path: CuPy caches compiled kernels by their
    source text and options, so a header NVRTC read from disk could change without the cache
    noticing. The spliced text is the whole program, for NVRTC, the emulator and the cache alike;
    the .cu files themselves still compile with nvcc, which finds the header beside them."""
    path = HERE / filename
    text = path.read_text()

    def splice(match):
        line = text.count("\n", 0, match.start()) + 1
        header = (HERE / match.group(1)).read_text()
        return f'#line 1 "{match.group(1)}"\n{header}\n#line {line + 1} "{filename}"'

    return f'#line 1 "{filename}"\n' + _INCLUDE.sub(splice, text)


_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}


def entry(name: str, dtype) -> str:
    """The extern "C" entry point of kernel ``name`` for ``dtype``: layer_norm_forward_f32, ...
    (each kernel is a C++ template with one entry point per dtype)."""
    suffix = _SUFFIX.get(np.dtype(dtype))
    if suffix is None:
        raise TypeError(f"{name}: the CUDA kernels take float32 or float64, got {np.dtype(dtype)}")
    return f"{name}_{suffix}"
