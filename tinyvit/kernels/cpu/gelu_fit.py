"""Re-derive PHI_TANH32, the coefficients of the float32 GELU's normal CDF (kernels/cpu/gelu.py):

    Phi(x) ~= (1 + tanh(x P(z))) / 2,   z = -x^2/2,   P(z) = c0 z^n + ... + cn   (n = 6 there)

Degree 1 with P(z) = sqrt(2/pi) (1 - 2 * 0.044715 z) is GELU's classic tanh form (error 1.8e-4).
Run ``python -m tinyvit.kernels.cpu.gelu_fit`` to print the refit, its error bounds and PHI_TANH32's.

What is minimised: Phi's maximum absolute error over the real line,

    E = max_x |e(x)|,   e(x) = (1 + tanh(u(x))) / 2 - Phi(x),   u(x) = x P(-x^2/2).

tanh is odd and Phi(-x) = 1 - Phi(x), so e(-x) = -e(x) in exact arithmetic: x > 0 suffices.

1. Start. tanh(x P) = 2 Phi - 1 exactly when P(z) = atanh(2 Phi(x) - 1) / x = log(Phi(x) / Phi(-x)) / (2x)
   (the log form keeps the tail's 1 - Phi = Phi(-x) to full relative precision, where 2 Phi - 1
   rounds towards 1). A change dP moves Phi by dPhi/dP = x (1 - tanh^2 u) / 2 = 2 x Phi(x) Phi(-x),
   so the least-squares fit of P to that target, residuals weighted by dPhi/dP, is the L2 fit of
   Phi's error to first order.
2. Minimax by Lawson's iteratively reweighted least squares: minimise sum_i lambda_i e_i^2, then
   multiply each weight by |e_i| and renormalise; the weights gather on the n + 2 points where the
   error equioscillates, and the solution tends to the minimax one. Each step linearises about the
   current P (Gauss-Newton), e(c + dc) ~= e(c) + J dc with J_ik = x_i (1 - tanh^2 u_i) / 2 z_i^(n-k),
   so the residual is Phi's true error: the first-order model of step 1 is off by 0.15% at x ~ 4.3,
   where tanh bends over the correction x dP ~ 1e-3.

Grid: 4000 points evenly on (0, X_MAX], X_MAX = 5.42, where 1 - Phi(x) = 2^-25, half a float32 ulp
below 1: past it float32 Phi is exactly 1 and the tanh form cannot resolve Phi(-x) either (0.5 - 0.5
tanh comes in steps of 2^-25), so there is nothing left to fit. The weights 2 x Phi Phi(-x), 3e-7
there and falling, barely constrain P anyway (the fit is the same for X_MAX from 4.5 to 6.5). The
tails beyond are checked, not fitted: max_abs_error covers the whole line, and a leading term c0 z^n positive for z < 0
makes x P(z) grow to +-inf, so tanh saturates (the fits of degree 2, 3 and 5 fail this: their c0 z^n
is negative there, P changes sign past X_MAX and the error reaches 1; degree 7 would gain only 15%).

The reference Phi is ops.activation.normal_cdf, float64 with Cody's erf (relative error < 1e-15).
"""
from __future__ import annotations

import functools
import math
import time

import numpy as np

from ...ops.activation import normal_cdf, polyval

X_MAX = 5.42          # Phi(-X_MAX) = 2.98e-8 ~= 2^-25
FIT_POINTS = 4000     # spacing 1.4e-3 against ~0.5 between the error's extrema
ERROR_CORE = 12.0     # max_abs_error: step 1e-5 on [-12, 12] (Phi(-12) = 2e-33), then tails to 1e30
ERROR_STEP = 1e-5

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CLASSIC_TANH = (-2.0 * 0.044715 * _SQRT_2_OVER_PI, _SQRT_2_OVER_PI)   # P(z) = sqrt(2/pi) (1 - 2*0.044715 z)


def phi_tanh(x, coeffs):
    """(1 + tanh(x P(z))) / 2 with z = -x^2/2, element-wise, in the float dtype of x (the coefficients,
    highest power first, rounded to it): the arithmetic of kernels/cpu/gelu.py up to its base-2 z."""
    x = np.asarray(x)
    f = x.dtype.type
    with np.errstate(over="ignore"):          # far tails: x^2 and P's terms overflow to +inf, harmlessly
        p = polyval([f(c) for c in coeffs], f(-0.5) * x * x)
        return f(0.5) + f(0.5) * np.tanh(x * p)


def _lstsq(a, b, lam):
    """argmin_c sum_i lam_i (a_i c - b_i)^2 by the normal equations (a^T lam a) c = a^T lam b, their
    columns scaled to unit diagonal first: condition number 2e5 instead of 3e12, so the 7 x 7 solve
    keeps 10 digits. LAPACK's lstsq on the 4000 rows is no more accurate for the fit and 3 to 60
    times slower here, its BLAS threads woken for each of the iterations' small solves."""
    aw = a * lam[:, None]
    m = aw.T @ a
    d = 1.0 / np.sqrt(np.diag(m))
    return d * np.linalg.solve(m * d[:, None] * d, d * (aw.T @ b))


def fit_phi_tanh(degree=6, x_max=X_MAX, points=FIT_POINTS, iterations=500):
    """The coefficients (highest power first) of the degree-``degree`` P whose tanh form has the least
    maximum absolute error of Phi on ``points`` evenly spaced x in (0, x_max] (module docstring)."""
    x = np.linspace(0.0, x_max, points + 1)[1:]
    upper, lower = normal_cdf(x), normal_cdf(-x)            # Phi(x), and 1 - Phi(x) without rounding
    z = -0.5 * x * x
    scale = -z[-1]                                          # fit in z / scale in [-1, 0): z^6 reaches
    basis = np.vander(z / scale, degree + 1)                # 1e7, which would spoil the conditioning
    slope = 2.0 * x * upper * lower                         # dPhi/dP
    c = _lstsq(basis, np.log(upper / lower) / (2.0 * x), slope ** 2)       # step 1
    lam = np.full(points, 1.0 / points)
    for _ in range(iterations):                             # step 2
        u = x * (basis @ c)
        e = 0.5 * np.tanh(u) + 0.5 - upper
        lam *= np.abs(e)
        lam /= lam.sum()
        jac = (0.5 * x / np.cosh(u) ** 2)[:, None] * basis
        c += _lstsq(jac, -e, lam)
    return tuple(float(v) for v in c / scale ** np.arange(degree, -1, -1))


@functools.lru_cache(maxsize=4)
def _error_grid(dtype):
    """x over the whole line in ``dtype`` (dense core, geometric tails to +-1e30, +-inf) and the float64
    Phi of those very values."""
    core = np.linspace(-ERROR_CORE, ERROR_CORE, int(round(2 * ERROR_CORE / ERROR_STEP)) + 1)
    tail = np.geomspace(ERROR_CORE, 1e30, 300)
    x = np.concatenate([[-np.inf], -tail[::-1], core, tail, [np.inf]]).astype(dtype)
    return x, normal_cdf(x.astype(np.float64))


def max_abs_error(coeffs, dtype=np.float64):
    """max |phi_tanh(x, coeffs) - Phi(x)| over _error_grid's x, the tanh form evaluated in ``dtype``,
    Phi in float64 (NaN if the form gives a NaN anywhere)."""
    x, phi = _error_grid(np.dtype(dtype))
    return float(np.max(np.abs(phi_tanh(x, coeffs).astype(np.float64) - phi)))


def main():
    from .gelu import PHI_TANH32

    start = time.perf_counter()
    refit = fit_phi_tanh()
    fit_seconds = time.perf_counter() - start
    print(f"degree-6 refit on {FIT_POINTS} points of (0, {X_MAX}] in {fit_seconds:.2f} s:")
    print("    (" + ", ".join(f"{c:.9e}" for c in refit) + ")")
    print(f"max |Phi error| over [-{ERROR_CORE:g}, {ERROR_CORE:g}] step {ERROR_STEP:g}, "
          "tails to 1e30 and inf:")
    print(f"{'':24s}{'float64':>12s}{'float32':>12s}")
    for name, coeffs in (("refit", refit), ("PHI_TANH32", PHI_TANH32),
                         ("degree 1, 0.044715", CLASSIC_TANH), ("degree 1, refit", fit_phi_tanh(1))):
        print(f"{name:24s}{max_abs_error(coeffs):12.4e}{max_abs_error(coeffs, np.float32):12.4e}")
    print(f"total {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
