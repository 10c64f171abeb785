"""GELU on the CPU, fast: the same function as ops/activation.py's GELU and GELUTanh, with

    the bias fused    the MLP's first Dense layer leaves its bias to GELU, which adds it to each block of
                      rows while the block is in the cache (one pass over memory less each way)
    blocks, threads   both passes over cache-sized blocks of rows shared among threads, temporaries in
                      per-thread scratch arrays (kernels/cpu/threads.py)
    one saved array   forward computes dy/dh too and saves only that: backward is one product
    no erf in float32 Phi(x) = (1 + tanh(x P(z))) / 2 with a degree-6 P fitted to float32 accuracy
                      (kernels/cpu/gelu_fit.py re-derives it), 18 passes over a block where Phi from
                      a float32 erf takes 27; float64 keeps the reference's erf (Cody's rational)

Tests: tests/test_kernels_cpu_gelu.py proves each equal to the reference, forward and every gradient.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ...autograd import Function
from ...backend import get_array_module
from ...ops.activation import normal_cdf, polyval as _polyval
from .threads import binary_in_blocks, column_sums, empty_like, for_each_block, row_blocks, scratch

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_C = 0.044715


# float32 (NumPy): Phi(x) = (1 + tanh(x P(z))) / 2 with z = -x^2/2 and P of degree 6, highest power
# first. This is GELU's tanh approximation (P(z) = sqrt(2/pi) (1 - 2 * 0.044715 z), error 2e-4)
# carried to more terms: coefficients fitted for the least maximum absolute error of Phi (Lawson's
# iteratively reweighted least squares in float64; `python -m tinyvit.kernels.cpu.gelu_fit` re-derives
# them, tests/test_kernels_gelu_fit.py checks the bounds): 2.9e-8 in exact arithmetic and 9.9e-8
# evaluated in float32, less than Phi from Eigen's float32 erf (2.4e-7). It takes
# 18 passes over a block where Phi from that erf takes 27, and its z is phi's exponent, which the
# derivative needs anyway. GELU evaluates P in w = log2(e) z instead (the coefficients rescaled by
# _in_base_two), so that phi's exp(z) is exp2(w), the cheaper function; the errors stay as above.
# P's leading coefficient is positive and x P(z) grows with |x| past the fitted range (x P(z) > 8.4
# for |x| > 5.3), so tanh saturates and Phi becomes exactly 0 or 1 in the tails, as it must in float32;
# there the powers of z may overflow to +-inf, which only hastens that.
PHI_TANH32 = (1.124016557e-07, 4.232519293e-06, 6.343636127e-05, 4.424505121e-04, -1.30379001e-04,
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
    u = _polyval(_in_base_two(PHI_TANH32), w, out=out)
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
    run over cache-sized blocks of rows (threads.for_each_block) shared among the threads.
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


def _gelu_block(x, y, d):
    """y = x Phi(x) and, unless d is None, d = Phi(x) + x phi(x), on one block (1-D arrays alike;
    y may be x itself, overwritten). Phi: the tanh form for float32 on NumPy, erf otherwise (float64
    keeps Cody's, as gradcheck needs). Phi is built in d's block when there is one, and the other
    temporaries are the thread's scratch arrays (threads.scratch): four block-sized arrays in all,
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
            cdf = normal_cdf(x)
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
