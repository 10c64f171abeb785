"""Run the CUDA C++ of a tinyvit/kernels/cuda/<op>.cu file (its module's SOURCE) on the CPU, on NumPy arrays.

build() compiles the module's SOURCE with g++ (C++20) against shim.h, which emulates the CUDA
features the kernels use: one std::thread per CUDA thread, the blocks of a grid one after another
and the threads of a block together, __syncthreads as a block barrier, warp shuffles through a
per-warp exchange, dynamic shared memory malloc'd at the launch's exact size and filled with NaN
bytes. Emulation.kernel stands in for tinyvit.kernels.cuda.kernel (what a module's launch helpers
call as kernel(SOURCE, entry(name, dtype))(grid, block, args, shared_mem=...)): its FakeKernel checks
what CuPy would pass to the GPU unchecked (each argument's type against the kernel's C parameter:
np.int32 for int, np.int64 for long long, np.float32 / np.float64 for float / double, a C-contiguous
array of the pointer's element type, or np.uintp(0) for NULL; grid and block limits; dynamic shared
memory beyond 48 KB only after opting in through max_dynamic_shared_size_bytes), then runs the
compiled kernel on the arrays' memory, and raises RuntimeError when the shim's checks found a
problem in the run: threads of a block waiting at different __syncthreads, lanes of a warp at
different shuffles, a full-mask shuffle after a lane exited (shim.h).

Arithmetic as on a GPU where it matters: multiply-adds fused wherever the compiler sees one (FLAGS,
when the CPU has FMA instructions; the GPU compiler fuses the same patterns, if not always the same
instances), float32 denormals flushed to zero (CuPy's -ftz=true). Not emulated (see shim.h): warp
scheduling and lockstep, the CUDA memory model, atomics, the last-ulp behaviour of the device math
functions. So a passing emulation proves the kernels' indexing, synchronisation structure and
arithmetic, with float64 to rounding and float32 to a few ulps of what a GPU computes; it does not
prove their speed, nor the absence of every race a real GPU might expose: a race changes a result
here only when the threads' timing happens to expose it, an out-of-bounds read only when what lies
there is not harmless.

Those two are what the sanitizer builds find every time: with TINYVIT_EMULATOR_SANITIZE=thread
(ThreadSanitizer: any two accesses of emulated threads, one a write, not ordered by a barrier or a
shuffle) or =address (AddressSanitizer: any access outside an array or the shared memory), build()
instruments the kernels. The runtime must be loaded first: run through sanitize.py (opt-in, slow;
tests/test_cuda_emulator_sanitizers.py, in CI, proves both catch their defect on one small case).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CXX = "g++"


def _cpu_has_fma() -> bool:
    """Whether this CPU has fused multiply-add instructions (x86: the fma flag; arm64 always has them)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    try:
        return any(line.startswith("flags") and " fma" in line for line in open("/proc/cpuinfo"))
    except OSError:
        return False


FMA = _cpu_has_fma()
# -fno-gnu-unique: each build keeps its own function statics (static __shared__ arrays), even when
# a mutated copy of a SOURCE is loaded beside the original.
# Contraction as on a GPU: NVRTC and ptxas fuse a * b + c into one FMA (exact product, one rounding)
# wherever the data flow allows, which changes results (a LayerNorm row of one element: g - mean(g)
# with g = gy * gamma came out as the product's rounding error, not 0). g++ does the same with
# -ffp-contract=fast (off under -std=c++20 by default) and FMA instructions (-mfma); -O3 unswitches
# loops on a flag as ptxas's input does (if (has_gamma) g *= gamma[i] becomes a loop of its own,
# where the product meets the subtraction). The _rn intrinsics stay unfused (shim.h).
FLAGS = ("-O3", "-std=c++20", "-pthread", "-shared", "-fPIC", "-fno-gnu-unique", "-ffp-contract=fast",
         *(("-mfma",) if FMA and platform.machine().lower() in ("x86_64", "amd64") else ()))
STATIC_SHARED_LIMIT = 48 * 1024
OPTIN_LIMIT = 166912                 # an A100's shared memory per block for kernels that opt in
C_POINTERS = {"float": np.float32, "double": np.float64, "long long": np.int64, "int": np.int32}
C_SCALARS = {"int": (np.int32, ctypes.c_int32), "long long": (np.int64, ctypes.c_int64),
             "float": (np.float32, ctypes.c_float), "double": (np.float64, ctypes.c_double)}
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)')
_EXTERN_SHARED = re.compile(r"extern\s+__shared__[^;\[]*?\b(\w+)\s*\[\s*\]\s*;")
_STATIC_SHARED = re.compile(r"(?<!extern )__shared__\s+([^;=]+?)\s+(\w+)\s*((?:\[[^\]]+\])+)\s*;")


def unavailable_reason() -> str | None:
    """Why kernels cannot be emulated here (no g++, or no C++20 <source_location>), or None."""
    if shutil.which(CXX) is None:
        return f"{CXX} not found"
    probe = subprocess.run([CXX, "-std=c++20", "-fsyntax-only", "-x", "c++", "-"], capture_output=True, text=True,
                           input="#include <source_location>\nauto here = std::source_location::current();\n",
                           check=False)
    if probe.returncode:
        return f"{CXX} has no C++20 <source_location>: {probe.stderr.strip()[:200]}"
    return None


def signatures(source: str) -> dict:
    """{entry name: [(C type, is pointer, parameter name), ...]} of the extern "C" __global__ functions
    (after the preprocessor, so macro-generated entry points count)."""
    expanded = subprocess.run([CXX, "-E", "-P", "-x", "c++", "-std=c++20", "-"], input=source, text=True,
                              capture_output=True, check=True).stdout
    found = {}
    for name, params in _KERNEL.findall(expanded):
        parsed = []
        for p in params.split(","):
            p = " ".join(p.replace("__restrict__", "").split())
            m = re.fullmatch(r"(?:const\s+)?([\w ]+?)\s*(\*)?\s*(?:const\s+)?(\w+)", p)
            assert m, f"{name}: cannot parse parameter {p!r}"
            parsed.append((m.group(1), m.group(2) is not None, m.group(3)))
        found[name] = parsed
    return found


def flushes_denormals(name: str, params) -> bool:
    """Whether entry point ``name`` runs with float32 denormals flushed (-ftz=true, which CuPy gives
    every kernel, affects float32 only): a float32 entry point, by its name (<kernel>_f32) or by
    parameters of type float and none of type double."""
    types = {t for t, _, _ in params}
    return name.endswith("_f32") or ("float" in types and "double" not in types)


def translate(source: str, sigs: dict) -> str:
    """SOURCE as host C++: shim.h first, extern __shared__ arrays on the launch's buffer, static ones
    registered (shim.h refills them with NaN bytes before each block), and one
    emu_<name>(grid, block, shared bytes, params...) launcher per entry point."""
    body = _EXTERN_SHARED.sub(lambda m: f"\n#define {m.group(1)} emu_shared_memory\n", source)
    body = _STATIC_SHARED.sub(lambda m: f"static {m.group(1)} {m.group(2)}{m.group(3)}; static const bool emu_"
                              f"registered_{m.group(2)} = emu_register_shared({m.group(2)}, sizeof {m.group(2)});",
                              body)
    launchers = []
    for name, params in sigs.items():
        decl = "".join(f", {t}{'*' if ptr else ''} {n}" for t, ptr, n in params)
        args = "".join(f", {n}" for _, _, n in params)
        launchers.append(
            f'extern "C" const char* emu_{name}(unsigned emu_gx, unsigned emu_gy, unsigned emu_gz, unsigned emu_bx, '
            f"unsigned emu_by, unsigned emu_bz, size_t emu_shared{decl}) {{\n"
            f"    return emu_launch(&{name}, dim3(emu_gx, emu_gy, emu_gz), dim3(emu_bx, emu_by, emu_bz), "
            f"emu_shared, {'true' if flushes_denormals(name, params) else 'false'}{args});\n}}")
    return '#include "shim.h"\n' + body + "\n" + "\n".join(launchers) + "\n"


# TINYVIT_EMULATOR_SANITIZE=thread or =address: builds instrumented by ThreadSanitizer (data races
# between the emulated threads: a missing __syncthreads) or AddressSanitizer (reads and writes out of
# an array's or the shared memory's bounds). Their runtime must be in the process from its start:
# run the tests through `python tests/cuda_emulator/sanitize.py thread|address [pytest arguments]`.
SANITIZERS = {"thread": "__tsan_init", "address": "__asan_init"}


def sanitizer() -> str | None:
    """The sanitizer TINYVIT_EMULATOR_SANITIZE asks for ("thread", "address"), or None."""
    name = os.environ.get("TINYVIT_EMULATOR_SANITIZE", "").strip().lower()
    if name in ("", "0", "off", "none"):
        return None
    if name not in SANITIZERS:
        raise ValueError(f"TINYVIT_EMULATOR_SANITIZE={name!r}: expected one of {sorted(SANITIZERS)}")
    return name


def sanitizer_flags(name: str | None) -> tuple:
    """g++ flags of a build instrumented by sanitizer ``name``; refuses when its runtime is not loaded."""
    if name is None:
        return ()
    try:
        getattr(ctypes.CDLL(None), SANITIZERS[name])
    except AttributeError:
        raise RuntimeError(f"TINYVIT_EMULATOR_SANITIZE={name}: the {name} sanitizer's runtime is not loaded in "
                           f"this process; run `python tests/cuda_emulator/sanitize.py {name} [pytest arguments]`"
                           ) from None
    # the plain build's -O3 kept: the same arithmetic (fused multiply-adds), with or without a sanitizer
    return ("-g", "-fno-omit-frame-pointer", f"-fsanitize={name}")


def build(source: str, build_dir, extra_flags=()) -> Library:
    """Compile source (cached in build_dir by a hash of the translated code and flags), instrumented
    by the sanitizer TINYVIT_EMULATOR_SANITIZE names, if any."""
    sigs = signatures(source)
    code = translate(source, sigs)
    flags = [*FLAGS, *sanitizer_flags(sanitizer()), *extra_flags]
    key = hashlib.sha1((code + " ".join(flags) + (HERE / "shim.h").read_text()).encode()).hexdigest()[:16]
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    lib = build_dir / f"{key}.so"
    if not lib.exists():
        cpp = build_dir / f"{key}.cpp"
        cpp.write_text(code)
        done = subprocess.run([CXX, *flags, f"-I{HERE}", str(cpp), "-o", str(lib) + ".tmp"],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"g++ failed on the translated SOURCE ({cpp}):\n{done.stderr[-4000:]}")
        Path(str(lib) + ".tmp").rename(lib)
    return Library(ctypes.CDLL(str(lib)), sigs, source)


class Library:
    """A compiled SOURCE: its launchers and the entry points' signatures."""

    def __init__(self, cdll, sigs, source):
        self.cdll, self.signatures, self.source = cdll, sigs, source


class FakeKernel:
    """What tinyvit.kernels.cuda.kernel returns (a cupy.RawKernel), run on the CPU."""

    def __init__(self, library, name, log):
        object.__setattr__(self, "max_dynamic_shared_size_bytes", STATIC_SHARED_LIMIT)
        self.name, self.params, self.log = name, library.signatures[name], log
        self.function = getattr(library.cdll, f"emu_{name}")
        self.function.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_size_t] + [
            ctypes.c_void_p if ptr else C_SCALARS[t][1] for t, ptr, _ in self.params]
        self.function.restype = ctypes.c_char_p        # the first problem a check found, or NULL

    def __setattr__(self, key, value):
        if key == "max_dynamic_shared_size_bytes" and value > OPTIN_LIMIT:
            raise RuntimeError(f"{self.name}: {value} bytes of shared memory, beyond the device's opt-in limit")
        object.__setattr__(self, key, value)

    def __call__(self, grid, block, args, shared_mem=0):
        name = self.name
        assert isinstance(args, tuple), f"{name}: RawKernel args must be a tuple"
        grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        assert all(isinstance(g, int) and g >= 1 for g in grid + block), f"{name}: grid {grid}, block {block}"
        assert grid[0] < 2 ** 31 and grid[1] <= 65535 and grid[2] <= 65535, f"{name}: grid {grid}"
        assert block[0] * block[1] * block[2] <= 1024 and block[2] <= 64, f"{name}: block {block}"
        assert shared_mem <= self.max_dynamic_shared_size_bytes, \
            f"{name}: {shared_mem} bytes of dynamic shared memory without opting in"
        assert len(args) == len(self.params), f"{name}: {len(args)} arguments for {len(self.params)} parameters"
        values = []
        for a, (t, ptr, pname) in zip(args, self.params):
            if ptr:
                if isinstance(a, np.uintp) and a == 0:
                    values.append(None)
                    continue
                assert isinstance(a, np.ndarray), f"{name}({pname}): {type(a).__name__} for {t}*"
                if t in C_POINTERS:              # a struct pointer (optim's table) takes raw words
                    assert a.dtype == C_POINTERS[t], f"{name}({pname}): {a.dtype} array for {t}*"
                assert a.flags.c_contiguous, f"{name}({pname}): not C-contiguous"
                values.append(a.ctypes.data)
            else:
                assert type(a) is C_SCALARS[t][0], f"{name}({pname}): {type(a).__name__} for {t}"
                values.append(a.item())
        self.log.append((name, grid, block, shared_mem))
        problem = self.function(*grid, *block, shared_mem, *values)
        if problem:
            raise RuntimeError(f"{name}: {problem.decode()}")


class Emulation:
    """A stand-in for tinyvit.kernels.cuda.kernel serving one compiled SOURCE; log lists the launches."""

    def __init__(self, library):
        self.library, self.log, self._kernels = library, [], {}

    def kernel(self, source, name):
        assert source == self.library.source, "kernel() called with another SOURCE than the one built"
        if name not in self._kernels:
            assert name in self.library.signatures, f"no extern \"C\" __global__ {name} in SOURCE"
            self._kernels[name] = FakeKernel(self.library, name, self.log)
        return self._kernels[name]


def _nan_empty(shape, dtype=float, order="C"):
    out = np.empty(shape, dtype, order)
    if out.dtype.kind == "f":
        out.fill(np.nan)
    return out


def _nan_empty_like(a, dtype=None, order="K", subok=True, shape=None):
    out = np.empty_like(a, dtype, order, subok, shape)
    if out.dtype.kind == "f":
        out.fill(np.nan)
    return out


# NumPy whose empty() / empty_like() are NaN-filled: an output element no kernel writes shows up.
# Give it to a module as its get_array_module's answer.
nan_numpy = types.SimpleNamespace(**{k: getattr(np, k) for k in dir(np) if not k.startswith("__")})
nan_numpy.empty, nan_numpy.empty_like = _nan_empty, _nan_empty_like
