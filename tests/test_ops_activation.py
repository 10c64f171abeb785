"""erf, GELU (exact and tanh), softmax and log_softmax: accuracy, gradients, PyTorch parity, dtypes, errors.

These test the ops through tinyvit.functional on both paths (BOTH_PATHS): the reference ops of
tinyvit/ops/activation.py and the kernels the switchboard picks (kernels/cpu/gelu.py). The kernels'
own features (the fused bias, the float32 Phi polynomial, blocks and threads) are tested in
tests/test_kernels_cpu_gelu.py."""
import math

import numpy as np
import pytest

import tinyvit as tv
import tinyvit.functional as F
from tinyvit.backend import to_numpy
from tinyvit.ops.activation import erf

from helpers import assert_close, param, torch_parity

BOTH_PATHS = True   # every test runs with the kernels and with the reference ops (conftest.py)

SHAPES = [(7,), (3, 5), (2, 1, 5), (1, 3, 1), (2, 3, 4)]

_math_erf = np.vectorize(math.erf, otypes=[np.float64])
_math_erfc = np.vectorize(math.erfc, otypes=[np.float64])


# ---------------------------------------------------------------- references written out in NumPy


def gelu_reference(x, approximate):
    x = np.asarray(x, dtype=np.float64)
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    return x * 0.5 * (1.0 + _math_erf(x / math.sqrt(2.0)))


def softmax_reference(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax_reference(x, axis):
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


# ---------------------------------------------------------------- erf


def _erf_grid():
    tiny = np.geomspace(1e-300, 1.0, 3001)
    edges = [0.0, 0.46875, np.nextafter(0.46875, 1), np.nextafter(0.46875, 0), 4.0, 6.0,
             np.nextafter(6.0, 7), 26.5, 27.3]
    half = np.concatenate([np.linspace(0.0, 30.0, 60001), tiny, edges])
    return np.concatenate([half, -half])


def test_erf_float64_matches_math_erf_to_1e14_relative():
    x = _erf_grid()                                  # > 120,000 points: many of erf's blocks
    got, want = erf(x), _math_erf(x)
    assert got.dtype == np.float64 and got.shape == x.shape
    rel = np.abs(got - want) / np.maximum(np.abs(want), np.finfo(np.float64).tiny)
    worst = int(rel.argmax())
    assert rel[worst] < 1e-14, f"erf({x[worst]!r}) = {got[worst]!r}, math.erf gives {want[worst]!r}"


def test_erf_subnormal_inf_nan_and_odd_symmetry():
    x = np.array([5e-324, 1e-310, -1e-310, np.inf, -np.inf, np.nan, 40.0, -1e300])
    got = erf(x)
    np.testing.assert_array_equal(got[3:5], [1.0, -1.0])
    assert np.isnan(got[5])
    np.testing.assert_array_equal(got[6:], [1.0, -1.0])
    np.testing.assert_allclose(got[:3], _math_erf(x[:3]), rtol=1e-6, atol=1e-323)
    g = np.linspace(-8, 8, 1001)
    np.testing.assert_array_equal(erf(-g), -erf(g))


def test_erf_float32_stays_float32_and_is_accurate():
    x = np.concatenate([np.linspace(-30, 30, 40001), np.geomspace(1e-37, 1, 500),
                        -np.geomspace(1e-37, 1, 500)]).astype(np.float32)
    got = erf(x)
    assert got.dtype == np.float32
    want = _math_erf(x.astype(np.float64))      # erf of the float32 input values, exactly
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_erf_shapes_and_integer_input():
    x = np.random.default_rng(0).standard_normal((3, 1, 4))
    assert erf(x).shape == (3, 1, 4)
    assert erf(np.array(0.5)).shape == ()
    assert erf(np.array(0.5)) == pytest.approx(math.erf(0.5), rel=1e-15)
    ints = erf(np.arange(-3, 4))
    assert ints.dtype == np.float64
    np.testing.assert_allclose(ints, _math_erf(np.arange(-3.0, 4.0)), rtol=1e-15)
    x_t = np.asfortranarray(np.random.default_rng(1).standard_normal((5, 6)))[:, ::2]   # non-contiguous
    np.testing.assert_allclose(erf(x_t), _math_erf(x_t), rtol=1e-14)


def test_erf_on_backend(xp):
    x = np.linspace(-7, 7, 2001)
    for dtype, rtol in [(np.float64, 1e-14), (np.float32, 1e-6)]:
        got = erf(xp.asarray(x, dtype=dtype))
        assert type(got) is type(xp.asarray(x)) and got.dtype == dtype
        np.testing.assert_allclose(to_numpy(got), _math_erf(x.astype(dtype).astype(np.float64)), rtol=rtol,
                                   atol=1e-300)


# ---------------------------------------------------------------- GELU


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_forward_matches_numpy_reference(xp, rng, approximate):
    x = rng.standard_normal((4, 9)) * 3
    x[0, :5] = [-40.0, -8.0, 0.0, 8.0, 40.0]
    y = F.gelu(xp.asarray(x), approximate=approximate)
    assert_close(y, gelu_reference(x, approximate), rtol=1e-13, atol=1e-15, what=f"gelu {approximate}")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_gradcheck(xp, rng, shape, approximate):
    x = param(xp, rng, *shape, scale=2.0)
    tv.gradcheck(lambda t: F.gelu(t, approximate=approximate), [x])


def test_gelu_modes_differ_a_little():
    x = np.linspace(-4, 4, 101)
    exact, tanh = F.gelu(x).numpy(), F.gelu(x, approximate="tanh").numpy()
    assert 1e-5 < np.abs(exact - tanh).max() < 1e-3     # the tanh form is an approximation, not a copy


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float32, 1e-4)])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_torch_parity(torch, rng, dtype, rtol, approximate):
    x = rng.standard_normal((6, 17)) * 3
    torch_parity(torch, lambda t: F.gelu(t, approximate=approximate),
                 lambda t: torch.nn.functional.gelu(t, approximate=approximate), [x], dtype, rtol)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_far_tails_are_finite(approximate):
    x = tv.Tensor(np.array([-1e4, -50.0, 50.0, 1e4], dtype=np.float32), requires_grad=True)
    y = F.gelu(x, approximate=approximate)
    y.backward(np.ones(4, dtype=np.float32))
    np.testing.assert_allclose(y.numpy(), [0.0, 0.0, 50.0, 1e4], atol=1e-30)
    np.testing.assert_allclose(x.grad, [0.0, 0.0, 1.0, 1.0], atol=1e-30)


def test_gelu_float32_value_and_derivative_are_accurate():
    """y = x Phi(x) and dy/dx = Phi(x) + x phi(x) in float32 against float64 math.erfc, densely on [-10, 10]."""
    x = np.linspace(-10, 10, 400_001).astype(np.float32)
    x64 = x.astype(np.float64)
    cdf = 0.5 * _math_erfc(-x64 / math.sqrt(2.0))
    pdf = np.exp(-0.5 * x64 * x64) / math.sqrt(2.0 * math.pi)
    t = tv.Tensor(x, requires_grad=True)
    y = F.gelu(t)
    y.backward(np.ones_like(x))
    assert y.dtype == np.float32 and t.grad.dtype == np.float32
    assert (np.abs(y.numpy() - x64 * cdf) <= 2e-7 * np.abs(x64)).all()           # 1.3e-7 |x| measured
    assert np.abs(t.grad - (cdf + x64 * pdf)).max() < 3e-7                     # 1.6e-7 measured


# ---------------------------------------------------------------- softmax and log_softmax

OPS = [(F.softmax, softmax_reference, "softmax"), (F.log_softmax, log_softmax_reference, "log_softmax")]


@pytest.mark.parametrize("op,reference,torch_name", OPS)
@pytest.mark.parametrize("shape,axis", [((7,), -1), ((3, 5), -1), ((3, 5), 0), ((2, 1, 5), 1),
                                        ((2, 3, 4), 1), ((1, 3, 1), -1)])
def test_softmax_gradcheck(xp, rng, op, reference, torch_name, shape, axis):
    x = param(xp, rng, *shape, scale=2.0)
    tv.gradcheck(lambda t: op(t, axis=axis), [x])


@pytest.mark.parametrize("op,reference,torch_name", OPS)
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_forward_matches_numpy_reference(xp, rng, op, reference, torch_name, axis):
    x = rng.standard_normal((3, 4, 5)) * 4
    assert_close(op(xp.asarray(x), axis=axis), reference(x, axis), rtol=1e-12, atol=1e-15, what=torch_name)


def test_softmax_rows_sum_to_one(xp, rng):
    y = F.softmax(xp.asarray(rng.standard_normal((4, 6, 9))), axis=1)
    np.testing.assert_allclose(to_numpy(y.data).sum(axis=1), 1.0, rtol=1e-13)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float32, 1e-4)])
@pytest.mark.parametrize("op,reference,torch_name", OPS)
@pytest.mark.parametrize("axis", [-1, 1])
def test_softmax_torch_parity(torch, rng, dtype, rtol, op, reference, torch_name, axis):
    x = rng.standard_normal((4, 7, 5)) * 3
    torch_fn = getattr(torch.nn.functional, torch_name)
    torch_parity(torch, lambda t: op(t, axis=axis), lambda t: torch_fn(t, dim=axis), [x], dtype, rtol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op,reference,torch_name", OPS)
def test_softmax_huge_logits_stay_finite(xp, rng, dtype, op, reference, torch_name):
    x64 = rng.standard_normal((5, 8)) * 1e4
    x = tv.Tensor(xp.asarray(x64, dtype=dtype), requires_grad=True)
    y = op(x)
    y.backward(xp.asarray(rng.standard_normal((5, 8)), dtype=dtype))
    assert np.isfinite(to_numpy(y.data)).all() and np.isfinite(to_numpy(x.grad)).all()
    assert_close(y, reference(x64.astype(dtype).astype(np.float64), -1), rtol=1e-5, atol=1e-6, what=torch_name)


@pytest.mark.parametrize("fn", [F.softmax, F.log_softmax, F.gelu, lambda t: F.gelu(t, approximate="tanh")])
def test_float32_in_float32_out_and_gradient(xp, rng, fn):
    x = tv.Tensor(xp.asarray(rng.standard_normal((3, 4)), dtype=np.float32), requires_grad=True)
    y = fn(x)
    y.backward(xp.ones((3, 4), dtype=np.float32))
    assert y.dtype == np.float32 and x.grad.dtype == np.float32


def test_raw_arrays_give_tensors_without_grad():
    y = F.softmax(np.zeros((2, 4)))
    assert isinstance(y, tv.Tensor) and not y.requires_grad
    np.testing.assert_allclose(y.numpy(), 0.25)


# ---------------------------------------------------------------- bad input


def test_bad_input_errors():
    x = np.zeros((2, 3))
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh', got 'exact'"):
        F.gelu(x, approximate="exact")
    with pytest.raises(TypeError, match=r"gelu: x must be a floating-point array, got dtype int64"):
        F.gelu(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match=r"softmax: axis 2 is not an axis of an input of shape \(2, 3\)"):
        F.softmax(x, axis=2)
    with pytest.raises(ValueError, match=r"log_softmax: axis -3 is not an axis"):
        F.log_softmax(x, axis=-3)
    with pytest.raises(ValueError, match=r"softmax: axis None is not an axis"):
        F.softmax(x, axis=None)
    with pytest.raises(ValueError, match=r"at least one axis, got shape \(\)"):
        F.softmax(np.array(1.0))
    with pytest.raises(ValueError, match=r"axis 1 of shape \(2, 0\) is empty"):
        F.log_softmax(np.zeros((2, 0)))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_in_float16_gives_no_nan_where_float32_gives_none(approximate):
    """Exact GELU's erf (Cody's rational) and the tanh form's x^3 overflow float16 for |x| of a few
    units, which gave NaN; float16 is computed in float32 and rounded back: finite wherever float32
    is, and equal to the float32 result to float16 precision, forward and backward."""
    x = np.array([-60000, -300, -10, -4, -3.9, -1, -1e-3, 0, 1e-3, 1, 3.9, 4, 10, 300, 60000])
    results = {}
    for dtype in (np.float16, np.float32):
        t = tv.Tensor(x.astype(dtype), requires_grad=True)
        y = F.gelu(t, approximate)
        y.backward(np.ones(x.shape, dtype))
        assert y.dtype == dtype and t.grad.dtype == dtype
        results[dtype] = y.numpy().astype(np.float64), t.grad.astype(np.float64)
    for half, single in zip(results[np.float16], results[np.float32]):
        assert np.isfinite(half).all()
        np.testing.assert_allclose(half, single, rtol=1e-3, atol=1e-3)
