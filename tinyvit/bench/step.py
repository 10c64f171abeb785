"""The pieces of a timed training step: the model and batch both sides start from, tinyvit's step
(with the kernels on or off), the thread and TF32 settings, the timing loop, peak memory, and the
machine's matmul peak for MFU.

A step is what training does for every batch: forward, cross-entropy, backward, AdamW update.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

import numpy as np

from .. import backend, kernels, optim
from .. import functional as F
from ..kernels import use_kernels
from ..kernels.cpu import threads as cpu_pool
from ..models import create
from .machine import blas_threads

# The optimizer of every side (one group, the same numbers).
LR, WEIGHT_DECAY = 1e-3, 0.05


# ====================================================================== the model, the batch, the step


def build_model(model: str, model_args: dict | None, seed: int):
    """The named model (tinyvit.models.create) on the CPU in float32, initialised from ``seed``:
    every side starts from these weights."""
    backend.manual_seed(seed)
    with backend.default_dtype(np.float32):
        return create(model, **(model_args or {}))


def synthetic_batch(cfg, batch_size: int, dtype, seed: int):
    """Standard-normal images (B, C, H, W) of ``dtype`` and int64 labels (B,), on the host."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((batch_size, cfg.in_channels, cfg.image_size, cfg.image_size)).astype(dtype)
    return images, rng.integers(0, max(cfg.num_classes, 1), batch_size)


def sync_of(xp):
    """A function that waits until the device has done its queued work (nothing to wait for on NumPy)."""
    if xp is np:
        return lambda: None
    return xp.cuda.get_current_stream().synchronize


# tinyvit's three paths: the reference ops alone; the model with its per-op kernels (the default,
# `model(x)`); and the explicit cross-layer fusion a training run takes (`kernels.fuse(model)`).
PATHS = ("fused", "kernels", "reference")


def tinyvit_step(model: str, model_args, images, labels, *, device="cpu", dtype="float32", seed=0,
                 path: str = "fused") -> tuple:
    """Build tinyvit's side and return (step, sync, losses): step() is one training step on ``path``
    (one of PATHS), losses collects each step's loss (a device array, read after timing)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    xp = backend.cupy_module() if device != "cpu" else np
    net = build_model(model, model_args, seed).to(device=device, dtype=dtype).train()
    kernels_on = path != "reference"
    with use_kernels(kernels_on):
        forward = kernels.fuse(net) if path == "fused" else net     # as `tinyvit train` does, in one line
    opt = optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    x, y = backend.to_device(images, device), backend.to_device(labels, device)
    losses = []

    def step():
        with use_kernels(kernels_on):                   # the switchboard reads it at every op
            loss = F.cross_entropy(forward(x), y)       # forward and loss
            opt.zero_grad()
            loss.backward()                             # backward
            opt.step()                                  # AdamW update
        losses.append(loss.data)

    return step, sync_of(xp), losses


def time_steps(step, sync, steps: int) -> tuple:
    """Run ``steps`` calls of step(), each followed by sync() (a GPU finishes its queued work).
    Returns (wall seconds, process CPU seconds) of each call: CPU time below threads x wall time
    means the process waited, for the machine or for itself."""
    walls, cpus = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        sync()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return walls, cpus


# ====================================================================== settings


@contextlib.contextmanager
def cpu_threads(n: int):
    """tinyvit on n CPU threads inside the block: NumPy's BLAS (blas_threads) and the kernels'
    element-wise blocks (tinyvit.kernels.cpu.threads). Yields the BLAS thread count in effect."""
    previous = cpu_pool.set_num_threads(n)
    try:
        with blas_threads(n) as in_effect:
            yield in_effect
    finally:
        cpu_pool.set_num_threads(previous)


def passive_torch_threads() -> bool:
    """Before PyTorch loads: make its idle OpenMP threads sleep at once (OMP_WAIT_POLICY=PASSIVE unless
    set), as tinyvit's do, so that neither side's threads spin through the other's timing. Read when
    PyTorch loads: False, changing nothing, if it already has."""
    if "torch" in sys.modules:
        return False
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return True


def measure_matmul_peak(device: str, dtype, repeats: int = 5) -> float:
    """FLOP/s of the best of ``repeats`` square (n x n) @ (n x n) products, n = 2048 on the CPU and
    8192 on a GPU, in ``dtype`` with the threads/TF32 setting in effect: the machine's practical
    matmul peak for MFU."""
    xp = backend.cupy_module() if device != "cpu" else np
    n = 8192 if xp is not np else 2048
    rng = np.random.default_rng(0)
    a, b = (xp.asarray(rng.standard_normal((n, n)).astype(dtype)) for _ in range(2))
    out = xp.empty((n, n), dtype=dtype)
    sync = sync_of(xp)
    xp.matmul(a, b, out=out)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        xp.matmul(a, b, out=out)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


# ====================================================================== memory


def _proc_status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"no {key} in /proc/self/status")


class PeakHostMemory:
    """Peak resident memory of this process inside a ``with`` block, over the memory at its start.
    ``bytes`` and ``method`` are set on exit."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                    # 5: reset the peak (VmHWM) to the current RSS
            self.method, self.start = "rss-peak", _proc_status_kib("VmRSS") * 1024
        except OSError:
            self.method, self.start = "maxrss-growth", self._maxrss()
        return self

    @staticmethod
    def _maxrss():
        import resource                        # Unix only
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024    # macOS reports bytes, Linux KiB

    def __exit__(self, *exc):
        peak = _proc_status_kib("VmHWM") * 1024 if self.method == "rss-peak" else self._maxrss()
        self.bytes = max(0, peak - self.start)
        return False


class PeakCupyMemory:
    """CuPy's default memory pool: emptied on entry; on exit ``bytes`` = the pool's total_bytes()
    (everything it holds, used or cached: the high-water mark, since the pool never gives back)."""
    method = "cupy-pool-total"

    def __enter__(self):
        cp = backend.cupy_module()
        cp.cuda.get_current_stream().synchronize()
        self.pool = cp.get_default_memory_pool()
        self.pool.free_all_blocks()
        self.start = self.pool.total_bytes()
        return self

    def __exit__(self, *exc):
        self.bytes = max(0, self.pool.total_bytes() - self.start)
        return False
