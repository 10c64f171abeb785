"""The training state in a run's latest.safetensors, read back and checked before a resume uses it.

    read_training_state(latest, metadata, ema) -> dict    parsed (of a bounded depth), every field
                                                           checked for its type and range
    saved_plan(state, cfg, steps_per_epoch) -> (Plan, note)   the run's steps, as its version planned them
    check_state_fits(state, plan, steps_per_epoch, latest)     the positions it holds, within that plan

A field of the wrong type or out of range is one ValueError that names it and says what to do
("progress.epoch is '1', not a whole number >= 0"): a hand-edited or damaged state never reaches
the code that uses it (once a KeyError or TypeError traceback). A state written by an older
tinyvit lacks what that version did not write: its ``plan`` (before the time budget, 2026-11-24)
is derived as that version scheduled the run; anything else missing is named.
"""
from __future__ import annotations

import math

import numpy as np

from ..io.arrays import parse_json
from . import budget


class _Bad(Exception):
    """A field that is not what it should be: (where, what was found, what was expected)."""


def _fail(where, value, expected):
    raise _Bad(f"{where} is {_short(value)}, not {expected}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def whole(low: int = 0):
    def check(value, where):
        if type(value) is not int or value < low:
            _fail(where, value, f"a whole number >= {low}")
    return check


def number(low: float = -math.inf, high: float = math.inf, finite: bool = True):
    def check(value, where):
        if type(value) not in (int, float) or not low <= value <= high or (finite and not math.isfinite(value)):
            _fail(where, value, f"a number in [{low:g}, {high:g}]" if math.isfinite(high) else
                  f"a {'finite ' if finite else ''}number >= {low:g}" if math.isfinite(low) else "a finite number")
    return check


def setting(value, where):
    """An optimizer setting: a number, a flag, None or a list of numbers (Adam's betas)."""
    if not (value is None or type(value) in (int, float, bool) or
            type(value) is list and all(type(v) in (int, float) for v in value)):
        _fail(where, value, "a number or a list of numbers")


def random_state(value, where):
    """A NumPy generator's state: what tinyvit's generators (PCG64) accept, tried on a new one."""
    try:
        np.random.default_rng().bit_generator.state = value
    except (TypeError, ValueError, KeyError):
        _fail(where, value, "a random generator's state (NumPy PCG64)")


def nullable(spec):
    def check(value, where):
        if value is not None:
            spec(value, where)
    return check


def listof(spec):
    def check(value, where):
        if type(value) is not list:
            _fail(where, value, "a list")
        for i, item in enumerate(value):
            spec(item, f"{where}.{i}")
    return check


def obj(fields: dict, others=None):
    """An object with ``fields`` (a name ending in "?" may be missing); with ``others``, any other
    key's value is checked by it."""
    def check(value, where):
        if type(value) is not dict:
            _fail(where, value, "an object {...}")
        for name, spec in fields.items():
            key = name.rstrip("?")
            if key in value:
                spec(value[key], f"{where}.{key}" if where else key)
            elif not name.endswith("?"):
                raise _Bad(f"{where + '.' if where else ''}{key} is missing")
        for key in set(value) - {name.rstrip("?") for name in fields}:
            if others is not None:
                others(value[key], f"{where}.{key}")
    return check


def numbered(spec):
    """An object whose keys are parameter numbers ("0", "1", ...)."""
    def check(value, where):
        if type(value) is not dict:
            _fail(where, value, "an object {...}")
        for key, item in value.items():
            if not key.isdigit():
                raise _Bad(f"{where} has a key {_short(key)}, not a parameter number")
            spec(item, f"{where}.{key}")
    return check


PROGRESS = obj({"epoch": whole(), "best_acc": number(-1, 1), "best_loss?": number(finite=False),
                "partial": nullable(obj({"loss": number(), "correct": number(0), "seen": whole(),
                                         "seconds": number(0)})),
                "trained": nullable(obj({"epoch": whole(1), "train_loss": number(), "train_acc": number(0, 1),
                                         "lr": number(0), "seconds": number(0)})),
                "plan?": obj({"total_steps": whole(1), "warmup_steps": whole(), "epochs": whole(1)})})
STATE = obj({"optimizer": obj({"param_groups": listof(obj({"params": listof(whole()), "lr": number(0)}, setting)),
                               "scalars": numbered(obj({}, setting))}),
             "scheduler": obj({"step": whole()}),
             "loader": obj({"epoch": whole(), "position": whole(), "rng": random_state,
                            "order_rng": nullable(random_state), "transform?": obj({"rng": random_state})}),
             "rng": random_state,
             "config": obj({}),
             "progress": PROGRESS,
             "ema_step?": whole()})


def damaged(latest, problem: str) -> ValueError:
    return ValueError(f"--resume: the training state in {latest} is damaged: {problem}; fine-tune from the run's "
                      "best.safetensors with `tinyvit finetune`, or start a new run with --out DIR")


def read_training_state(latest, metadata: dict, ema: bool = False) -> dict:
    """The training state of ``metadata`` (a checkpoint's), parsed and checked field by field;
    ``ema``: the run averages its weights, so the state must hold the average's step."""
    if "training" not in metadata:
        raise ValueError(f"--resume: {latest} holds a model but no training state; fine-tune from it with "
                         "`tinyvit finetune`, or start a new run with --out DIR")
    try:
        state = parse_json(metadata["training"], "its 'training' metadata")
    except ValueError as exc:
        raise damaged(latest, str(exc)) from None
    try:
        STATE(state, "")
        if ema and "ema_step" not in state:
            raise _Bad("ema_step is missing (the run averages its weights: --ema)")
        plan = state["progress"].get("plan")
        if plan is not None:
            check_within_plan(state, budget.Plan(**plan))
    except _Bad as exc:
        raise damaged(latest, str(exc)) from None
    return state


def check_within_plan(state: dict, plan) -> None:
    if state["progress"]["epoch"] > plan.epochs:
        raise _Bad(f"progress.epoch is {state['progress']['epoch']}, beyond the plan's {plan.epochs} epochs")
    if state["scheduler"]["step"] > plan.total_steps:
        raise _Bad(f"scheduler.step is {state['scheduler']['step']}, beyond the plan's {plan.total_steps} steps")


def saved_plan(state: dict, cfg, steps_per_epoch: int) -> tuple:
    """(Plan, note or None): the plan the run started with. A state without one was written before the
    time budget existed, when a run was its epochs times steps, int(warmup_epochs x steps) of them
    warmup, never shortened: so it is rebuilt, and the note says so."""
    if "plan" in state["progress"]:
        return budget.Plan(**state["progress"]["plan"]), None
    plan = budget.Plan(cfg.epochs * steps_per_epoch, int(cfg.warmup_epochs * steps_per_epoch), cfg.epochs)
    return plan, (f"resuming a run of an older tinyvit (its state holds no plan): {plan.total_steps} steps, "
                  f"{plan.warmup_steps} of warmup, as that version scheduled them")


def check_state_fits(state: dict, plan, steps_per_epoch: int, latest) -> None:
    """The positions the state holds lie within ``plan`` and an epoch of ``steps_per_epoch`` steps."""
    try:
        check_within_plan(state, plan)
        if state["loader"]["position"] > steps_per_epoch:
            raise _Bad(f"loader.position is {state['loader']['position']}, beyond an epoch of {steps_per_epoch} steps")
    except _Bad as exc:
        raise damaged(latest, str(exc)) from None
