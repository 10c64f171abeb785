"""RandAugment (Cubuk et al., 2020) on whole batches: each image gets N ops drawn at random, magnitude M.

Every op works on a batch of float images in [0, 1], x: (b, C, H, W), and returns the same shape.
Ops that have a direction (rotate, shear, translate, the enhance factors) pick a random sign per
image. The magnitude m is on the paper's scale 0..10 and maps to:

    identity       -                               invert        1 - x
    autocontrast   stretch each channel to [0, 1]  equalize      histogram equalisation per channel
    brightness     x * f                            color         blend with the greyscale image
    contrast       blend with the mean grey level   sharpness     blend with a 3x3 smoothed image
                   (for those four: f = 1 +- 0.9 m/10)
    solarize       invert pixels >= 1 - m/10        posterize     keep 8 - round(4 m/10) bits
    rotate         +- 30 m/10 degrees               shear_x/y     +- 0.3 m/10
    translate_x/y  +- 0.45 m/10 of the image size

Geometric ops sample with nearest neighbour and fill uncovered pixels with grey (0.5), all through
one vectorised gather (:func:`affine_nearest`). Colour and enhance ops on one-channel images use
the channel itself as the grey level (so ``color`` is the identity there).

Randomness comes from an explicit ``numpy.random.Generator`` on the host; only small per-image
parameters cross to the device, so results are identical on CPU and GPU for the same seed.
"""
from __future__ import annotations

import numpy as np

from ..backend import get_array_module


def _per_image(xp, values, x):
    """Host values (b,) -> device array (b, 1, 1, 1) of x's dtype, to broadcast over C, H, W."""
    return xp.asarray(np.asarray(values), dtype=x.dtype).reshape(-1, 1, 1, 1)


def _signs(rng, b):
    return rng.choice(np.array([-1.0, 1.0]), size=b)


def _grey(x):
    """(b, C, H, W) -> (b, 1, H, W) luminance (ITU-R 601: 0.299 R + 0.587 G + 0.114 B) or the channel."""
    if x.shape[1] != 3:
        return x.mean(axis=1, keepdims=True)
    return 0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]


def _blend(base, x, factor):
    """base + factor * (x - base), clipped: factor 0 gives base, 1 gives x, > 1 extrapolates."""
    xp = get_array_module(x)
    return xp.clip(base + _per_image(xp, factor, x) * (x - base), 0.0, 1.0)


def _enhance_factor(m, rng, b):
    return 1.0 + _signs(rng, b) * 0.9 * m / 10.0


def affine_nearest(x, theta, fill=0.5):
    """Resample every image of x with its own affine map, nearest neighbour.

    x: (b, C, H, W)   theta: (b, 2, 3) host array taking centred output coordinates (u, v, 1) to
    centred input coordinates (u_in, v_in). Output pixels whose source falls outside get ``fill``.
    """
    xp = get_array_module(x)
    b, c, h, w = x.shape
    theta = xp.asarray(theta, dtype=np.float32)
    v, u = xp.meshgrid(xp.arange(h, dtype=np.float32) - (h - 1) / 2,
                       xp.arange(w, dtype=np.float32) - (w - 1) / 2, indexing="ij")     # (H, W) each
    t = theta[:, :, :, None, None]                                                       # (b, 2, 3, 1, 1)
    src_u = xp.rint(t[:, 0, 0] * u + t[:, 0, 1] * v + t[:, 0, 2] + (w - 1) / 2).astype(np.int64)  # (b, H, W)
    src_v = xp.rint(t[:, 1, 0] * u + t[:, 1, 1] * v + t[:, 1, 2] + (h - 1) / 2).astype(np.int64)
    inside = (src_u >= 0) & (src_u < w) & (src_v >= 0) & (src_v < h)                    # (b, H, W)
    out = x[xp.arange(b)[:, None, None, None], xp.arange(c)[None, :, None, None],
            xp.clip(src_v, 0, h - 1)[:, None], xp.clip(src_u, 0, w - 1)[:, None]]       # (b, C, H, W)
    return xp.where(inside[:, None], out, xp.asarray(fill, dtype=x.dtype))


def _affine(b, a, bb, c, d, tu=0.0, tv=0.0):
    """Stack per-image 2x3 matrices [[a, bb, tu], [c, d, tv]] (each entry a scalar or (b,) array)."""
    theta = np.zeros((b, 2, 3))
    theta[:, 0, 0], theta[:, 0, 1], theta[:, 0, 2] = a, bb, tu
    theta[:, 1, 0], theta[:, 1, 1], theta[:, 1, 2] = c, d, tv
    return theta


# ----------------------------------------------------------------------------- the ops: (x, m, rng) -> x

def identity(x, m, rng):
    return x


def invert(x, m, rng):
    return 1.0 - x


def autocontrast(x, m, rng):
    xp = get_array_module(x)
    lo, hi = x.min(axis=(2, 3), keepdims=True), x.max(axis=(2, 3), keepdims=True)       # (b, C, 1, 1)
    span = hi - lo
    return xp.where(span > 0, (x - lo) / xp.where(span > 0, span, 1.0), x)


def equalize(x, m, rng):
    """Map each channel through its own normalised cumulative histogram (256 bins)."""
    xp = get_array_module(x)
    b, c, h, w = x.shape
    q = xp.rint(x * 255).astype(np.int64).reshape(b * c, h * w)                          # (bC, HW)
    rows = xp.arange(b * c)[:, None]
    hist = xp.bincount((rows * 256 + q).ravel(), minlength=b * c * 256).reshape(b * c, 256)
    cdf = xp.cumsum(hist, axis=1).astype(x.dtype)                                         # (bC, 256)
    cdf_min = xp.where(hist > 0, cdf, xp.asarray(np.inf, dtype=x.dtype)).min(axis=1, keepdims=True)
    denom = (h * w) - cdf_min
    lut = (cdf - cdf_min) / xp.where(denom > 0, denom, 1.0)                             # (bC, 256)
    out = xp.where(denom > 0, xp.take_along_axis(lut, q, axis=1), x.reshape(b * c, h * w))  # flat: as is
    return xp.clip(out, 0, 1).reshape(b, c, h, w).astype(x.dtype)


def brightness(x, m, rng):
    return _blend(0.0, x, _enhance_factor(m, rng, len(x)))


def color(x, m, rng):
    return _blend(_grey(x), x, _enhance_factor(m, rng, len(x)))


def contrast(x, m, rng):
    return _blend(_grey(x).mean(axis=(2, 3), keepdims=True), x, _enhance_factor(m, rng, len(x)))


def sharpness(x, m, rng):
    """Blend with PIL's SMOOTH filter [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13 (edges replicated)."""
    xp = get_array_module(x)
    h, w = x.shape[2:]
    padded = xp.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="edge")
    smooth = 4.0 * x
    for dy in range(3):
        for dx in range(3):
            smooth = smooth + padded[:, :, dy:dy + h, dx:dx + w]
    return _blend(smooth / 13.0, x, _enhance_factor(m, rng, len(x)))


def solarize(x, m, rng):
    threshold = 256.0 * (1.0 - m / 10.0)            # in 0..255 units; m = 0 changes nothing
    xp = get_array_module(x)
    return xp.where(x * 255.0 >= threshold, 1.0 - x, x)


def posterize(x, m, rng):
    xp = get_array_module(x)
    step = 2.0 ** (8 - max(1, 8 - int(round(4 * m / 10.0))))   # drop the low bits of 0..255
    return (xp.floor(xp.rint(x * 255.0) / step) * step / 255.0).astype(x.dtype)


def rotate(x, m, rng):
    angle = np.deg2rad(_signs(rng, len(x)) * 30.0 * m / 10.0)           # rotate the picture by +angle:
    cos, sin = np.cos(angle), np.sin(angle)                             # sample it at R(-angle) (u, v)
    return affine_nearest(x, _affine(len(x), cos, sin, -sin, cos))


def shear_x(x, m, rng):
    s = _signs(rng, len(x)) * 0.3 * m / 10.0
    return affine_nearest(x, _affine(len(x), 1.0, s, 0.0, 1.0))


def shear_y(x, m, rng):
    s = _signs(rng, len(x)) * 0.3 * m / 10.0
    return affine_nearest(x, _affine(len(x), 1.0, 0.0, s, 1.0))


def translate_x(x, m, rng):
    t = _signs(rng, len(x)) * 0.45 * m / 10.0 * x.shape[3]
    return affine_nearest(x, _affine(len(x), 1.0, 0.0, 0.0, 1.0, tu=-t))


def translate_y(x, m, rng):
    t = _signs(rng, len(x)) * 0.45 * m / 10.0 * x.shape[2]
    return affine_nearest(x, _affine(len(x), 1.0, 0.0, 0.0, 1.0, tv=-t))


OPS = {f.__name__: f for f in (identity, autocontrast, equalize, invert, rotate, posterize, solarize,
                               color, contrast, brightness, sharpness, shear_x, shear_y,
                               translate_x, translate_y)}


class RandAugment:
    """Apply ``num_ops`` ops, each picked uniformly per image from ``ops``, at magnitude ``magnitude``.

    x: (B, C, H, W) float in [0, 1] -> (B, C, H, W). Vectorised: per round, the images that drew op k
    are gathered and transformed together (a loop over the ~15 ops, never over images).
    """

    def __init__(self, num_ops: int = 2, magnitude: float = 9.0, ops=None):
        if not 0 <= magnitude <= 10:
            raise ValueError(f"RandAugment magnitude must be in [0, 10], got {magnitude}")
        names = list(ops) if ops is not None else list(OPS)
        unknown = [n for n in names if n not in OPS]
        if unknown:
            raise ValueError(f"unknown RandAugment ops {unknown}; known: {list(OPS)}")
        self.num_ops, self.magnitude, self.ops = num_ops, float(magnitude), [OPS[n] for n in names]

    def __call__(self, x, rng: np.random.Generator):
        xp = get_array_module(x)
        x = x.copy()
        for _ in range(self.num_ops):
            choice = rng.integers(len(self.ops), size=len(x))           # (B,) op index per image
            for k, op in enumerate(self.ops):
                idx = np.flatnonzero(choice == k)
                if idx.size:
                    idx = idx if xp is np else xp.asarray(idx)
                    x[idx] = op(x[idx], self.magnitude, rng)
        return x

    def __repr__(self) -> str:
        return f"RandAugment(num_ops={self.num_ops}, magnitude={self.magnitude}, ops={[f.__name__ for f in self.ops]})"
