"""Patch embedding, the x_p E of Eq. 1: cut images into P x P patches, flatten, project linearly.

    z_0 = [x_class; x_p^1 E; x_p^2 E; ...; x_p^N E] + E_pos,   E in R^{(P^2 C) x D}      (Eq. 1)

This op is the x_p^i E part: (B, C, H, W) -> (B, N, D), N = HW / P^2. Patches are flattened in
(C, P, P) order and numbered row-major over the (H/P, W/P) grid, so it equals a convolution with
kernel E^T.reshape(D, C, P, P) and stride P, flattened as conv(x).flatten(2).transpose(1, 2).
"""
from __future__ import annotations

from ..autograd import Function
from .common import require_float, require_ndim, require_same_dtype, shape_of


def patches_of(images, p):
    """(B, C, H, W) -> (B*N, C*P*P): every P x P patch flattened in (C, P, P) order, patches
    numbered row-major over the (H/P, W/P) grid (a copy)."""
    bsz, c, hh, ww = images.shape
    return (images.reshape(bsz, c, hh // p, p, ww // p, p)
            .transpose(0, 2, 4, 1, 3, 5)                   # (B, H/P, W/P, C, P, P)
            .reshape(bsz * (hh // p) * (ww // p), c * p * p))


def images_of(patch_rows, image_shape, p):
    """The inverse of patches_of: (B*N, C*P*P) -> (B, C, H, W)."""
    bsz, c, hh, ww = image_shape
    return (patch_rows.reshape(bsz, hh // p, ww // p, c, p, p)
            .transpose(0, 3, 1, 4, 2, 5)                   # (B, C, H/P, P, W/P, P)
            .reshape(image_shape))


class PatchEmbed(Function):
    """Eq. 1's x_p E + b for every patch of every image, as one 2-D GEMM.

    images: (B, C, H, W)   w: (C*P*P, D)   b: (D,) or None   ->   y: (B, N, D), N = (H/P)(W/P)
    Forward:  patches = patches_of(images) (B*N, C*P*P);   y = patches w + b
    Backward: dw = patches^T gy,  db = sum of gy over (B, N),  d images = images_of(gy w^T).
    """

    def forward(self, images, w, b, patch_size):
        patches = patches_of(images, patch_size)           # (B*N, C*P*P)
        y = patches @ w                                    # (B*N, D)
        if b is not None:
            y = y + b
        self.save(patches, w, images.shape, patch_size)
        return y.reshape(images.shape[0], -1, w.shape[1])

    def backward(self, gy):
        patches, w, image_shape, p = self.saved
        g = gy.reshape(-1, gy.shape[-1])                   # (B*N, D)
        dimages = images_of(g @ w.T, image_shape, p) if self.needs_input_grad[0] else None
        return dimages, patches.T @ g, g.sum(axis=0)


def patch_embed(images, w, b, patch_size, function=None):
    """Split images (B, C, H, W) into P x P patches and embed each: (B, N, D) with N = HW / P^2 (Eq. 1).

    w: (C*P*P, D), rows in (C, P, P) order (a conv kernel (D, C, P, P) reshaped to (D, C*P*P) and
    transposed); b: (D,) or None. H and W must be divisible by P.
    function: the Function that computes it, this reference unless tinyvit.functional passes a kernel."""
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
    return (function or PatchEmbed).apply(images, w, b, patch_size)
