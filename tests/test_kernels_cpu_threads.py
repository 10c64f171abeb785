"""kernels/cpu/threads.py, the machinery the CPU kernels share: blocks of an array shared among threads
(for_each_block, row_blocks, flat_blocks), the threaded row helpers (add_row_vector_, column_sums,
binary_in_blocks), per-thread scratch arrays, the thread-count setting, and 64-byte-aligned arrays
(empty, empty_like, aligned_matmul), with the kernels' outputs that rely on them."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from tinyvit.kernels.cpu import attention as k_attention
from tinyvit.kernels.cpu import gelu as k_gelu
from tinyvit.kernels.cpu import layernorm as k_layernorm
from tinyvit.kernels.cpu import linear as k_linear
from tinyvit.kernels.cpu import threads

from kernel_checks import SMALL_BLOCK


# ---------------------------------------------------------------- blocks among threads


def test_for_each_block_shares_blocks_among_threads(num_threads):
    """With 2 threads, two blocks run at the same time (each waits at a barrier for the other: one
    thread alone would time out), every block runs once, and the results keep the blocks' order."""
    num_threads(2)
    barrier = threading.Barrier(2, timeout=10)
    ran = []

    def fn(block):
        if block < 2:
            barrier.wait()
        ran.append(block)
        return block * block

    assert threads.for_each_block(fn, list(range(9))) == [b * b for b in range(9)]
    assert sorted(ran) == list(range(9))


def test_for_each_block_nested_in_a_worker_runs_there(num_threads):
    """A kernel that runs blocks inside a block (nested for_each_block) neither deadlocks nor loses work."""
    num_threads(2)
    inner = lambda b: threads.for_each_block(lambda i: 10 * b + i, list(range(3)))  # noqa: E731
    assert threads.for_each_block(inner, list(range(4))) == [[10 * b + i for i in range(3)] for b in range(4)]


def test_num_threads_setting(num_threads, monkeypatch):
    """set_num_threads takes a positive int or None (then OPENBLAS_NUM_THREADS or OMP_NUM_THREADS
    decides, else the cores this process may use); anything else is a ValueError."""
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="positive number of threads"):
            num_threads(bad)
    num_threads(3)
    assert threads.get_num_threads() == 3
    num_threads(None)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "5")
    assert threads.get_num_threads() == 5
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert threads.get_num_threads() == 4
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.get_num_threads() >= 1


@pytest.mark.parametrize("threads_", [1, 2])
def test_threaded_row_helpers_match_numpy(num_threads, threads_):
    """The bias add, bias gradient and same-shape ufuncs that run in blocks of rows among the kernels'
    threads give NumPy's whole-array answers, for arrays of several blocks and a ragged last one."""
    num_threads(threads_)
    rng = np.random.default_rng(0)
    y = rng.standard_normal((3 * threads.BLOCK_ELEMENTS // 96 + 7, 96)).astype(np.float32)
    b = rng.standard_normal(96).astype(np.float32)
    z = rng.standard_normal(y.shape).astype(np.float32)
    np.testing.assert_array_equal(threads.add_row_vector_(y.copy(), b), y + b)
    np.testing.assert_allclose(threads.column_sums(y), y.astype(np.float64).sum(axis=0), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(threads.column_sums(y[:, 10:50]), y[:, 10:50].astype(np.float64).sum(axis=0),
                               rtol=1e-5, atol=1e-4)                 # some columns of a C-contiguous array
    np.testing.assert_array_equal(threads.binary_in_blocks(np.add, y, z), y + z)
    np.testing.assert_array_equal(threads.binary_in_blocks(np.multiply, y, z), y * z)
    small = y[:3]
    np.testing.assert_array_equal(threads.binary_in_blocks(np.add, small, small), small + small)
    tokens = y[:y.shape[0] // 48 * 48].reshape(-1, 48, 96)   # 85 samples: blocks of 28, a ragged last
    for pos in (z[:48][None], z[:48], z[:1]):          # (1, N, D), (N, D); (1, D) broadcasts too
        np.testing.assert_array_equal(threads.binary_in_blocks(np.add, tokens, pos), tokens + pos)


def test_blocks_cover_every_element_once_and_scratch(small_blocks):
    """row_blocks and flat_blocks cut an array into consecutive blocks of at most BLOCK_ELEMENTS
    elements (a whole row when a row is longer) that cover it exactly once; scratch hands a thread the
    same memory again for the same owner (shape and dtype of ``like``), and separate memory per owner."""
    for rows, length in [(7, 30), (5, 64), (3, 100), (1, 1), (0, 5)]:
        covered = np.zeros(rows, int)
        for r in threads.row_blocks(np.empty((rows, length))):
            covered[r] += 1
            assert len(covered[r]) * length <= max(SMALL_BLOCK, length)
        np.testing.assert_array_equal(covered, 1)
    covered = np.zeros(1000, int)
    for s in threads.flat_blocks(covered):
        covered[s] += 1
        assert len(covered[s]) <= SMALL_BLOCK
    np.testing.assert_array_equal(covered, 1)
    like = np.zeros((3, 5), np.float32)
    a, b = threads.scratch("test", 2, like)
    again, _ = threads.scratch("test", 2, like)
    (other,) = threads.scratch("test other", 1, like)
    assert a.shape == like.shape and a.dtype == np.float32 and np.shares_memory(a, again)
    assert not np.shares_memory(a, b) and not np.shares_memory(a, other)
    big = threads.scratch("test", 2, np.zeros(4 * SMALL_BLOCK))           # larger than a block: grows
    assert big[0].shape == (4 * SMALL_BLOCK,) and not np.shares_memory(big[0], big[1])


# ---------------------------------------------------------------- cache-line-aligned arrays


def is_aligned(a):
    return a.ctypes.data % threads.CACHE_LINE == 0


@pytest.mark.parametrize("shape,dtype", [((8320, 192), np.float32), ((3, 5, 7), np.float64), ((0, 4), np.float32),
                                         ((), np.float32), ((13,), np.int64)])
def test_empty_is_cache_line_aligned(shape, dtype):
    """threads.empty gives a writable array of the asked shape and dtype starting on a 64-byte line,
    whatever the offset malloc returned (several allocations, so that an aligned one by chance
    cannot pass for all), and threads.aligned_matmul a product in such an array."""
    arrays = [threads.empty(shape, dtype) for _ in range(8)]
    for a in arrays:
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        assert is_aligned(a) or a.size == 0
        a[...] = 1                                       # all of it is ours to write
    like = threads.empty_like(np.zeros((5, 3), np.float32))
    assert like.shape == (5, 3) and like.dtype == np.float32 and is_aligned(like)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((37, 11)), rng.standard_normal((11, 5))
    for _ in range(4):
        y = threads.aligned_matmul(x, w)
        assert is_aligned(y)
        np.testing.assert_array_equal(y, x @ w)
    y = threads.aligned_matmul(x.astype(np.float32), w.T.astype(np.float32).T)   # strided operand, float32 out
    assert y.dtype == np.float32 and is_aligned(y)


def test_hot_kernels_write_aligned_outputs(rng):
    """The element-wise kernels' outputs and the GEMM outputs they then update in place start on a
    cache line (a misaligned output made their stores straddle two lines: up to 3x slower). Four
    rounds, so that malloc's 16-byte alignment cannot pass by chance (1 in 4 per array)."""
    x = rng.standard_normal((4, 65, 48)).astype(np.float32)
    w, b = rng.standard_normal((48, 96)).astype(np.float32), rng.standard_normal(96).astype(np.float32)
    w_qkv, w_proj = rng.standard_normal((48, 144)).astype(np.float32), rng.standard_normal((48, 48)).astype(np.float32)
    for _ in range(4):
        outputs = {"linear": k_linear.Linear.apply(x, w, b), "gelu": k_gelu.GELU.apply(x),
                   "gelu with bias": k_gelu.GELU.apply(x, x[0, 0]), "gelu_tanh": k_gelu.GELUTanh.apply(x),
                   "layer_norm": k_layernorm.LayerNorm.apply(x, None, None, 1e-6)}
        outputs["add_layer_norm s"], outputs["add_layer_norm y"] = k_layernorm.add_layer_norm(x, x, None, None)
        outputs["attention"], outputs["attention weights"] = k_attention.MultiHeadAttention.apply(
            x, w_qkv, None, w_proj, None, 3, return_attention=True)
        for name, t in outputs.items():
            assert is_aligned(t.data), name


# ---------------------------------------------------------------- the same numbers on any thread count; process settings


def _grads_of(fn, arrays, upstream):
    import tinyvit as tv
    ts = [tv.Tensor(a, requires_grad=True) for a in arrays]
    y = fn(*ts)
    y.backward(upstream)
    return [y.numpy()] + [t.grad for t in ts]


@pytest.mark.parametrize("op", ["layer_norm", "gelu", "attention"])
def test_threads_give_the_same_numbers(op):
    """The kernels split their element-wise blocks among threads; each block is computed the same
    way, so the results must not depend on the thread count (several blocks per thread here)."""
    from tinyvit import functional as F
    rng = np.random.default_rng(0)
    b, n, d = 24, 65, 96                      # LayerNorm: 1560 rows of 96, several row blocks
    x = rng.standard_normal((b, n, d)).astype(np.float32)
    if op == "layer_norm":
        fn, arrays = (lambda x, w, c: F.layer_norm(x, w, c)), [x, rng.standard_normal(d).astype(np.float32),
                                                               rng.standard_normal(d).astype(np.float32)]
    elif op == "gelu":
        x = rng.standard_normal((b, n, 4 * d)).astype(np.float32) * 3
        fn, arrays = F.gelu, [x]
    else:
        w = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in ((d, 3 * d), (3 * d,), (d, d), (d,))]
        fn, arrays = (lambda *a: F.multi_head_attention(*a, num_heads=3)), [x, *w]
    upstream = rng.standard_normal(fn(*arrays).shape).astype(np.float32)
    before = threads._num_threads
    try:
        threads.set_num_threads(1)
        serial = _grads_of(fn, arrays, upstream)
        threads.set_num_threads(3)
        threaded = _grads_of(fn, arrays, upstream)
    finally:
        threads.set_num_threads(before)
    for s, t in zip(serial, threaded):
        np.testing.assert_array_equal(s, t)


def test_for_each_block_nested_and_ordered():
    before = threads._num_threads
    try:
        threads.set_num_threads(2)
        inner = lambda i: threads.for_each_block(lambda j: 10 * i + j, list(range(3)))   # noqa: E731
        assert threads.for_each_block(inner, list(range(5))) == [[10 * i + j for j in range(3)] for i in range(5)]
        with pytest.raises(ValueError):
            threads.set_num_threads(0)
    finally:
        threads.set_num_threads(before)


def test_retain_freed_memory_keeps_a_freed_array_resident():
    """After retain_freed_memory, a freed 64 MiB array stays in the process (glibc), where by default
    glibc unmaps it at once. Run in a child process: the setting is process-wide and irreversible."""
    import platform
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the setting applies to glibc's malloc only")
    child = """
import sys, numpy as np
from tinyvit.kernels.cpu.threads import retain_freed_memory
def resident_mib():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
if sys.argv[1] == 'retain':
    assert retain_freed_memory()
before = resident_mib()
a = np.ones(16 << 20, np.float32)   # 64 MiB, touched
del a
print(resident_mib() - before)
"""
    kept = {mode: float(subprocess.run([sys.executable, "-c", child, mode], capture_output=True, text=True,
                                       check=True).stdout) for mode in ("retain", "default")}
    assert kept["retain"] > 48, kept
    assert kept["default"] < 16, kept


def test_the_first_cpu_kernel_sets_openblas_thread_timeout_unless_set():
    """`import tinyvit` leaves OPENBLAS_THREAD_TIMEOUT alone and does not load the CPU kernels; the
    first CPU kernel the switchboard picks asks OpenBLAS's idle threads to sleep at once (4), and
    leaves a value the user set alone."""
    code = ("import os, sys, numpy as np, tinyvit, tinyvit.functional as F\n"
            "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'), 'tinyvit.kernels.cpu' in sys.modules)\n"
            "F.gelu(np.ones(3, np.float32))\n"
            "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'), 'tinyvit.kernels.cpu' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "False", "4", "True"]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OPENBLAS_THREAD_TIMEOUT": "28"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["28", "False", "28", "True"]
