"""The gradient all-reduce of data-parallel training: every rank ends the backward pass with the
gradient of the global batch's mean loss.

Why a weighted sum. Rank r computed g_r, the gradient of the mean loss over its n_r rows. The global
batch's mean loss is (1 / n) sum over all rows, n = sum_r n_r, so its gradient is

    g = sum_r (n_r / n) g_r

Each rank puts n_r g_r and n_r in a buffer; one all-reduce sums both over the ranks; dividing by the
summed n gives g on every rank. With equal shards (the global batch split evenly, the usual case)
this is the plain mean of the g_r; with unequal ones (the last short batch of a tiny training set)
it is still exactly g, where a plain mean would over-weight the smaller shards.

Why buckets. One all-reduce per parameter would pay each message's fixed cost (latency, a kernel
launch) a hundred and fifty times a step for a ViT; one message holding everything would need a
buffer as large as the model and, for a large model, could not start before the whole backward
ends. As PyTorch's DistributedDataParallel does, the parameters are grouped into buckets of about
``BUCKET_BYTES`` (its default bucket_cap_mb is 25), in reverse order of registration, the order in
which backward finishes them, and each bucket is one preallocated flat array: the gradients are
copied in (already multiplied by n_r), one all-reduce runs in place, and the parameters' ``.grad``
become views of the result.

Not overlapped with the backward pass. DDP starts a bucket's all-reduce as soon as backward has
finished its last gradient, so that communication hides behind the rest of backward. That pays only
when the all-reduce is a large share of the step. Measured on 2 CPU cores (docs/performance.md,
`python -m tinyvit.bench.allreduce`): the all-reduce is 2.4% of a 2-rank step of vit-mnist/7, most
of it the wait for the slower rank, and a non-blocking all-reduce started before the backward pass
is no nearer done after it, since MPI without a progress thread moves data only inside MPI calls,
which the backward pass does not make. On 8 NVLink GPUs the estimate in docs/performance.md puts
the all-reduce at about 4% of the step of the large presets. So the all-reduce runs once backward
is done; tinyvit's autograd has no gradient-ready hook, and none is added for a gain that small.
"""
from __future__ import annotations

import weakref

from ..backend import get_array_module

# About this many bytes of gradients per all-reduce (PyTorch DDP's default bucket_cap_mb = 25).
BUCKET_BYTES = 25 * 2**20


class Bucket:
    """Parameters whose gradients travel in one all-reduce, and the flat buffer they travel in:

        buffer[offset_i : offset_i + size_i]   n_r * gradient of parameter i (zeros if it has none here)
        buffer[flags + i]                      1 if this rank has a gradient for parameter i, else 0
        buffer[-1]                             n_r, this rank's rows

    After the sum, the flags count the ranks that had a gradient: a parameter none of them had keeps
    ``grad = None`` (the optimizer skips it, as in one process)."""

    def __init__(self, params):
        self.params = list(params)
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.size
        self.flags = total
        first = self.params[0].data
        self.buffer = get_array_module(first).zeros(total + len(self.params) + 1, dtype=first.dtype)

    def fill(self, rows: int) -> list:
        """Copy this rank's gradients in, times ``rows``; returns the indices of parameters without one."""
        xp, buf, missing = get_array_module(self.buffer), self.buffer, []
        for i, (p, start) in enumerate(zip(self.params, self.offsets)):
            part = buf[start:start + p.size]
            if p.grad is None:
                part[...] = 0
                missing.append(i)
            else:
                xp.multiply(p.grad.reshape(-1), rows, out=part)
        buf[self.flags:-1] = 1
        for i in missing:
            buf[self.flags + i] = 0
        buf[-1] = rows
        return missing

    def scatter(self, missing: list) -> None:
        """Divide the summed gradients by the summed rows and make them the parameters' gradients
        (views of the buffer: no copy). Only where this rank had no gradient is a flag read back
        (on a GPU that waits for the device), to learn whether another rank had one."""
        buf = self.buffer
        grads = buf[:self.flags]
        grads /= buf[-1:]                     # on the device: no host read of the row count
        for i, (p, start) in enumerate(zip(self.params, self.offsets)):
            if i in missing and float(buf[self.flags + i]) == 0:
                continue                      # no rank had a gradient: keep None
            p.grad = grads[start:start + p.size].reshape(p.shape)


class GradientBuckets:
    """The buckets of one model's trainable parameters, for one World."""

    def __init__(self, params, world, bucket_bytes: int = BUCKET_BYTES):
        self.world = world
        self.buckets, group, nbytes = [], [], 0
        for p in reversed([p for p in params if p.requires_grad]):      # the order backward finishes them
            if group and (nbytes + p.data.nbytes > bucket_bytes or _kind(p) != _kind(group[0])):
                self.buckets.append(Bucket(group))
                group, nbytes = [], 0
            group.append(p)
            nbytes += p.data.nbytes
        if group:
            self.buckets.append(Bucket(group))
        self.key = _key(params)

    def average(self, rows: int) -> None:
        """Turn every parameter's gradient of this rank's mean loss over ``rows`` rows into the
        gradient of the mean loss over all ranks' rows (module docstring), on every rank."""
        for bucket in self.buckets:
            missing = bucket.fill(rows)
            self.world.all_reduce_sum(bucket.buffer)
            bucket.scatter(missing)


def _kind(p) -> tuple:
    """Parameters share a buffer only with the same dtype on the same device."""
    return p.data.dtype, getattr(p.data, "device", "cpu")


def _key(params) -> tuple:
    return tuple((id(p), _kind(p), p.shape, p.requires_grad) for p in params)


_buckets = weakref.WeakKeyDictionary()       # model -> its GradientBuckets, made on first use


def average_gradients(model, rows: int, world, bucket_bytes: int = BUCKET_BYTES) -> None:
    """All-reduce ``model``'s gradients over the ranks of ``world`` (weighted by ``rows``, this
    rank's rows in the step); nothing at all in a single process. The buckets are made at the first
    call and made again if the parameters change (another dtype or device after ``model.to``)."""
    if world.size == 1:
        return
    params = list(model.parameters())
    buckets = _buckets.get(model)
    if buckets is None or buckets.key != _key(params) or buckets.world is not world:
        buckets = _buckets[model] = GradientBuckets(params, world, bucket_bytes)
    buckets.average(rows)
