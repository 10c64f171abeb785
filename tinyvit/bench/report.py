"""The record of a benchmark run: each side's numbers, the text `tinyvit bench` prints, and the
JSON file it writes (--json FILE, or --record DIR for docs/bench/records/<date>-<commit>-<name>.json).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

# how format_report labels the sides (the record's keys are the ones on the left)
LABELS = {"tinyvit_fused": "tinyvit, fused", "tinyvit": "tinyvit, per-op kernels",
          "tinyvit_reference": "tinyvit, reference ops", "torch": "torch"}


def side_report(walls, cpus, batch_size, flops_per_image, peak_flops, memory, losses) -> dict:
    """One side's numbers: the median step time (and every step's), CPU time, images/s, peak memory,
    TFLOP/s and MFU, and the loss of every step run (warmup included)."""
    step = float(np.median(walls))
    images_per_s = batch_size / step
    tflops = flops_per_image * images_per_s / 1e12
    return {"step_time_s": step, "step_times_s": [float(t) for t in walls],
            "cpu_time_s": float(np.median(cpus)), "images_per_s": images_per_s,
            "peak_memory_bytes": int(memory.bytes), "memory_method": memory.method, "tflops": tflops,
            "mfu": tflops * 1e12 / peak_flops if peak_flops else None, "losses": [float(v) for v in losses]}


def round_ratios(numerator_steps, denominator_steps, steps: int) -> list:
    """Each round's own ratio, the median of one side's ``steps`` step times in that round over the
    median of the other's (both lists hold the rounds one after the other): on a machine whose speed
    drifts, their spread says how far to trust the overall ratio."""
    return [float(np.median(numerator_steps[i:i + steps]) / np.median(denominator_steps[i:i + steps]))
            for i in range(0, len(numerator_steps), steps)]


def _mib(n):
    return f"{n / 2 ** 20:.1f} MiB"


def format_report(report: dict) -> str:
    """The record as the few lines `tinyvit bench` prints."""
    m = report["machine"]
    precision = report["dtype"] + (", TF32 " + ("on" if report["tf32"] else "off") if report["device"] != "cpu" else "")
    rounds = f" x {report['rounds']} rounds" if report["rounds"] > 1 else ""
    load = ""
    if m.get("loadavg_before") is not None:
        load = f"; load average {m['loadavg_before']:.2f} before, {m['loadavg_after']:.2f} after"
    gpu = ", ".join(m.get("gpus") or []) if report["device"] != "cpu" else ""
    lines = [
        f"tinyvit bench: {report['model']} ({report['parameters'] / 1e6:.2f}M parameters), batch "
        f"{report['batch_size']}, {report['device']} {precision}, {report['threads']} threads "
        f"(BLAS: {report['blas_threads']}), kernels {report['kernels']}, {report['warmup']} warmup + "
        f"{report['steps']} timed steps{rounds}",
        f"machine: {gpu or m['cpu']}; numpy {m['numpy']} ({m['blas']})"
        + (f"; torch {report['torch']['torch_version']}" if "torch" in report else "") + load
        + "".join(f"; {k}={v}" for k, v in m.get("env", {}).items()),
        f"commit {(report.get('commit') or 'unknown')[:12]}, {report['date']}; training FLOPs per image "
        f"{report['train_flops_per_image'] / 1e9:.3f} G; peak {report['peak_tflops']:.3f} TFLOP/s "
        f"({report['peak_source']})",
        f"{'':<24}{'step (median)':>14}{'CPU time':>10}{'images/s':>10}{'peak memory':>13}{'TFLOP/s':>9}{'MFU':>7}"
        + (f"{'/ torch':>9}" if "torch" in report else ""),
    ]
    for side in report.get("sides", []):
        r = report[side]
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        versus = f"{r['ratio_to_torch']:>8.2f}x" if "ratio_to_torch" in r else ""
        lines.append(f"{LABELS.get(side, side):<24}{r['step_time_s']:>12.3f} s{r['cpu_time_s']:>8.2f} s"
                     f"{r['images_per_s']:>10.1f}{_mib(r['peak_memory_bytes']):>13}{r['tflops']:>9.3f}{mfu:>7}{versus}")
    if "readability_price" in report:
        lines.append(f"the price of readability (reference ops / fused step time): {report['readability_price']:.2f}x;"
                     f" the fusion's gain (per-op kernels / fused): {report['fusion_gain']:.2f}x")
        if len(report.get("readability_round_ratios", [])) > 1:
            lines.append("  in each round: " + " ".join(f"{r:.2f}x" for r in report["readability_round_ratios"]))
    if "ratio" in report:
        ours = LABELS[report["sides"][0]]
        lines.append(f"ratio ({ours} step time / torch step time): {report['ratio']:.2f}x"
                     f"  (torch attention: {report['torch']['attention']})")
        if len(report.get("round_ratios", [])) > 1:
            lines.append("ratio in each round: " + " ".join(f"{r:.2f}x" for r in report["round_ratios"]))
    return "\n".join(lines)


def record_name(report: dict, name: str | None = None) -> str:
    """<date>-<commit>-<name>.json: the UTC date, the first 7 characters of the commit ("nocommit"
    outside a git checkout) and ``name`` (default: model, device, dtype, kernels and comparison),
    every run of other characters than letters, digits, '.' and '_' made one '-'."""
    if name is None:
        name = f"{report['model']}-{report['device']}-{report['dtype']}-kernels-{report['kernels']}"
        name += f"-vs-{report['compare']}" if report.get("compare") else ""
    name = re.sub(r"[^A-Za-z0-9._]+", "-", name).strip("-") or "run"
    commit = report["commit"][:7] if report.get("commit") else "nocommit"
    return f"{report['date'][:10]}-{commit}-{name}.json"


def write_json(report: dict, path) -> Path:
    """Write the record to ``path`` (its folder must exist), indented, one field a line."""
    path = Path(path)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    return path


def write_record(report: dict, folder, name: str | None = None) -> Path:
    """Add the record to ``folder`` (created if needed) as record_name(report, name), never replacing
    a record already there: a second run of the same day, commit and name gets '-2', '-3', ..."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / record_name(report, name)
    n = 2
    while path.exists():
        path = path.with_name(f"{record_name(report, name)[:-len('.json')]}-{n}.json")
        n += 1
    return write_json(report, path)
