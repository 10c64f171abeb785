"""kernels/cuda/gelu.py (GELU, GELUTanh, the fused bias) against ops/activation.py's GELU and GELUTanh:
the output and every gradient, float64 and float32, with and without the bias, rows of H = 1, 7,
192, 1000 and 3072 in odd counts, 1-D, one-element and 0-d inputs, the far tails (-40, -8, 0, 8, 40).

Each equality test runs on the GPU (marked gpu; through the switchboard with use_kernels("all"))
and emulated on the CPU (the Python side against a NumPy emulation of the kernel, checked against
the CUDA source's parameters): see tests/test_kernels_cuda_layernorm.py, whose harness this file uses.

float32 tolerance: rtol 1e-5 and atol 2e-6 times the array's largest magnitude (at least 1), as for
the CPU kernel: the kernel's Phi is CUDA's erfcf (the reference: 1 + erf, both within a few float32
ulps of Phi, the kernel's more accurate in the left tail), so y = h Phi(h) may differ by ~2e-7 |h|
and dy/dh by ~3e-7 absolutely; near-zero outputs (y(-5) ~ -1e-6) need the absolute term.
"""
import math

import numpy as np
import pytest

import tinyvit.functional as F
from tinyvit.backend import to_numpy
from tinyvit.kernels import kernel_for, use_kernels
from tinyvit.kernels.cuda import gelu as k_gelu
from tinyvit.ops import activation

from kernel_checks import F64
from cuda_checks import assert_equal_results, cuda_signature, forward_backward_on, make_device_fixture, ptx_by_entry

OPS = ["gelu", "gelu_tanh"]   # the ops these tests cover (python -m tinyvit.kernels.cuda.record)

TOL = {np.float64: (F64["rtol"], F64["atol"]), np.float32: (1e-5, 2e-6)}
KERNEL = {"gelu": k_gelu.GELU, "gelu_tanh": k_gelu.GELUTanh}
REFERENCE = {"gelu": activation.GELU, "gelu_tanh": activation.GELUTanh}
APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}

# ---------------------------------------------------------------- the emulated kernel (NumPy)

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _exact(h):
    cdf = activation.normal_cdf(h)
    return h * cdf, cdf + h * np.exp(-0.5 * h * h) * h.dtype.type(_INV_SQRT_2PI)


def _tanh(h):
    with np.errstate(over="ignore", invalid="ignore"):
        t = np.tanh(_SQRT_2_OVER_PI * (h + 0.044715 * h * h * h))
        slope = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * h * h)
    return 0.5 * h * (1 + t), slope


def _emulator(formula):
    def emulate(a, grid, block):
        rows, cols = int(a.rows), int(a.cols)
        assert block == (k_gelu.THREADS, 1, 1), block
        assert grid[0] * block[0] >= cols > (grid[0] - 1) * block[0], f"grid {grid} for {cols} columns"
        assert 1 <= grid[1] <= rows and grid[2] == 1, f"grid {grid} for {rows} rows"
        h = a.x.reshape(rows, cols)
        if a.has_bias:
            h = h + a.bias.reshape(cols)
        y, slope = formula(h)
        a.y.reshape(rows, cols)[...] = y
        if a.want_slope:
            a.slope.reshape(rows, cols)[...] = slope
    return emulate


EMULATORS = {"gelu_forward": _emulator(_exact), "gelu_tanh_forward": _emulator(_tanh)}

device = make_device_fixture(k_gelu, EMULATORS)


def inputs(rng, shape):
    """N(0, 3^2) with the far tails and zero in it: -40, -8, 0, 8, 40 where they fit."""
    x = np.asarray(rng.standard_normal(shape) * 3)
    if x.ndim == 0:
        return x
    flat = x.reshape(-1)
    special = [-40.0, -8.0, 0.0, 8.0, 40.0][:flat.size]
    flat[:len(special)] = special
    return x


def gelu_kernel(device, name):
    """The kernel as users reach it: on the GPU F.gelu with use_kernels("all") (the switchboard must
    pick kernels/cuda's Function); emulated (NumPy arrays get the CPU kernel there), the Function."""
    if device.name == "emulated":
        return KERNEL[name].apply

    def through_the_switchboard(x):
        with use_kernels("all"):
            assert kernel_for(name, x) is KERNEL[name]
            return F.gelu(x, APPROXIMATE[name])
    return through_the_switchboard


def gelu_reference(name):
    def reference(x):
        with use_kernels(False):
            return F.gelu(x, APPROXIMATE[name])
    return reference


# ---------------------------------------------------------------- equal to the reference

SHAPES = [(3, 5, 192), (2, 17, 3072), (13, 1000), (9, 1), (1, 1, 7), (9,), (1, 1), ()]


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_equals_reference(device, name, dtype, shape):
    """The "gelu" and "gelu_tanh" kernels without a bias: y and dL/dx equal the reference's."""
    rng = np.random.default_rng(len(shape) + sum(shape))
    arrays, upstream = [inputs(rng, shape)], [rng.standard_normal(shape)]
    got = forward_backward_on(device.xp, gelu_kernel(device, name), arrays, upstream, dtype)
    want = forward_backward_on(device.xp, gelu_reference(name), arrays, upstream, dtype)
    assert_equal_results(got, want, TOL[dtype], ["x"])


@pytest.fixture
def few_blocks(monkeypatch):
    """A grid of about 4 blocks: each thread strides down many rows (its bias read once)."""
    monkeypatch.setattr(k_gelu, "TARGET_BLOCKS", 4)


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(3, 5, 192), (2, 17, 3072), (13, 1000), (9, 1), (1, 1, 7), (600, 7)])
@pytest.mark.parametrize("wants", [(1, 1), (1, 0), (0, 1)], ids=["both", "x", "bias"])
@pytest.mark.parametrize("blocks", ["default", "few"])
def test_gelu_with_bias_equals_reference_of_the_sum(device, request, name, dtype, shape, wants, blocks):
    """kernel(x, b) with the bias fused equals reference(x + b): the output, dL/dx and dL/db, also
    when only x or only b wants a gradient, with the default grid and with a few blocks striding
    down the rows."""
    if blocks == "few":
        request.getfixturevalue("few_blocks")
    rng = np.random.default_rng(shape[-1])
    reference = REFERENCE[name]
    arrays, upstream = [inputs(rng, shape), rng.standard_normal(shape[-1])], [rng.standard_normal(shape)]

    def summed(x, b):
        with use_kernels(False):
            return reference.apply(x + b)

    got = forward_backward_on(device.xp, KERNEL[name].apply, arrays, upstream, dtype, wants)
    want = forward_backward_on(device.xp, summed, arrays, upstream, dtype, wants)
    assert_equal_results(got, want, TOL[dtype], ["x", "bias"])


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gelu_takes_a_broadcast_upstream_gradient(device, name, dtype):
    """loss = sum(y): dL/dy arrives as a read-only broadcast of 1."""
    rng = np.random.default_rng(2)
    arrays = [inputs(rng, (7, 300)), rng.standard_normal(300)]
    got = forward_backward_on(device.xp, KERNEL[name].apply, arrays, ["sum"], dtype)
    want = forward_backward_on(device.xp, lambda x, b: REFERENCE[name].apply(x + b), arrays, ["sum"], dtype)
    assert_equal_results(got, want, TOL[dtype], ["x", "bias"])


def test_gelu_without_gradient_saves_nothing(device):
    """Under no gradient the forward kernel is told not to write dy/dh, and nothing is saved."""
    import tinyvit as tv
    x = tv.Tensor(device.xp.asarray(np.linspace(-3, 3, 12).reshape(3, 4)))
    y = KERNEL["gelu"].apply(x)
    want = REFERENCE["gelu"].apply(x)
    np.testing.assert_allclose(to_numpy(y.data), to_numpy(want.data), rtol=1e-12)
    assert y._ctx is None
    if device.emulation:
        assert device.emulation.arguments[-1]["want_slope"] == 0


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh"])
def test_gelu_float32_accuracy_against_float64_math(device, name):
    """The float32 kernel on a dense grid of [-10, 10] plus a bias against float64 math (math.erfc,
    or the tanh form): |y - truth| <= 1e-6 |h| and |dy/dh - truth| <= 4e-6 (CUDA's erfcf, expf and
    tanhf are within a few ulps; the tanh form's 1 - t^2 cancels where t nears -+1)."""
    if device.name == "emulated":
        pytest.skip("the accuracy of CUDA's float32 math functions: on a GPU only")
    import tinyvit as tv
    xp = device.xp
    x = np.linspace(-10, 10, 20_000).astype(np.float32).reshape(-1, 8)
    b = np.linspace(-0.5, 0.5, 8).astype(np.float32)
    h = (x + b).astype(np.float64)                    # the float32 sums the kernel computes, exactly
    if name == "gelu":
        cdf = 0.5 * np.vectorize(math.erfc)(-h / math.sqrt(2.0))
        slope = cdf + h * np.exp(-0.5 * h * h) / math.sqrt(2.0 * math.pi)
    else:
        t = np.tanh(_SQRT_2_OVER_PI * (h + 0.044715 * h ** 3))
        cdf = 0.5 * (1 + t)
        slope = cdf + 0.5 * h * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * h * h)
    xt, bt = tv.Tensor(xp.asarray(x), requires_grad=True), tv.Tensor(xp.asarray(b), requires_grad=True)
    y = KERNEL[name].apply(xt, bt)
    y.backward(xp.ones_like(xt.data))
    assert y.dtype == np.float32 and xt.grad.dtype == np.float32
    assert (np.abs(to_numpy(y.data) - h * cdf) <= 1e-6 * np.abs(h) + 1e-30).all()
    assert np.abs(to_numpy(xt.grad) - slope).max() <= 4e-6


def test_gelu_bias_must_fit_x(device):
    xp = device.xp
    x = xp.zeros((3, 4))
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        k_gelu.GELU.apply(x, xp.zeros(3))
    with pytest.raises(TypeError, match="bias is float32"):
        k_gelu.GELU.apply(x, xp.zeros(4, np.float32))


# ---------------------------------------------------------------- the Python side, on the CPU


@pytest.mark.parametrize("rows", [1, 7, 342, 343, 50_432, 10 ** 6])
@pytest.mark.parametrize("cols", [1, 7, 192, 256, 257, 3072, 5120, 10 ** 8])
def test_launch_covers_every_column_and_row(rows, cols):
    """A thread for every column, no block without one; 1 <= grid.y <= rows (each thread strides
    down the rows) within CUDA's limit; about TARGET_BLOCKS blocks when there are enough rows."""
    (gx, gy), (threads,) = k_gelu.launch(rows, cols)
    assert gx * threads >= cols > (gx - 1) * threads and threads <= 1024
    assert 1 <= gy <= min(rows, 65535)
    if gy < rows and gy < 65535:
        assert gx * gy >= k_gelu.TARGET_BLOCKS


def test_entry_points_for_float32_and_float64_only():
    for name in EMULATORS:
        f32 = cuda_signature(k_gelu.SOURCE, k_gelu.entry(name, np.float32))
        f64 = cuda_signature(k_gelu.SOURCE, k_gelu.entry(name, np.float64))
        assert [(t.replace("float", "double"), n) for t, n in f32] == f64
    with pytest.raises(TypeError, match="float32 or float64"):
        k_gelu.entry("gelu_forward", np.int32)


def test_float32_kernels_do_no_double_arithmetic():
    """The float32 entry points compile to PTX without an f64 instruction (every constant is cast)."""
    ptx = ptx_by_entry(k_gelu.SOURCE)
    assert set(ptx) == {k_gelu.entry(n, t) for n in EMULATORS for t in (np.float32, np.float64)}
    for name, code in ptx.items():
        if name.endswith("_f32"):
            assert ".f64" not in code, f"{name} computes in double"
