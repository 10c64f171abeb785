"""kernels/cuda/layernorm.py (LayerNorm, AddLayerNorm) against ops/norm.py's LayerNorm: the output and
every gradient, float64 and float32, rows of D = 192, 768, 1000, 1 and 7 in counts that are not a
multiple of a block's rows, without scale or shift, with a gradient through one output only.

Each equality test runs twice (the ``device`` fixture):
  gpu        the CUDA kernels on CuPy arrays, through the switchboard with use_kernels("all"),
             against the reference with use_kernels(False); marked ``gpu`` (pytest -m gpu), skipped
             without a CUDA device. `python -m tinyvit.kernels.cuda.record` runs these and records
             the ops below (OPS) in kernels/cuda/passed.json when they pass.
  emulated   on the CPU: the same Functions on NumPy arrays, each kernel launch replaced by a NumPy
             emulation of that kernel (EMULATORS) that first checks the launch against the CUDA
             source: the entry point exists, every argument has the type of its parameter (pointers:
             C-contiguous arrays of the kernel's dtype; int, long long, float, double: np.int32,
             np.int64, np.float32, np.float64) and the grid covers the data. This proves the Python
             side (shapes, dtypes, argument order, launch configuration, what is saved); only a GPU
             can prove the CUDA C++.

float32 tolerance: rtol 1e-5 and atol 1e-5 times the array's largest magnitude (at least 1), as for
the CPU kernel: the kernel sums each row in its own order (per lane, then across the warp), and
dL/dgamma, dL/dbeta in chunks of rows, so each element rounds differently by a few ulps.

The harness (cuda_signature, Emulation, the device fixture, forward_backward_on) is tests/cuda_checks.py,
shared with the other CUDA kernels' tests.
"""
import re

import numpy as np
import pytest

import tinyvit as tv
import tinyvit.functional as F
from tinyvit.backend import to_numpy
from tinyvit.kernels import kernel_for, use_kernels
from tinyvit.kernels.cuda import layernorm as k_layernorm
from tinyvit.ops import norm

from cuda_checks import (Emulation, assert_equal_results, cuda_signature, forward_backward_on,
                         make_device_fixture, ptx_by_entry)
from kernel_checks import F64

OPS = ["layer_norm"]          # the ops these tests cover (python -m tinyvit.kernels.cuda.record)

TOL = {np.float64: (F64["rtol"], F64["atol"]), np.float32: (1e-5, 1e-5)}

# ================================================================ the emulated kernels (NumPy)


def _emulate_forward(a, grid, block):
    rows, d = int(a.rows), int(a.d)
    assert block[0] % 32 == 0 and block[1] == block[2] == 1, f"one warp per row: block {block}"
    assert grid[0] * (block[0] // 32) >= rows > (grid[0] - 1) * (block[0] // 32), f"grid {grid} for {rows} rows"
    x = a.x.reshape(rows, d)
    s = x + a.branch.reshape(rows, d) if a.has_branch else x
    if a.has_branch:
        a.s.reshape(rows, d)[...] = s
    mean = s.sum(axis=1) / s.dtype.type(d)
    c = s - mean[:, None]
    rstd = 1 / np.sqrt((c * c).sum(axis=1) / s.dtype.type(d) + a.eps)
    y = c * rstd[:, None]
    if a.has_gamma:
        y = y * a.gamma.reshape(d)
    if a.has_beta:
        y = y + a.beta.reshape(d)
    a.y.reshape(rows, d)[...] = y
    a.mean.reshape(rows)[...] = mean
    a.rstd.reshape(rows)[...] = rstd


def _x_hat(a, rows, d):
    return (a.x.reshape(rows, d) - a.mean.reshape(rows, 1)) * a.rstd.reshape(rows, 1)


def _emulate_backward_dx(a, grid, block):
    rows, d = int(a.rows), int(a.d)
    assert block[0] % 32 == 0 and grid[0] * (block[0] // 32) >= rows
    gy, x_hat = a.gy.reshape(rows, d), _x_hat(a, rows, d)
    g = gy * a.gamma.reshape(d) if a.has_gamma else gy
    dx = a.rstd.reshape(rows, 1) * (g - g.mean(axis=1, keepdims=True) - x_hat * (g * x_hat).mean(axis=1, keepdims=True))
    if a.has_gs:
        dx = dx + a.gs.reshape(rows, d)
    a.dx.reshape(rows, d)[...] = dx


def _emulate_param_grads(a, grid, block):
    rows, d, per_chunk = int(a.rows), int(a.d), int(a.rows_per_chunk)
    chunks = grid[1]
    assert block == (k_layernorm.COLUMN_TILE, k_layernorm.COLUMN_LANES, 1), block
    assert grid[0] * block[0] >= d > (grid[0] - 1) * block[0], f"grid {grid} for {d} columns"
    assert chunks * per_chunk >= rows > (chunks - 1) * per_chunk, f"{chunks} chunks of {per_chunk} for {rows} rows"
    gy, x_hat = a.gy.reshape(rows, d), _x_hat(a, rows, d)
    for c in range(chunks):
        r = slice(c * per_chunk, (c + 1) * per_chunk)
        if a.need_gamma:
            a.part_gamma.reshape(-1, d)[c] = (gy[r] * x_hat[r]).sum(axis=0)
        if a.need_beta:
            a.part_beta.reshape(-1, d)[c] = gy[r].sum(axis=0)


def _emulate_sum_chunks(a, grid, block):
    chunks, d = int(a.chunks), int(a.d)
    assert grid[0] * block[0] >= d
    a.out.reshape(d)[...] = a.part.reshape(chunks, d).sum(axis=0)


EMULATORS = {"layer_norm_forward": _emulate_forward, "layer_norm_backward_dx": _emulate_backward_dx,
             "layer_norm_param_grads": _emulate_param_grads, "sum_chunks": _emulate_sum_chunks}

device = make_device_fixture(k_layernorm, EMULATORS)

# ================================================================ LayerNorm

# (rows..., D): D = 192 (ViT-Ti), 768 (ViT-B) over 394 rows (7 chunks of rows for dgamma), 1000 (not
# a multiple of 32), 1 (x_hat = 0) and 7 (fewer elements than lanes); row counts 15, 394, 13, 9, 1.
LN_SHAPES = [(3, 5, 192), (2, 197, 768), (13, 1000), (9, 1), (1, 1, 7)]
AFFINE = ["random", "none", "unit", "gamma", "beta"]


def affine(kind, rng, d):
    gamma, beta = rng.standard_normal(d), rng.standard_normal(d)
    return {"random": (gamma, beta), "none": (None, None), "unit": (np.ones(d), np.zeros(d)),
            "gamma": (gamma, None), "beta": (None, beta)}[kind]


def layer_norm_kernel(device, eps=1e-6):
    """The kernel as users reach it: on the GPU through F.layer_norm with use_kernels("all") (the
    switchboard must pick kernels/cuda's LayerNorm); emulated, the Function itself (the switchboard
    gives NumPy arrays the CPU kernel)."""
    if device.name == "emulated":
        return lambda x, g, b: k_layernorm.LayerNorm.apply(x, g, b, eps)

    def through_the_switchboard(x, g, b):
        with use_kernels("all"):
            assert kernel_for("layer_norm", x, g, b) is k_layernorm.LayerNorm
            return F.layer_norm(x, g, b, eps)
    return through_the_switchboard


def layer_norm_reference(x, g, b, eps=1e-6):
    with use_kernels(False):
        return F.layer_norm(x, g, b, eps)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", LN_SHAPES)
@pytest.mark.parametrize("kind,wants", [(kind, wants) for kind in AFFINE for wants in ("all", "x", "params")
                                        if (kind, wants) != ("none", "params")])   # none: no parameters
def test_layer_norm_equals_reference(device, dtype, shape, kind, wants):
    """The "layer_norm" kernel: y and dL/dx, dL/dgamma, dL/dbeta equal the reference's, for every
    combination of scale and shift, inputs far from zero mean (2 N(0, 1) + 3: a one-pass variance
    would cancel), and gradients wanted for all inputs, x only or the parameters only."""
    rng = np.random.default_rng(shape[-1] + len(kind))
    arrays = [rng.standard_normal(shape) * 2 + 3, *affine(kind, rng, shape[-1])]
    wants = {"all": (1, 1, 1), "x": (1, 0, 0), "params": (0, 1, 1)}[wants]
    upstream = [rng.standard_normal(shape)]
    got = forward_backward_on(device.xp, layer_norm_kernel(device), arrays, upstream, dtype, wants)
    want = forward_backward_on(device.xp, layer_norm_reference, arrays, upstream, dtype, wants)
    assert_equal_results(got, want, TOL[dtype], ["x", "gamma", "beta"])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_layer_norm_takes_a_broadcast_upstream_gradient(device, dtype):
    """loss = sum(y): dL/dy arrives as a read-only broadcast of 1 (zero strides), which the kernel
    must make contiguous before reading it row by row."""
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((6, 200)) * 2 + 1, rng.standard_normal(200), rng.standard_normal(200)]
    got = forward_backward_on(device.xp, layer_norm_kernel(device), arrays, ["sum"], dtype)
    want = forward_backward_on(device.xp, layer_norm_reference, arrays, ["sum"], dtype)
    assert_equal_results(got, want, TOL[dtype], ["x", "gamma", "beta"])


@pytest.fixture
def small_chunks(monkeypatch):
    """dL/dgamma and dL/dbeta summed over many short chunks of rows: chunks of at least 3 rows, at
    most 5 chunks (100 rows: 5 chunks of 20; 13 rows: 3 chunks of 4 and a ragged last one of 1)."""
    monkeypatch.setattr(k_layernorm, "MIN_ROWS_PER_CHUNK", 3)
    monkeypatch.setattr(k_layernorm, "MAX_CHUNKS", 5)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(100, 33), (13, 7)])
def test_layer_norm_parameter_gradients_over_many_chunks(device, small_chunks, dtype, shape):
    """dL/dgamma and dL/dbeta, summed chunk by chunk (the second kernel adds the chunks' partial
    sums), equal the reference's with ragged chunks and a column count that is not a multiple of 32."""
    rng = np.random.default_rng(shape[0])
    arrays = [rng.standard_normal(shape) + 1, rng.standard_normal(shape[-1]), rng.standard_normal(shape[-1])]
    upstream = [rng.standard_normal(shape)]
    got = forward_backward_on(device.xp, layer_norm_kernel(device), arrays, upstream, dtype)
    want = forward_backward_on(device.xp, layer_norm_reference, arrays, upstream, dtype)
    assert_equal_results(got, want, TOL[dtype], ["x", "gamma", "beta"])
    if device.emulation:
        assert ("layer_norm_param_grads_" + {np.float64: "f64", np.float32: "f32"}[dtype],
                ((shape[-1] + 31) // 32, k_layernorm.column_chunks(shape[0])[0], 1),
                (32, k_layernorm.COLUMN_LANES, 1)) in device.emulation.launches


def test_layer_norm_parameter_gradients_are_deterministic(device):
    """Two backward passes of the same numbers give the same bits (no atomics: fixed summation order)."""
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((2, 197, 768)), rng.standard_normal(768), rng.standard_normal(768)]
    upstream = [rng.standard_normal((2, 197, 768))]
    first = forward_backward_on(device.xp, layer_norm_kernel(device), arrays, upstream, np.float32)
    second = forward_backward_on(device.xp, layer_norm_kernel(device), arrays, upstream, np.float32)
    for a, b in zip(first[0] + first[1], second[0] + second[1]):
        np.testing.assert_array_equal(a, b)


def test_layer_norm_of_no_rows_launches_nothing(device):
    """x of shape (0, 8): an empty y, an empty dL/dx and zero dL/dgamma, dL/dbeta, no kernel launched
    (CUDA refuses a grid of 0 blocks)."""
    xp = device.xp
    x = tv.Tensor(xp.zeros((0, 8)), requires_grad=True)
    g, b = tv.Tensor(xp.ones(8), requires_grad=True), tv.Tensor(xp.zeros(8), requires_grad=True)
    y = k_layernorm.LayerNorm.apply(x, g, b, 1e-6)
    y.backward(xp.zeros((0, 8)))
    assert y.shape == (0, 8) and x.grad.shape == (0, 8)
    np.testing.assert_array_equal(to_numpy(g.grad), np.zeros(8))
    np.testing.assert_array_equal(to_numpy(b.grad), np.zeros(8))
    if device.emulation:
        assert device.emulation.launches == []


# ================================================================ AddLayerNorm: residual add + LayerNorm


def add_then_layer_norm(x, branch, gamma, beta):
    """The reference: s = x + branch, y = LayerNorm(s) (ops/norm.py)."""
    with use_kernels(False):
        s = x + branch
        return s, norm.LayerNorm.apply(s, gamma, beta, 1e-6)


def add_layer_norm_kernel(x, branch, gamma, beta):
    return k_layernorm.AddLayerNorm.apply(x, branch, gamma, beta, 1e-6)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(3, 5, 192), (13, 1000), (9, 1), (2, 197, 768)])
@pytest.mark.parametrize("kind", ["random", "none", "unit"])
@pytest.mark.parametrize("used", ["both", "s", "y"])
def test_add_layer_norm_equals_add_then_layer_norm(device, dtype, shape, kind, used):
    """AddLayerNorm: s, y and every input's gradient equal x + branch followed by the reference
    LayerNorm, with an upstream gradient on both outputs or on only one (the other receives None),
    with and without scale and shift."""
    rng = np.random.default_rng(len(kind) + shape[-1])
    arrays = [rng.standard_normal(shape) * 2 + 1, rng.standard_normal(shape), *affine(kind, rng, shape[-1])]
    gs, gy = rng.standard_normal(shape), rng.standard_normal(shape)
    upstream = [gs if used != "y" else None, gy if used != "s" else None]
    got = forward_backward_on(device.xp, add_layer_norm_kernel, arrays, upstream, dtype)
    want = forward_backward_on(device.xp, add_then_layer_norm, arrays, upstream, dtype)
    assert_equal_results(got, want, TOL[dtype], ["x", "branch", "gamma", "beta"])


@pytest.mark.parametrize("wants", [(1, 0, 1, 1), (0, 1, 0, 0), (0, 0, 1, 1)], ids=["x-params", "branch", "params"])
def test_add_layer_norm_some_inputs_constant(device, wants):
    """Gradients for x but not branch (or the reverse), or for the parameters only."""
    rng = np.random.default_rng(7)
    shape = (5, 7, 192)
    arrays = [rng.standard_normal(shape), rng.standard_normal(shape), rng.standard_normal(192), rng.standard_normal(192)]
    upstream = [rng.standard_normal(shape), rng.standard_normal(shape)]
    got = forward_backward_on(device.xp, add_layer_norm_kernel, arrays, upstream, np.float64, wants)
    want = forward_backward_on(device.xp, add_then_layer_norm, arrays, upstream, np.float64, wants)
    assert_equal_results(got, want, TOL[np.float64], ["x", "branch", "gamma", "beta"])


def test_add_layer_norm_rejects_mismatched_shapes_and_dtypes(device):
    xp = device.xp
    x = xp.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="branch must have x's shape"):
        k_layernorm.AddLayerNorm.apply(x, xp.zeros((2, 1, 4)), None, None, 1e-6)
    with pytest.raises(TypeError, match="one dtype"):
        k_layernorm.AddLayerNorm.apply(x, x.astype(np.float32), None, None, 1e-6)


# ================================================================ the Python side, on the CPU


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 63, 64, 65, 394, 16_383, 16_385, 50_432, 10 ** 7])
def test_launch_configurations_cover_every_row_once(rows):
    """row_launch: a warp for every row and no block without one; column_chunks: at most MAX_CHUNKS
    non-empty chunks of at least MIN_ROWS_PER_CHUNK rows (or one), covering the rows exactly."""
    (blocks,), (threads,) = k_layernorm.row_launch(rows)
    warps = threads // 32
    assert threads % 32 == 0 and threads <= 1024 and blocks * warps >= rows > (blocks - 1) * warps
    chunks, per_chunk = k_layernorm.column_chunks(rows)
    assert 1 <= chunks <= k_layernorm.MAX_CHUNKS and chunks * per_chunk >= rows > (chunks - 1) * per_chunk
    assert per_chunk >= min(rows, k_layernorm.MIN_ROWS_PER_CHUNK)
    for d in (1, 7, 32, 33, 768, 1000):
        grid, block, c, p = k_layernorm.column_launch(rows, d)
        assert (c, p) == (chunks, per_chunk) and grid[1] == chunks <= 65535
        assert grid[0] * block[0] >= d > (grid[0] - 1) * block[0] and block[0] * block[1] <= 1024
    (sum_blocks,), (sum_threads,) = k_layernorm.sum_chunks_launch(rows)
    assert sum_blocks * sum_threads >= rows > (sum_blocks - 1) * sum_threads


def test_source_constants_match_the_python_side():
    """The CUDA source's COLUMN_LANES (the shared tile's height) is the Python side's."""
    (value,) = re.findall(r"#define COLUMN_LANES (\d+)", k_layernorm.SOURCE)
    assert int(value) == k_layernorm.COLUMN_LANES


def test_entry_points_for_float32_and_float64_only():
    """Every kernel has an f32 and an f64 entry point with the same parameters (but the dtype);
    other dtypes are refused before anything launches."""
    for name in EMULATORS:
        f32 = cuda_signature(k_layernorm.SOURCE, k_layernorm.entry(name, np.float32))
        f64 = cuda_signature(k_layernorm.SOURCE, k_layernorm.entry(name, np.float64))
        assert [(t.replace("float", "double"), n) for t, n in f32] == f64
    with pytest.raises(TypeError, match="float32 or float64"):
        k_layernorm.entry("layer_norm_forward", np.float16)


def test_float32_kernels_do_no_double_arithmetic():
    """The float32 entry points compile to PTX without a single f64 instruction: no constant or
    function silently promotes float32 arithmetic to double (64x slower on most GPUs)."""
    ptx = ptx_by_entry(k_layernorm.SOURCE)
    assert set(ptx) == {k_layernorm.entry(n, t) for n in EMULATORS for t in (np.float32, np.float64)}
    for name, code in ptx.items():
        if name.endswith("_f32"):
            assert ".f64" not in code, f"{name} computes in double"


def test_the_harness_catches_a_wrong_argument():
    """The emulated launch rejects a missing argument, a Python int where the kernel takes an int
    (CuPy would pass it as a 64-bit long long, and the kernel would read garbage) and an array of
    the wrong dtype."""
    emulation = Emulation(k_layernorm, EMULATORS)
    part, out = np.zeros((3, 4), np.float32), np.zeros(4, np.float32)
    with pytest.raises(AssertionError, match="3 arguments for 4 parameters"):
        emulation("sum_chunks", np.float32, (1,), (256,), [part, out, np.int32(3)])
    with pytest.raises(AssertionError, match=r"sum_chunks_f32\(chunks\): int for int"):
        emulation("sum_chunks", np.float32, (1,), (256,), [part, out, 3, np.int32(4)])
    with pytest.raises(AssertionError, match=r"sum_chunks_f32\(part\): float64 array for const float"):
        emulation("sum_chunks", np.float32, (1,), (256,), [part.astype(np.float64), out, np.int32(3), np.int32(4)])
    emulation("sum_chunks", np.float32, (1,), (256,), [part + 1, out, np.int32(3), np.int32(4)])
    np.testing.assert_array_equal(out, 3.0)
