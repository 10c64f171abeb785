"""What a run folder holds, written and read back by the training loop (loop.py):

    latest.safetensors    the model with the optimizer, schedule, data order and random state in one
                          atomic file (save_training_checkpoint): everything a resume needs
    metrics.jsonl         one row per epoch           steps.jsonl    one row per logging interval
    .lock                 held by the run using the folder (RunFolderLock); holds its pid

and the checks that a run may start there (check_run_folder) and that a resume continues the same
run (check_resume).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from .. import backend, io

try:
    import fcntl
except ImportError:                   # Windows: no flock, so there a run folder is not locked
    fcntl = None


class RunFolderInUse(RuntimeError):
    """Another process holds the run folder's lock."""


class RunFolderLock:
    """The lock a run holds on its folder from start to end, so that two runs never interleave their
    files: an exclusive, non-blocking ``flock`` on FOLDER/.lock. A second run fails at once
    (RunFolderInUse, naming the holder's pid, which the file records). The OS drops the lock when
    the process ends, however it ends: a crash or kill -9 leaves no stale lock.

    The lock file stays between runs (removing it would let a run that opened it a moment before
    lock a file no longer there), except in a folder this start created and left empty: a run that
    failed before writing anything leaves no trace (and a run that locked that removed file notices
    and locks the new one)."""
    NAME = ".lock"

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / self.NAME
        self.made_folder = False
        self._fd = None

    def __enter__(self) -> RunFolderLock:
        self.made_folder = not self.folder.exists()
        while self._fd is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip()
                os.close(fd)
                raise RunFolderInUse(f"{self.folder} is in use by another run{f' (pid {holder})' if holder else ''}; "
                                     "wait for it to end, or give this run another folder with --out DIR") from None
            if _is_open_file(fd, self.path):
                self._fd = fd
            else:                                         # removed by a failed start before we held it: again
                os.close(fd)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error_type is not None and self.made_folder and os.listdir(self.folder) == [self.NAME]:
            self.path.unlink()
            self.folder.rmdir()
        os.close(self._fd)                                # releases the lock
        self._fd = None


def _is_open_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def check_run_folder(cfg, latest: Path) -> None:
    """A new run needs a folder without a checkpoint; a resume needs one (reads nothing but whether
    ``latest`` exists: refused, a run changes nothing)."""
    if latest.exists() and not cfg.resume:
        raise FileExistsError(f"{latest.parent} already holds a run ({latest.name}); pass --resume to continue it, "
                              "or --out DIR for a new run")
    if cfg.resume and not latest.exists():
        raise FileNotFoundError(f"--resume: no checkpoint at {latest} to resume from; start the run again without "
                                "--resume (a run stopped before its first checkpoint starts from scratch)")


def flatten_optimizer(opt) -> tuple[dict, dict]:
    """Optimizer state -> (arrays for the file, JSON-able rest)."""
    sd = opt.state_dict()
    arrays, scalars = {}, {}
    for idx, entry in sd["state"].items():
        for key, value in entry.items():
            if hasattr(value, "shape") and getattr(value, "ndim", 0) > 0:
                arrays[f"optimizer.{idx}.{key}"] = value
            else:
                scalars.setdefault(str(idx), {})[key] = value.item() if hasattr(value, "item") else value
    return arrays, {"param_groups": sd["param_groups"], "scalars": scalars}


def unflatten_optimizer(arrays: dict, rest: dict) -> dict:
    state = {int(i): dict(v) for i, v in rest["scalars"].items()}
    for name, value in arrays.items():
        if name.startswith("optimizer."):
            _, idx, key = name.split(".", 2)
            state.setdefault(int(idx), {})[key] = value
    return {"state": state, "param_groups": rest["param_groups"]}


def dataset_metadata(dataset) -> dict:
    """What predict/eval need to treat new images as the model was trained: classes and normalisation."""
    return {"dataset": json.dumps({"name": dataset.name, "classes": list(dataset.classes),
                                   "mean": list(dataset.mean), "std": list(dataset.std),
                                   **dataset.info.get("checkpoint", {})})}    # a folder's path and split


def save_training_checkpoint(path, model, opt, sched, loader, cfg, progress: dict, dataset, ema=None) -> None:
    """Everything a resume needs, in one atomic safetensors file (also loadable by tinyvit.load): the
    trained weights as the model, the optimizer's state and the weights' average (``ema``) as arrays."""
    arrays, opt_rest = flatten_optimizer(opt)
    state = {"optimizer": opt_rest, "scheduler": sched.state_dict(), "loader": loader.state_dict(),
             "rng": backend.rng().bit_generator.state, "config": asdict(cfg), "progress": progress}
    if ema is not None:
        ema_state = ema.state_dict()
        state["ema_step"] = ema_state.pop("step")
        arrays = {**arrays, **ema_state}
    io.save(model, path, arrays=arrays,
            metadata={"training": json.dumps(state, default=_json_default), **dataset_metadata(dataset)})


# What a resumed run may change: where and how it computes, and the two knobs that rescue a diverged
# run (a lower --lr, --grad-clip), which the schedule and each update read afresh. Every other setting
# (data, model, optimizer, batches, augmentation, seed, length) is part of what the run is: with
# another, the checkpoint's weights, optimizer state and best accuracy would belong to a different run.
RESUME_MAY_CHANGE = ("device", "precision", "data_dir", "eval_batch_size", "lr", "grad_clip")


def check_resume(cfg, latest: Path, log=print) -> None:
    """Refuse to resume the run in ``latest`` with settings (resolved, recipe values filled in) that
    change what the run is, naming them; log the allowed changes. Reads the checkpoint's header only."""
    from ..io.arrays import read_header
    _, metadata = read_header(latest)
    if "training" not in metadata:
        raise ValueError(f"--resume: {latest} holds a model but no training state; fine-tune from it with "
                         "`tinyvit finetune`, or start a new run with --out DIR")
    try:
        saved = json.loads(metadata["training"])["config"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"--resume: the training state in {latest} is damaged (not JSON with a 'config' entry); "
                         "fine-tune from the run's best.safetensors with `tinyvit finetune`, or start a new run "
                         "with --out DIR") from None
    now = json.loads(json.dumps(asdict(cfg), default=_json_default))      # as stored: tuples become lists
    for name in ("out", "resume", "from_recipe"):                          # which run, not what it is
        del now[name]
    # a setting older runs did not store: its default (ema: runs from before it existed had none)
    defaults = {**asdict(type(cfg)()), "ema": 0.0}
    before = {name: saved.get(name, defaults[name]) for name in now}
    differ = [name for name in now if now[name] != before[name]]
    refused = [name for name in differ if name not in RESUME_MAY_CHANGE]
    if refused:
        listed = ", ".join(f"{_setting(n)} {now[n]!r} (the run's: {before[n]!r})" for n in refused)
        raise ValueError(f"--resume: {listed} would change the run in {latest.parent}; resume it with the settings "
                         "it started with (its config.json), or start a new run with --out DIR")
    for name in differ:
        log(f"resuming with {_setting(name)} {now[name]!r} (the run had {before[name]!r})")


def _setting(name: str) -> str:
    """How a user sets a TrainConfig field: its flag, or its table in a --config file."""
    return {"model_args": "--model-arg/[model]", "dataset_args": "[dataset]"}.get(name, "--" + name.replace("_", "-"))


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint's metadata")


def read_log(path: Path, held=None) -> list:
    """The rows of a JSON-lines log (metrics.jsonl, steps.jsonl). With ``held``, only the rows the
    checkpoint holds: a row written just before an interruption that the checkpoint missed is
    dropped from the file (its epoch or steps are done again)."""
    if not path.exists():                               # interrupted in the first epoch
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}, line {number}: not valid JSON ({exc}); delete that line and resume "
                             "again") from None
    kept = rows if held is None else [row for row in rows if held(row)]
    if len(kept) < len(rows):
        path.write_text("".join(json.dumps(row) + "\n" for row in kept))
    return kept


def log_interval(path: Path | None, sched, epoch: float, now: dict, before: dict) -> None:
    """One row of steps.jsonl: the mean training loss and accuracy since the previous check (none
    with ``path`` None: the ranks other than 0 of a data-parallel run write no files)."""
    seen = now["seen"] - before["seen"]
    if seen <= 0 or path is None:
        return
    row = {"step": sched.step_count, "epoch": round(epoch, 4), "train_loss": (now["loss"] - before["loss"]) / seen,
           "train_acc": (now["correct"] - before["correct"]) / seen, "lr": float(sched.last_lr)}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def last_good(latest: Path) -> str:
    """What a diverged run leaves behind, and how to go on from it (a resume may lower --lr or clip)."""
    if latest.exists():
        return (f"The last good checkpoint is kept at {latest}: continue from it with --resume and a lower --lr "
                "(or --grad-clip 1.0)")
    return "No checkpoint was saved yet: start again with a lower --lr (or --grad-clip 1.0)"
