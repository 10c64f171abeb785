"""Activations: GELU (the non-linearity of the ViT MLP, Eq. 3) and softmax / log-softmax (the attention
weights, Eq. 6 of appendix A, and the classifier).

GELU needs the error function. NumPy has none and SciPy is not a dependency, so ``erf`` below
evaluates W. J. Cody's rational Chebyshev approximations (Math. Comp. 23, 1969, 631-638; the
coefficients of his CALERF routine), accurate to a unit or two in the last place of float64. On CuPy
it calls cupyx.scipy.special.erf, the same function as a GPU kernel. The fast GELU (bias fused,
cache blocks, threads, no erf in float32) is kernels/cpu/gelu.py.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ..autograd import Function
from ..backend import get_array_module
from .common import require_float, shape_of

# ---------------------------------------------------------------- erf (Cody 1969)

# Coefficients, highest power first; the denominators are monic.
# |x| <= 0.46875:   erf(x)  = x A(x^2) / B(x^2)
_A = (1.85777706184603153e-1, 3.16112374387056560e00, 1.13864154151050156e02,
      3.77485237685302021e02, 3.20937758913846947e03)
_B = (1.0, 2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
      2.84423683343917062e03)
# y = |x| > 0.46875: erfc(y) = exp(-y^2) C(y) / D(y), erf(x) = sign(x) (1 - erfc(y))
_C = (2.15311535474403846e-8, 5.64188496988670089e-1, 8.88314979438837594e00,
      6.61191906371416295e01, 2.98635138197400131e02, 8.81952221241769090e02,
      1.71204761263407058e03, 2.05107837782607147e03, 1.23033935479799725e03)
_D = (1.0, 1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
      1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
      3.43936767414372164e03, 1.23033935480374942e03)
_SMALL_SQ = 0.46875 ** 2   # the boundary between the two ranges, squared


def polyval(coeffs, z, out=None):
    """c0 z^n + c1 z^(n-1) + ... + cn by Horner's rule (a loop over coefficients, not elements),
    into ``out`` if given (an array like z, not z itself), else into a fresh array."""
    r = get_array_module(z).multiply(z, coeffs[0], out=out)
    r += coeffs[1]
    for c in coeffs[2:]:
        r *= z
        r += c
    return r


def _erf_cody(x):
    """erf of a NumPy array, both of Cody's ranges evaluated everywhere and picked by xp.where.

    Cody's rational for erfc on (0.46875, 4] is used out to |x| = 6: there erfc < 2e-17, so its
    error no longer shows in 1 - erfc, and beyond 6 erf is 1 to float64 precision. (Cody's third
    range matters only for erfc itself, whose relative accuracy erf does not need.)"""
    xp = get_array_module(x)
    z = x * x
    small = polyval(_A, z)
    small /= polyval(_B, z)
    small *= x                                   # erf(x) for |x| <= 0.46875
    y = xp.minimum(xp.abs(x), 6.0)              # NaN stays NaN; +-inf becomes 6
    large = polyval(_C, y)
    large /= polyval(_D, y)
    y *= y
    y *= -1.0
    large *= xp.exp(y, out=y)                    # erfc(|x|)
    xp.subtract(1.0, large, out=large)
    return xp.where(z <= _SMALL_SQ, small, xp.copysign(large, x))



def erf(x):
    """The error function erf(x) = 2/sqrt(pi) int_0^x exp(-t^2) dt, element-wise.

    x: NumPy/CuPy array of any shape (float32 stays float32; integers become float64) -> same shape.
    Relative error below 1e-15 in float64 over the whole real line. On NumPy: W. J. Cody's rational
    approximations (_erf_cody); on CuPy: cupyx.scipy.special.erf, one GPU kernel.
    """
    xp = get_array_module(x)
    if xp is not np:
        from cupyx.scipy.special import erf as cupy_erf
        return cupy_erf(x)
    x = np.asarray(x)
    if x.dtype.kind != "f":
        x = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):   # |x| > 1e154 overflows x^2 in the unused range
        return _erf_cody(x.reshape(-1)).reshape(x.shape)  # 1-D: a 0-d array's steps would give scalars


def normal_cdf(x):
    """Phi(x) = (1 + erf(x / sqrt 2)) / 2, the standard normal CDF."""
    return 0.5 * (1.0 + erf(x * _SQRT1_2))


# ---------------------------------------------------------------- GELU

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_C = 0.044715


class GELU(Function):
    """Gaussian error linear unit (Hendrycks & Gimpel 2016), the MLP non-linearity of ViT (Eq. 3).

    x: any shape -> y: same shape
      y = x Phi(x),  Phi(x) = (1 + erf(x / sqrt 2)) / 2        (the standard normal CDF)
      dy/dx = Phi(x) + x phi(x),  phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
    """

    float16_in_float32 = True            # erf's rational and x^2 overflow float16 for |x| of a few units

    def forward(self, x):
        cdf = normal_cdf(x)
        self.save(x, cdf)
        return x * cdf

    def backward(self, gy):
        x, cdf = self.saved
        pdf = get_array_module(x).exp(-0.5 * x * x) * _INV_SQRT_2PI
        return gy * (cdf + x * pdf)


class GELUTanh(Function):
    """GELU with the tanh approximation of Phi (the original BERT/GPT-2 form; approximate="tanh",
    and the official ViT code's, whose flax nn.gelu defaults to it).

    x: any shape -> y: same shape
      y = x (1 + t) / 2,  t = tanh(u),  u = sqrt(2/pi) (x + 0.044715 x^3)
      dy/dx = (1 + t) / 2 + x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2) / 2
    """

    float16_in_float32 = True            # x^3 overflows float16 from |x| = 40

    def forward(self, x):
        xp = get_array_module(x)
        with np.errstate(over="ignore", invalid="ignore"):   # |x| > 1e13 in float32: x^3 is inf
            t = xp.tanh(_SQRT_2_OVER_PI * (x + _TANH_C * x * x * x))
        self.save(x, t)
        return 0.5 * x * (1.0 + t)

    def backward(self, gy):
        x, t = self.saved
        with np.errstate(over="ignore", invalid="ignore"):
            du_dx = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_C * x * x)
            dy_dx = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du_dx
        return gy * dy_dx


# ---------------------------------------------------------------- softmax and log-softmax


class Softmax(Function):
    """y = exp(x - max x) / sum exp(x - max x) along ``axis`` (subtracting the max changes nothing
    but keeps exp from overflowing).  x: any shape -> y: same shape.
      dL/dx = y * (gy - sum(gy * y, axis))
    """

    def forward(self, x, axis):
        xp = get_array_module(x)
        y = x - x.max(axis=axis, keepdims=True)
        xp.exp(y, out=y)
        y /= y.sum(axis=axis, keepdims=True)
        self.save(y, axis)
        return y

    def backward(self, gy):
        y, axis = self.saved
        gx = gy * y
        gx -= y * gx.sum(axis=axis, keepdims=True)
        return gx


class LogSoftmax(Function):
    """y = x - max x - log sum exp(x - max x) along ``axis``, the log of softmax without its
    underflow.  x: any shape -> y: same shape.
      dL/dx = gy - softmax(x) * sum(gy, axis),  softmax(x) = exp(y)
    """

    def forward(self, x, axis):
        xp = get_array_module(x)
        y = x - x.max(axis=axis, keepdims=True)
        y -= xp.log(xp.exp(y).sum(axis=axis, keepdims=True))
        self.save(y, axis)
        return y

    def backward(self, gy):
        y, axis = self.saved
        xp = get_array_module(y)
        return gy - xp.exp(y) * gy.sum(axis=axis, keepdims=True)


# ---------------------------------------------------------------- the functions users call


def gelu(x, approximate="none", function=None):
    """GELU, y = x Phi(x): exact with approximate="none" (erf), the tanh form with approximate="tanh".
    function: the Function that computes it, this module's GELU or GELUTanh unless
    tinyvit.functional passes a kernel."""
    require_float("gelu", x=x)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if function is None:
        function = GELU if approximate == "none" else GELUTanh
    return function.apply(x)


def _check_axis(op, x, axis):
    shape = shape_of(x)
    if not shape:
        raise ValueError(f"{op}: input must have at least one axis, got shape {shape}")
    if not isinstance(axis, numbers.Integral) or isinstance(axis, bool) or not -len(shape) <= axis < len(shape):
        raise ValueError(f"{op}: axis {axis!r} is not an axis of an input of shape {shape}")
    axis = int(axis) % len(shape)
    if shape[axis] == 0:
        raise ValueError(f"{op}: axis {axis} of shape {shape} is empty")
    return axis


def softmax(x, axis=-1):
    """Softmax along ``axis`` (the last by default); the rows sum to 1."""
    require_float("softmax", x=x)
    return Softmax.apply(x, _check_axis("softmax", x, axis))


def log_softmax(x, axis=-1):
    """log(softmax(x)) along ``axis``, computed stably."""
    require_float("log_softmax", x=x)
    return LogSoftmax.apply(x, _check_axis("log_softmax", x, axis))
