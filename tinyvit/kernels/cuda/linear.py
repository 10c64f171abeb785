"""Dense layers on an NVIDIA GPU: ops/basic.py's Linear (every dense layer of Eq. 2-4) and
ops/patch.py's PatchEmbed (Eq. 1's x_p E), each as one 2-D cuBLAS GEMM per product. No CUDA C++:
CuPy's matmul is cuBLAS, and what this module adds is the shape the GEMMs get.

The reference writes y = x W for x of shape (..., D_in), which CuPy runs as a batched, broadcasting
matmul (one small GEMM per leading index, and dW summed over the batch afterwards). Here the leading
axes are folded into rows first, R = B*N tokens, so that every product is a single large GEMM:

    forward    rows = x as (R, D_in)          y = rows W + b                  (R, D_out)
    backward   g = dL/dy as (R, D_out)        dL/dx = g W^T                   (R, D_in)
                                              dL/dW = rows^T g                (D_in, D_out): one GEMM
                                                                              summing over all R rows
                                              dL/db = sum of g over rows      (D_out,)
PatchEmbed is the same with rows = the images' patches, (B*N, C*P*P) in (C, P, P) order
(ops/patch.py's patches_of), and dL/dimages = images_of(g E^T). The patches are kept for backward
only when E wants a gradient (the images' gradient needs E only).

The CuPy code is the same on NumPy arrays, where the tests run it (and on the CuPy stand-in, whose
strictness catches a NumPy-only call). Tests: tests/test_kernels_cuda_linear.py (equal to the
reference on NumPy, the stand-in and, `pytest -m gpu`, a GPU).
"""
from __future__ import annotations

from ...autograd import Function
from ...ops.patch import images_of, patches_of


def _rows(a):
    """a as a 2-D (R, last axis) array: a view where the layout allows (CuPy copies otherwise, as for
    the read-only broadcast upstream gradient of sum(y))."""
    return a.reshape(-1, a.shape[-1])


class Linear(Function):
    """y = x W + b as one GEMM over all rows (ops/basic.py's Linear; the module docstring has the
    formulas).

    x: (..., D_in)   W: (D_in, D_out)   b: (D_out,) or None   ->   y: (..., D_out)
    Saves x's rows and W (references, no copies).
    """

    def forward(self, x, w, b=None):
        rows = _rows(x)                                    # (R, D_in), R = B*N
        y = rows @ w                                       # (R, D_out): one GEMM
        if b is not None:
            y += b
        self.save(rows, w, x.shape)
        return y.reshape(*x.shape[:-1], w.shape[1])

    def backward(self, gy):
        rows, w, x_shape = self.saved
        need = self.needs_input_grad
        g = _rows(gy)                                      # (R, D_out)
        gx = (g @ w.T).reshape(x_shape) if need[0] else None
        gw = rows.T @ g if need[1] else None
        gb = g.sum(axis=0) if len(need) > 2 and need[2] else None
        return gx, gw, gb


class PatchEmbed(Function):
    """Eq. 1's x_p E + b for every patch of every image, as one GEMM (ops/patch.py's PatchEmbed).

    images: (B, C, H, W)   w: (C*P*P, D)   b: (D,) or None   ->   y: (B, N, D), N = (H/P)(W/P)
    Saves the patches (only when w wants a gradient), w and the images' shape.
    """

    def forward(self, images, w, b, patch_size):
        patches = patches_of(images, patch_size)           # (B*N, C*P*P)
        y = patches @ w                                    # (B*N, D): one GEMM
        if b is not None:
            y += b
        self.save(patches if self.needs_input_grad[1] else None, w, images.shape, patch_size)
        return y.reshape(images.shape[0], -1, w.shape[1])

    def backward(self, gy):
        patches, w, image_shape, p = self.saved
        need_images, need_w, need_b = self.needs_input_grad[:3]
        g = _rows(gy)                                      # (B*N, D)
        dimages = images_of(g @ w.T, image_shape, p) if need_images else None
        dw = patches.T @ g if need_w else None
        db = g.sum(axis=0) if need_b else None
        return dimages, dw, db
