"""Activations: GELU (the non-linearity of the ViT MLP, Eq. 3) and softmax / log-softmax (the attention
weights, Eq. 6 of appendix A, and the classifier).

GELU needs the error function. NumPy has none and SciPy is not a dependency, so ``erf`` below
evaluates W. J. Cody's rational Chebyshev approximations (Math. Comp. 23, 1969, 631-638; the
coefficients of his CALERF routine), accurate to a unit or two in the last place of float64, and
for float32 the single rational approximation of Eigen (and XLA), as accurate as float32 needs at a
third of the cost. On CuPy it calls cupyx.scipy.special.erf, the same function as a GPU kernel.
GELU in float32 on NumPy needs no erf at all: it takes Phi from a tanh form fitted to float32
accuracy (see _PHI_TANH32), cheaper still.
"""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from ..autograd import Function
from ..backend import get_array_module
from .common import (binary_in_blocks, blockwise, column_sums, empty_like, for_each_block, require_float,
                     require_same_dtype, row_blocks, scratch, shape_of)

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

# float32: erf(x) = x alpha(x^2) / beta(x^2) on [-4, 4] (Eigen's generic_fast_erf_float, also XLA's);
# outside, erf is +-1 to float32 precision. Absolute error below 5e-7 when evaluated in float32.
_ALPHA32 = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
            -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_BETA32 = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
           -1.42647390514189e-02)


def _polyval(coeffs, z, out=None):
    """c0 z^n + c1 z^(n-1) + ... + cn by Horner's rule (a loop over coefficients, not elements),
    into ``out`` if given (an array like z, not z itself), else into a fresh array."""
    r = get_array_module(z).multiply(z, coeffs[0], out=out)
    r += coeffs[1]
    for c in coeffs[2:]:
        r *= z
        r += c
    return r


def _erf_block(x):
    """erf of a 1-D array, both of Cody's ranges evaluated everywhere and picked by xp.where.

    Cody's rational for erfc on (0.46875, 4] is used out to |x| = 6: there erfc < 2e-17, so its
    error no longer shows in 1 - erfc, and beyond 6 erf is 1 to float64 precision. (Cody's third
    range matters only for erfc itself, whose relative accuracy erf does not need.)"""
    xp = get_array_module(x)
    z = x * x
    small = _polyval(_A, z)
    small /= _polyval(_B, z)
    small *= x                                   # erf(x) for |x| <= 0.46875
    y = xp.minimum(xp.abs(x), 6.0)              # NaN stays NaN; +-inf becomes 6
    large = _polyval(_C, y)
    large /= _polyval(_D, y)
    y *= y
    y *= -1.0
    large *= xp.exp(y, out=y)                    # erfc(|x|)
    xp.subtract(1.0, large, out=large)
    return xp.where(z <= _SMALL_SQ, small, xp.copysign(large, x))


def _erf_block_float32(x):
    """erf of a float32 1-D array: Eigen's x alpha(x^2) / beta(x^2), x clipped to [-4, 4] (NaN stays NaN)."""
    x = np.clip(x, -4.0, 4.0)
    z = x * x
    r = _polyval(_ALPHA32, z)
    r /= _polyval(_BETA32, z)
    r *= x                                       # last, so that tiny x keeps its precision
    return r


def _erf_kernel(x):
    """erf of a block (NumPy: Cody in float64, Eigen's rational in float32) or of a CuPy array."""
    if get_array_module(x) is not np:
        from cupyx.scipy.special import erf as cupy_erf
        return cupy_erf(x)
    if x.dtype == np.float32:
        return _erf_block_float32(x)
    with np.errstate(over="ignore", invalid="ignore"):   # |x| > 1e154 overflows x^2 in the unused range
        return _erf_block(x)


def erf(x):
    """The error function erf(x) = 2/sqrt(pi) int_0^x exp(-t^2) dt, element-wise.

    x: NumPy/CuPy array of any shape (float32 stays float32; integers become float64) -> same shape.
    Relative error below 1e-15 in float64 over the whole real line, absolute error below 5e-7
    (a few float32 units) in float32. NumPy has no erf and SciPy is not a dependency, so on NumPy
    this evaluates W. J. Cody's rational Chebyshev approximations (float64) or Eigen's float32
    rational in cache-sized blocks (ops.common.blockwise: a Python loop over blocks, each block
    vectorized, about 3x faster than whole-array temporaries); on CuPy it is
    cupyx.scipy.special.erf, one GPU kernel.
    """
    if get_array_module(x) is np:
        x = np.asarray(x)
        if x.dtype.kind != "f":
            x = x.astype(np.float64)
    return blockwise(_erf_kernel, x)


# ---------------------------------------------------------------- GELU

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_C = 0.044715


# float32 (NumPy): Phi(x) = (1 + tanh(x P(z))) / 2 with z = -x^2/2 and P of degree 6, highest power
# first. This is GELU's tanh approximation (P(z) = sqrt(2/pi) (1 - 2 * 0.044715 z), error 2e-4)
# carried to more terms: coefficients fitted offline for the least maximum absolute error of Phi
# (Lawson's iteratively reweighted least squares, in float64 against scipy.special.ndtr), 3e-8 in exact
# arithmetic and 1e-7 evaluated in float32, less than Phi from Eigen's float32 erf (2.4e-7). It takes
# 18 passes over a block where Phi from that erf takes 27, and its z is phi's exponent, which the
# derivative needs anyway. GELU evaluates P in w = log2(e) z instead (the coefficients rescaled by
# _in_base_two), so that phi's exp(z) is exp2(w), the cheaper function; the errors stay as above.
# P's leading coefficient is positive and x P(z) grows with |x| past the fitted range (x P(z) > 8.4
# for |x| > 5.3), so tanh saturates and Phi becomes exactly 0 or 1 in the tails, as it must in float32;
# there the powers of z may overflow to +-inf, which only hastens that.
_PHI_TANH32 = (1.124016557e-07, 4.232519293e-06, 6.343636127e-05, 4.424505121e-04, -1.30379001e-04,
               -7.266616883e-02, 7.978849415e-01)


_LOG2_E = 1.0 / math.log(2.0)


@functools.lru_cache(maxsize=4)
def _in_base_two(coeffs):
    """The coefficients (highest power first) of P(z) as a polynomial in w = log2(e) z."""
    degree = len(coeffs) - 1
    return tuple(c / _LOG2_E ** (degree - i) for i, c in enumerate(coeffs))


def _normal_cdf_tanh32(x, w, out):
    """Phi(x) of float32 x, given w = -x^2/2 * log2(e) (so that exp2(w) is phi's exp(-x^2/2)), as
    (1 + tanh(x P(z))) / 2 with P evaluated in w (coefficients rescaled once), written into out."""
    u = _polyval(_in_base_two(_PHI_TANH32), w, out=out)
    u *= x
    np.tanh(u, out=u)
    u *= 0.5
    u += 0.5
    return u


class GELU(Function):
    """Gaussian error linear unit (Hendrycks & Gimpel 2016), the MLP non-linearity of ViT (Eq. 3),
    optionally of x plus a bias: the MLP's first Dense layer leaves its bias to GELU, which adds it
    to each block of rows while the block is in the cache (one pass over memory less each way).

    x: (..., H)   bias: (H,) or None   ->   y: same shape as x
      y = h Phi(h),  h = x + bias,  Phi(h) = (1 + erf(h / sqrt 2)) / 2  (the standard normal CDF)
      dy/dh = Phi(h) + h phi(h),  phi(h) = exp(-h^2 / 2) / sqrt(2 pi)
      dL/dx = gy dy/dh,  dL/dbias = sum over rows of dL/dx

    When x wants a gradient, forward computes dy/dh too and saves only that: the derivative needs
    Phi(h) and h^2, which forward has at hand, and backward is then a single product. Both passes
    run over cache-sized blocks of rows (ops.common.for_each_block) shared among the threads.
    """

    def forward(self, x, bias=None):
        xp = get_array_module(x)
        x2 = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)     # (R, H)
        y = empty_like(x2)
        d = empty_like(x2) if any(self.needs_input_grad) else None     # dy/dh

        def block(r):
            h = x2[r]
            if bias is not None:                      # h = x + bias goes into y's block, and the
                h = xp.add(h, bias, out=y[r])         # block computes y = h Phi(h) over it in place
            self._block(h, y[r], None if d is None else d[r])

        for_each_block(block, row_blocks(x2))
        self.save(d, bias is not None)
        return y.reshape(x.shape)

    def backward(self, gy):
        d, has_bias = self.saved
        if not has_bias:
            return binary_in_blocks(np.multiply, gy, d.reshape(gy.shape))
        xp = get_array_module(d)
        g2 = gy.reshape(d.shape)
        gx = empty_like(d)

        def block(r):                                   # dL/dx, and this block's share of dL/dbias
            xp.multiply(g2[r], d[r], out=gx[r])
            return column_sums(gx[r]) if self.needs_input_grad[1] else None

        parts = for_each_block(block, row_blocks(gx))
        gb = sum(parts) if self.needs_input_grad[1] else None   # the blocks' sums added in block order
        return gx.reshape(gy.shape), gb

    @staticmethod
    def _block(x, y, d):
        _gelu_block(x, y, d)


def _normal_cdf(x):
    """Phi(x) = (1 + erf(x / sqrt 2)) / 2."""
    cdf = _erf_kernel(x * _SQRT1_2)
    cdf += 1.0
    cdf *= 0.5
    return cdf


def _gelu_block(x, y, d):
    """y = x Phi(x) and, unless d is None, d = Phi(x) + x phi(x), on one block (1-D arrays alike;
    y may be x itself, overwritten). Phi: the tanh form for float32 on NumPy, erf otherwise (float64
    keeps Cody's, as gradcheck needs). Phi is built in d's block when there is one, and the other
    temporaries are the thread's scratch arrays (ops.common.scratch): four block-sized arrays in all,
    which the CPU cache holds (a fifth and sixth spilled out of it: 12% slower, measured)."""
    xp = get_array_module(x)
    tanh32 = xp is np and x.dtype == np.float32
    z, spare = scratch("gelu", 2, x)
    with np.errstate(over="ignore"):          # far tails: x^2 or the powers of z become inf, harmlessly
        xp.multiply(x, x, out=z)
        if tanh32:                            # z = -x^2/2 log2(e): exp2(z) is exp(-x^2/2), and NumPy's
            z *= -0.5 * _LOG2_E               # float32 exp2 takes 0.7x exp's time (and is as accurate)
            cdf = _normal_cdf_tanh32(x, z, out=spare if d is None else d)
        else:
            z *= -0.5                         # z = -x^2/2, phi's exponent
            cdf = _normal_cdf(x)
        if d is not None:                     # x phi(x), before y = x Phi(x) may overwrite x
            (xp.exp2 if tanh32 else xp.exp)(z, out=z)
            z *= x
            z *= _INV_SQRT_2PI
        xp.multiply(x, cdf, out=y)
        if d is not None:
            if cdf is d:
                d += z
            else:
                xp.add(cdf, z, out=d)


class GELUTanh(GELU):
    """GELU with the tanh approximation of Phi (the original BERT/GPT-2 form; approximate="tanh",
    and the official ViT code's, whose flax nn.gelu defaults to it).

    x: any shape -> y: same shape
      y = x (1 + tanh(u)) / 2,  u = sqrt(2/pi) (x + 0.044715 x^3)
      dy/dx = (1 + t) / 2 + x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2) / 2,  t = tanh(u)
    GELU's forward and backward with another block: forward computes dy/dx too and saves only that.
    """

    @staticmethod
    def _block(x, y, d):
        _gelu_tanh_block(x, y, d)


def _gelu_tanh_block(x, y, d):
    """y = x (1 + t) / 2 and, unless d is None, d = dy/dx, on one block (y may be x itself,
    overwritten last); t = tanh(x (a + b x^2)) with a = sqrt(2/pi), b = 0.044715 a. Temporaries in
    the thread's scratch arrays."""
    xp = get_array_module(x)
    a, b = _SQRT_2_OVER_PI, _SQRT_2_OVER_PI * _TANH_C
    x2, t = scratch("gelu_tanh", 2, x)
    with np.errstate(over="ignore", invalid="ignore"):   # |x| > 1e19 in float32: x^2 is inf
        xp.multiply(x, x, out=x2)
        xp.multiply(x2, b, out=t)
        t += a
        t *= x                                 # u
        xp.tanh(t, out=t)                      # t = tanh(u)
        if d is not None:
            x2 *= 3.0 * b
            x2 += a                            # du/dx = a + 3 b x^2
            x2 *= x
            xp.multiply(t, t, out=d)
            xp.subtract(1.0, d, out=d)         # 1 - t^2
            d *= x2                            # x (1 - t^2) du/dx
            d += t
            d += 1.0
            d *= 0.5
        t += 1.0
        t *= 0.5
        xp.multiply(x, t, out=y)


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


def gelu(x, approximate="none", bias=None):
    """GELU, y = h Phi(h) with h = x (+ bias): exact with approximate="none" (erf), the tanh form
    with approximate="tanh". bias: (H,) for x (..., H), or None; gelu(x, bias=b) equals gelu(x + b)
    in one pass (the MLP's fc1 bias)."""
    require_float("gelu", x=x, bias=bias)
    require_same_dtype("gelu", x=x, bias=bias)
    if bias is not None:
        sx = shape_of(x)
        if not sx or shape_of(bias) != sx[-1:]:
            raise ValueError(f"gelu: bias must have shape ({sx[-1] if sx else 'H'},), one per entry of x's "
                             f"last axis, for x of shape {sx}; got {shape_of(bias)}")
    if approximate == "none":
        return GELU.apply(x, bias)
    if approximate == "tanh":
        return GELUTanh.apply(x, bias)
    raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


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
