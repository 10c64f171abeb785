"""`tinyvit bench --gemms`: the 2-D matrix products of one CPU training step, each timed alone.

    tinyvit bench --gemms --compare torch --threads 2 --steps 21

The GEMMs are most of a CPU step (README, Performance). This records every 2-D product of one step
of a ViT (all of them go through two functions, which it wraps while the step runs), with its shape
and how often it runs: forward and dL/dx products y = a @ b, and weight gradients dW = x^T g summed
over the B*N rows. Then it times each shape on its own, the sides in turn (so that a change in the
machine's load hits all alike), and reports the median per call and the step's total (calls x median):

  numpy               tinyvit's own calls (ops.common.aligned_matmul, ops.basic.weight_gradient)
  openblas, beta=1    NumPy's OpenBLAS called directly as C += op(a) @ b: the same kernel without the
                      zeroing of C that beta = 0, the only call NumPy makes, costs first. It measures
                      how much of a gap that zeroing is; tinyvit does not call BLAS this way.
  torch               with --compare torch: PyTorch's a @ b (MKL on its CPU builds)
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import datetime
import time

import numpy as np

from . import bench
from .ops import attention, basic, common, patch

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
# cblas_sgemm's names in the OpenBLAS that NumPy's wheels ship (64-bit integers) and in other builds.
_SGEMM = (("scipy_cblas_sgemm64_", ctypes.c_int64), ("cblas_sgemm64_", ctypes.c_int64),
          ("scipy_cblas_sgemm", ctypes.c_int), ("cblas_sgemm", ctypes.c_int))
PRODUCT = "y = a b"            # a (rows, inner) @ b (inner, cols)
GRADIENT = "dW = x^T g"        # x (rows, inner), g (rows, cols) -> (inner, cols)


def record_products(model: str, model_args=None, batch_size: int = 128, seed: int = 0) -> collections.Counter:
    """{(kind, rows, inner, cols): calls} of one tinyvit training step in float32 on the CPU."""
    calls = collections.Counter()
    matmul, gradient = common.aligned_matmul, basic.weight_gradient

    def recorded_matmul(a, b):
        calls[PRODUCT, a.shape[0], a.shape[1], b.shape[1]] += 1
        return matmul(a, b)

    def recorded_gradient(x, g):
        calls[GRADIENT, x.shape[0], x.shape[1], g.shape[1]] += 1
        return gradient(x, g)

    cfg = bench.config_for(model, **(model_args or {}))
    images, labels = bench.synthetic_batch(cfg, batch_size, "float32", seed)
    step, _, _ = bench.tinyvit_step(model, model_args, images, labels, seed=seed)
    ops = (basic, attention, patch)          # the ops that call the two, each by its own imported name
    saved = [(op, vars(op).get("aligned_matmul"), vars(op).get("weight_gradient")) for op in ops]
    try:
        _point(saved, recorded_matmul, recorded_gradient)
        step()
    finally:
        _point(saved)                        # back to the ops' own
    return calls


def _point(saved, matmul=None, gradient=None):
    """Set each saved op's aligned_matmul and weight_gradient (those it has) to the given functions,
    or back to its own (saved: [(op, its aligned_matmul or None, its weight_gradient or None)])."""
    for op, own_matmul, own_gradient in saved:
        if own_matmul is not None:
            op.aligned_matmul = matmul or own_matmul
        if own_gradient is not None:
            op.weight_gradient = gradient or own_gradient


def openblas_sgemm():
    """sgemm(trans_a, a, b, c): c += op(a) @ b (op(a) = a^T if trans_a), float32, C-contiguous, by
    the cblas_sgemm of NumPy's OpenBLAS with beta = 1; None where that is not found."""
    for lib in bench.openblas_libraries():
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
    fns = {"numpy": (lambda: basic.weight_gradient(a, b)) if gradient else (lambda: common.aligned_matmul(a, b))}
    if sgemm is not None:
        c = common.empty((inner, cols) if gradient else (rows, cols), np.float32)
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
    sum of calls x median}, ...}, products largest first."""
    if batch_size < 1 or repeats < 1:
        raise ValueError(f"need batch_size >= 1 and steps >= 1, got {batch_size}, {repeats}")
    threads = int(threads or common.get_num_threads())
    torch = settings = None
    if compare == "torch":
        bench.passive_torch_threads()
        from . import bench_torch
        torch, settings = bench_torch.torch, bench_torch.torch_settings(threads, tf32=False)
    report = {"model": model, "batch_size": batch_size, "threads": threads, "repeats": repeats,
              "date": datetime.date.today().isoformat(),
              "machine": {"cpu": bench.cpu_name(), "numpy": np.__version__, "blas": bench.blas_info(),
                          "torch": torch.__version__ if torch else None}}
    common.retain_freed_memory()                      # as in the step: no page faults for re-allocated outputs
    rng, sgemm = np.random.default_rng(seed), openblas_sgemm()
    per_step, products = collections.Counter(), []
    with bench.cpu_threads(threads) as blas, (settings or contextlib.nullcontext()):
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
    """The report as the table `tinyvit bench --gemms` prints: per product and side, the median ms
    per call and its GFLOP/s; then the step's total per side."""
    m = report["machine"]
    sides = list(report["per_step_s"])
    lines = [f"tinyvit bench --gemms: {report['model']}, batch {report['batch_size']}, {report['threads']} threads "
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
