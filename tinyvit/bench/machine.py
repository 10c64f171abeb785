"""The machine a benchmark runs on, as its record keeps it: the CPU and its cores, the GPU, the
versions of NumPy, PyTorch and CuPy, NumPy's BLAS (and, for OpenBLAS, its thread count, set through
ctypes), the git commit of the code being measured, and the date in UTC.

Nothing here imports PyTorch or CuPy: their versions come from the installed packages' metadata, so
that PyTorch's thread settings can still be chosen before it loads (see step.passive_torch_threads).
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

# Environment variables that change how the BLAS and OpenMP threads behave; the record lists those set.
# OPENBLAS_THREAD_TIMEOUT=4 makes OpenBLAS's idle threads sleep at once instead of spinning ~0.1 s after
# each call, which frees the cores for tinyvit's own element-wise threads (read when NumPy loads).
THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
              "MKL_NUM_THREADS", "GOMP_SPINCOUNT", "TINYVIT_KERNELS")


# ====================================================================== CPU, GPU, versions


def cpu_name() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) Processor"), as lscpu shows it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_threads() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def physical_cores() -> int | None:
    """Distinct (package, core) pairs in /proc/cpuinfo: cores without their hyper-threads (Linux)."""
    cores, package = set(), None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "physical id":
                    package = value.strip()
                elif key.strip() == "core id":
                    cores.add((package, value.strip()))
    except OSError:
        return None
    return len(cores) or None


def gpu_names(device: str = "cpu") -> list | None:
    """The GPUs' names: CuPy's for a run on a CUDA device; otherwise what nvidia-smi lists (without
    starting CUDA in this process), or None where there is no NVIDIA driver."""
    if device != "cpu":
        from .. import backend
        cp = backend.cupy_module()
        return [cp.cuda.runtime.getDeviceProperties(i)["name"].decode()
                for i in range(cp.cuda.runtime.getDeviceCount())]
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else None


def package_version(module: str) -> str | None:
    """The installed version of the distribution that provides ``module`` ("torch", "cupy": CuPy's
    wheels are named cupy-cuda12x and so on), read from its metadata, never by importing it; None if
    it is not installed."""
    if module in sys.modules and hasattr(sys.modules[module], "__version__"):
        return str(sys.modules[module].__version__)
    names = importlib.metadata.packages_distributions().get(module, [module])
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


# ====================================================================== NumPy's BLAS

_SET = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
        "openblas_set_num_threads")
_GET = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads", "openblas_get_num_threads64_",
        "openblas_get_num_threads")
_CORE = ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
         "openblas_get_corename")


def openblas_libraries() -> list:
    """The OpenBLAS libraries NumPy loaded, as ctypes.CDLL handles (none where NumPy uses another
    BLAS); found as kernels/cpu/blas.py finds them, without ever loading a second copy."""
    from ..kernels.cpu.blas import open_loaded, openblas_library_paths
    return [lib for lib in map(open_loaded, openblas_library_paths()) if lib is not None]


def _openblas_functions():
    """(set_num_threads, get_num_threads, get_corename) of the OpenBLAS that NumPy loaded, or None
    (another BLAS, or another system)."""
    for lib in openblas_libraries():
        found = [next((getattr(lib, n) for n in names if hasattr(lib, n)), None) for names in (_SET, _GET, _CORE)]
        if found[0] is not None and found[1] is not None:
            if found[2] is not None:
                found[2].restype = ctypes.c_char_p
            return found
    return None


def blas_info() -> str:
    """'OpenBLAS <core>' (the kernels OpenBLAS picked for this CPU) or the name of NumPy's BLAS."""
    fns = _openblas_functions()
    if fns and fns[2] is not None:
        return f"OpenBLAS {fns[2]().decode()}"
    return numpy_build().get("blas", {}).get("name", "unknown")


def numpy_build() -> dict:
    """NumPy's BLAS and LAPACK (name, version, configuration) and its SIMD extensions, from
    numpy.show_config(mode="dicts") (NumPy >= 2; {} before)."""
    try:
        config = np.show_config(mode="dicts")
    except TypeError:                              # NumPy 1.x: no mode, prints instead
        return {}
    keep = ("name", "version", "openblas configuration")
    out = {lib: {k: v for k, v in info.items() if k in keep}
           for lib, info in config.get("Build Dependencies", {}).items() if lib in ("blas", "lapack")}
    simd = config.get("SIMD Extensions", {})
    out["simd"] = {"baseline": simd.get("baseline"), "found": simd.get("found")}
    return out


@contextlib.contextmanager
def blas_threads(n: int):
    """Run NumPy's matrix products on ``n`` threads inside the block (OpenBLAS, through ctypes);
    yields the thread count in effect, or None where it cannot be set (then it is unchanged)."""
    fns = _openblas_functions()
    if fns is None:
        yield None
        return
    set_threads, get_threads, _ = fns
    previous = get_threads()
    set_threads(int(n))
    try:
        yield get_threads()
    finally:
        set_threads(previous)


# ====================================================================== the code and the date


def _git_dir(start: Path) -> Path | None:
    for folder in (start, *start.parents):
        dot_git = folder / ".git"
        if dot_git.is_dir():
            return dot_git
        if dot_git.is_file():                      # a worktree: "gitdir: <path>"
            text = dot_git.read_text().strip()
            if text.startswith("gitdir:"):
                return (folder / text[len("gitdir:"):].strip()).resolve()
    return None


def git_commit(path=None) -> str | None:
    """The commit checked out in the git repository that holds ``path`` (default: this tinyvit's
    source), read from the .git folder without running git; None outside a checkout. It names HEAD
    only: uncommitted changes in the working tree are not detected. TINYVIT_COMMIT, when set, is
    taken instead (a copy of the tree whose .git is not its own, as on a borrowed GPU machine)."""
    if os.environ.get("TINYVIT_COMMIT"):
        return os.environ["TINYVIT_COMMIT"]
    git = _git_dir(Path(path or Path(__file__).resolve().parent))
    if git is None:
        return None
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head or None                    # a detached HEAD holds the commit itself
        ref = head[len("ref:"):].strip()
        common = git / (git / "commondir").read_text().strip() if (git / "commondir").is_file() else git
        for folder in (git, common):
            if (folder / ref).is_file():
                return (folder / ref).read_text().strip()
        packed = common / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
    except OSError:
        pass
    return None


def utc_now() -> str:
    """The time now in UTC, ISO 8601 to the second: '2026-05-09T07:35:25+00:00'."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def loadavg() -> float | None:
    """The one-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def describe(device: str = "cpu") -> dict:
    """The machine part of a benchmark record."""
    return {
        "cpu": cpu_name(), "cpu_count": os.cpu_count(), "cpu_physical_cores": physical_cores(),
        "cpu_threads_available": default_threads(), "gpus": gpu_names(device), "os": platform.platform(),
        "python": platform.python_version(), "numpy": np.__version__, "torch": package_version("torch"),
        "cupy": package_version("cupy"), "blas": blas_info(), "numpy_build": numpy_build(),
        "env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
    }
