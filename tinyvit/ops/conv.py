"""2-D convolution (im2col + one GEMM) and max pooling: the engine of the hybrid model's ResNet (BiT) stem.

Both ops see the padded input through a *window view* built with stride tricks, without copying:

    windows[b, c, i, j, u, v] = x_pad[b, c, i*s_h + u, j*s_w + v]      (B, C, H_out, W_out, kh, kw)

    H_out = (H + 2 p_h - kh) // s_h + 1,   W_out = (W + 2 p_w - kw) // s_w + 1

Their backward passes scatter gradients back through the same geometry with a loop over the kh*kw
kernel offsets (u, v): for each offset, one strided slice of the padded gradient,
x_pad[:, :, u : u + s_h*H_out : s_h, v : v + s_w*W_out : s_w], receives the gradient of every window at
once. Where windows overlap (stride < kernel) the additions accumulate, as the chain rule requires.
No loop runs over batch, channels or pixels.
"""
from __future__ import annotations

import operator

import numpy as np

from ..autograd import Function
from ..backend import get_array_module
from .common import require_float, require_ndim, shape_of

# ---------------------------------------------------------------- geometry shared by both ops


def _out_size(size, kernel, stride, padding):
    """Number of window positions along one axis: (size + 2 padding - kernel) // stride + 1."""
    return (size + 2 * padding - kernel) // stride + 1


def _pad(xp, x, padding, value):
    """x (B, C, H, W) -> (B, C, H + 2 p_h, W + 2 p_w), the border filled with ``value``."""
    ph, pw = padding
    if ph == 0 and pw == 0:
        return x
    return xp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), mode="constant", constant_values=value)


def _windows(xp, x_pad, kernel, stride, out):
    """A read-only view (B, C, H_out, W_out, kh, kw) of every kh x kw window of x_pad (B, C, Hp, Wp).

    windows[b, c, i, j, u, v] = x_pad[b, c, i*s_h + u, j*s_w + v]; no data is copied."""
    (kh, kw), (sh, sw), (ho, wo) = kernel, stride, out
    b, c = x_pad.shape[:2]
    s_b, s_c, s_h, s_w = x_pad.strides
    return xp.lib.stride_tricks.as_strided(
        x_pad, shape=(b, c, ho, wo, kh, kw), strides=(s_b, s_c, s_h * sh, s_w * sw, s_h, s_w))


def _offset_slice(u, v, stride, out):
    """The slice of x_pad that kernel offset (u, v) touches in every window: (B, C, H_out, W_out)."""
    (sh, sw), (ho, wo) = stride, out
    return (slice(None), slice(None), slice(u, u + sh * ho, sh), slice(v, v + sw * wo, sw))


def _strip(xp, g_pad, padding):
    """Drop the padded border of a gradient (B, C, Hp, Wp) -> (B, C, H, W), contiguous."""
    ph, pw = padding
    return xp.ascontiguousarray(g_pad[:, :, ph:g_pad.shape[2] - ph, pw:g_pad.shape[3] - pw])


# ---------------------------------------------------------------- convolution


class Conv2d(Function):
    """y = conv2d(x, W) + b, cross-correlation as in every deep-learning library.

    x: (B, C_in, H, W)  W: (C_out, C_in, kh, kw)  b: (C_out,) or None  stride, padding: (int, int)
      ->  y: (B, C_out, H_out, W_out), contiguous, with H_out, W_out as in the module docstring.

        y[b, o, i, j] = b[o] + sum_{c,u,v} W[o, c, u, v] * x_pad[b, c, i*s_h + u, j*s_w + v]

    Forward (im2col): the im2col matrix cols (B*H_out*W_out, C_in*kh*kw) holds one flattened window
    per row, in the (c, u, v) order of W's last three axes, so the whole convolution is ONE 2-D GEMM
        Y = cols @ W2^T + b,   W2 = W.reshape(C_out, C_in*kh*kw),   Y: (B*H_out*W_out, C_out).
    We build and keep cols *transposed*, cols^T (C_in*kh*kw, B*H_out*W_out), and run the same GEMM as
    Y^T = W2 @ cols^T: then both the im2col copy and the move to NCHW read whole rows of pixels
    (several times faster than the row-per-window layout, whose NCHW transpose gathers every element).
    Backward, with G^T = gy laid out as (C_out, B*H_out*W_out):
        dL/dW = (G^T @ cols).reshape(W.shape),   dL/db = sum of gy over (B, H_out, W_out),
        dL/dcols^T = W2^T @ G^T, scattered back onto x_pad (col2im: one strided add per kernel
        offset, accumulating where windows overlap), then the padding is stripped.
    Saves cols^T (kh*kw/(s_h*s_w) times the input's size) only when W needs a gradient, and W only
    when x needs one (the first conv on images needs no dx, so it keeps no W and runs no col2im).
    """

    def forward(self, x, w, b, stride, padding):
        xp = get_array_module(x)
        n, c_in, h, wd = x.shape
        c_out, _, kh, kw = w.shape
        out = (_out_size(h, kh, stride[0], padding[0]), _out_size(wd, kw, stride[1], padding[1]))
        windows = _windows(xp, _pad(xp, x, padding, 0), (kh, kw), stride, out)  # (B, C_in, Ho, Wo, kh, kw)
        cols_t = windows.transpose(1, 4, 5, 0, 2, 3).reshape(c_in * kh * kw, -1)  # cols^T: the one copy
        y_t = w.reshape(c_out, -1) @ cols_t                              # Y^T (C_out, B*Ho*Wo): the GEMM
        if b is not None:
            y_t += b[:, None]
        self.save(cols_t if self.needs_input_grad[1] else None, w if self.needs_input_grad[0] else None,
                  x.shape, w.shape, stride, padding)
        return xp.ascontiguousarray(y_t.reshape(c_out, n, *out).transpose(1, 0, 2, 3))

    def backward(self, gy):
        cols_t, w, x_shape, w_shape, stride, padding = self.saved
        xp = get_array_module(gy)
        n, c_in, h, wd = x_shape
        c_out, _, kh, kw = w_shape
        out = gy.shape[2:]
        needs = self.needs_input_grad
        g_t = gy.transpose(1, 0, 2, 3).reshape(c_out, -1)                # G^T: (C_out, B*Ho*Wo)
        dw = (g_t @ cols_t.T).reshape(w_shape) if needs[1] else None
        db = gy.sum(axis=(0, 2, 3)) if needs[2] else None
        dx = None
        if needs[0]:
            dcols_t = (w.reshape(c_out, -1).T @ g_t).reshape(c_in, kh, kw, n, *out)  # dL/dcols^T
            dcols_t = dcols_t.transpose(1, 2, 3, 0, 4, 5)                # (kh, kw, B, C_in, Ho, Wo) view
            dx_pad = xp.zeros((n, c_in, h + 2 * padding[0], wd + 2 * padding[1]), dtype=gy.dtype)
            for u in range(kh):                                          # col2im: kh*kw strided adds
                for v in range(kw):
                    dx_pad[_offset_slice(u, v, stride, out)] += dcols_t[u, v]
            dx = _strip(xp, dx_pad, padding)
        return dx, dw, db


# ---------------------------------------------------------------- max pooling


class MaxPool2d(Function):
    """y = the maximum of each kh x kw window of x, padded with -inf (so padding never wins).

    x: (B, C, H, W)  kernel, stride, padding: (int, int)  ->  y: (B, C, H_out, W_out)

        y[b, c, i, j] = max_{u,v} x_pad[b, c, i*s_h + u, j*s_w + v]

    Backward: each output's gradient goes to the arg-max of its window (the first maximum, in
    row-major (u, v) order, when several tie, as PyTorch does); where windows overlap
    (stride < kernel) an input that wins several windows collects all their gradients:
        dL/dx_pad[b, c, i*s_h + u, j*s_w + v] += gy[b, c, i, j] * [argmax(window b,c,i,j) == (u, v)]
    Saves only the arg-max index within each window, (B, C, H_out, W_out), one byte per output for
    kernels of up to 255 elements.
    """

    def forward(self, x, kernel, stride, padding):
        xp = get_array_module(x)
        n, c, h, wd = x.shape
        kh, kw = kernel
        out = (_out_size(h, kh, stride[0], padding[0]), _out_size(wd, kw, stride[1], padding[1]))
        windows = _windows(xp, _pad(xp, x, padding, -np.inf), kernel, stride, out)
        flat = windows.reshape(n, c, out[0], out[1], kh * kw)           # (B, C, Ho, Wo, kh*kw): a copy
        arg = flat.argmax(axis=-1)[..., None]                            # first max on ties
        y = xp.take_along_axis(flat, arg, axis=-1)[..., 0]               # (faster than flat.max(-1))
        arg = arg[..., 0].astype(np.uint8 if kh * kw <= 255 else np.int32)  # 1 byte per output
        self.save(arg, x.shape, kernel, stride, padding)
        return y

    def backward(self, gy):
        arg, x_shape, (kh, kw), stride, padding = self.saved
        xp = get_array_module(gy)
        n, c, h, wd = x_shape
        out = gy.shape[2:]
        dx_pad = xp.zeros((n, c, h + 2 * padding[0], wd + 2 * padding[1]), dtype=gy.dtype)
        for k in range(kh * kw):                                         # one strided add per offset
            u, v = divmod(k, kw)
            dx_pad[_offset_slice(u, v, stride, out)] += gy * (arg == k)
        return _strip(xp, dx_pad, padding)


# ---------------------------------------------------------------- the functions users call


def _pair(op, name, value, minimum):
    """An int or a pair of ints -> (int, int), each at least ``minimum``."""
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in pair):
        raise TypeError(f"{op}: {name} must be an int or a pair of ints, got {value!r}")
    pair = tuple(operator.index(v) for v in pair)
    if min(pair) < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"{op}: {name} must be {kind}, got {value!r}")
    return pair


def _check_fits(op, x_shape, kernel, padding):
    h, w = x_shape[2] + 2 * padding[0], x_shape[3] + 2 * padding[1]
    if kernel[0] > h or kernel[1] > w:
        raise ValueError(f"{op}: kernel {kernel[0]}x{kernel[1]} is larger than the padded input "
                         f"{h}x{w} (input shape {x_shape}, padding {padding})")


def conv2d(x, w, b=None, stride=1, padding=0):
    """2-D convolution (cross-correlation), NCHW.

    x: (B, C_in, H, W)  w: (C_out, C_in, kh, kw) like every conv library  b: (C_out,) or None
    stride, padding: an int or a pair (vertical, horizontal); padding adds zeros on both sides.
    Returns y: (B, C_out, (H + 2 p_h - kh) // s_h + 1, (W + 2 p_w - kw) // s_w + 1).
    """
    require_float("conv2d", input=x, weight=w, bias=b)
    require_ndim("conv2d", "input", x, 4, "4-D (B, C_in, H, W)")
    require_ndim("conv2d", "weight", w, 4, "4-D (C_out, C_in, kh, kw)")
    sx, sw = shape_of(x), shape_of(w)
    if sx[1] != sw[1]:
        raise ValueError(f"conv2d: input of shape {sx} has C_in = {sx[1]} channels but weight of shape {sw} "
                         f"expects C_in = {sw[1]} (weight is (C_out, C_in, kh, kw))")
    if b is not None and shape_of(b) != (sw[0],):
        raise ValueError(f"conv2d: bias has shape {shape_of(b)}, expected ({sw[0]},) for weight {sw}")
    dtypes = {str(a.dtype) for a in (x, w, b) if a is not None}
    if len(dtypes) > 1:
        raise TypeError(f"conv2d: input ({x.dtype}), weight ({w.dtype})"
                        + (f" and bias ({b.dtype})" if b is not None else "")
                        + " must share one dtype; convert with .astype() first")
    stride = _pair("conv2d", "stride", stride, 1)
    padding = _pair("conv2d", "padding", padding, 0)
    _check_fits("conv2d", sx, sw[2:], padding)
    return Conv2d.apply(x, w, b, stride, padding)


def max_pool2d(x, kernel, stride=None, padding=0):
    """Max pooling over kh x kw windows, NCHW; the border is padded with -inf, as in PyTorch.

    x: (B, C, H, W)  kernel: int or pair  stride: int or pair, defaults to kernel
    padding: int or pair, at most half the kernel (so every window holds a real element).
    Returns y: (B, C, (H + 2 p_h - kh) // s_h + 1, (W + 2 p_w - kw) // s_w + 1).
    """
    require_float("max_pool2d", input=x)
    require_ndim("max_pool2d", "input", x, 4, "4-D (B, C, H, W)")
    kernel = _pair("max_pool2d", "kernel", kernel, 1)
    stride = kernel if stride is None else _pair("max_pool2d", "stride", stride, 1)
    padding = _pair("max_pool2d", "padding", padding, 0)
    if padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
        raise ValueError(f"max_pool2d: padding {padding} must be at most half the kernel {kernel} "
                         "(a window of padding alone would have no maximum)")
    _check_fits("max_pool2d", shape_of(x), kernel, padding)
    return MaxPool2d.apply(x, kernel, stride, padding)
