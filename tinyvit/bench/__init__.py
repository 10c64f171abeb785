"""`tinyvit bench`: the speed of one training step, in tinyvit with its kernels on and/or off, and
(with compare="torch") in PyTorch eager.

A step is what training does for every batch: forward, cross-entropy, backward, AdamW update. Every
side runs the same model (same config, same initial weights), the same synthetic batch, the same
optimizer settings, dtype and number of CPU threads (TF32 on or off on all on a GPU), one after the
other in this process. Per side the record gives:

    step_time_s        median wall time of ``steps`` timed steps; ``warmup`` steps before them are
                       not counted (first-call costs, the optimizer's state allocation)
    images_per_s       batch_size / step_time_s
    peak_memory_bytes  CPU: the process's peak resident memory (Linux VmHWM, reset first through
                       /proc/self/clear_refs) from just before the side's model is built to its last
                       step, minus the resident memory at that start, i.e. parameters, optimizer state,
                       activations, gradients and whatever the allocator keeps; a later side may reuse
                       memory an earlier one left (freed memory is retained), so its figure can be lower
                       (PyTorch's includes its runtime's own allocations on first use). Where the peak
                       cannot be reset, the growth of getrusage's ru_maxrss (a lower bound for later
                       sides). GPU: CuPy's default memory pool total_bytes() after the steps, the pool
                       emptied before (the pool keeps every block it ever held, so this is its
                       high-water mark); PyTorch: torch.cuda.max_memory_reserved().
    tflops, mfu        training FLOPs per image (tinyvit.models.training_flops: 3x the forward's
                       matmul FLOPs) times images_per_s, and that over the peak FLOP/s: ``peak_tflops``
                       when given, else a measured square matmul of the benchmark's dtype.

tinyvit's sides are its three paths: ``tinyvit_fused`` (what a training run steps: kernels.fuse(model)),
``tinyvit`` (the model as written, per-op kernels) and ``tinyvit_reference`` (the reference ops
alone); kernels="on" times the first two, "off" the last, "both" all three.
``readability_price`` (kernels="both") is the reference ops' step time over the fused step's and
``fusion_gain`` the per-op step's over the fused one's; with compare="torch" each side's
``ratio_to_torch`` is its step time over PyTorch's (below 1: tinyvit is faster), ``ratio`` the
first side's. Timings on a
shared machine are noisy and depend on what else runs: ``rounds`` > 1 alternates the sides, and the
record keeps the load average and each side's CPU time per step (CPU time below threads x step
time means the process waited for the machine). The record also says where and what was measured:
machine (CPU, cores, GPUs, library versions, NumPy's BLAS), UTC date, git commit and command.

    machine.py     the machine, NumPy's BLAS and its threads, the commit and the date
    step.py        the model, batch and step; threads, TF32, timing, peak memory, the matmul peak
    run.py         run_benchmark
    report.py      format_report and the JSON records
    torch_vit.py   the PyTorch reference ViT (also the parity tests' reference); needs PyTorch
    torch_side.py  the PyTorch side of compare="torch"; needs PyTorch
"""
from .report import format_report, record_name, round_ratios, write_json, write_record
from .run import COMPARE, DTYPES, KERNELS, run_benchmark

__all__ = ["run_benchmark", "format_report", "round_ratios", "record_name", "write_json", "write_record",
           "DTYPES", "KERNELS", "COMPARE"]
