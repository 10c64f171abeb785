"""GELU on an NVIDIA GPU: the same function as ops/activation.py's GELU and GELUTanh, with the bias
of the MLP's first Dense layer optionally fused in (the signature of kernels/cpu/gelu.py):

    exact   y = h Phi(h),  h = x + bias,  Phi(h) = erfc(-h / sqrt 2) / 2
            dy/dh = Phi(h) + h phi(h),  phi(h) = exp(-h^2 / 2) / sqrt(2 pi)
    tanh    y = h (1 + t) / 2,  t = tanh(u),  u = sqrt(2/pi) (h + 0.044715 h^3)
            dy/dh = (1 + t) / 2 + h (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 h^2) / 2

Phi is CUDA's erfcf / erfc (the reference writes (1 + erf(h / sqrt 2)) / 2, the same function;
erfc keeps its relative accuracy in the left tail, where 1 + erf cancels). Each formula is computed
in the input's precision (float32 stays float32: the constants are cast, nothing promotes to double).

One kernel per form and dtype (gelu_forward_f32, gelu_tanh_forward_f64, ...), element-wise over x
seen as a (rows, cols) matrix: one thread per column, blocks of THREADS columns (a warp reads 32
adjacent elements: coalesced), and grid.y blocks striding down the rows, so that each thread reads its
column's bias once. Without a bias the whole array is one row. Forward computes dy/dh too when a
gradient is wanted and saves only that; backward is then dL/dx = gy * dy/dh (one CuPy multiply) and
dL/dbias = the column sums of dL/dx (a CuPy sum over rows).
Tests: tests/test_kernels_cuda_gelu.py (on a GPU: `pytest -m gpu`; on the CPU the Python side runs
against a NumPy emulation of the kernel).
"""
from __future__ import annotations

import numpy as np

from ...autograd import Function
from ...backend import get_array_module
from . import entry, kernel, load_source

THREADS = 256                # columns per block
TARGET_BLOCKS = 4096         # grid.y is chosen so that the grid has about this many blocks ...
MAX_GRID_Y = 65535           # ... within CUDA's limit on grid.y
MAX_GRID_X = 2 ** 31 - 1

SOURCE = load_source("gelu.cu")          # the CUDA C++ of the kernels below


def launch(rows: int, cols: int):
    """(grid, block) of gelu_forward for a (rows, cols) matrix: ceil(cols / THREADS) blocks across,
    and enough down (each striding over the rows) for about TARGET_BLOCKS blocks in all."""
    grid_x = -(-cols // THREADS)
    if grid_x > MAX_GRID_X:
        raise ValueError(f"gelu: a row of {cols} elements is more than one CUDA grid covers")
    grid_y = max(1, min(rows, MAX_GRID_Y, -(-TARGET_BLOCKS // grid_x)))
    return (grid_x, grid_y), (THREADS,)


def _launch(name, dtype, grid, block, args):
    """Run entry point ``name`` for ``dtype`` (tests on the CPU replace this with an emulation)."""
    kernel(SOURCE, entry(name, dtype))(grid, block, args)


class GELU(Function):
    """Gaussian error linear unit (Hendrycks & Gimpel 2016), the MLP non-linearity of ViT (Eq. 3),
    optionally of x plus a bias, on the GPU (the module docstring has the formulas and layout).

    x: (..., H)   bias: (H,) or None   ->   y: same shape as x
    Saves dy/dh only (computed by the forward kernel when a gradient is wanted).
    Backward: dL/dx = gy dy/dh,  dL/dbias = sum over rows of dL/dx.
    """

    _kernel = "gelu_forward"

    def forward(self, x, bias=None):
        xp = get_array_module(x)
        if bias is not None:
            if x.ndim == 0 or bias.shape != x.shape[-1:]:
                raise ValueError(f"{type(self).__name__}: bias must have shape "
                                 f"({x.shape[-1] if x.ndim else 'x has no axis'},), got {bias.shape}")
            if bias.dtype != x.dtype:
                raise TypeError(f"{type(self).__name__}: bias is {bias.dtype}, x is {x.dtype}")
            bias = xp.ascontiguousarray(bias)                  # the kernel indexes bias[column]
        x2 = xp.ascontiguousarray(x).reshape(-1, x.shape[-1]) if bias is not None else \
            xp.ascontiguousarray(x).reshape(1, -1)                       # (rows, cols)
        y = xp.empty_like(x2)
        want_slope = any(self.needs_input_grad)
        slope = xp.empty_like(x2) if want_slope else None
        rows, cols = x2.shape
        if x2.size:
            grid, block = launch(rows, cols)
            _launch(self._kernel, x2.dtype, grid, block, (
                x2, x2 if bias is None else bias, y, y if slope is None else slope,   # unused: x2, y
                np.int32(bias is not None), np.int32(want_slope), np.int64(rows), np.int64(cols)))
        self.save(slope, bias is not None)
        return y.reshape(x.shape)

    def backward(self, gy):
        slope, has_bias = self.saved
        gx = gy * slope.reshape(gy.shape)
        if not has_bias:
            return gx
        gb = gx.reshape(-1, gx.shape[-1]).sum(axis=0) if self.needs_input_grad[1] else None
        return gx, gb


class GELUTanh(GELU):
    """GELU with the tanh approximation of Phi (approximate="tanh"; the official ViT code's flax
    nn.gelu default), on the GPU: GELU's forward and backward with the tanh kernel.

    x: (..., H)   bias: (H,) or None   ->   y: same shape as x
    """

    _kernel = "gelu_tanh_forward"

