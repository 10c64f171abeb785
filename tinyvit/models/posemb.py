"""Position embeddings beyond the learned table: fixed 2D sin-cos, and the paper's 2D interpolation
of learned embeddings for a new resolution (section 3.2, "Fine-tuning and higher resolution")."""
from __future__ import annotations

import numpy as np


def sincos_2d(grid_h: int, grid_w: int, dim: int, temperature: float = 10000.0) -> np.ndarray:
    """Fixed 2D sin-cos embeddings (gh*gw, dim), rows in row-major grid order.

    A quarter of the channels each for sin(x w), cos(x w), sin(y w), cos(y w) (x: column, y: row),
    with frequencies w_k = 1 / temperature^(k / (dim/4)), k = 0..dim/4-1, as MoCo v3 (Chen et al.
    2021). big_vision's posemb_sincos_2d divides the exponent by dim/4 - 1 instead: close, not equal."""
    if dim % 4:
        raise ValueError(f"sincos_2d needs dim divisible by 4, got {dim}")
    y, x = np.meshgrid(np.arange(grid_h, dtype=np.float64), np.arange(grid_w, dtype=np.float64), indexing="ij")
    omega = 1.0 / temperature ** (np.arange(dim // 4) / (dim // 4))
    y = y.reshape(-1, 1) * omega
    x = x.reshape(-1, 1) * omega
    return np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)


def _linear_weights(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) matrix of 1-D linear interpolation that maps the end points onto each other,
    as scipy.ndimage.zoom(order=1) does (the official code's resize)."""
    w = np.zeros((n_out, n_in))
    if n_in == 1 or n_out == 1:     # degenerate grids: zoom maps output 0 onto input 0
        w[:, 0] = 1.0
        return w
    src = np.arange(n_out) * (n_in - 1) / (n_out - 1)
    lo = np.clip(np.floor(src).astype(int), 0, n_in - 2)
    frac = src - lo
    w[np.arange(n_out), lo] = 1.0 - frac
    w[np.arange(n_out), lo + 1] += frac
    return w


def _cubic_weights(n_in: int, n_out: int, a: float = -0.5) -> np.ndarray:
    """(n_out, n_in) matrix of timm's bicubic resize: torch.nn.functional.interpolate(mode="bicubic",
    align_corners=False, antialias=True), which timm's resample_abs_pos_embed uses to grow and to
    shrink alike. That is PIL's resampling filter: Keys' cubic kernel with a = -0.5 (interpolate
    without antialias uses -0.75 and clamps the borders), centred for output i at (i + 1/2) s on the
    input axis, s = n_in / n_out; when shrinking (s > 1) the kernel is stretched by s, so that every
    input position under an output one contributes (the antialiasing). Taps outside the grid are
    dropped and each row is normalised to sum to 1."""
    scale = n_in / n_out
    stretch = max(scale, 1.0)                                   # > 1 only when shrinking
    centres = (np.arange(n_out) + 0.5) * scale                   # output i's centre, in input pixels
    t = np.abs(np.arange(n_in) + 0.5 - centres[:, None]) / stretch   # (n_out, n_in) distances, kernel units
    w = np.where(t <= 1, ((a + 2) * t - (a + 3)) * t * t + 1,
                 np.where(t < 2, ((a * t - 5 * a) * t + 8 * a) * t - 4 * a, 0.0))
    return w / w.sum(axis=1, keepdims=True)


def resize_pos_embed(pos_embed, old_grid, new_grid, method: str = "bilinear", num_prefix_tokens: int = 1):
    """2D-interpolate learned position embeddings to a new patch grid (paper, section 3.2).

    pos_embed: (1, prefix + gh*gw, D) array; old_grid, new_grid: int or (h, w).
    The class-token entry (the first ``num_prefix_tokens``) is kept; the grid is interpolated
    bilinearly as the official code (scipy zoom, order 1) or bicubically as timm (PyTorch's
    antialiased bicubic, also when growing). Both are separable: W_y (new_h, old_h) and W_x
    (new_w, old_w) give W_y grid W_x^T for each channel.
    Returns (1, prefix + new_h*new_w, D) in the input's dtype. Same grid -> the input unchanged.
    """
    old = (old_grid, old_grid) if isinstance(old_grid, int) else tuple(old_grid)
    new = (new_grid, new_grid) if isinstance(new_grid, int) else tuple(new_grid)
    pos = np.asarray(pos_embed)
    if pos.ndim != 3 or pos.shape[0] != 1 or pos.shape[1] != num_prefix_tokens + old[0] * old[1]:
        raise ValueError(f"pos_embed of shape {pos.shape} does not match a {old[0]}x{old[1]} grid "
                         f"with {num_prefix_tokens} prefix token(s)")
    if old == new:
        return pos_embed
    weights = {"bilinear": _linear_weights, "bicubic": _cubic_weights}
    if method not in weights:
        raise ValueError(f"method must be 'bilinear' or 'bicubic', got {method!r}")
    prefix, grid = pos[:, :num_prefix_tokens], pos[0, num_prefix_tokens:].reshape(old[0], old[1], -1)
    wy, wx = weights[method](old[0], new[0]), weights[method](old[1], new[1])
    # Separable: resize along y, then x. (new_h, old_h) x (old_h, old_w, D) -> (new_h, old_w, D) ...
    resized = np.einsum("ya,xb,abd->yxd", wy, wx, grid.astype(np.float64), optimize=True)
    resized = resized.reshape(1, new[0] * new[1], -1).astype(pos.dtype)
    return np.concatenate([prefix, resized], axis=1)
