"""The machinery the CPU kernels share: a thread pool that runs independent cache-sized blocks of an
array in parallel, per-thread scratch arrays, 64-byte-aligned arrays, and the malloc setting that
keeps freed memory for the next step. None of it is in the reference ops (tinyvit/ops/); every
kernel that uses it is tested equal to its reference (tests/test_kernels_cpu_*.py; the machinery
itself: tests/test_kernels_cpu_threads.py)."""
from __future__ import annotations

import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ...backend import get_array_module

# ---------------------------------------------------------------- cache blocking and threads (NumPy)

# An element-wise formula of several steps (GELU's erf, LayerNorm, softmax) makes one temporary per
# step. On whole (B*N, D) arrays each temporary streams through main memory; evaluated on blocks of
# BLOCK_ELEMENTS elements (512 KiB of float32) the temporaries stay in the CPU cache and only the
# inputs and outputs travel. The blocks are independent, so they are also shared among threads:
# NumPy runs each call on one core but releases the GIL inside it, so two threads each looping over
# their own blocks do run at the same time (blocks this large keep the GIL hand-overs rare).
# On CuPy there is one block, the whole array: each step is a GPU kernel either way.
BLOCK_ELEMENTS = 1 << 17

_num_threads = None                # None: one per CPU core this process may use
_pool, _pool_size = None, 0        # the worker threads, started on first use
_local = threading.local()         # .worker is True in a worker thread
_pool_lock = threading.Lock()


def _forget_pool():                # a forked child has none of its parent's threads
    global _pool, _pool_size
    _pool, _pool_size = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def get_num_threads() -> int:
    """Threads the element-wise blocks are shared among (NumPy; BLAS has its own setting). Unless
    set_num_threads says otherwise: OPENBLAS_NUM_THREADS or OMP_NUM_THREADS when set (the numbers
    NumPy's BLAS follows), else one per CPU core this process may use."""
    if _num_threads is not None:
        return _num_threads
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:         # not Linux
        return os.cpu_count() or 1


def set_num_threads(n):
    """Share the element-wise blocks among n threads (None: one per available core). Returns the
    setting it replaces, to restore later."""
    global _num_threads
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"set_num_threads: need a positive number of threads or None, got {n!r}")
    previous, _num_threads = _num_threads, n
    return previous


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def retain_freed_memory() -> bool:
    """Ask the C library's malloc to keep freed memory for the next allocation instead of giving it
    back to the operating system. Training allocates and frees the same large arrays every step
    (activations, gradients); by default glibc serves each one above 128 KiB-32 MiB from a fresh
    mmap and unmaps it on free, so every step pays the page faults of touching new memory again
    (measured: ~10% of a vit-cifar/4 step on the CPU). Process-wide and irreversible: the process
    keeps its peak memory. Returns False, changing nothing, where malloc is not glibc's.
    `tinyvit train` (and pretrain, finetune) and `tinyvit bench` call it; a library user may."""
    import ctypes
    import platform
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)                  # large blocks from the heap, not mmap
                and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)  # never shrink the heap on free
                and mallopt(_M_TOP_PAD, 64 << 20))        # and grow it 64 MiB at a time


def _run_in_worker(work):
    _local.worker = True           # a worker never waits on the pool: blocks nested in fn run serially
    work()


def for_each_block(fn, blocks) -> list:
    """[fn(b) for b in blocks], computed by get_num_threads() threads (the calling thread is one)
    that each take the next block not yet taken, so a thread slowed by other work on its core just
    does fewer blocks. fn must only write what its block owns; results keep the order of blocks."""
    global _pool, _pool_size
    n = min(get_num_threads(), len(blocks))
    if n <= 1 or getattr(_local, "worker", False):
        return [fn(b) for b in blocks]
    with _pool_lock:
        if _pool is None or _pool_size < n - 1:
            _pool_size = max(n, os.cpu_count() or 1) - 1  # threads start only when work needs them
            _pool = ThreadPoolExecutor(max_workers=_pool_size, thread_name_prefix="tinyvit")
        pool = _pool
    results = [None] * len(blocks)
    tickets = itertools.count()                           # next() on it is atomic: one block per ticket

    def work():
        while (i := next(tickets)) < len(blocks):
            results[i] = fn(blocks[i])

    others = [pool.submit(_run_in_worker, work) for _ in range(n - 1)]
    work()
    for future in others:
        future.result()
    return results


def row_blocks(x2):
    """Slices of consecutive rows of the 2-D array x2, about BLOCK_ELEMENTS elements each
    (a single slice of all rows on CuPy)."""
    rows, length = x2.shape
    if get_array_module(x2) is not np:
        return [slice(None)]
    step = max(1, BLOCK_ELEMENTS // max(1, length))
    return [slice(start, start + step) for start in range(0, max(rows, 1), step)]


def flat_blocks(x1):
    """Slices of consecutive elements of the 1-D array x1, BLOCK_ELEMENTS each (a single slice of
    all on CuPy)."""
    if get_array_module(x1) is not np:
        return [slice(None)]
    return [slice(start, start + BLOCK_ELEMENTS) for start in range(0, x1.size, BLOCK_ELEMENTS)]


def add_row_vector_(y2, b):
    """y2 += b for y2: (R, O) and b: (O,), in place (a layer's bias), in blocks of rows shared among
    the threads on NumPy: a single whole-array add would leave the other cores idle."""
    if get_array_module(y2) is not np:
        y2 += b
        return y2
    for_each_block(lambda r: np.add(y2[r], b, out=y2[r]), row_blocks(y2))
    return y2


def column_sums(g2):
    """The sum over the rows of g2: (R, O) -> (O,) (a bias's gradient). On NumPy, for a g2 whose rows
    are contiguous (C-contiguous, or some columns of such an array), the BLAS product ones(R) @ g2:
    one threaded pass with no temporary, each column summed in one thread, so the result does not
    depend on the number of threads (measured: half the time of NumPy's axis-0 sum on (8320, 576)
    float32, a third on 192 of those columns, and closer to the float64 sum)."""
    if get_array_module(g2) is not np:
        return g2.sum(axis=0)
    if g2.ndim != 2 or g2.dtype.kind != "f" or g2.strides[1] != g2.itemsize or g2.strides[0] % g2.itemsize:
        return g2.sum(axis=0)
    return np.ones(g2.shape[0], dtype=g2.dtype) @ g2


def binary_in_blocks(ufunc, a, b):
    """ufunc(a, b) (np.add, np.multiply) of two large NumPy arrays of one shape and dtype, both
    C-contiguous, block by block among the threads into a cache-line-aligned array (GELU's backward).
    Anything else, CuPy included, as a plain ufunc(a, b)."""
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
            and a.shape == b.shape and a.flags.c_contiguous and b.flags.c_contiguous and a.size > BLOCK_ELEMENTS):
        return ufunc(a, b)
    out = empty_like(a)
    a1, b1, o1 = a.reshape(-1), b.reshape(-1), out.reshape(-1)
    for_each_block(lambda s: ufunc(a1[s], b1[s], out=o1[s]), flat_blocks(o1))
    return out


# A fresh temporary of a block's size (512 KiB) is often a new mmap whose pages fault in when first
# written, which can triple the cost of the pass that fills it; the hot kernels (GELU, LayerNorm)
# instead reuse a few block-sized arrays that each thread keeps for the next block.
_scratch = threading.local()


def scratch(owner: str, count: int, like) -> list:
    """``count`` arrays of the shape and dtype of the array ``like``, the calling thread's own and
    kept for its next call with the same ``owner``: temporaries for one block of a kernel, to fill
    with out=. Their contents are garbage, and the next call with this owner in this thread hands
    out the same memory again. Fresh arrays on CuPy, whose memory pool already reuses memory."""
    if get_array_module(like) is not np:
        return [get_array_module(like).empty_like(like) for _ in range(count)]
    store = _scratch.__dict__.setdefault("buffers", {})
    key = (owner, like.dtype)
    buffer = store.get(key)
    if buffer is None or buffer.shape[0] < count or buffer.shape[1] < like.size:
        rows, length = (count, BLOCK_ELEMENTS) if buffer is None else buffer.shape
        buffer = store[key] = empty((max(rows, count), max(length, like.size)), like.dtype)
    return [buffer[i, :like.size].reshape(like.shape) for i in range(count)]


# ---------------------------------------------------------------- cache-line-aligned arrays (NumPy)

# glibc's malloc aligns to 16 bytes, so a large NumPy array usually starts in the middle of a 64-byte
# cache line, and then every 64-byte (AVX-512) store into it straddles two lines. In the memory-bound
# passes of the element-wise kernels that made writing such an array up to 3x slower (measured: an
# (8320, 192) float32 add, one thread: 3.4 ms into a misaligned output, 1.1 ms into an aligned one;
# a vit-cifar/4 training step on 2 threads ~3% faster with the hot arrays aligned). PyTorch's CPU
# allocator aligns to 64 bytes for the same reason.
CACHE_LINE = 64


def empty(shape: tuple, dtype, xp=np):
    """An uninitialised array of ``shape`` (a tuple) and ``dtype`` whose data starts on a 64-byte
    cache-line boundary on NumPy (xp.empty on CuPy, whose allocations are aligned further already):
    the outputs of the hot kernels, so that their stores never straddle two cache lines."""
    if xp is not np:
        return xp.empty(shape, dtype=dtype)
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + CACHE_LINE, dtype=np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def empty_like(a):
    """empty(a.shape, a.dtype), in a's array module: a cache-line-aligned array like a."""
    return empty(a.shape, a.dtype, get_array_module(a))


def aligned_matmul(a, b):
    """a @ b for 2-D a (M, K) and b (K, N), written into a cache-line-aligned (M, N) array (see empty):
    the GEMMs whose outputs the element-wise kernels then read and write in place."""
    xp = get_array_module(a, b)
    return xp.matmul(a, b, out=empty((a.shape[0], b.shape[1]), xp.result_type(a, b), xp))
