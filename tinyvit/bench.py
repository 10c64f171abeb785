"""`tinyvit bench`: the speed of one training step, in tinyvit and (with compare="torch") in PyTorch.

A step is what training does for every batch: forward, cross-entropy, backward, AdamW update. Both
sides run the same model (same config, same initial weights), the same synthetic batch, the same
optimizer settings, dtype and number of CPU threads (TF32 on or off on both on a GPU), one after
the other in this process. Per side the report gives:

    step_time_s        median wall time of ``steps`` timed steps; ``warmup`` steps before them are
                       not counted (first-call costs, the optimizer's state allocation)
    images_per_s       batch_size / step_time_s
    peak_memory_bytes  CPU: the process's peak resident memory (Linux VmHWM, reset first through
                       /proc/self/clear_refs) from just before the model is built to the last step,
                       minus the resident memory at that start, i.e. parameters, optimizer state,
                       activations, gradients and whatever the allocator keeps (PyTorch's includes
                       its runtime's own allocations on first use). Where the peak
                       cannot be reset, the growth of getrusage's ru_maxrss (a lower bound for the
                       second side). GPU: CuPy's default memory pool total_bytes() after the steps,
                       the pool emptied before (the pool keeps every block it ever held, so this is
                       its high-water mark); PyTorch: torch.cuda.max_memory_reserved().
    tflops, mfu        training FLOPs per image (tinyvit.models.training_flops: 3x the forward's
                       matmul FLOPs) times images_per_s, and that over the peak FLOP/s: ``peak_tflops``
                       when given, else a measured square matmul of the benchmark's dtype.

``ratio`` is tinyvit's step time over PyTorch's (below 1: tinyvit is faster). Timings on a shared
machine are noisy and depend on what else runs: ``rounds`` > 1 alternates the two sides, and the
report keeps the load average and each side's CPU time per step (CPU time below threads x step
time means the process waited for the machine).
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import platform
import sys
import time
from dataclasses import asdict

import numpy as np

from . import backend, optim
from . import functional as F
from .models import config_for, count_parameters, create, training_flops

DTYPES = ("float32", "float64")
# Environment variables that change how the BLAS and OpenMP threads behave; the report lists those set.
# OPENBLAS_THREAD_TIMEOUT=4 makes OpenBLAS's idle threads sleep at once instead of spinning ~0.1 s after
# each call, which frees the cores for tinyvit's own element-wise threads (read when NumPy loads).
THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
              "MKL_NUM_THREADS", "GOMP_SPINCOUNT")
COMPARE = ("torch",)
# The optimizer of both sides (one group, the same numbers).
LR, WEIGHT_DECAY = 1e-3, 0.05


# ====================================================================== the machine


def cpu_name() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) Processor"), as lscpu shows it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_threads() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------- NumPy's BLAS threads

_SET = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
        "openblas_set_num_threads")
_GET = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads", "openblas_get_num_threads64_",
        "openblas_get_num_threads")
_CORE = ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
         "openblas_get_corename")


def openblas_libraries():
    """The OpenBLAS libraries NumPy loaded, as ctypes.CDLL objects, found in /proc/self/maps (Linux;
    none elsewhere, or where NumPy uses another BLAS)."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line})
    except OSError:
        return []
    libraries = []
    for path in paths:
        try:
            libraries.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libraries


def _openblas_functions():
    """(set_num_threads, get_num_threads, get_corename) of the OpenBLAS that NumPy loaded, or None
    (another BLAS, or another system)."""
    for lib in openblas_libraries():
        found = [next((getattr(lib, n) for n in names if hasattr(lib, n)), None) for names in (_SET, _GET, _CORE)]
        if found[0] is not None and found[1] is not None:
            if found[2] is not None:
                found[2].restype = ctypes.c_char_p
            return found
    return None


def blas_info() -> str:
    """'OpenBLAS <core>' or NumPy's BLAS name."""
    fns = _openblas_functions()
    if fns and fns[2] is not None:
        return f"OpenBLAS {fns[2]().decode()}"
    try:
        return np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]
    except Exception:
        return "unknown"


@contextlib.contextmanager
def blas_threads(n: int):
    """Run NumPy's matrix products on ``n`` threads inside the block (OpenBLAS, through ctypes);
    yields the thread count in effect, or None where it cannot be set (then it is unchanged)."""
    fns = _openblas_functions()
    if fns is None:
        yield None
        return
    set_threads, get_threads, _ = fns
    previous = get_threads()
    set_threads(int(n))
    try:
        yield get_threads()
    finally:
        set_threads(previous)


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


# ====================================================================== timing and the peak


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


@contextlib.contextmanager
def cupy_tf32(enabled: bool):
    """CuPy's float32 matmuls with TF32 tensor cores (enabled) or in full float32, restored after.
    (Written for CUDA devices of compute capability 8.0 or newer; not exercised on a CPU-only machine.)"""
    from cupy._core import _routines_linalg as linalg
    previous = linalg.get_compute_type(np.float32)
    tf32 = getattr(linalg, "COMPUTE_TYPE_TF32", 7)
    default = getattr(linalg, "COMPUTE_TYPE_DEFAULT", 1)
    linalg.set_compute_type(np.float32, tf32 if enabled else default)
    try:
        yield
    finally:
        linalg.set_compute_type(np.float32, previous)


@contextlib.contextmanager
def cpu_threads(n: int):
    """tinyvit on n CPU threads inside the block: NumPy's BLAS (blas_threads) and the element-wise
    blocks of the ops (tinyvit.ops.common.set_num_threads). Yields the BLAS thread count in effect."""
    from .ops import common
    previous = common._num_threads
    common.set_num_threads(n)
    try:
        with blas_threads(n) as in_effect:
            yield in_effect
    finally:
        common.set_num_threads(previous)


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
    on_gpu = device != "cpu"
    xp = backend.cupy_module() if on_gpu else np
    n = 8192 if on_gpu else 2048
    rng = np.random.default_rng(0)
    a, b = (xp.asarray(rng.standard_normal((n, n)).astype(dtype)) for _ in range(2))
    out = xp.empty((n, n), dtype=dtype)
    sync = _sync(xp)
    xp.matmul(a, b, out=out)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        xp.matmul(a, b, out=out)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def _sync(xp):
    if xp is np:
        return lambda: None
    return xp.cuda.get_current_stream().synchronize


# ====================================================================== the two sides


def build_model(model: str, model_args: dict | None, seed: int):
    """The named model (tinyvit.models.create) on the CPU in float32, initialised from ``seed``:
    both sides start from these weights."""
    backend.manual_seed(seed)
    with backend.default_dtype(np.float32):
        return create(model, **(model_args or {}))


def synthetic_batch(cfg, batch_size: int, dtype, seed: int):
    """Standard-normal images (B, C, H, W) of ``dtype`` and int64 labels (B,), on the host."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((batch_size, cfg.in_channels, cfg.image_size, cfg.image_size)).astype(dtype)
    return images, rng.integers(0, max(cfg.num_classes, 1), batch_size)


def tinyvit_step(model: str, model_args, images, labels, *, device="cpu", dtype="float32", seed=0) -> tuple:
    """Build tinyvit's side and return (step, sync, losses): step() is one training step, losses
    collects each step's loss (a device array, read after timing)."""
    on_gpu = device != "cpu"
    xp = backend.cupy_module() if on_gpu else np
    net = build_model(model, model_args, seed).to(device=device, dtype=dtype).train()
    opt = optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    x, y = backend.to_device(images, device), backend.to_device(labels, device)
    losses = []

    def step():
        loss = F.cross_entropy(net(x), y)               # forward and loss
        opt.zero_grad()
        loss.backward()                                 # backward
        opt.step()                                      # AdamW update
        losses.append(loss.data)

    return step, _sync(xp), losses


def _side_report(walls, cpus, batch_size, flops_per_image, peak_flops, memory, losses) -> dict:
    step = float(np.median(walls))
    images_per_s = batch_size / step
    tflops = flops_per_image * images_per_s / 1e12
    return {"step_time_s": step, "step_times_s": [float(t) for t in walls],
            "cpu_time_s": float(np.median(cpus)), "images_per_s": images_per_s,
            "peak_memory_bytes": int(memory.bytes), "memory_method": memory.method, "tflops": tflops,
            "mfu": tflops * 1e12 / peak_flops if peak_flops else None, "losses": [float(v) for v in losses]}


def _loadavg():
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


# ====================================================================== the benchmark


def run_benchmark(model: str = "vit-cifar/4", batch_size: int = 128, device: str = "cpu",
                  dtype: str = "float32", tf32: bool = False, threads: int | None = None, warmup: int = 2,
                  steps: int = 10, rounds: int = 1, compare: str | None = None, torch_attention: str = "explicit",
                  peak_tflops: float | None = None, model_args: dict | None = None, seed: int = 0) -> dict:
    """Benchmark one training step of ``model`` (a variant name, with ViTConfig overrides in
    model_args) and return the report (a JSON-ready dict; see the module docstring).

    Each side is built, runs ``warmup`` untimed steps and ``steps`` timed ones (peak memory is
    measured over all that); with rounds > 1 both sides then run ``steps`` more timed steps, in
    turn, rounds - 1 more times, so that a change in the machine's load hits both sides alike.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if compare not in (None,) + COMPARE:
        raise ValueError(f"compare must be one of {COMPARE} or None, got {compare!r}")
    if batch_size < 1 or steps < 1 or warmup < 0 or rounds < 1:
        raise ValueError(f"need batch_size >= 1, steps >= 1, warmup >= 0, rounds >= 1; got {batch_size}, {steps}, "
                         f"{warmup}, {rounds}")
    device = backend.normalize_device(device)
    on_gpu = device != "cpu"
    if tf32 and (not on_gpu or dtype != "float32"):
        raise ValueError("tf32 applies to float32 matmuls on a CUDA device only")
    if not threads:
        from .ops.common import get_num_threads
        threads = get_num_threads()
    threads = int(threads)
    cfg = config_for(model, **(model_args or {}))
    flops_per_image = training_flops(cfg)
    images, labels = synthetic_batch(cfg, batch_size, dtype, seed)

    report = {
        "model": model, "config": asdict(cfg), "parameters": count_parameters(cfg), "batch_size": batch_size,
        "device": device, "dtype": dtype, "tf32": bool(tf32), "threads": threads, "warmup": warmup,
        "steps": steps, "rounds": rounds, "date": datetime.date.today().isoformat(),
        "machine": {"cpu": cpu_name(), "cpu_threads_available": default_threads(), "python": platform.python_version(),
                    "numpy": np.__version__, "blas": blas_info(), "loadavg_before": _loadavg(),
                    "env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ}},
        "train_flops_per_image": flops_per_image,
    }
    if on_gpu:
        cp = backend.cupy_module()
        report["machine"]["gpu"] = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
        report["machine"]["cupy"] = cp.__version__

    # Both sides run in this process, so both get the allocator that keeps freed memory (as
    # `tinyvit train` does): neither pays page faults for re-allocating its arrays every step.
    from .ops.common import retain_freed_memory
    report["machine"]["retain_freed_memory"] = retain_freed_memory()
    # And the idle threads of both sleep at once, so that neither side's spinning threads take cores
    # from the other's timed steps: tinyvit's OpenBLAS threads (OPENBLAS_THREAD_TIMEOUT=4, set by
    # `import tinyvit`) and PyTorch's OpenMP threads, which otherwise spin after each parallel region
    # (measured: tinyvit's steps after PyTorch's rounds were up to 1.6x slower; PyTorch's own steps
    # did not change). Read when PyTorch loads, so only if it has not been imported yet.
    if compare == "torch" and passive_torch_threads():
        report["machine"]["env"]["OMP_WAIT_POLICY"] = os.environ["OMP_WAIT_POLICY"]
    sides = {}                               # name -> [step, sync, losses, walls, cpus, memory]
    with contextlib.ExitStack() as settings:
        report["blas_threads"] = settings.enter_context(cpu_threads(threads))
        if on_gpu:
            settings.enter_context(cupy_tf32(tf32))
        if peak_tflops:
            peak_flops, report["peak_source"] = peak_tflops * 1e12, "given"
        else:
            peak_flops = measure_matmul_peak(device, dtype)
            report["peak_source"] = f"measured: best square {dtype} matmul"
        report["peak_tflops"] = peak_flops / 1e12

        with (PeakCupyMemory() if on_gpu else PeakHostMemory()) as memory:
            step, sync, losses = tinyvit_step(model, model_args, images, labels, device=device, dtype=dtype,
                                              seed=seed)
            time_steps(step, sync, warmup)
            sides["tinyvit"] = [step, sync, losses, *time_steps(step, sync, steps), memory]
        if compare == "torch":
            from . import bench_torch
            settings.enter_context(bench_torch.torch_settings(threads, tf32))
            weights = build_model(model, model_args, seed)
            with (bench_torch.PeakTorchCuda(device) if on_gpu else PeakHostMemory()) as memory:
                step, sync, losses, report["torch_setup"] = bench_torch.torch_step(
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
    report["machine"]["loadavg_after"] = _loadavg()

    for name, (_, _, losses, walls, cpus, memory) in sides.items():
        report[name] = _side_report(walls, cpus, batch_size, flops_per_image, peak_flops, memory, losses)
    if "torch" in sides:
        report["torch"].update(report.pop("torch_setup"))
        report["ratio"] = report["tinyvit"]["step_time_s"] / report["torch"]["step_time_s"]
        report["round_ratios"] = round_ratios(report["tinyvit"]["step_times_s"], report["torch"]["step_times_s"],
                                              steps)
    return report


def round_ratios(tinyvit_steps, torch_steps, steps: int) -> list:
    """Each round's own ratio, the median of tinyvit's ``steps`` step times in that round over the
    median of PyTorch's (both lists hold the rounds one after the other): on a machine whose speed
    drifts, their spread says how far to trust the overall ratio."""
    return [float(np.median(tinyvit_steps[i:i + steps]) / np.median(torch_steps[i:i + steps]))
            for i in range(0, len(tinyvit_steps), steps)]


def _mib(n):
    return f"{n / 2 ** 20:.1f} MiB"


def format_report(report: dict) -> str:
    """The report as the few lines `tinyvit bench` prints."""
    m = report["machine"]
    precision = report["dtype"] + (", TF32 " + ("on" if report["tf32"] else "off") if report["device"] != "cpu" else "")
    rounds = f" x {report['rounds']} rounds" if report["rounds"] > 1 else ""
    load = ""
    if m.get("loadavg_before") is not None:
        load = f"; load average {m['loadavg_before']:.2f} before, {m['loadavg_after']:.2f} after"
    lines = [
        f"tinyvit bench: {report['model']} ({report['parameters'] / 1e6:.2f}M parameters), batch "
        f"{report['batch_size']}, {report['device']} {precision}, {report['threads']} threads "
        f"(BLAS: {report['blas_threads']}), {report['warmup']} warmup + {report['steps']} timed steps{rounds}",
        f"machine: {m.get('gpu') or m['cpu']}; numpy {m['numpy']} ({m['blas']})"
        + (f"; torch {report['torch']['torch_version']}" if "torch" in report else "") + load
        + "".join(f"; {k}={v}" for k, v in m.get("env", {}).items()),
        f"training FLOPs per image {report['train_flops_per_image'] / 1e9:.3f} G; peak "
        f"{report['peak_tflops']:.3f} TFLOP/s ({report['peak_source']})",
        f"{'':<9}{'step (median)':>14}{'CPU time':>10}{'images/s':>10}{'peak memory':>13}{'TFLOP/s':>9}{'MFU':>7}",
    ]
    for side in ("tinyvit", "torch"):
        if side in report:
            r = report[side]
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
            lines.append(f"{side:<9}{r['step_time_s']:>12.3f} s{r['cpu_time_s']:>8.2f} s{r['images_per_s']:>10.1f}"
                         f"{_mib(r['peak_memory_bytes']):>13}{r['tflops']:>9.3f}{mfu:>7}")
    if "ratio" in report:
        lines.append(f"ratio (tinyvit step time / torch step time): {report['ratio']:.2f}x"
                     f"  (torch attention: {report['torch']['attention']})")
        if len(report.get("round_ratios", [])) > 1:
            lines.append("ratio in each round: " + " ".join(f"{r:.2f}x" for r in report["round_ratios"]))
    return "\n".join(lines)
