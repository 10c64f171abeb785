"""kernels/cpu/gelu.py (GELU, GELUTanh, the fused bias, PHI_TANH32) against ops/activation.py's GELU and
GELUTanh: outputs and every gradient, float64 and float32, many small blocks, 1 and 2 threads (the
shared helpers and the meta-test are in test_kernels_cpu.py).

float32 tolerance: rtol 1e-5 and atol 2e-6 times the array's largest magnitude (at least 1). In
float32 the exact kernel takes Phi from a fitted tanh polynomial (PHI_TANH32, absolute error ~1e-7)
where the reference evaluates Cody's erf in float32 (~1e-7 too), so y = x Phi(x) may differ by
~2e-7 |x| and dy/dx by ~3e-7 absolutely: near-zero outputs (y(-5) ~ -1e-6) differ relatively by far
more than 1e-5, hence the absolute term. float64 runs the same erf on both paths: rtol 1e-12.
"""
import math

import numpy as np
import pytest

import tinyvit as tv
from tinyvit.kernels.cpu import gelu as k_gelu
from tinyvit.ops import activation

from helpers import param, torch_parity
from kernel_checks import F64, assert_kernel_equals_reference, cpu_kernel

TOL = {np.float64: (F64["rtol"], F64["atol"]), np.float32: (1e-5, 2e-6)}
REFERENCE = {"gelu": activation.GELU, "gelu_tanh": activation.GELUTanh}

# rows of 24 (two per block of 64) and an odd count, rows of 100 (longer than a block), 1-D, one
# element, a 0-d array
SHAPES = [(7, 5, 24), (3, 100), (9,), (1, 1), ()]

_math_erfc = np.vectorize(math.erfc, otypes=[np.float64])


def inputs(rng, shape):
    """N(0, 3^2) with the far tails and zero in it: -40, -8, 0, 8, 40 where they fit."""
    x = np.asarray(rng.standard_normal(shape) * 3)
    if x.ndim == 0:
        return x
    flat = x.reshape(-1)
    special = [-40.0, -8.0, 0.0, 8.0, 40.0][:flat.size]
    flat[:len(special)] = special
    return x


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_equals_reference(small_blocks, name, dtype, shape):
    """The "gelu" and "gelu_tanh" kernels without a bias: y and dL/dx equal the reference's."""
    rng = np.random.default_rng(len(shape) + sum(shape))
    assert_kernel_equals_reference(cpu_kernel(name).apply, REFERENCE[name].apply, [inputs(rng, shape)],
                                   [rng.standard_normal(shape)], dtype, TOL[dtype], names=["x"])


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", SHAPES[:3])
@pytest.mark.parametrize("wants", [(1, 1), (1, 0), (0, 1)], ids=["both", "x", "bias"])
def test_gelu_with_bias_equals_reference_of_the_sum(small_blocks, name, dtype, shape, wants):
    """The "gelu" and "gelu_tanh" kernels with the bias fused, kernel(x, b), equal reference(x + b):
    the output, dL/dx and dL/db (the kernel sums dL/dx over the rows block by block), also when only
    x or only b wants a gradient."""
    rng = np.random.default_rng(shape[-1])
    ref = REFERENCE[name]
    arrays = [inputs(rng, shape), rng.standard_normal(shape[-1])]
    assert_kernel_equals_reference(cpu_kernel(name).apply, lambda x, b: ref.apply(x + b), arrays,
                                   [rng.standard_normal(shape)], dtype, TOL[dtype], wants_grad=wants,
                                   names=["x", "bias"])


@pytest.mark.parametrize("cls", [k_gelu.GELU, k_gelu.GELUTanh])
@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 3, 4)])
def test_gelu_with_bias_gradcheck(small_blocks, rng, cls, shape):
    """GELU(x, bias=b), the MLP's fc1 bias fused into GELU: finite differences agree with the gradients
    of x and b (random upstream), over several small blocks."""
    x, b = param(np, rng, *shape, scale=2.0), param(np, rng, shape[-1])
    tv.gradcheck(lambda t, c: cls.apply(t, c), [x, b])


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float32, 1e-4)])
@pytest.mark.parametrize("cls,approximate", [(k_gelu.GELU, "none"), (k_gelu.GELUTanh, "tanh")])
def test_gelu_with_bias_torch_parity(torch, rng, dtype, rtol, cls, approximate):
    """The fused kernel(x, b) against PyTorch's gelu(x + b): output and both gradients."""
    x, b = rng.standard_normal((6, 17)) * 3, rng.standard_normal(17)
    torch_parity(torch, lambda t, c: cls.apply(t, c),
                 lambda t, c: torch.nn.functional.gelu(t + c, approximate=approximate), [x, b], dtype, rtol)


# ---------------------------------------------------------------- the float32 Phi polynomial


def _phi_tanh32(x):
    with np.errstate(over="ignore"):                 # as in GELU: -x^2/2 and its powers reach -+inf far out
        w = x * x
        w *= -0.5 * k_gelu._LOG2_E                   # GELU's variable: exp2(w) = exp(-x^2/2)
        return k_gelu._normal_cdf_tanh32(x, w, out=np.empty_like(x))


def test_gelu_float32_phi_is_accurate_and_every_coefficient_matters(monkeypatch):
    """float32 GELU takes Phi(x) from (1 + tanh(x P(-x^2/2))) / 2 with fitted coefficients
    (PHI_TANH32): absolute error below 1.5e-7 on a dense grid of [-10, 10] (1e-7 measured), and a 2%
    error in any one coefficient breaks that bound."""
    x = np.linspace(-10, 10, 400_001).astype(np.float32)
    want = 0.5 * _math_erfc(-x.astype(np.float64) / math.sqrt(2.0))     # Phi of the float32 inputs
    got = _phi_tanh32(x)
    assert got.dtype == np.float32
    assert np.abs(got - want).max() < 1.5e-7
    for k, c in enumerate(k_gelu.PHI_TANH32):
        for wrong in (0.98 * c, 1.02 * c):
            coeffs = list(k_gelu.PHI_TANH32)
            coeffs[k] = wrong
            monkeypatch.setattr(k_gelu, "PHI_TANH32", tuple(coeffs))
            assert np.abs(_phi_tanh32(x) - want).max() > 1.5e-7, f"coefficient {k} off by 2% went unnoticed"
            monkeypatch.undo()


def test_gelu_float32_phi_tails_inf_and_nan():
    """Past |x| = 6 Phi is 0 or 1 to float32 precision, and the tanh form gives exactly that, out to
    +-inf (where the powers of -x^2/2 overflow); NaN stays NaN."""
    far = np.array([6.0, 10.0, 50.0, 1e4, 1e30, 3e38, np.inf], dtype=np.float32)
    np.testing.assert_array_equal(_phi_tanh32(far), 1.0)
    np.testing.assert_array_equal(_phi_tanh32(-far), 0.0)
    assert np.isnan(_phi_tanh32(np.array([np.nan], dtype=np.float32))).all()


@pytest.mark.parametrize("cls", [k_gelu.GELU, k_gelu.GELUTanh])
def test_gelu_kernel_float32_value_and_derivative_with_bias(small_blocks, cls):
    """The float32 kernel with a bias, on a dense grid split among small blocks: y = h Phi(h) and
    dy/dx = Phi(h) + h phi(h) at h = x + b against float64 math (erfc, or the tanh form), the same
    bounds as the ops' float32 accuracy test (2e-7 |h| for y, 3e-7 for dy/dx; the tanh form's dy/dx
    within 2e-6, as its 1 - tanh(u)^2 cancels in float32 where tanh(u) nears -+1: 1.2e-6 measured for
    the kernel and the reference alike)."""
    x = np.linspace(-10, 10, 20_000).astype(np.float32).reshape(-1, 8)   # rows of 8, one bias each
    b = np.linspace(-0.5, 0.5, 8).astype(np.float32)
    h = (x + b).astype(np.float64)                      # the float32 sum the kernel computes, exactly
    if cls is k_gelu.GELU:
        cdf = 0.5 * _math_erfc(-h / math.sqrt(2.0))
        slope = cdf + h * np.exp(-0.5 * h * h) / math.sqrt(2.0 * math.pi)
    else:
        t = np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3))
        cdf = 0.5 * (1 + t)
        slope = cdf + 0.5 * h * (1 - t * t) * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * h * h)
    xt, bt = tv.Tensor(x, requires_grad=True), tv.Tensor(b, requires_grad=True)
    y = cls.apply(xt, bt)
    y.backward(np.ones_like(x))
    assert y.dtype == np.float32 and xt.grad.dtype == np.float32 and bt.grad.dtype == np.float32
    assert (np.abs(y.numpy() - h * cdf) <= 2e-7 * np.abs(h) + 1e-30).all()
    assert np.abs(xt.grad - slope).max() < (3e-7 if cls is k_gelu.GELU else 2e-6)
    np.testing.assert_allclose(bt.grad, slope.sum(axis=0), rtol=1e-5)
