"""NumPy's BLAS threads, set at run time: make OpenBLAS's idle worker threads sleep at once after
each matrix product, whatever the order in which NumPy and tinyvit were imported.

Why: OpenBLAS's pthreads server (driver/others/blas_server.c, blas_thread_server) keeps each idle
worker spinning on sched_yield() for `thread_timeout` TSC cycles (default 2^28, ~0.1 s) before it
sleeps on a condition variable. Between two GEMMs the ops run their element-wise blocks on
tinyvit's own threads (threads.for_each_block), and the spinning worker holds a core they need:
on 2 cores a vit-cifar/4 training step took ~0.57 s with the default and ~0.46 s with
OPENBLAS_THREAD_TIMEOUT=4 (2^4 cycles: sleep at once).

How: OpenBLAS reads OPENBLAS_THREAD_TIMEOUT once, in its load-time constructor (memory.c,
gotoblas_init -> openblas_read_env, driver/others/openblas_env.c), into a static that
openblas_thread_timeout() returns; blas_thread_init (blas_server.c) copies it into the server's
static `thread_timeout` when it starts the workers, which it also does at load. Neither static is
exported, but three functions are, in every pthreads build since 0.2.x (also the scipy-openblas
wheels NumPy bundles, whose public API alone is renamed scipy_*64_): so, with the variable in the
environment (os.environ reaches the C getenv through putenv),

    openblas_read_env()        re-reads the environment into openblas_env.c's statics;
    blas_thread_shutdown_()    joins the workers (what OpenBLAS's own pthread_atfork handler does);
    blas_thread_init()         starts them again, and now reads the new timeout.

The restart takes a few milliseconds and leaves the thread counts alone (blas_num_threads and the
openblas_set_num_threads setting are kept). It must not run while another thread is inside a BLAS
call (the shutdown would wait forever for a worker that is busy), so call configure_blas_threads()
where nothing else runs: at import (tinyvit.kernels.cpu) and at the start of a command.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

# The value tinyvit wants: 2^4 TSC cycles, the smallest OpenBLAS accepts (it clamps to 4..30).
DEFAULT_THREAD_TIMEOUT = 4
ENV = "OPENBLAS_THREAD_TIMEOUT"

# What configure_blas_threads did (it returns one of these strings).
APPLIED = "applied"              # restarted at least one OpenBLAS's threads with the timeout
ALREADY = "already"              # every OpenBLAS loaded already had it (read when it loaded, or done before)
NO_OPENBLAS = "no-openblas"      # no OpenBLAS in this process (MKL, Accelerate, BLIS...): nothing to do
UNSUPPORTED = "unsupported"      # an OpenBLAS without the pthreads server or the functions, or Windows

# Exported names, tried in order: plain OpenBLAS, then the scipy-openblas builds (scipy_ prefix,
# 64_ / _64 suffix on the public API only; the internal functions keep their names).
_GET_PARALLEL = ("openblas_get_parallel", "openblas_get_parallel64_", "scipy_openblas_get_parallel64_",
                 "scipy_openblas_get_parallel_64_", "scipy_openblas_get_parallel")
_THREAD_TIMEOUT = ("openblas_thread_timeout",)
_READ_ENV = ("openblas_read_env",)
_SHUTDOWN = ("blas_thread_shutdown_", "blas_thread_shutdown")
_INIT = ("blas_thread_init",)

_PTHREADS = 1                    # openblas_get_parallel(): 0 sequential, 1 pthreads, 2 OpenMP

_lock = threading.Lock()


def _loaded_library_paths() -> list[str]:
    """Paths of the shared libraries loaded in this process (Linux: /proc/self/maps; macOS: dyld);
    an empty list where neither can be read."""
    if sys.platform == "darwin":
        try:
            libc = ctypes.CDLL(None)
            libc._dyld_image_count.restype = ctypes.c_uint32
            libc._dyld_get_image_name.restype = ctypes.c_char_p
            libc._dyld_get_image_name.argtypes = [ctypes.c_uint32]
            names = (libc._dyld_get_image_name(i) for i in range(libc._dyld_image_count()))
            return [n.decode(errors="replace") for n in names if n]
        except (OSError, AttributeError):
            return []
    try:
        with open("/proc/self/maps") as maps:
            fields = (line.split(None, 5) for line in maps)
            return list(dict.fromkeys(f[5].strip() for f in fields if len(f) == 6 and f[5].startswith("/")))
    except OSError:
        return []


def openblas_library_paths() -> list[str]:
    """The OpenBLAS libraries this process has loaded (NumPy's, and SciPy's if imported): the
    loaded libraries whose file name contains "openblas"."""
    return [p for p in _loaded_library_paths() if "openblas" in os.path.basename(p).lower()]


def _function(lib, names, restype=ctypes.c_int):
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, []
            return fn
    return None


def open_loaded(path):
    """A handle on an already loaded library (RTLD_NOLOAD: never loads a second copy), or None."""
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
    try:
        return ctypes.CDLL(path, mode=mode)
    except OSError:
        return None


def _wanted_timeout(timeout) -> int:
    if timeout is None:
        value = os.environ.get(ENV, "").strip()
        timeout = int(value) if value.isdigit() and int(value) > 0 else DEFAULT_THREAD_TIMEOUT
    if not isinstance(timeout, int) or isinstance(timeout, bool) or not 1 <= timeout <= 30:
        raise ValueError(f"configure_blas_threads: timeout must be an int in 1..30 (log2 of the "
                         f"cycles an idle OpenBLAS thread spins), got {timeout!r}")
    return timeout


def thread_timeouts() -> dict:
    """{path: the OPENBLAS_THREAD_TIMEOUT each loaded OpenBLAS has read (0: none, the built-in
    2^28 cycles)}; the libraries without openblas_thread_timeout are left out."""
    found = {}
    for path in openblas_library_paths():
        lib = open_loaded(path)
        get = lib is not None and _function(lib, _THREAD_TIMEOUT, ctypes.c_uint)
        if get:
            found[path] = int(get())
    return found


def configure_blas_threads(timeout: int | None = None) -> str:
    """Make the idle threads of every loaded OpenBLAS spin at most 2^timeout cycles before they sleep,
    as OPENBLAS_THREAD_TIMEOUT=timeout set before NumPy's import would have. timeout: by default the
    OPENBLAS_THREAD_TIMEOUT in os.environ (a value the user set wins), else 4; it is also written
    there (children inherit it). Returns APPLIED ("applied": threads restarted), ALREADY ("already":
    nothing to change; so calling again is free), NO_OPENBLAS ("no-openblas": NumPy uses another
    BLAS) or UNSUPPORTED ("unsupported": OpenMP or single-threaded OpenBLAS, missing functions,
    Windows). Never raises for the library it finds. Call it only while no other thread is inside a
    BLAS call (at import, at the start of a command): it restarts OpenBLAS's worker threads."""
    timeout = _wanted_timeout(timeout)
    if sys.platform.startswith("win"):       # blas_server_win32.c: another server, not this mechanism
        return UNSUPPORTED
    paths = openblas_library_paths()
    if not paths:
        return NO_OPENBLAS
    with _lock:
        os.environ[ENV] = str(timeout)       # putenv: what openblas_read_env's getenv sees
        outcome = UNSUPPORTED
        for path in paths:
            lib = open_loaded(path)
            if lib is None:
                continue
            get_parallel = _function(lib, _GET_PARALLEL)
            get_timeout = _function(lib, _THREAD_TIMEOUT, ctypes.c_uint)
            read_env = _function(lib, _READ_ENV, None)
            shutdown, init = _function(lib, _SHUTDOWN), _function(lib, _INIT)
            if None in (get_parallel, get_timeout, read_env, shutdown, init) or get_parallel() != _PTHREADS:
                continue
            if get_timeout() == timeout:
                outcome = ALREADY if outcome != APPLIED else outcome
                continue
            read_env()                       # openblas_env.c's statics, from the environment now
            shutdown()                       # join the workers...
            init()                           # ...and start them again: they take the new timeout
            outcome = APPLIED if get_timeout() == timeout else outcome
        return outcome
