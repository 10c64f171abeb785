"""Where a training step's time goes, op by op: every autograd Function's forward and backward, the
optimizer update, and what is left (Python between the ops), on the CPU or a GPU.

    python tools/step_profile.py --model vit-s/16 --batch-size 64 --device cuda [--path fused|kernels|reference]
                                 [--precision tf32] [--steps 5] [--json FILE]

Each Function subclass's forward and backward is wrapped for the timed steps (a tool's trick, never
the library's): the host time of each call, and on a GPU the device time between CUDA events
recorded around it (read once the step has finished, so the timing adds no synchronisation). A GPU
time well below the host time means the op waits for Python to launch it (launch-bound); the step's
device time over its wall time says how busy the GPU was.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinyvit  # noqa: E402
from tinyvit import backend, kernels, optim  # noqa: E402
from tinyvit import functional as F  # noqa: E402
from tinyvit.autograd import Function  # noqa: E402
from tinyvit.bench.step import build_model, synthetic_batch  # noqa: E402


def function_classes():
    """Every Function subclass loaded now (reference ops and kernels)."""
    seen, todo = [], list(Function.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return seen


class Timer:
    """Host and (on a GPU) device time per (label, phase); device times read after a sync."""

    def __init__(self, xp):
        self.xp, self.host = xp, collections.defaultdict(float)
        self.calls = collections.Counter()
        self.events = []                         # (key, start event, end event)

    @contextlib.contextmanager
    def span(self, key):
        start_event = None
        if self.xp is not np:
            start_event = self.xp.cuda.Event()
            start_event.record()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.host[key] += time.perf_counter() - t0
            self.calls[key] += 1
            if start_event is not None:
                end_event = self.xp.cuda.Event()
                end_event.record()
                self.events.append((key, start_event, end_event))

    def device(self):
        """{key: device seconds}, after the events have completed."""
        out = collections.defaultdict(float)
        for key, a, b in self.events:
            b.synchronize()
            out[key] += self.xp.cuda.get_elapsed_time(a, b) / 1e3
        return out


@contextlib.contextmanager
def timed_functions(timer):
    """Wrap forward and backward of every Function class defined in its own module, for the block."""
    originals = []
    for cls in function_classes():
        label = f"{cls.__module__.removeprefix('tinyvit.')}.{cls.__name__}"
        for phase in ("forward", "backward"):
            if phase in vars(cls):
                original = vars(cls)[phase]

                def wrapped(self, *args, _original=original, _key=(label, phase), **kwargs):
                    with timer.span(_key):
                        return _original(self, *args, **kwargs)
                setattr(cls, phase, wrapped)
                originals.append((cls, phase, original))
    try:
        yield
    finally:
        for cls, phase, original in originals:
            setattr(cls, phase, original)


def profile(model_name="vit-cifar/4", batch_size=128, device="cpu", path="fused", precision="fp32",
            steps=5, warmup=3, seed=0) -> dict:
    device = backend.normalize_device(device)
    xp = backend.cupy_module() if device != "cpu" else np
    cfg = tinyvit.models.config_for(model_name)
    images, labels = synthetic_batch(cfg, batch_size, np.float32, seed)
    net = build_model(model_name, None, seed).to(device=device).train()
    with tinyvit.use_kernels(path != "reference"):
        forward = kernels.fuse(net) if path == "fused" else net
    opt = optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.05)
    x, y = backend.to_device(images, device), backend.to_device(labels, device)
    sync = (lambda: None) if xp is np else xp.cuda.get_current_stream().synchronize
    timer = Timer(xp)

    def step(timed):
        with tinyvit.use_kernels(path != "reference"):
            with timer.span(("step", "forward+loss")) if timed else contextlib.nullcontext():
                loss = F.cross_entropy(forward(x), y)
            opt.zero_grad()
            with timer.span(("step", "backward")) if timed else contextlib.nullcontext():
                loss.backward()
            with timer.span(("optimizer", "AdamW.step")) if timed else contextlib.nullcontext():
                opt.step()

    with backend.matmul_precision(precision):
        for _ in range(warmup):
            step(False)
        sync()
        walls = []
        with timed_functions(timer):
            for _ in range(steps):
                t0 = time.perf_counter()
                step(True)
                sync()
                walls.append(time.perf_counter() - t0)
    dev = timer.device()
    rows = []
    for key in timer.host:
        rows.append({"op": key[0], "phase": key[1], "calls_per_step": timer.calls[key] / steps,
                     "host_ms": 1e3 * timer.host[key] / steps,
                     "device_ms": (1e3 * dev[key] / steps) if key in dev else None})
    rows.sort(key=lambda r: -(r["device_ms"] if r["device_ms"] is not None else r["host_ms"]))
    return {"model": model_name, "batch_size": batch_size, "device": device, "path": path, "precision": precision,
            "steps": steps, "step_ms": 1e3 * float(np.median(walls)), "rows": rows,
            "gpu": (xp.cuda.runtime.getDeviceProperties(0)["name"].decode() if xp is not np else None),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def format_profile(result: dict, top: int = 25) -> str:
    lines = [f"{result['model']} batch {result['batch_size']} on {result['device']} ({result['gpu'] or 'CPU'}), "
             f"path {result['path']}, {result['precision']}: {result['step_ms']:.2f} ms per step (median of "
             f"{result['steps']})",
             f"{'op':<52}{'phase':<14}{'calls':>7}{'host ms':>10}{'device ms':>11}"]
    for r in result["rows"][:top]:
        device_ms = f"{r['device_ms']:>11.3f}" if r["device_ms"] is not None else f"{'-':>11}"
        lines.append(f"{r['op'][:51]:<52}{r['phase'][:13]:<14}{r['calls_per_step']:>7.1f}{r['host_ms']:>10.3f}{device_ms}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit-cifar/4")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--path", choices=("fused", "kernels", "reference"), default="fused")
    parser.add_argument("--precision", choices=("fp32", "tf32"), default="fp32")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    result = profile(args.model, args.batch_size, args.device, args.path, args.precision, args.steps, args.warmup)
    print(format_profile(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
