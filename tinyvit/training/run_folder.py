"""What a run folder holds, written and read back by the training loop (loop.py):

    latest.safetensors    the model with the optimizer, schedule, data order and random state in one
                          atomic file (save_training_checkpoint): everything a resume needs
    metrics.jsonl         one row per epoch           steps.jsonl    one row per logging interval
    .lock                 held by the run using the folder (RunFolderLock); holds its pid

and the checks that a run may start there (check_run_folder) and that a resume continues the same
run (check_resume).

A run writes nothing outside its folder: a folder whose files (RUN_FILES) are symbolic links is
refused before anything is written, and every write goes through tinyvit.io.arrays, which never
follows a link (a new file is created O_EXCL | O_NOFOLLOW and renamed into place; an append or the
lock opens with O_NOFOLLOW), so a link that appears while the run is under way is not followed
either.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from .. import backend, io
from ..io.arrays import _NOFOLLOW, _link_error, append_text, check_json_depth, write_bytes_atomically

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
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:               # a file on the way, no permission, a read-only disk, ...
                raise OSError(f"--out: cannot make the run folder {self.folder} ({exc.strerror}); give --out a "
                              "folder you can write") from None
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o666)   # never through a link
            except OSError as exc:
                raise _link_error(self.path, exc) from None
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
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except FileNotFoundError:
        return False


# Every file a run writes in its folder (loop.py; curves.png by tinyvit.evaluation.plots).
RUN_FILES = (RunFolderLock.NAME, "config.json", "metrics.jsonl", "steps.jsonl", "curves.png", "latest.safetensors",
             "best.safetensors")


def check_run_folder(cfg, latest: Path) -> None:
    """A new run needs a folder without a checkpoint; a resume needs one; and none of the files a run
    writes there may be a symbolic link (reads nothing but whether they exist: refused, a run
    changes nothing)."""
    folder = latest.parent
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {folder} is a file, not a folder: give --out a new folder or a run's")
    for name in RUN_FILES:
        path = folder / name
        if path.is_symlink():
            raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)}); a run writes only files of its "
                             "own folder and never through a link: remove the link (the run's files are made "
                             "anew), or give the run another --out DIR")
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
    change what the run is, naming them, or from a damaged training state (saved_state.py); log the
    allowed changes. Reads the checkpoint's header only."""
    from ..io.arrays import read_header
    from .saved_state import read_training_state
    _, metadata = read_header(latest)
    saved = read_training_state(latest, metadata, ema=bool(cfg.ema))["config"]      # every field checked
    _check_same_source(cfg, saved, latest)
    now = json.loads(json.dumps(asdict(cfg), default=_json_default))      # as stored: tuples become lists
    for name in ("out", "resume", "from_recipe", "finetune_from"):         # which run, not what it is
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


def _check_same_source(cfg, saved: dict, latest: Path) -> None:
    """A fine-tuning run resumes with the checkpoint it fine-tunes (`tinyvit finetune CKPT --resume`), a
    run from scratch with `tinyvit train --resume`: with another checkpoint, the run would silently
    go on from its own. A run from before tinyvit recorded it (no "finetune_from") is not checked."""
    if "finetune_from" not in saved or saved["finetune_from"] == cfg.finetune_from:
        return
    was, now, folder = saved["finetune_from"], cfg.finetune_from, latest.parent
    if was is None:
        raise ValueError(f"--resume: the run in {folder} was trained from scratch, not fine-tuned from {now}: "
                         f"resume it with `tinyvit train --resume --out {folder}`, or fine-tune in a new run with "
                         "--out DIR")
    also = f", or fine-tune {now} in a new run with --out DIR" if now else ", or start a new run with --out DIR"
    raise ValueError(f"--resume: the run in {folder} fine-tunes {was}{f', not {now}' if now else ''}: resume it "
                     f"with `tinyvit finetune {was} --resume --out {folder}`{also}")


def _setting(name: str) -> str:
    """How a user sets a TrainConfig field: its flag, or its table in a --config file."""
    return {"model_args": "--model-arg/[model]", "dataset_args": "[dataset]"}.get(name, "--" + name.replace("_", "-"))


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint's metadata")


def read_log(path: Path, held=None, keys=()) -> list:
    """The rows of a JSON-lines log (metrics.jsonl, steps.jsonl), each an object holding numbers under
    ``keys``. With ``held``, only the rows the checkpoint holds: a row written just before an
    interruption that the checkpoint missed is dropped from the file (its epoch or steps are done again)."""
    if not path.exists():                               # interrupted in the first epoch
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            check_json_depth(line, "the line")
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}, line {number}: not valid JSON ({exc}); delete that line and resume "
                             "again") from None
        except ValueError as exc:
            raise ValueError(f"{path}, line {number}: {exc}; delete that line and resume again") from None
        if not isinstance(row, dict) or any(type(row.get(key)) not in (int, float) for key in keys):
            raise ValueError(f"{path}, line {number}: not a row tinyvit writes (it needs the numbers "
                             f"{', '.join(keys)}); delete that line and resume again")
        rows.append(row)
    kept = rows if held is None else [row for row in rows if held(row)]
    if len(kept) < len(rows):
        write_bytes_atomically(path, "".join(json.dumps(row) + "\n" for row in kept).encode())
    return kept


def append_row(path: Path, row: dict) -> None:
    """One JSON line onto a log of the run folder (never through a link: tinyvit.io.arrays.append_text)."""
    append_text(path, json.dumps(row) + "\n")


def write_config(folder: Path, cfg) -> None:
    """The run's settings as config.json, replaced atomically (a link there is replaced, not followed)."""
    write_bytes_atomically(folder / "config.json", json.dumps(asdict(cfg), indent=2).encode())


def log_interval(path: Path | None, sched, epoch: float, now: dict, before: dict) -> None:
    """One row of steps.jsonl: the mean training loss and accuracy since the previous check (none
    with ``path`` None: the ranks other than 0 of a data-parallel run write no files)."""
    seen = now["seen"] - before["seen"]
    if seen <= 0 or path is None:
        return
    append_row(path, {"step": sched.step_count, "epoch": round(epoch, 4),
                      "train_loss": (now["loss"] - before["loss"]) / seen,
                      "train_acc": (now["correct"] - before["correct"]) / seen, "lr": float(sched.last_lr)})


def last_good(latest: Path) -> str:
    """What a diverged run leaves behind, and how to go on from it (a resume may lower --lr or clip):
    latest.safetensors when its weights are finite (it is never saved otherwise, but an older
    tinyvit's Ctrl-C could), else best.safetensors when its are."""
    if not latest.exists():
        return "No checkpoint was saved yet: start again with a lower --lr (or --grad-clip 1.0)"
    if _finite_file(latest):
        return (f"The last good checkpoint is kept at {latest}: continue from it with --resume and a lower --lr "
                "(or --grad-clip 1.0)")
    best = latest.parent / "best.safetensors"
    if best.exists() and _finite_file(best):
        return (f"{latest} holds weights that are not finite either; {best} is good: fine-tune from it "
                f"(`tinyvit finetune {best}`), or start again with a lower --lr and --out DIR")
    return f"{latest} holds weights that are not finite either: start again with a lower --lr and --out DIR"


def _finite_file(path: Path) -> bool:
    """Whether a checkpoint's floating-point arrays are all finite (False for one that cannot be read)."""
    import numpy as np
    try:
        arrays, _ = io.load_arrays(path)
    except (OSError, ValueError):
        return False
    return all(np.isfinite(a).all() for a in arrays.values() if a.dtype.kind == "f")
