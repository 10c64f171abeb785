"""Patch embedding, the x_p E of Eq. 1: cut images into P x P patches, flatten, project linearly.

    z_0 = [x_class; x_p^1 E; x_p^2 E; ...; x_p^N E] + E_pos,   E in R^{(P^2 C) x D}      (Eq. 1)

This op is the x_p^i E part: (B, C, H, W) -> (B, N, D), N = HW / P^2. Patches are flattened in
(C, P, P) order and numbered row-major over the (H/P, W/P) grid, so it equals a convolution with
kernel E^T.reshape(D, C, P, P) and stride P, flattened as conv(x).flatten(2).transpose(1, 2).
"""
from __future__ import annotations

from ..autograd import Function
from .basic import weight_gradient
from .common import (add_row_vector_, aligned_matmul, column_sums, require_float, require_ndim, require_same_dtype,
                     shape_of)


class PatchEmbed(Function):
    """Eq. 1's x_p E + b for every patch of every image, as one 2-D GEMM.

    images: (B, C, H, W)   w: (C*P*P, D)   b: (D,) or None   ->   y: (B, N, D), N = (H/P)(W/P)
    Forward:  patches = images.reshape(B, C, H/P, P, W/P, P).transpose(0, 2, 4, 1, 3, 5)
                        .reshape(B*N, C*P*P);   y = patches w + b
    Backward: dw = patches^T gy,  db = sum of gy over (B, N),
              d images = (gy w^T) folded back by the inverse reshape/transpose (only if wanted).
    """

    def forward(self, images, w, b, patch_size):
        bsz, c, hh, ww = images.shape
        p = patch_size
        gh, gw = hh // p, ww // p
        patches = (images.reshape(bsz, c, gh, p, gw, p)
                   .transpose(0, 2, 4, 1, 3, 5)            # (B, H/P, W/P, C, P, P)
                   .reshape(bsz * gh * gw, c * p * p))     # (B*N, C*P*P), a copy
        y = aligned_matmul(patches, w)                     # (B*N, D)
        if b is not None:
            add_row_vector_(y, b)
        self.save(patches if self.needs_input_grad[1] else None, w, images.shape, p)
        return y.reshape(bsz, gh * gw, w.shape[1])

    def backward(self, gy):
        patches, w, image_shape, p = self.saved
        need_images, need_w, need_b = self.needs_input_grad[:3]
        g = gy.reshape(-1, gy.shape[-1])                   # (B*N, D)
        dimages = dw = db = None
        if need_images:
            bsz, c, hh, ww = image_shape
            dimages = ((g @ w.T)                           # (B*N, C*P*P)
                       .reshape(bsz, hh // p, ww // p, c, p, p)
                       .transpose(0, 3, 1, 4, 2, 5)        # (B, C, H/P, P, W/P, P)
                       .reshape(image_shape))
        if need_w:
            dw = weight_gradient(patches, g)
        if need_b:
            db = column_sums(g)
        return dimages, dw, db




def patch_embed(images, w, b, patch_size):
    """Split images (B, C, H, W) into P x P patches and embed each: (B, N, D) with N = HW / P^2 (Eq. 1).

    w: (C*P*P, D), rows in (C, P, P) order (a conv kernel (D, C, P, P) reshaped to (D, C*P*P) and
    transposed); b: (D,) or None. H and W must be divisible by P."""
    op = "patch_embed"
    require_float(op, images=images, w=w, b=b)
    require_same_dtype(op, images=images, w=w, b=b)
    require_ndim(op, "images", images, 4, "a batch of images (B, C, H, W)")
    if not isinstance(patch_size, int) or isinstance(patch_size, bool) or patch_size < 1:
        raise ValueError(f"{op}: patch_size must be a positive integer, got {patch_size!r}")
    bsz, c, hh, ww = shape_of(images)
    p = patch_size
    if hh % p or ww % p:
        raise ValueError(f"{op}: image size {hh}x{ww} (H x W) is not divisible by the patch size {p}")
    sw = shape_of(w)
    if len(sw) != 2 or sw[0] != c * p * p:
        raise ValueError(f"{op}: w must be (C*P*P, D) = ({c}*{p}*{p}, D) = ({c * p * p}, D) for images "
                         f"with C={c} channels and patch size P={p}, but w has shape {sw} ({sw[0] if sw else '?'} rows)")
    if b is not None and shape_of(b) != (sw[1],):
        raise ValueError(f"{op}: b must have shape ({sw[1]},) for w of shape {sw}, got {shape_of(b)}")
    return PatchEmbed.apply(images, w, b, patch_size)
