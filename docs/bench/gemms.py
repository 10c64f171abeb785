#!/usr/bin/env python
"""The 2-D matrix products of one CPU training step of tinyvit, each timed alone.

    python docs/bench/gemms.py --model vit-cifar/4 --compare torch --threads 2 --repeats 21

The GEMMs are most of a CPU step. This records every 2-D product of one step of a ViT with the
kernels on (all of them go through two functions of tinyvit's CPU kernels, aligned_matmul and
weight_gradient, which it wraps while the step runs), with its shape and how often it runs: forward
and dL/dx products y = a @ b, and weight gradients dW = x^T g summed over the B*N rows. Then it times
each shape on its own, the sides in turn (so that a change in the machine's load hits all alike), and
reports the median per call and the step's total (calls x median):

  numpy               tinyvit's own calls (aligned_matmul, weight_gradient)
  openblas, beta=1    NumPy's OpenBLAS called directly as C += op(a) @ b: the same kernel without the
                      zeroing of C that beta = 0, the only call NumPy makes, costs first. It measures
                      how much of a gap that zeroing is; tinyvit does not call BLAS this way.
  torch               with --compare torch: PyTorch's a @ b (MKL on its CPU builds)

A development tool, not part of the installed package: it imports tinyvit (and its bench helpers)
from wherever Python finds it. --json FILE writes the report with the machine, date and commit.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import sys
import time

import numpy as np

import tinyvit  # noqa: F401
from tinyvit.bench import machine, step
from tinyvit.kernels.cpu import threads as cpu_pool  # (importing the CPU kernels applies OPENBLAS_THREAD_TIMEOUT)
from tinyvit.models import config_for

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
# cblas_sgemm's names in the OpenBLAS that NumPy's wheels ship (64-bit integers) and in other builds.
_SGEMM = (("scipy_cblas_sgemm64_", ctypes.c_int64), ("cblas_sgemm64_", ctypes.c_int64),
          ("scipy_cblas_sgemm", ctypes.c_int), ("cblas_sgemm", ctypes.c_int))
PRODUCT = "y = a b"            # a (rows, inner) @ b (inner, cols)
GRADIENT = "dW = x^T g"        # x (rows, inner), g (rows, cols) -> (inner, cols)
WRAPPED = {"aligned_matmul": PRODUCT, "weight_gradient": GRADIENT}


def tinyvit_functions() -> list:
    """[(module, name, function)] for every loaded tinyvit module that holds a function named
    aligned_matmul or weight_gradient (the modules that define them, and those that imported them)."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("tinyvit.") and module is not None:
            for name in WRAPPED:
                fn = vars(module).get(name)
                if callable(fn):
                    found.append((module, name, fn))
    return found


def weight_gradient():
    """tinyvit's dW = x^T g over the rows (the first module found holding one), else NumPy's x.T @ g."""
    return next((fn for _, name, fn in tinyvit_functions() if name == "weight_gradient"), lambda x, g: x.T @ g)


def record_products(model: str, model_args=None, batch_size: int = 128, seed: int = 0) -> collections.Counter:
    """{(kind, rows, inner, cols): calls} of one tinyvit training step, float32, CPU, kernels on.
    One step runs first, unrecorded, so that every kernel module has been loaded; then every loaded
    tinyvit module's aligned_matmul and weight_gradient are wrapped for one recorded step, and put back."""
    calls = collections.Counter()
    cfg = config_for(model, **(model_args or {}))
    images, labels = step.synthetic_batch(cfg, batch_size, "float32", seed)
    train_step, _, _ = step.tinyvit_step(model, model_args, images, labels, seed=seed, path="fused")
    train_step()
    saved = tinyvit_functions()

    def recorded(kind, fn):
        def call(a, b):
            calls[kind, a.shape[0], a.shape[1], b.shape[1]] += 1
            return fn(a, b)
        return call

    try:
        for module, name, fn in saved:
            setattr(module, name, recorded(WRAPPED[name], fn))
        train_step()
    finally:
        for module, name, fn in saved:        # back to tinyvit's own
            setattr(module, name, fn)
    return calls


def openblas_sgemm():
    """sgemm(trans_a, a, b, c): c += op(a) @ b (op(a) = a^T if trans_a), float32, C-contiguous, by
    the cblas_sgemm of NumPy's OpenBLAS with beta = 1; None where that is not found."""
    for lib in machine.openblas_libraries():
        for name, integer in _SGEMM:
            if hasattr(lib, name):
                fn = getattr(lib, name)
                fn.argtypes = ([ctypes.c_int] * 3 + [integer] * 3
                               + [ctypes.c_float, ctypes.c_void_p, integer, ctypes.c_void_p, integer]
                               + [ctypes.c_float, ctypes.c_void_p, integer])
                fn.restype = None

                def sgemm(trans_a, a, b, c, fn=fn):
                    m, n = c.shape
                    k = a.shape[0] if trans_a else a.shape[1]
                    if a.shape != ((k, m) if trans_a else (m, k)) or b.shape != (k, n) or not all(
                            t.dtype == np.float32 and t.flags.c_contiguous for t in (a, b, c)):
                        raise ValueError(f"sgemm: shapes {a.shape}, {b.shape} -> {c.shape} (trans_a={trans_a}) "
                                         "do not match, or not C-contiguous float32")
                    fn(_ROW_MAJOR, _TRANS if trans_a else _NO_TRANS, _NO_TRANS, m, n, k, 1.0, a.ctypes.data,
                       a.shape[1], b.ctypes.data, n, 1.0, c.ctypes.data, n)
                return sgemm
    return None


def _sides(kind, rows, inner, cols, rng, sgemm=None, torch=None) -> dict:
    """{side: a function computing the product once} for one recorded shape (sgemm: openblas_sgemm())."""
    a = rng.standard_normal((rows, inner), dtype=np.float32)
    b = rng.standard_normal((inner if kind == PRODUCT else rows, cols), dtype=np.float32)
    gradient = kind == GRADIENT
    wg = weight_gradient()
    fns = {"numpy": (lambda: wg(a, b)) if gradient else (lambda: cpu_pool.aligned_matmul(a, b))}
    if sgemm is not None:
        c = cpu_pool.empty((inner, cols) if gradient else (rows, cols), np.float32)     # aligned, as tinyvit's
        c[...] = 0
        fns["openblas, beta=1"] = lambda: sgemm(gradient, a, b, c)
    if torch is not None:
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        fns["torch"] = (lambda: ta.T @ tb) if gradient else (lambda: ta @ tb)
    return fns


def _median_times(fns: dict, repeats: int) -> dict:
    """{side: median seconds of ``repeats`` calls}, the sides called in turn after one untimed call each."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def run_gemm_benchmark(model: str = "vit-cifar/4", batch_size: int = 128, threads: int | None = None,
                       repeats: int = 10, compare: str | None = None, model_args=None, seed: int = 0) -> dict:
    """Record the products of one step, time each shape ``repeats`` times per side; return the report:
    {"products": [{kind, rows, inner, cols, calls, gflop, seconds: {side: median}}], "per_step_s": {side:
    sum of calls x median}, "machine", "date", "commit", ...}, products largest first."""
    if batch_size < 1 or repeats < 1:
        raise ValueError(f"need batch_size >= 1 and repeats >= 1, got {batch_size}, {repeats}")
    threads = int(threads or cpu_pool.get_num_threads())
    torch = settings = None
    if compare == "torch":
        step.passive_torch_threads()
        from tinyvit.bench import torch_side
        torch, settings = torch_side.torch, torch_side.torch_settings(threads, tf32=False)
    report = {"model": model, "model_args": model_args or {}, "batch_size": batch_size, "threads": threads,
              "repeats": repeats, "compare": compare, "seed": seed, "date": machine.utc_now(),
              "commit": machine.git_commit(), "machine": machine.describe("cpu")}
    cpu_pool.retain_freed_memory()                    # as in the step: no page faults for re-allocated outputs
    rng, sgemm = np.random.default_rng(seed), openblas_sgemm()
    per_step, products = collections.Counter(), []
    with step.cpu_threads(threads) as blas, (settings or contextlib.nullcontext()):
        report["blas_threads"] = blas
        calls = record_products(model, model_args, batch_size, seed)
        for (kind, rows, inner, cols), n in sorted(calls.items(), key=lambda kv: -kv[0][1] * kv[0][2] * kv[0][3]):
            seconds = _median_times(_sides(kind, rows, inner, cols, rng, sgemm, torch), repeats)
            products.append({"kind": kind, "rows": rows, "inner": inner, "cols": cols, "calls": n,
                             "gflop": 2.0 * rows * inner * cols / 1e9, "seconds": seconds})
            for side, t in seconds.items():
                per_step[side] += n * t
    report["products"], report["per_step_s"] = products, dict(per_step)
    return report


def format_gemm_report(report: dict) -> str:
    """The report as a table: per product and side, the median ms per call and its GFLOP/s; then
    the step's total per side."""
    m = report["machine"]
    sides = list(report["per_step_s"])
    lines = [f"gemms: {report['model']}, batch {report['batch_size']}, {report['threads']} threads "
             f"(BLAS: {report['blas_threads']}); median of {report['repeats']} calls of each product",
             f"machine: {m['cpu']}; numpy {m['numpy']} ({m['blas']})" + (f"; torch {m['torch']}" if m["torch"] else ""),
             f"{'':<38}" + "".join(f"{side:>22}" for side in sides),
             f"{'product':<11}{'rows x inner x cols':>21}{'calls':>6}" + f"{'ms (GFLOP/s)':>22}" * len(sides)]
    for p in report["products"]:
        shape = f"{p['rows']} x {p['inner']} x {p['cols']}"
        cells = "".join(f"{p['seconds'][side] * 1e3:>14.2f} ({p['gflop'] / p['seconds'][side]:>5.0f})"
                        for side in sides)
        lines.append(f"{p['kind']:<11}{shape:>21}{p['calls']:>6}{cells}")
    lines.append(f"{'per step: calls x median, ms':<38}"
                 + "".join(f"{report['per_step_s'][side] * 1e3:>14.0f}{'':8}" for side in sides))
    return "\n".join(line.rstrip() for line in lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python docs/bench/gemms.py",
        description="Time each 2-D matrix product of one tinyvit CPU training step (float32, kernels on) alone: "
                    "NumPy, OpenBLAS with beta = 1 and, with --compare torch, PyTorch.")
    parser.add_argument("--model", default="vit-cifar/4", help="named variant (default vit-cifar/4)")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="ViTConfig override (repeatable), e.g. depth=2")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores available)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls of each product per side (default 10)")
    parser.add_argument("--compare", choices=("torch",), default=None, help="also time PyTorch's products")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the report as JSON")
    args = parser.parse_args(argv)
    from tinyvit.cli import UsageError, model_args
    try:
        report = run_gemm_benchmark(model=args.model, batch_size=args.batch_size, threads=args.threads,
                                    repeats=args.repeats, compare=args.compare, model_args=model_args(args.model_arg),
                                    seed=args.seed)
    except (ValueError, UsageError) as exc:
        parser.error(str(exc))
    report["command"] = " ".join(["python", "docs/bench/gemms.py", *(sys.argv[1:] if argv is None else argv)])
    print(format_gemm_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
