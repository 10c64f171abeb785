"""What a run tells its reader while it runs and when it ends (the loop, loop.py, calls these).

    progress_bar(...)   in a terminal, tqdm's bar for the epoch; elsewhere (nohup, Slurm, a notebook's
                        `!tinyvit train`, a pipe) a line every PROGRESS_EVERY_SECONDS instead of the bar's
                        carriage-return redraws, which fill a log file with thousands of updates
    RunClock            the whole run's pace and time left (the bar's own ETA is the epoch's)
    summary(...)        the run's last lines: wall time, best epoch and metric, where the files are
"""
from __future__ import annotations

import sys
import time

# Without a terminal, a progress line at most this often (and at the first check of a run).
PROGRESS_EVERY_SECONDS = 30.0


def format_seconds(seconds: float) -> str:
    """12.3 -> "12 s", 754 -> "12 min 34 s", 7384 -> "2 h 3 min"."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {s} s" if s and minutes < 10 else f"{minutes} min"
    h, m = divmod(minutes, 60)
    return f"{h} h {m} min" if m else f"{h} h"


class RunClock:
    """The pace of the whole run in this process: steps done since it started (or resumed), and the
    wall time they took, evaluations and checkpoints included; the time left at that pace."""

    def __init__(self, plan, step: int):
        self.plan, self.first_step, self.started = plan, step, time.perf_counter()
        self.last_line = None          # when LineProgress last printed, over all epochs

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self, step: int) -> float | None:
        """Seconds until the plan's last step at the pace so far (None before the first step)."""
        done = step - self.first_step
        if done <= 0:
            return None
        return self.elapsed() / done * max(self.plan.total_steps - step, 0)

    def describe(self, step: int) -> str:
        """E.g. "run: step 1200/9360, about 14 min left"."""
        left = self.left(step)
        eta = f", about {format_seconds(left)} left" if left is not None else ""
        return f"run: step {step}/{self.plan.total_steps}{eta}"


class LineProgress:
    """tqdm's interface (update, set_postfix, close) as a line of text every PROGRESS_EVERY_SECONDS,
    for output that is not a terminal. ``step`` gives the run's step count; ``clock`` the run's ETA."""

    def __init__(self, total: int, initial: int, desc: str, clock: RunClock, step, log=print):
        self.total, self.n, self.desc, self.clock, self.step, self.log = total, initial, desc, clock, step, log

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, **values) -> None:
        now = time.perf_counter()
        if self.clock.last_line is not None and now - self.clock.last_line < PROGRESS_EVERY_SECONDS:
            return
        self.clock.last_line = now
        shown = "  ".join(f"{key.replace('_', '/')} {value}" for key, value in values.items())
        self.log(f"{self.desc} step {self.n + 1}/{self.total}  {shown}  ({self.clock.describe(self.step())})")

    def close(self) -> None:
        pass


def progress_bar(total: int, initial: int, desc: str, enabled: bool, clock: RunClock = None, step=None):
    """The epoch's progress: tqdm's bar on a terminal, LineProgress elsewhere, None when disabled
    (tests, the ranks other than 0) or where neither fits (no tqdm, no clock)."""
    if not enabled:
        return None
    if not sys.stderr.isatty():
        return LineProgress(total, initial, desc, clock, step) if clock is not None and step is not None else None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc=desc, unit="step", leave=False, dynamic_ncols=True)


def summary(result: dict, metric: str, seconds: float, out, files: list) -> str:
    """The run's last lines: how long it took, its best epoch and metric, and what it left where."""
    best = result.get("best_acc", -1.0)
    if best < 0:
        line = f"done in {format_seconds(seconds)}: no epoch finished"
    else:
        at = f" at epoch {result['best_epoch']}" if result.get("best_epoch") else ""
        final = f", final {100 * result['test_acc']:.2f}%" if "test_acc" in result else ""
        line = f"done in {format_seconds(seconds)}: best {metric} {100 * best:.2f}%{at}{final}"
    described = {"best.safetensors": "the best epoch's model (for eval, predict, finetune)",
                 "latest.safetensors": "the last epoch's, with the training state (--resume)",
                 "metrics.jsonl": "one row per epoch", "curves.png": "loss, accuracy and learning rate"}
    lines = [line, f"files in {out}:"]
    lines += [f"  {name:<20s}{described.get(name, '')}" for name in files if name in described]
    return "\n".join(lines)
