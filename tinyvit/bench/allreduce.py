"""The data-parallel training step on N ranks: images/s, the gradient all-reduce's share of the
step, whether starting it during the backward pass would hide it, and what 8 GPUs would give.

    python -m tinyvit.bench.allreduce                        # 1 rank, on every core it may use
    mpirun -n 2 python -m tinyvit.bench.allreduce            # 2 ranks (mpirun binds each to one core)
    python -m tinyvit.bench.allreduce --projection           # the 8-GPU estimate: computed, nothing run

Every rank builds the same model (rank 0's weights broadcast), takes its B/N rows of one synthetic
global batch of B, and times steps of the training loop: forward and backward, the bucketed
all-reduce of tinyvit.distributed, the AdamW update. Each step starts at a barrier, so the
all-reduce's time includes waiting for the slowest rank's forward and backward, as it does in
training (the report gives the slowest rank's too). Then two
measurements for the question of overlap (several ranks only): the all-reduce of the buckets alone,
and the wait that is left after the backward pass for a non-blocking all-reduce started before it.
If MPI moved the data while the backward pass ran, that wait would be short; MPI without a progress
thread only moves data inside MPI calls, so it is about as long as the all-reduce alone.

The projection (``projection``) needs no GPU: the all-reduce's time on n GPUs from the message
sizes (the presets' float32 parameters in tinyvit's 25 MB buckets) and published bus bandwidths,
t = S * 2(n-1)/n / busbw(S), beside the compute of a step at an assumed speed.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from .. import distributed, optim
from .. import functional as F
from ..distributed import BUCKET_BYTES, GradientBuckets
from ..kernels.cpu.threads import retain_freed_memory
from ..models import config_for, count_parameters, training_flops
from . import machine
from .step import LR, WEIGHT_DECAY, build_model, cpu_threads, synthetic_batch

# ====================================================================== the measured step


def run(model: str = "vit-cifar/4", batch_size: int = 128, steps: int = 10, warmup: int = 2, seed: int = 0,
        threads: int | None = None, world=None) -> dict:
    """Time the data-parallel step on this process's ``world`` (every rank calls this); the record
    of rank 0's timings (every rank returns one)."""
    world = world or distributed.world()
    if batch_size % world.size:
        raise ValueError(f"--batch-size {batch_size} must split evenly over {world.size} ranks")
    threads = threads or machine.default_threads()
    net = build_model(model, None, seed).train()
    world.broadcast_arrays(list(net.state_dict().values()))
    opt = optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    images, labels = synthetic_batch(net.config, batch_size, np.float32, seed)
    lo, hi = world.rank * batch_size // world.size, (world.rank + 1) * batch_size // world.size
    x, y = images[lo:hi], labels[lo:hi]                  # this rank's rows of the global batch
    buckets = GradientBuckets(list(net.parameters()), world)
    times = {"step": [], "compute": [], "allreduce": [], "update": []}
    with cpu_threads(threads):
        for i in range(warmup + steps):
            world.barrier()
            t0 = time.perf_counter()
            loss = F.cross_entropy(net(x), y)            # forward
            opt.zero_grad()
            loss.backward()                              # backward
            t1 = time.perf_counter()
            if world.size > 1:
                buckets.average(len(x))                  # the all-reduce
            t2 = time.perf_counter()
            opt.step()                                   # update
            t3 = time.perf_counter()
            if i >= warmup:
                for key, value in zip(times, (t3 - t0, t1 - t0, t2 - t1, t3 - t2)):
                    times[key].append(value)
        alone, wait = _overlap_probe(net, x, y, buckets, world, steps) if world.size > 1 else (None, None)
    median = {key: float(np.median(values)) for key, values in times.items()}
    slowest = max(world.gather(median["compute"]))       # the all-reduce waits for the slowest rank
    return {"model": model, "parameters": net.num_parameters(), "ranks": world.size, "batch_size": batch_size,
            "rows_per_rank": len(x), "threads_per_rank": threads, "steps": steps, "warmup": warmup,
            "gradient_bytes": sum(b.buffer.nbytes for b in buckets.buckets), "buckets": len(buckets.buckets),
            "step_time_s": median["step"], "compute_s": median["compute"], "compute_slowest_rank_s": slowest,
            "allreduce_s": median["allreduce"],
            "update_s": median["update"], "allreduce_share": median["allreduce"] / median["step"],
            "images_per_s": batch_size / median["step"], "allreduce_alone_s": alone,
            "wait_after_backward_s": wait, "step_times_s": times["step"], "allreduce_times_s": times["allreduce"]}


def _overlap_probe(net, x, y, buckets, world, steps) -> tuple:
    """(median all-reduce of the buckets alone, median wait after backward for non-blocking
    all-reduces of the same buffers started before the forward pass): rank 0's."""
    comm, MPI = world.comm, world.MPI
    buffers = [b.buffer.copy() for b in buckets.buckets]
    alone, wait = [], []
    for _ in range(steps):
        world.barrier()
        t0 = time.perf_counter()
        for buf in buffers:
            world.all_reduce_sum(buf)
        alone.append(time.perf_counter() - t0)
    for _ in range(steps):
        world.barrier()
        requests = [comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM) for buf in buffers]
        F.cross_entropy(net(x), y).backward()            # the work the all-reduce could hide behind
        t0 = time.perf_counter()
        MPI.Request.Waitall(requests)
        wait.append(time.perf_counter() - t0)
    return float(np.median(alone)), float(np.median(wait))


def format_report(r: dict) -> str:
    lines = [f"{r['model']} ({r['parameters'] / 1e6:.2f}M parameters, {r['gradient_bytes'] / 1e6:.1f} MB of gradients "
             f"in {r['buckets']} bucket(s)), global batch {r['batch_size']} on {r['ranks']} rank(s) x "
             f"{r['threads_per_rank']} thread(s), median of {r['steps']} steps",
             f"  {r['images_per_s']:.1f} images/s, step {1e3 * r['step_time_s']:.1f} ms: forward+backward "
             f"{1e3 * r['compute_s']:.1f} ms (slowest rank {1e3 * r['compute_slowest_rank_s']:.1f} ms), all-reduce "
             f"{1e3 * r['allreduce_s']:.2f} ms "
             f"({100 * r['allreduce_share']:.1f}% of the step), update {1e3 * r['update_s']:.1f} ms"]
    if r["allreduce_alone_s"] is not None:
        lines.append(f"  all-reduce alone {1e3 * r['allreduce_alone_s']:.2f} ms; started before the backward pass, "
                     f"{1e3 * r['wait_after_backward_s']:.2f} ms still to wait after it")
    return "\n".join(lines)


# ====================================================================== the 8-GPU projection

# All-reduce bus bandwidth (GB/s) against message size (bytes) on one 8-GPU NVLink 4 / NVSwitch node:
# the nccl-tests column of the table measured on 8x H200 (NCCL 2.30.7) in
# https://github.com/stas00/ml-engineering/blob/master/network/benchmarks/README.md ("How the calls are
# timed"). The H200 is an H100 with more memory, on the same NVLink 4 (450 GB/s each way per GPU); at
# large sizes 8x H100 SXM nodes are quoted at 460-480 GB/s (https://docs.alayanew.com/en/docs/tech-blog/
# 2026-05-06-nccl-tests), as this table's 464-481 GB/s.
NVLINK4_BUSBW = {2**20: 72.45, 2**21: 91.48, 2**22: 139.97, 2**23: 182.03, 2**24: 242.45, 2**25: 298.44,
                 2**26: 369.82, 2**27: 411.21, 2**28: 442.27, 2**29: 455.82, 2**30: 464.00}
BUSBW_SOURCE = "https://github.com/stas00/ml-engineering/blob/master/network/benchmarks/README.md"
# H100 SXM dense TF32 tensor-core peak, TFLOP/s (NVIDIA's 989 is with 2:4 sparsity, twice the dense rate).
H100_TF32_DENSE_TFLOPS = 494.7
PROJECTED = ("vit-mnist/7", "vit-cifar/4", "vit-s/16", "vit-b/16", "vit-l/16")


def busbw(nbytes: float) -> float:
    """Bus bandwidth (GB/s) of an all-reduce of ``nbytes``, interpolated in log size (clamped at the ends)."""
    sizes = sorted(NVLINK4_BUSBW)
    return float(np.interp(np.log2(nbytes), np.log2(sizes), [NVLINK4_BUSBW[s] for s in sizes]))


def allreduce_seconds(nbytes: float, ranks: int) -> float:
    """nccl-tests' definition read backwards: busbw = algbw * 2(n-1)/n, algbw = S / t."""
    return nbytes * 2 * (ranks - 1) / ranks / (busbw(nbytes) * 1e9)


def bucket_sizes(nbytes: int, bucket_bytes: int = BUCKET_BYTES) -> list:
    """``nbytes`` of gradients as the messages of tinyvit's buckets: full buckets and the rest (the
    real buckets end at parameter boundaries, a difference of a few per cent at most)."""
    full, rest = divmod(nbytes, bucket_bytes)
    return [bucket_bytes] * full + ([rest] if rest else [])


def projection(ranks: int = 8, batch_per_gpu: int = 128, fraction_of_peak: float = 0.5) -> list:
    """For each preset: its float32 gradient bytes, the all-reduce per step on ``ranks`` NVLink GPUs,
    the compute of a step of ``batch_per_gpu`` images per GPU at ``fraction_of_peak`` of the H100's
    dense TF32 peak, and the speed-up over one GPU with the all-reduce after the backward pass (not
    overlapped): ranks * compute / (compute + all-reduce)."""
    rows = []
    for name in PROJECTED:
        cfg = config_for(name)
        nbytes = 4 * count_parameters(cfg)
        t_ar = sum(allreduce_seconds(size, ranks) for size in bucket_sizes(nbytes))
        t_compute = training_flops(cfg) * batch_per_gpu / (fraction_of_peak * H100_TF32_DENSE_TFLOPS * 1e12)
        rows.append({"model": name, "parameters": count_parameters(cfg), "gradient_bytes": nbytes,
                     "buckets": len(bucket_sizes(nbytes)), "allreduce_s": t_ar, "compute_s": t_compute,
                     "speedup": ranks * t_compute / (t_compute + t_ar)})
    return rows


def format_projection(rows: list, ranks: int, batch_per_gpu: int, fraction_of_peak: float) -> str:
    lines = [f"{ranks} GPUs on NVLink 4, {batch_per_gpu} images per GPU, compute at {100 * fraction_of_peak:.0f}% of "
             f"the H100's dense TF32 peak ({H100_TF32_DENSE_TFLOPS} TFLOP/s); bus bandwidth: {BUSBW_SOURCE}",
             f"{'model':<12} {'params':>8} {'MB':>8} {'buckets':>7} {'all-reduce':>11} {'compute':>9} {'speed-up':>9}"]
    for r in rows:
        lines.append(f"{r['model']:<12} {r['parameters'] / 1e6:>7.2f}M {r['gradient_bytes'] / 1e6:>8.1f} {r['buckets']:>7} "
                     f"{1e3 * r['allreduce_s']:>9.3f}ms {1e3 * r['compute_s']:>7.2f}ms {r['speedup']:>8.2f}x")
    return "\n".join(lines)


# ====================================================================== the command


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tinyvit.bench.allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit-cifar/4")
    p.add_argument("--batch-size", type=int, default=128, help="the global batch (default 128)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="threads per rank (default: the cores it may use)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", default=None, help="also write rank 0's record to FILE")
    p.add_argument("--projection", action="store_true", help="print the 8-GPU estimate instead (nothing is run)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the projection (default 8)")
    p.add_argument("--fraction-of-peak", type=float, default=0.5, help="compute speed of the projection (default 0.5)")
    args = p.parse_args(argv)
    if args.projection:
        print(format_projection(projection(args.gpus, args.batch_size, args.fraction_of_peak), args.gpus,
                                args.batch_size, args.fraction_of_peak))
        return 0
    retain_freed_memory()
    world = distributed.world()
    report = run(args.model, args.batch_size, args.steps, args.warmup, args.seed, args.threads, world)
    if world.writer:
        launcher = f"mpirun -n {world.size} " if world.size > 1 else ""
        report.update(date=machine.utc_now(), commit=machine.git_commit(), machine=machine.describe("cpu"),
                      command=launcher + shlex.join(["python", "-m", "tinyvit.bench.allreduce", *sys.argv[1:]]))
        print(format_report(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            print(f"record written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
