"""The one shape every dataset takes: :class:`ImageDataset`, plain arrays plus what describes them.

    train_images: (N_train, C, H, W) uint8      train_labels: (N_train,) int64 in [0, K)
    test_images:  (N_test,  C, H, W) uint8      test_labels:  (N_test,)  int64
    classes: K names;   mean, std: C floats each, in the [0, 1] pixel scale (x / 255)

Images stay uint8 until they reach the device: four times less memory and transfer than float32.
The loader (loader.py) and augmentation (augment.py) turn them into normalised float batches.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import numpy as np

from .errors import DataFormatError

# Per-channel mean and standard deviation of the training pixels (scaled to [0, 1]), the values the
# literature uses: CIFAR-10 and CIFAR-100 as computed over the 50,000 training images (population
# std over all pixels), Fashion-MNIST over its 60,000 training images.
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
FASHION_MNIST_MEAN, FASHION_MNIST_STD = (0.2860,), (0.3530,)


@dataclass
class ImageDataset:
    """A classification dataset held in memory as NumPy arrays (see the module docstring for shapes)."""

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    classes: Sequence[str]
    mean: tuple
    std: tuple
    info: dict = field(default_factory=dict)     # where it came from (folder, files), free-form

    def __post_init__(self):
        self.classes = list(self.classes)
        self.mean, self.std = tuple(float(m) for m in self.mean), tuple(float(s) for s in self.std)
        for split in ("train", "test"):
            x, y = getattr(self, f"{split}_images"), getattr(self, f"{split}_labels")
            if x.ndim != 4:
                raise DataFormatError(f"{self.name}: {split}_images must be (N, C, H, W), got {x.shape}")
            if y.shape != (x.shape[0],):
                raise DataFormatError(f"{self.name}: {split}_labels has shape {y.shape}, "
                                      f"expected ({x.shape[0]},) to match {split}_images")
            if y.size and (y.min() < 0 or y.max() >= len(self.classes)):
                raise DataFormatError(f"{self.name}: {split}_labels outside [0, {len(self.classes)})")
        if self.train_images.shape[1:] != self.test_images.shape[1:]:
            raise DataFormatError(f"{self.name}: train images {self.train_images.shape[1:]} and test "
                                  f"images {self.test_images.shape[1:]} differ in shape")
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise DataFormatError(f"{self.name}: mean/std need {self.channels} values (one per channel)")

    @property
    def channels(self) -> int:
        """C, the number of colour channels (3 for CIFAR, 1 for Fashion-MNIST)."""
        return self.train_images.shape[1]

    @property
    def image_size(self) -> int:
        """H (= W for every dataset here)."""
        return self.train_images.shape[2]

    @property
    def num_classes(self) -> int:
        """K, the number of classes."""
        return len(self.classes)

    def subset(self, train: Optional[int] = None, test: Optional[int] = None) -> "ImageDataset":
        """The first ``train`` training and ``test`` test examples (None keeps a split whole)."""
        return replace(self, train_images=self.train_images[:train], train_labels=self.train_labels[:train],
                       test_images=self.test_images[:test], test_labels=self.test_labels[:test])

    def __repr__(self) -> str:
        return (f"ImageDataset({self.name!r}, train={self.train_images.shape}, test={self.test_images.shape}, "
                f"classes={self.num_classes}, mean={self.mean}, std={self.std})")
