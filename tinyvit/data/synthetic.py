"""A synthetic image dataset that needs no download: seeded, learnable, in the shape of the real ones.

Each class k is a coloured stripe pattern, a plane wave with its own orientation, frequency and
per-channel colour, on a class-specific background tint::

    wave_k(u, v)   = cos(2 pi f_k (u cos theta_k + v sin theta_k) + phi)       u, v in [0, 1)
    image[c, v, u] = 0.5 + 0.3 * colour_k[c] * wave_k(u, v) + 0.15 * tint_k[c] + noise

Every image draws its own phase phi (the stripes shift anywhere), contrast and brightness jitter
and Gaussian pixel noise. With 3 channels and 10 classes, colour alone identifies about 70% of the
images; the rest needs the orientation and width of the stripes, which no single pixel shows: the
class mean image is a poor template (the phase averages out), while a small model that looks at
patches gets close to 100% in a couple of epochs. The same seed gives the same bytes on every
machine (NumPy's PCG64 generator).
"""
from __future__ import annotations

import numpy as np

from .dataset import ImageDataset


def _render(rng: np.random.Generator, labels: np.ndarray, protos: dict, image_size: int, channels: int,
            noise: float) -> np.ndarray:
    """Draw one image per label: (N,) int64 -> (N, C, S, S) uint8."""
    n = len(labels)
    grid = np.arange(image_size, dtype=np.float32) / image_size               # (S,)
    u, v = grid[None, None, :], grid[None, :, None]                            # (1, 1, S), (1, S, 1)
    theta, freq = protos["theta"][labels], protos["freq"][labels]             # (N,)
    phase = rng.uniform(-np.pi, np.pi, n).astype(np.float32)          # (N,) stripe shift
    wave = np.cos(2 * np.pi * freq[:, None, None] * (u * np.cos(theta)[:, None, None] +
                                                       v * np.sin(theta)[:, None, None])
                  + phase[:, None, None])                                      # (N, S, S)
    contrast = rng.uniform(0.7, 1.3, (n, 1, 1, 1)).astype(np.float32)
    brightness = rng.normal(0.0, 0.05, (n, 1, 1, 1)).astype(np.float32)
    colour = protos["colour"][labels][:, :, None, None]                        # (N, C, 1, 1)
    tint = protos["tint"][labels][:, :, None, None]                            # (N, C, 1, 1)
    images = (0.5 + 0.3 * contrast * colour * wave[:, None] + 0.15 * tint + brightness
              + rng.normal(0.0, noise, (n, channels, image_size, image_size)).astype(np.float32))
    return np.clip(np.rint(images * 255), 0, 255).astype(np.uint8)


def make_synthetic(num_classes: int = 10, image_size: int = 32, channels: int = 3, train_size: int = 5000,
                   test_size: int = 1000, noise: float = 0.1, seed: int = 0) -> ImageDataset:
    """Build the synthetic dataset (see the module docstring).

    Returns an ImageDataset with train_images (train_size, channels, image_size, image_size) uint8,
    balanced int64 labels in [0, num_classes), class names "class_0" ..., and the per-channel
    mean/std measured on the training images. Deterministic for a given set of arguments.
    """
    least = dict(num_classes=2, image_size=4, channels=1, train_size=1, test_size=1)
    given = dict(num_classes=num_classes, image_size=image_size, channels=channels, train_size=train_size,
                 test_size=test_size)
    bad = [f"{name} must be a whole number >= {least[name]}, got {value!r}" for name, value in given.items()
           if not isinstance(value, int) or isinstance(value, bool) or value < least[name]]
    if bad:                                 # its settings come from [dataset] (--config) or --dataset-arg
        raise ValueError(f"synthetic dataset: {'; '.join(bad)} ([dataset] of --config, or --dataset-arg)")
    rng = np.random.default_rng(seed)
    k = num_classes
    # orientations spread over [0, pi) and shuffled, so neighbouring labels are not neighbouring angles
    theta = rng.permutation(np.linspace(0, np.pi, k, endpoint=False)) + rng.uniform(-0.1, 0.1, k)
    protos = {
        "theta": theta.astype(np.float32),                                      # (K,)
        "freq": rng.uniform(1.0, 3.5, k).astype(np.float32),                    # (K,) stripes per image
        "colour": rng.choice([-1.0, 1.0], (k, channels)).astype(np.float32)
                  * rng.uniform(0.5, 1.0, (k, channels)).astype(np.float32),   # (K, C)
        "tint": rng.uniform(-1.0, 1.0, (k, channels)).astype(np.float32),       # (K, C)
    }
    splits = []
    for n in (train_size, test_size):
        labels = rng.permutation(np.arange(n) % k).astype(np.int64)             # balanced classes
        splits += [_render(rng, labels, protos, image_size, channels, noise), labels]
    pixels = splits[0].astype(np.float64) / 255.0
    mean, std = pixels.mean(axis=(0, 2, 3)), pixels.std(axis=(0, 2, 3))
    return ImageDataset("synthetic", *splits, classes=[f"class_{i}" for i in range(k)],
                        mean=tuple(mean), std=tuple(np.maximum(std, 1e-3)),
                        info={"seed": seed, "noise": noise})
