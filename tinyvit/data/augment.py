"""Data augmentation as array operations on whole batches, on whatever device the batch lives on.

Every function takes a batch x: (B, C, H, W) (NumPy or CuPy, ``xp = get_array_module(x)``) and
an explicit ``numpy.random.Generator``: the random draws are small per-image parameters made on
the host, so the same seed gives the same result on CPU and GPU (except random erasing's noise, a
whole batch of it, which a GPU draws itself). No function loops over images.

    normalize(x, mean, std)                       (x - mean) / std per channel
    random_crop(x, rng, padding=4, mode)          pad by 4 (reflect or zero), crop H x W at random
    horizontal_flip(x, rng, p=0.5)                mirror a random half of the images
    random_erasing(x, rng, p, ...)                blank one random rectangle (Zhong et al., 2020)
    mixup(x, y, rng, alpha, K)                    x' = lam x + (1 - lam) x[perm], same for targets
    cutmix(x, y, rng, alpha, K)                   paste a box from x[perm]; targets by area
    RandAugment(n, m)                             see randaugment.py

Mixup and CutMix return SOFT targets (B, K) whose rows sum to 1, for a cross-entropy that accepts
probabilities; label smoothing is left to the loss (F.cross_entropy(..., label_smoothing=)).
:class:`Augment` chains them into the usual training recipe.
"""
from __future__ import annotations

import copy
from typing import Optional, Sequence

import numpy as np

from ..backend import get_array_module
from .loader import to_float
from .randaugment import RandAugment


def normalize(x, mean: Sequence[float], std: Sequence[float]):
    """(x - mean[c]) / std[c] for each channel c.  x: (B, C, H, W) float -> same shape and dtype."""
    xp = get_array_module(x)
    mean = xp.asarray(mean, dtype=x.dtype).reshape(1, -1, 1, 1)
    std = xp.asarray(std, dtype=x.dtype).reshape(1, -1, 1, 1)
    return (x - mean) / std


def random_crop(x, rng: np.random.Generator, padding: int = 4, mode: str = "reflect"):
    """Pad each side by ``padding`` and cut out an H x W window at a random offset per image.

    x: (B, C, H, W) -> (B, C, H, W). mode: "reflect" (mirror the border) or "zero".
    padding=0 returns x unchanged. The window is gathered with one fancy-indexing expression.
    """
    if padding == 0:
        return x
    if mode not in ("reflect", "zero"):
        raise ValueError(f"crop mode must be 'reflect' or 'zero', got {mode!r}")
    xp = get_array_module(x)
    b, c, h, w = x.shape
    padded = xp.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)),
                    mode="reflect" if mode == "reflect" else "constant")          # (B, C, H+2p, W+2p)
    top = rng.integers(0, 2 * padding + 1, size=b)                                # (B,)
    left = rng.integers(0, 2 * padding + 1, size=b)
    rows = xp.asarray(top[:, None] + np.arange(h))                                # (B, H)
    cols = xp.asarray(left[:, None] + np.arange(w))                               # (B, W)
    return padded[xp.arange(b)[:, None, None, None], xp.arange(c)[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]


def horizontal_flip(x, rng: np.random.Generator, p: float = 0.5):
    """Mirror (left <-> right) each image with probability p.  x: (B, C, H, W) -> same."""
    xp = get_array_module(x)
    flip = xp.asarray(rng.random(len(x)) < p)                                     # (B,) bool
    return xp.where(flip[:, None, None, None], x[..., ::-1], x)


def one_hot(labels, num_classes: int, dtype=np.float32):
    """(B,) int -> (B, K) with a 1 in each row's label column."""
    xp = get_array_module(labels)
    return xp.eye(num_classes, dtype=dtype)[labels]


def _as_probs(targets, num_classes, dtype):
    if targets.ndim == 2:
        return targets.astype(dtype, copy=False)
    if num_classes is None:
        raise ValueError("integer labels need num_classes to become soft targets")
    return one_hot(targets, num_classes, dtype)


def mixup(x, targets, rng: np.random.Generator, alpha: float = 0.8, num_classes: Optional[int] = None):
    """Mixup (Zhang et al., 2018): blend every image with another image of the batch.

    lam ~ Beta(alpha, alpha) once per batch, perm a random permutation of the batch:
        x' = lam x + (1 - lam) x[perm]        y' = lam y + (1 - lam) y[perm]
    x: (B, C, H, W) float; targets: (B,) int (needs num_classes) or (B, K) probabilities.
    Returns (x', y' (B, K), lam).
    """
    y = _as_probs(targets, num_classes, x.dtype)
    lam = float(rng.beta(alpha, alpha))
    perm = get_array_module(x).asarray(rng.permutation(len(x)))
    return lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm], lam


def cutmix(x, targets, rng: np.random.Generator, alpha: float = 1.0, num_classes: Optional[int] = None):
    """CutMix (Yun et al., 2019): paste one box cut from x[perm] into every image of the batch.

    lam ~ Beta(alpha, alpha); a box of area (1 - lam) H W, centred at a uniform random pixel and
    clipped to the image. The targets mix by the area actually pasted:
        lam' = 1 - box area / (H W)           y' = lam' y + (1 - lam') y[perm]
    Returns (x', y' (B, K), lam').
    """
    xp = get_array_module(x)
    b, c, h, w = x.shape
    y = _as_probs(targets, num_classes, x.dtype)
    lam = float(rng.beta(alpha, alpha))
    perm = xp.asarray(rng.permutation(b))
    cut_h, cut_w = int(h * np.sqrt(1 - lam)), int(w * np.sqrt(1 - lam))
    cy, cx = int(rng.integers(h)), int(rng.integers(w))
    y0, y1 = np.clip([cy - cut_h // 2, cy + cut_h - cut_h // 2], 0, h)
    x0, x1 = np.clip([cx - cut_w // 2, cx + cut_w - cut_w // 2], 0, w)
    rows, cols = xp.arange(h)[:, None], xp.arange(w)[None, :]
    box = (rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1)                 # (H, W) bool
    lam = 1.0 - float((y1 - y0) * (x1 - x0)) / (h * w)
    return xp.where(box, x[perm], x), lam * y + (1 - lam) * y[perm], lam


def random_erasing(x, rng: np.random.Generator, p: float = 0.25, scale=(0.02, 1 / 3), ratio=(0.3, 3.3),
                   value="pixel"):
    """Random Erasing (Zhong et al., 2020): with probability p, blank a random rectangle per image.
    (The boxes come from ``rng`` on every device; on a GPU the noise that fills them comes from a
    CuPy generator seeded from ``rng``: other numbers than NumPy's, as reproducible.)

    The rectangle covers a fraction ~U(scale) of the image with aspect ratio h/w log-uniform in
    ratio, clipped to the image. value: "pixel" (fill with N(0, 1) noise per pixel, for normalised
    images, as DeiT does) or a number. x: (B, C, H, W) float -> same.
    """
    xp = get_array_module(x)
    b, c, h, w = x.shape
    erase = rng.random(b) < p                                                      # (B,)
    area = rng.uniform(*scale, size=b) * h * w
    aspect = np.exp(rng.uniform(np.log(ratio[0]), np.log(ratio[1]), size=b))
    eh = np.clip(np.rint(np.sqrt(area * aspect)), 1, h).astype(np.int64)          # (B,) box heights
    ew = np.clip(np.rint(np.sqrt(area / aspect)), 1, w).astype(np.int64)
    top = (rng.random(b) * (h - eh + 1)).astype(np.int64)
    left = (rng.random(b) * (w - ew + 1)).astype(np.int64)
    dev = lambda a: xp.asarray(a)[:, None, None, None]                             # noqa: E731
    rows, cols = xp.arange(h)[None, None, :, None], xp.arange(w)[None, None, None, :]
    mask = dev(erase) & (rows >= dev(top)) & (rows < dev(top + eh)) & (cols >= dev(left)) & (cols < dev(left + ew))
    if value == "pixel" and xp is np:
        fill = rng.standard_normal(x.shape, dtype=np.float32).astype(x.dtype, copy=False)
    elif value == "pixel":  # a whole batch of noise is drawn where it is used, by a GPU generator
        # seeded from rng: reproducible from rng's state, never made on the host and copied
        device_rng = xp.random.RandomState(int(rng.integers(2**63)))
        fill = device_rng.standard_normal(x.shape, dtype=np.float32).astype(x.dtype, copy=False)
    else:
        fill = xp.asarray(value, dtype=x.dtype)
    return xp.where(mask, fill, x)                                                 # mask: (B, 1, H, W)


class Augment:
    """The training (or evaluation) transform: uint8 batch -> (normalised float batch, targets).

    Order, as in the DeiT/timm recipe: to float in [0, 1] -> RandAugment -> random crop ->
    horizontal flip -> normalize -> random erasing -> mixup or CutMix. With every option off it is
    the evaluation transform (to float, normalize).

    images: (B, C, H, W) uint8 or float in [0, 1], on any device; labels: (B,) int.
    Returns x: (B, C, H, W) of ``dtype`` (default: the backend's, float32) and targets: (B,) int
    labels, or (B, K) probabilities whenever mixup_alpha > 0 or cutmix_alpha > 0 (even for a batch
    left unmixed).

    mix_prob: chance that a batch is mixed at all; switch_prob: chance of CutMix rather than Mixup
    when both alphas are set. All randomness comes from ``np.random.default_rng(seed)``, whose state
    :meth:`state_dict` saves.
    """

    def __init__(self, mean, std, num_classes: Optional[int] = None, crop_padding: int = 0,
                 crop_mode: str = "reflect", flip: bool = False, randaug_n: int = 0, randaug_m: float = 9.0,
                 mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0, mix_prob: float = 1.0,
                 switch_prob: float = 0.5, erasing_p: float = 0.0, seed: int = 0, dtype=None):
        self.mean, self.std, self.num_classes = tuple(mean), tuple(std), num_classes
        self.crop_padding, self.crop_mode, self.flip = crop_padding, crop_mode, flip
        self.randaug = RandAugment(randaug_n, randaug_m) if randaug_n > 0 else None
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.mix_prob, self.switch_prob, self.erasing_p = mix_prob, switch_prob, erasing_p
        self.dtype = dtype
        if self.soft_targets and num_classes is None:
            raise ValueError("mixup/cutmix need num_classes to build soft targets")
        self.rng = np.random.default_rng(seed)

    @property
    def soft_targets(self) -> bool:
        """True when targets come out as (B, K) probabilities."""
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    @property
    def is_random(self) -> bool:
        """False for the evaluation transform (no random op enabled)."""
        return bool(self.crop_padding or self.flip or self.randaug or self.soft_targets or self.erasing_p)

    def __call__(self, images, labels):
        x = to_float(images, self.dtype)                                  # (B, C, H, W) in [0, 1]
        if self.randaug is not None:
            x = self.randaug(x, self.rng)
        if self.crop_padding:
            x = random_crop(x, self.rng, self.crop_padding, self.crop_mode)
        if self.flip:
            x = horizontal_flip(x, self.rng)
        x = normalize(x, self.mean, self.std)
        if self.erasing_p > 0:
            x = random_erasing(x, self.rng, self.erasing_p)
        if not self.soft_targets:
            return x, labels
        if self.rng.random() >= self.mix_prob:
            return x, _as_probs(labels, self.num_classes, x.dtype)
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0 or self.rng.random() < self.switch_prob)
        if use_cutmix:
            x, y, _ = cutmix(x, labels, self.rng, self.cutmix_alpha, self.num_classes)
        else:
            x, y, _ = mixup(x, labels, self.rng, self.mixup_alpha, self.num_classes)
        return x, y

    def state_dict(self) -> dict:
        return {"rng": copy.deepcopy(self.rng.bit_generator.state)}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = copy.deepcopy(state["rng"])

    def __repr__(self) -> str:
        on = [f"crop(pad={self.crop_padding}, {self.crop_mode})" if self.crop_padding else "",
              "flip" if self.flip else "", repr(self.randaug) if self.randaug else "",
              f"erasing(p={self.erasing_p})" if self.erasing_p else "",
              f"mixup(alpha={self.mixup_alpha})" if self.mixup_alpha else "",
              f"cutmix(alpha={self.cutmix_alpha})" if self.cutmix_alpha else ""]
        ops = ", ".join(o for o in on if o) or "no random ops"
        return f"Augment(normalize(mean={self.mean}, std={self.std}), {ops})"
