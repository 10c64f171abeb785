"""How many steps a run gets: from epochs, or from a time budget (``tinyvit train --time-budget 30m``).

A learner has a fixed amount of patience, not a fixed number of epochs. With a time budget the
trainer times a few training steps and one evaluation before it starts (on a throw-away copy of
the model, so the run itself is not touched), then fixes the number of steps so that training and
its evaluations end within the budget:

    total steps T:  the largest T with   elapsed + T * t_step + ceil(T / S) * t_epoch  <=  budget
                    (t_step: seconds per training step, S: steps per epoch, t_epoch: the evaluation
                    and checkpoint after each epoch; the last epoch may be cut short)

The learning-rate schedule (warmup, then cosine decay) is laid over exactly those T steps. After each
epoch the plan is refitted to the time left (keep_to_budget): a run slowed down by other work on the
machine is shortened, its decay compressed to end with it, so that it still ends in time; one whose
trial ran while the machine was busy is lengthened, early in the run only. The same
holds for a run given in epochs: a recipe's warmup that would fill more than WARMUP_SHARE of a short
run is shortened to that share (a 1-epoch CIFAR run would otherwise spend itself in the CIFAR
recipe's 10 warmup epochs and never reach its learning rate), and the run says so.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

# A recipe's warmup takes at most this share of a run's steps (the CIFAR recipe's 10 of 200 epochs is
# 5%, DeiT's 5 of 300 under 2%; a 2-epoch run's recipe warmup of 1 epoch would be 50%).
WARMUP_SHARE = 0.1
# Seconds kept back from a budget for what is not timed: the last checkpoint and plot, jitter.
SAFETY_SECONDS = 5.0
# Seconds per epoch, beside its evaluation, for writing two checkpoints and the curves.
EPOCH_OVERHEAD_SECONDS = 1.0

# The longest budget accepted: a month. A longer one is a typo (1e30 minutes once planned 4e32 steps,
# and 1e308 overflowed the plan to NaN).
MAX_BUDGET_MINUTES = 30 * 24 * 60

_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?\s*$")


def parse_duration(text) -> float:
    """A duration in minutes: "30m", "2h", "1h30m", "90s", or a bare number of minutes ("45").
    Raises ValueError naming the accepted forms."""
    word = str(text).strip().lower()
    try:
        minutes = float(word)                                   # a bare number: minutes
    except ValueError:
        match = _DURATION.match(word)
        if not word or not match or not any(match.groups()):
            raise ValueError(f"--time-budget: cannot read {text!r} as a duration; write e.g. 30m, 2h, 1h30m, "
                             "90s, or a number of minutes") from None
        h, m, s = (float(g) if g else 0.0 for g in match.groups())
        minutes = 60 * h + m + s / 60
    if not math.isfinite(minutes) or minutes <= 0:
        raise ValueError(f"--time-budget must be a positive duration, got {text!r}")
    if minutes > MAX_BUDGET_MINUTES:
        raise ValueError(f"--time-budget must be at most {MAX_BUDGET_MINUTES // (24 * 60)} days "
                         f"({MAX_BUDGET_MINUTES} minutes), got {text!r} minutes; for a longer run give --epochs")
    return minutes


def format_duration(minutes: float) -> str:
    """30.0 -> "30 min", 0.5 -> "30 s", 90 -> "1 h 30 min"."""
    seconds = round(60 * minutes)
    if seconds < 60:
        return f"{seconds} s"
    h, m = divmod(round(seconds / 60), 60)
    return f"{h} h {m} min" if h and m else f"{h} h" if h else f"{m} min"


@dataclass(frozen=True)
class Plan:
    """The steps of a run: ``total_steps`` optimizer updates, the first ``warmup_steps`` of them
    warming the learning rate up, in ``epochs`` passes over the data (the last one possibly short)."""
    total_steps: int
    warmup_steps: int
    epochs: int

    def as_dict(self) -> dict:
        return {"total_steps": self.total_steps, "warmup_steps": self.warmup_steps, "epochs": self.epochs}


def warmup_steps_for(warmup_epochs: float, steps_per_epoch: int, total_steps: int, from_recipe: bool) -> tuple:
    """(warmup steps, note): the asked warmup in steps; a recipe's warmup longer than WARMUP_SHARE of
    the run is shortened to that share, and the note says so (None when nothing changed)."""
    asked = int(round(warmup_epochs * steps_per_epoch))
    cap = int(WARMUP_SHARE * total_steps)
    if from_recipe and asked > cap:
        note = (f"the recipe's warmup of {warmup_epochs:g} epoch{'' if warmup_epochs == 1 else 's'} ({asked} steps) is more than "
                f"{WARMUP_SHARE:.0%} of this {total_steps}-step run: shortened to {cap} steps "
                f"({cap / steps_per_epoch:.2f} epochs); --warmup-epochs sets it")
        return cap, note
    if asked > total_steps:
        return asked, (f"--warmup-epochs {warmup_epochs:g} ({asked} steps) is longer than the run "
                       f"({total_steps} steps): the learning rate never reaches --lr")
    return asked, None


def steps_within(budget_s: float, elapsed_s: float, step_s: float, epoch_s: float, steps_per_epoch: int) -> int:
    """The largest number of training steps T with
    elapsed + T step_s + ceil(T / steps_per_epoch) epoch_s + SAFETY_SECONDS <= budget (0 if none fits)."""
    if step_s <= 0 or steps_per_epoch < 1:
        raise ValueError(f"steps_within: step time {step_s} s and steps per epoch {steps_per_epoch} must be positive")
    left = budget_s - elapsed_s - SAFETY_SECONDS
    per_epoch = steps_per_epoch * step_s + epoch_s             # a whole epoch with its evaluation
    full = max(int(left // per_epoch), 0)
    rest = left - full * per_epoch - epoch_s                   # a last, partial epoch also gets evaluated
    partial = min(max(int(rest // step_s), 0), steps_per_epoch - 1)
    return full * steps_per_epoch + partial


def plan_for_budget(budget_min: float, elapsed_s: float, step_s: float, epoch_s: float, steps_per_epoch: int,
                    warmup_epochs: float, from_recipe: bool) -> tuple:
    """(Plan, message) for a time budget, from the measured step and per-epoch times. Raises
    ValueError when not even one step fits, naming the times measured."""
    total = steps_within(60 * budget_min, elapsed_s, step_s, epoch_s, steps_per_epoch)
    if total < 1:
        raise ValueError(f"--time-budget {format_duration(budget_min)} leaves no time to train: {elapsed_s:.0f} s went to "
                         f"loading and timing, a step takes {step_s:.3f} s and an evaluation {epoch_s:.1f} s; "
                         "give a longer budget")
    warmup, note = warmup_steps_for(warmup_epochs, steps_per_epoch, total, from_recipe)
    epochs = -(-total // steps_per_epoch)
    message = (f"time budget {format_duration(budget_min)}: a step takes {step_s:.3f} s and an evaluation {epoch_s:.1f} s, "
               f"so {total} steps ({total / steps_per_epoch:.2f} epochs of {steps_per_epoch}), "
               f"warmup {warmup} steps, then cosine decay to the end")
    return Plan(total, warmup, epochs), message + (f"; {note}" if note else "")


# The refit's pace is the median of the last this many epochs' (budget.recent_pace).
PACE_EPOCHS = 3


def recent_pace(history: list, steps_per_epoch: int) -> float:
    """Seconds a training step took, the median over the last ``PACE_EPOCHS`` epochs of ``history``
    (metrics rows with "seconds" and "epochs_trained"). One epoch slowed by other work on the machine
    does not move it; a slowdown that lasts two epochs does. (Following the last epoch alone, one
    slow epoch of a 30-minute run cut its plan by 4,000 steps and the next epoch put them back: two
    steps in the learning rate for nothing.)"""
    paces, before = [], 0.0
    for row in history:
        steps = round((row["epochs_trained"] - before) * steps_per_epoch)
        before = row["epochs_trained"]
        if steps > 0:
            paces.append(row["seconds"] / steps)
    if not paces:
        raise ValueError("recent_pace: no epoch with steps in the history")
    recent = sorted(paces[-PACE_EPOCHS:])
    middle = len(recent) // 2
    return recent[middle] if len(recent) % 2 else (recent[middle - 1] + recent[middle]) / 2


def keep_to_budget(plan: Plan, budget_min: float, elapsed_s: float, step_s: float, epoch_s: float,
                   steps_done: int, steps_per_epoch: int) -> tuple:
    """(plan, message or None) at the end of an epoch: the plan refitted to the time left at the pace
    of the recent epochs (recent_pace). Shortened when its steps no longer fit by more than half the safety
    margin (other work on the machine slowed the run after its trial was timed); lengthened when at least 5% more steps fit and at
    most half the plan is done (the trial ran while the machine was busy), not later, when the
    learning rate is low and raising it would undo the decay. The warmup is kept; the cosine decay
    ends with the new last step, so the learning rate steps once onto the new run's curve."""
    fit = steps_done + steps_within(60 * budget_min, elapsed_s, step_s, epoch_s, steps_per_epoch)
    early = steps_done <= plan.total_steps // 2
    # an overrun that half the safety margin absorbs is jitter, not a slower machine: no refit for it
    small_overrun = (plan.total_steps - fit) * step_s <= SAFETY_SECONDS / 2
    if (fit >= plan.total_steps or small_overrun) and not (early and fit > 1.05 * plan.total_steps):
        return plan, None
    new = Plan(fit, min(plan.warmup_steps, fit), -(-fit // steps_per_epoch))
    why = "behind" if fit < plan.total_steps else "ahead of"
    return new, (f"{why} the time budget (a step now takes {step_s:.3f} s): the run ends after {fit} steps "
                 f"({fit / steps_per_epoch:.2f} epochs) instead of {plan.total_steps}")
