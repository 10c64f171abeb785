"""run_benchmark: time tinyvit's training step with the kernels on, off or both, and optionally
PyTorch's, on the same model, weights, batch, optimizer settings and threads; return the record.

Each side is built, runs ``warmup`` untimed steps and ``steps`` timed ones (its peak memory is
measured over all that); with rounds > 1 every side then runs ``steps`` more timed steps, in turn,
rounds - 1 more times, so that a change in the machine's load hits all sides alike. The sides, by
their keys in the record:

    tinyvit_fused      the step a training run takes: the model fused across layers (kernels.fuse)
    tinyvit            the model as written, its ops' kernels chosen inside the F.* calls (the default)
    tinyvit_reference  tinyvit on its reference ops alone (``use_kernels(False)``)
    torch              PyTorch eager (torch_vit.TorchViT), with compare="torch"
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import asdict

from .. import backend
from ..kernels import kernels_enabled
from ..kernels.cpu.threads import get_num_threads, retain_freed_memory
from ..models import config_for, count_parameters, training_flops
from . import machine
from .report import round_ratios, side_report
from .step import (LR, WEIGHT_DECAY, PeakCupyMemory, PeakHostMemory, build_model, cpu_threads,
                   measure_matmul_peak, passive_torch_threads, synthetic_batch, time_steps, tinyvit_step)

DTYPES = ("float32", "float64")
KERNELS = ("on", "off", "both")
COMPARE = ("torch",)
SIDE_OF_KERNELS = {"on": ["tinyvit_fused", "tinyvit"], "off": ["tinyvit_reference"],
                   "both": ["tinyvit_fused", "tinyvit", "tinyvit_reference"]}
PATH_OF_SIDE = {"tinyvit_fused": "fused", "tinyvit": "kernels", "tinyvit_reference": "reference"}


def kernels_setting(kernels) -> str:
    """'on', 'off' or 'both' from those words, True/False, or None: the switch as it is now
    (on, unless use_kernels(False) or TINYVIT_KERNELS=0 turned it off)."""
    if kernels is None:
        return "on" if kernels_enabled() else "off"
    if isinstance(kernels, bool):
        return "on" if kernels else "off"
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    return kernels


def _check(dtype, compare, batch_size, steps, warmup, rounds, tf32, on_gpu):
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if compare not in (None,) + COMPARE:
        raise ValueError(f"compare must be one of {COMPARE} or None, got {compare!r}")
    if batch_size < 1 or steps < 1 or warmup < 0 or rounds < 1:
        raise ValueError(f"need batch_size >= 1, steps >= 1, warmup >= 0, rounds >= 1; got {batch_size}, {steps}, "
                         f"{warmup}, {rounds}")
    if tf32 and (not on_gpu or dtype != "float32"):
        raise ValueError("tf32 applies to float32 matmuls on a CUDA device only")


def run_benchmark(model: str = "vit-cifar/4", batch_size: int = 128, device: str = "cpu",
                  dtype: str = "float32", tf32: bool = False, threads: int | None = None, warmup: int = 2,
                  steps: int = 10, rounds: int = 1, kernels=None, compare: str | None = None,
                  torch_attention: str = "explicit", peak_tflops: float | None = None,
                  model_args: dict | None = None, seed: int = 0) -> dict:
    """Benchmark one training step of ``model`` (a variant name, with ViTConfig overrides in
    model_args) and return the record, a JSON-ready dict (docs/bench/README.md lists its fields).

    kernels: "on", "off" or "both" (see kernels_setting; None: as the switch is now).
    kernels="on" times the fused step and the plain model with its per-op kernels, "off" the
    reference ops alone, "both" all three. compare="torch" adds PyTorch eager's step; each side's
    ``ratio_to_torch`` is then its step time over PyTorch's, and ``ratio`` the first side's. With
    kernels="both", ``readability_price`` is the reference ops' step time over the fused step's
    (what the readable code costs) and ``fusion_gain`` the plain model's over the fused step's.
    """
    device = backend.normalize_device(device)
    on_gpu = device != "cpu"
    _check(dtype, compare, batch_size, steps, warmup, rounds, tf32, on_gpu)
    kernels = kernels_setting(kernels)
    threads = int(threads or get_num_threads())
    cfg = config_for(model, **(model_args or {}))
    flops_per_image = training_flops(cfg)
    images, labels = synthetic_batch(cfg, batch_size, dtype, seed)

    report = {
        "date": machine.utc_now(), "commit": machine.git_commit(), "command": None,
        "model": model, "config": asdict(cfg), "parameters": count_parameters(cfg), "batch_size": batch_size,
        "device": device, "dtype": dtype, "tf32": bool(tf32), "threads": threads, "warmup": warmup,
        "steps": steps, "rounds": rounds, "kernels": kernels, "compare": compare, "seed": seed,
        "machine": machine.describe(device), "train_flops_per_image": flops_per_image,
    }
    report["machine"]["loadavg_before"] = machine.loadavg()
    # All sides run in this process, so all get the allocator that keeps freed memory (as `tinyvit
    # train` does): none pays page faults for re-allocating its arrays every step.
    report["machine"]["retain_freed_memory"] = retain_freed_memory()
    # And the idle threads of all sleep at once, so that no side's spinning threads take cores from
    # another's timed steps: tinyvit's OpenBLAS threads (OPENBLAS_THREAD_TIMEOUT=4, set by `import
    # tinyvit`) and PyTorch's OpenMP threads, which otherwise spin after each parallel region
    # (measured: tinyvit's steps after PyTorch's rounds were up to 1.6x slower; PyTorch's own steps
    # did not change). Read when PyTorch loads, so only if it has not been imported yet.
    if compare == "torch" and passive_torch_threads():
        report["machine"]["env"]["OMP_WAIT_POLICY"] = os.environ["OMP_WAIT_POLICY"]
    sides = {}                               # name -> [step, sync, losses, walls, cpus, memory]
    with contextlib.ExitStack() as settings:
        report["blas_threads"] = settings.enter_context(cpu_threads(threads))
        if on_gpu:
            settings.enter_context(backend.matmul_precision("tf32" if tf32 else "fp32"))
        if peak_tflops:
            peak_flops, report["peak_source"] = peak_tflops * 1e12, "given"
        else:
            peak_flops = measure_matmul_peak(device, dtype)
            report["peak_source"] = f"measured: best square {dtype} matmul"
        report["peak_tflops"] = peak_flops / 1e12

        for name in SIDE_OF_KERNELS[kernels]:
            with (PeakCupyMemory() if on_gpu else PeakHostMemory()) as memory:
                step, sync, losses = tinyvit_step(model, model_args, images, labels, device=device, dtype=dtype,
                                                  seed=seed, path=PATH_OF_SIDE[name])
                time_steps(step, sync, warmup)
                sides[name] = [step, sync, losses, *time_steps(step, sync, steps), memory]
        if compare == "torch":
            from . import torch_side
            settings.enter_context(torch_side.torch_settings(threads, tf32))
            weights = build_model(model, model_args, seed)
            with (torch_side.PeakTorchCuda(device) if on_gpu else PeakHostMemory()) as memory:
                step, sync, losses, torch_setup = torch_side.torch_step(
                    weights, images, labels, device=device, dtype=dtype, seed=seed, attention=torch_attention,
                    lr=LR, weight_decay=WEIGHT_DECAY)
                time_steps(step, sync, warmup)
                sides["torch"] = [step, sync, losses, *time_steps(step, sync, steps), memory]
            del weights
        for _ in range(rounds - 1):
            for side in sides.values():
                walls, cpus = time_steps(side[0], side[1], steps)
                side[3] += walls
                side[4] += cpus
    report["machine"]["loadavg_after"] = machine.loadavg()

    report["sides"] = list(sides)
    for name, (_, _, losses, walls, cpus, memory) in sides.items():
        report[name] = side_report(walls, cpus, batch_size, flops_per_image, peak_flops, memory, losses)
    if "torch" in sides:
        report["torch"].update(torch_setup)
        for name in sides:
            if name != "torch":
                report[name]["ratio_to_torch"] = report[name]["step_time_s"] / report["torch"]["step_time_s"]
        ours = report["sides"][0]
        report["ratio"] = report[ours]["step_time_s"] / report["torch"]["step_time_s"]
        report["round_ratios"] = round_ratios(report[ours]["step_times_s"], report["torch"]["step_times_s"], steps)
    if kernels == "both":
        fast, plain = report["tinyvit_fused"], report["tinyvit_reference"]
        report["readability_price"] = plain["step_time_s"] / fast["step_time_s"]
        report["readability_round_ratios"] = round_ratios(plain["step_times_s"], fast["step_times_s"], steps)
        report["fusion_gain"] = report["tinyvit"]["step_time_s"] / fast["step_time_s"]
    return report
