"""Dense layers on the CPU, fast: ops/basic.py's Linear and ops/patch.py's PatchEmbed with

    aligned outputs   each GEMM writes into a 64-byte-aligned array, so the element-wise kernels that
                      read and write it next never straddle two cache lines (kernels/cpu/threads.py)
    threaded biases   the bias add and its gradient's column sums run in blocks of rows among the
                      threads (a whole-array add would leave the other cores idle)
    weight gradients  x^T g computed as (g^T x)^T when the product has fewer rows than columns
                      (weight_gradient: OpenBLAS's threaded GEMM was 2-14x slower the other way)

Tests: tests/test_kernels_cpu_linear.py proves each equal to the reference, forward and every gradient.
"""
from __future__ import annotations

from ...autograd import Function
from ...backend import get_array_module
from ...ops.patch import images_of, patches_of
from .threads import add_row_vector_, aligned_matmul, column_sums


def weight_gradient(x_rows, g_rows):
    """x^T g: the gradient of W in y = x W, from x: (R, I) and g = dL/dy: (R, O) -> (I, O).

    Summed over all R = B*N rows in one GEMM. When I < O it is computed as (g^T x)^T and copied
    to row-major order (I*O elements, cheap): OpenBLAS's threaded GEMM with a long inner axis R
    was 2-3x slower, up to 14x, when the product has fewer rows than columns (measured with 2
    threads on the 2-core benchmark machine shared with other jobs; one thread shows no difference)."""
    if x_rows.shape[1] < g_rows.shape[1]:
        return get_array_module(x_rows).ascontiguousarray((g_rows.T @ x_rows).T)
    return x_rows.T @ g_rows


class Linear(Function):
    """y = x W + b (ops/basic.py's Linear), aligned and threaded.
    x: (..., D_in)  W: (D_in, D_out)  b: (D_out,) or None  ->  y: (..., D_out)"""

    def forward(self, x, w, b=None):
        rows = x.reshape(-1, x.shape[-1])
        y = aligned_matmul(rows, w)
        if b is not None:
            add_row_vector_(y, b)
        self.save(rows, w, x.shape)
        return y.reshape(*x.shape[:-1], w.shape[1])

    def backward(self, gy):
        rows, w, x_shape = self.saved
        g = gy.reshape(-1, gy.shape[-1])
        gx = aligned_matmul(g, w.T).reshape(x_shape) if self.needs_input_grad[0] else None
        gw = weight_gradient(rows, g) if self.needs_input_grad[1] else None
        gb = column_sums(g) if len(self.needs_input_grad) > 2 and self.needs_input_grad[2] else None
        return gx, gw, gb


class PatchEmbed(Function):
    """Eq. 1's x_p E + b (ops/patch.py's PatchEmbed), aligned and threaded; the patches are kept for
    backward only when w wants a gradient.
    images: (B, C, H, W)   w: (C*P*P, D)   b: (D,) or None   ->   y: (B, N, D)"""

    def forward(self, images, w, b, patch_size):
        patches = patches_of(images, patch_size)           # (B*N, C*P*P)
        y = aligned_matmul(patches, w)                     # (B*N, D)
        if b is not None:
            add_row_vector_(y, b)
        self.save(patches if self.needs_input_grad[1] else None, w, images.shape, patch_size)
        return y.reshape(images.shape[0], -1, w.shape[1])

    def backward(self, gy):
        patches, w, image_shape, p = self.saved
        need_images, need_w, need_b = self.needs_input_grad[:3]
        g = gy.reshape(-1, gy.shape[-1])                   # (B*N, D)
        dimages = images_of(g @ w.T, image_shape, p) if need_images else None
        dw = weight_gradient(patches, g) if need_w else None
        db = column_sums(g) if need_b else None
        return dimages, dw, db
