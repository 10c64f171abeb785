"""Batching: walk over (images, labels) arrays in (shuffled) mini-batches, on the device you train on.

Each batch is gathered on the host as uint8, moved to the device (4x fewer bytes than float32),
and only there turned into floats, by ``transform`` (an :class:`~tinyvit.data.augment.Augment`) or,
without one, by scaling to [0, 1]. So augmentation always runs on the device that trains.

The shuffling generator is a ``numpy.random.Generator`` whose state is part of
:meth:`DataLoader.state_dict`: a run resumed from a checkpoint taken in the middle of an epoch sees
the same order for the rest of that epoch, and the same orders afterwards.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

import numpy as np

from ..backend import get_array_module, get_default_dtype, to_device


def to_float(images, dtype=None):
    """uint8 pixels (B, C, H, W) -> floats in [0, 1] of ``dtype`` (default float32), on the same device.

    Float input is taken to be in [0, 1] already and is only cast.
    """
    dtype = dtype or get_default_dtype()
    if images.dtype == np.uint8:
        return images.astype(dtype) / 255
    return images.astype(dtype, copy=False)


class DataLoader:
    """Iterate over ``(images, labels)`` in batches of ``batch_size``.

    images: (N, C, H, W) uint8 (or float in [0, 1])    labels: (N,) int64
    Each step yields ``transform(x, y)`` if a transform is given, else ``(to_float(x), y)``, where
    x: (B, C, H, W) and y: (B,) are already on ``device`` ('cpu', 'cuda', 'cuda:N').

    shuffle: a new random order every epoch, drawn from ``np.random.default_rng(seed)``; without it
    the order is 0..N-1. drop_last: skip the last batch when it is smaller than batch_size (keeps
    batch statistics and step shapes constant in training); otherwise it is yielded short.

    Iterating again after a ``break`` continues the unfinished epoch (that is what resuming means);
    a finished epoch starts the next one with a new order.

    shard=(rank, ranks): this process's share of every batch, in data-parallel training
    (tinyvit.distributed). Every rank draws the same order from the same seed, walks the same
    batches of ``batch_size`` (the global batch), and keeps rows [rank * b // ranks, (rank + 1) * b // ranks)
    of each batch of b rows: together the ranks see each batch exactly once. Epoch, position and
    generator states count global batches, so a checkpoint resumes with any number of ranks.
    """

    def __init__(self, images, labels, batch_size: int, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = False, device: str = "cpu", transform: Optional[Callable] = None,
                 dtype=None, shard: tuple = (0, 1)):
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        rank, ranks = shard
        if not 0 <= rank < ranks:
            raise ValueError(f"shard (rank, ranks) needs 0 <= rank < ranks, got {shard}")
        self.images, self.labels = images, labels
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.device, self.transform, self.dtype = device, transform, dtype
        self.shard = (int(rank), int(ranks))
        if ranks > 1 and min(self._batch_sizes(), default=ranks) < ranks:
            raise ValueError(f"a batch of {min(self._batch_sizes())} images cannot be shared among {ranks} ranks: "
                             f"give every rank at least one image (more images, or fewer ranks)")
        self.rng = np.random.default_rng(seed)
        self.epoch = 0                 # epochs completed
        self.position = 0              # batches already handed out in the current epoch
        self._order_state = None       # generator state the current epoch's order is drawn from

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.images)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _batch_sizes(self) -> list:
        """The rows of each (global) batch of an epoch."""
        n, b = len(self.images), self.batch_size
        return [min(b, n - i * b) for i in range(len(self))]

    def _my_rows(self, idx):
        """This rank's contiguous slice of one global batch's indices (all of them without a shard)."""
        rank, ranks = self.shard
        return idx[rank * len(idx) // ranks:(rank + 1) * len(idx) // ranks]

    def rows_per_epoch(self) -> int:
        """The rows this rank takes in one epoch (every row of the epoch without a shard)."""
        rank, ranks = self.shard
        return sum((rank + 1) * b // ranks - rank * b // ranks for b in self._batch_sizes())

    def _epoch_order(self) -> np.ndarray:
        """The permutation of this epoch, redrawn from its saved generator state when resuming."""
        if self._order_state is None:
            self._order_state = copy.deepcopy(self.rng.bit_generator.state)
        else:
            self.rng.bit_generator.state = copy.deepcopy(self._order_state)
        n = len(self.images)
        return self.rng.permutation(n) if self.shuffle else np.arange(n)

    def _next_epoch(self) -> None:
        self.epoch, self.position, self._order_state = self.epoch + 1, 0, None

    def __iter__(self):
        if self.position >= len(self):           # the last epoch was consumed batch by batch with next()
            self._next_epoch()
        order = self._epoch_order()
        xp = get_array_module(self.images)         # the arrays may already live on the GPU
        for b in range(self.position, len(self)):
            idx = self._my_rows(order[b * self.batch_size:(b + 1) * self.batch_size])   # (B / ranks,)
            idx = idx if xp is np else xp.asarray(idx)
            x = to_device(self.images[idx], self.device)                       # (B, C, H, W) uint8
            y = to_device(self.labels[idx], self.device)                       # (B,) int64
            batch = self.transform(x, y) if self.transform is not None else (to_float(x, self.dtype), y)
            self.position = b + 1                   # counted once ready: a checkpoint taken after
            yield batch                             # this step resumes with batch b + 1
        self._next_epoch()

    def state_dict(self) -> dict:
        """Everything needed to continue exactly here: epoch, position, generator states (JSON-able)."""
        state = {"epoch": self.epoch, "position": self.position,
                 "rng": copy.deepcopy(self.rng.bit_generator.state),
                 "order_rng": copy.deepcopy(self._order_state)}
        if hasattr(self.transform, "state_dict"):
            state["transform"] = self.transform.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; the next iteration continues from that point."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.rng.bit_generator.state = copy.deepcopy(state["rng"])
        self._order_state = copy.deepcopy(state["order_rng"])
        if "transform" in state and hasattr(self.transform, "load_state_dict"):
            self.transform.load_state_dict(state["transform"])
