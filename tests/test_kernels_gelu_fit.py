"""kernels/cpu/gelu_fit.py re-derives PHI_TANH32, the float32 GELU's Phi(x) = (1 + tanh(x P(-x^2/2))) / 2,
and the bounds that kernels/cpu/gelu.py states for it hold.

Measured on max_abs_error's grid (step 1e-5 on [-12, 12], tails to 1e30, +-inf):
    PHI_TANH32   2.888e-8 in float64, 9.54e-8 in float32 (9.87e-8 over every float32 in [1, 2))
    refit        2.888e-8 in float64, 9.54e-8 in float32
    classic tanh GELU (degree 1, 0.044715): 1.79e-4
"""
import numpy as np
import pytest

from tinyvit.kernels.cpu.gelu import PHI_TANH32
from tinyvit.kernels.cpu.gelu_fit import CLASSIC_TANH, X_MAX, fit_phi_tanh, max_abs_error, phi_tanh
from tinyvit.ops.activation import normal_cdf


@pytest.fixture(scope="module")
def refit():
    return fit_phi_tanh()


def test_refit_reproduces_phi_tanh32(refit):
    # The minimax solution is unique, so the refit lands on PHI_TANH32 up to the 10 digits printed
    # there (they agree to 3e-7 relative); its error is as small (to 0.1%, from that rounding).
    np.testing.assert_allclose(refit, PHI_TANH32, rtol=1e-5)
    assert max_abs_error(refit) <= 1.001 * max_abs_error(PHI_TANH32)


def test_refit_equioscillates(refit):
    # Chebyshev's criterion: a minimax P of degree 6 makes Phi's error reach +-E alternately at
    # 6 + 2 = 8 points of (0, X_MAX] at least (an L2 fit would peak unevenly).
    x = np.linspace(1e-3, X_MAX, 200_001)
    e = phi_tanh(x, refit) - normal_cdf(x)
    peak = np.abs(e).max()
    near = np.abs(e) > 0.999 * peak
    assert np.count_nonzero(np.diff(np.sign(e[near])) != 0) + 1 >= 8


def test_phi_tanh32_bounds():
    # gelu.py's comment: 3e-8 in exact arithmetic, 1e-7 evaluated in float32. Float32 adds rounding
    # to the 2.9e-8: half an ulp of Phi near 1 (3e-8) and tanh's own error, whose size depends on
    # NumPy's float32 tanh on this CPU, so the float32 bound has a margin over the 9.5e-8 measured.
    assert max_abs_error(PHI_TANH32) < 2.9e-8
    assert max_abs_error(PHI_TANH32, np.float32) < 1.2e-7


def test_classic_tanh_is_much_worse(refit):
    # Degree 1 is GELU's tanh form: 1.8e-4, so the bounds above can fail. Its own minimax refit
    # (1.4e-4) beats 0.044715, as the fit should.
    classic = max_abs_error(CLASSIC_TANH)
    assert 1.5e-4 < classic < 2e-4
    assert max_abs_error(fit_phi_tanh(degree=1)) < 0.8 * classic
    assert classic > 1000 * max_abs_error(refit)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_odd_symmetry(dtype):
    # tanh is odd, so Phi(-x) = 1 - Phi(x) holds up to the rounding of 0.5 +- 0.5 tanh.
    x = np.linspace(0.0, 8.0, 10_001, dtype=dtype)
    gap = phi_tanh(-x, PHI_TANH32) + phi_tanh(x, PHI_TANH32) - dtype(1.0)
    assert np.abs(gap).max() <= np.finfo(dtype).eps


def test_p_positive_on_the_whole_range():
    # x P(z) has x's sign for every x iff P > 0 for all z <= 0: no real root there, P(0) > 0.
    # Then tanh saturates in the tails instead of turning back.
    roots = np.roots(PHI_TANH32)
    assert not np.any((np.abs(roots.imag) < 1e-12) & (roots.real <= 0))
    assert PHI_TANH32[-1] > 0


@pytest.mark.parametrize("dtype, smallest", [(np.float32, 6.0), (np.float64, 40.0)])
def test_tails_exact(dtype, smallest):
    # Past where 1 - Phi drops under half an ulp of 1 the form must give exactly 1 (and 0 for -x),
    # with no NaN where x^2 or P's powers of z overflow (x = 1e20, 1e30, the largest float, inf).
    big = np.array([smallest, 10.0, 1e2, 1e4, 1e19, 1e20, 1e30, np.finfo(dtype).max, np.inf], dtype)
    np.testing.assert_array_equal(phi_tanh(big, PHI_TANH32), 1.0)
    np.testing.assert_array_equal(phi_tanh(-big, PHI_TANH32), 0.0)
    assert phi_tanh(dtype(0.0), PHI_TANH32) == 0.5
