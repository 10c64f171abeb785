"""Supervised training, the loop behind `tinyvit train` and `tinyvit finetune`.

    data -> augment -> model -> cross-entropy -> backward -> (clip) -> optimizer -> schedule

A run's length is --epochs, or --time-budget: then a timed trial decides the number of steps
(budget.py). Either way warmup and cosine decay are laid over exactly the run's steps.

One run writes into its folder (``out``):
    metrics.jsonl         one JSON object per epoch (epoch, train_loss, train_acc, test_loss, test_acc, lr, seconds,
                          epochs_trained: less than epoch when the plan ends inside it)
    steps.jsonl           one JSON object per logging interval of 20 steps (step, epoch as a fraction,
                          train_loss and train_acc over the interval, lr)
    curves.png            loss, accuracy (per interval and per epoch) and learning rate
    latest.safetensors    model + optimizer + schedule + data order + RNG: everything ``resume`` needs
    best.safetensors      the model with the best test accuracy so far
    .lock                 held by the run for as long as it runs: a second run on the folder fails at once
Checkpoints are written atomically (temp file + rename; tinyvit.io.save_arrays), so a crash or Ctrl-C
never leaves a torn file (and the next run removes the temporary file a killed write left). Ctrl-C
saves latest.safetensors as of the last complete step (the step in progress is done again after
resuming; an optimizer update is never half applied), and so do SIGTERM and SIGHUP, the way a
scheduler or a closed terminal stops a job (``Stopped``). Resuming restores
the exact data order and random state, so a run stopped (after an epoch, or by Ctrl-C anywhere) and
resumed ends with the same weights as one that never stopped (on the CPU; on a GPU CuPy's generator
is re-seeded at each epoch, so runs resumed mid-epoch may differ slightly).

Under mpirun the same loop runs on every rank (tinyvit.distributed): each takes its slice of every
global batch, the gradients are all-reduced before clipping, evaluation is shared, and rank 0 alone
writes the files above and prints (``world.writer``); the checkpoint counts global batches, so a run
resumes with any number of ranks.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from .. import backend, distributed, io, kernels, optim
from ..data import DataLoader
from ..evaluation.inference import check_not_empty
from ..evaluation.plots import training_curves
from ..io.arrays import leftover_temporary_files
from . import budget
from .components import (describe_model, input_shape, load_data, make_optimizer, make_transforms, model_name, resident,
                         resize_images, run_dir)
from .objectives import Classification
from .recipes import TrainConfig
from .progress import RunClock, summary
from .progress import progress_bar as _progress_bar       # tqdm on a terminal, a line every 30 s elsewhere
from .run_folder import (RunFolderLock, append_row, check_resume, check_run_folder, dataset_metadata, last_good,
                         log_interval, read_log, save_training_checkpoint, unflatten_optimizer, write_config)
from .saved_state import check_state_fits, damaged, read_training_state, saved_plan
from .signals import ctrl_c_after_block, stop_signals_interrupt, stop_together


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


def train(cfg: TrainConfig, model=None, objective=None, progress: bool = True,
          stop_after_epoch: int | None = None, log=print) -> dict:
    """Train (or, given ``model``, fine-tune) as ``cfg`` says, minimising ``objective``
    (default: classification). Returns the final metrics row plus the run folder.
    ``stop_after_epoch`` ends the run early after that epoch, as an interruption would (tests use it
    to check that resuming gives the same weights).

    For the whole call the run folder is locked (run_folder.RunFolderLock) and SIGTERM and SIGHUP
    raise ``Stopped``, a KeyboardInterrupt: the run saves and stops as on Ctrl-C. Among several ranks
    (mpirun) the three stop every rank at the same step, the next check (signals.stop_together)."""
    several_ranks = distributed.launched_size() > 1
    with contextlib.ExitStack() as held, stop_signals_interrupt(several_ranks):     # held: released however train ends
        return _train(cfg, model, objective, progress, stop_after_epoch, log, held)


def _train(cfg, model, objective, progress, stop_after_epoch, log, held: contextlib.ExitStack) -> dict:
    """train() itself; ``held`` keeps the run folder's lock until train() ends."""
    started = time.perf_counter()                          # a time budget counts from here
    world = distributed.world()                            # one process, or one rank of several (mpirun)
    if not world.writer:                                   # rank 0 alone prints and writes the run's files
        log, progress = _silent, False
    notes = []
    cfg = distributed.check_run(cfg.resolved(notes), world)   # the same on every rank; this rank's device
    backend.normalize_device(cfg.device)                   # a GPU that cannot be used: refused before anything
    for note in notes:                                     # e.g. a short run without the recipe's augmentation
        log(note)
    objective = distributed.across_ranks(objective or Classification(cfg.label_smoothing), world)  # evaluation too
    out = run_dir(cfg)
    latest, best_path = out / "latest.safetensors", out / "best.safetensors"
    check_run_folder(cfg, latest)                          # a refused run touches nothing, not even the lock
    if cfg.resume:
        check_resume(cfg, latest, log)
    if world.writer:                                       # the folder is rank 0's alone
        held.enter_context(RunFolderLock(out))
        check_run_folder(cfg, latest)                      # again: another run may have ended in between
        for path in leftover_temporary_files(out):         # a killed write's, now that no write can be under way
            os.remove(path)

    resume_from = io.load_checkpoint(latest) if cfg.resume else None
    # a folder of images is read at the model's input shape: the given model's, the resumed one's, cfg.model's
    shape = input_shape(cfg, model if model is not None else resume_from[0] if resume_from else None)
    dataset = load_data(cfg.dataset, cfg.data_dir, cfg.dataset_args, shape)
    if cfg.train_limit or cfg.test_limit:
        dataset = dataset.subset(cfg.train_limit, cfg.test_limit)
    check_not_empty(dataset)
    backend.manual_seed(cfg.seed)
    created = None              # the model's name, when this run creates it by name
    if model is None:           # resuming: the checkpoint's own model (a fine-tuned one is no preset)
        if resume_from:
            model = resume_from[0]
        else:
            model, created = objective.build_model(cfg, dataset), model_name(cfg, dataset)
    if model.config.image_size != dataset.image_size:        # fine-tuning at another resolution
        size = model.config.image_size
        log(f"resizing {dataset.name} images from {dataset.image_size} to {size} px")
        dataset = replace(dataset, train_images=resize_images(dataset.train_images, size),
                          test_images=resize_images(dataset.test_images, size))
    objective.check(model, dataset)
    model.to(device=cfg.device)
    world.broadcast_arrays(list(model.state_dict().values()))      # every rank starts from rank 0's weights
    # Speed that spans layers, as one visible step (nanoGPT's `model = torch.compile(model)`): the same
    # model and Parameters, its encoder run fused across layers (tinyvit/kernels/fusion.py). The loop
    # calls `forward`; with --kernels off that is the model itself, every Block.forward as written.
    forward = kernels.fuse(model)
    opt = make_optimizer(cfg, model)
    ema = optim.WeightEMA(model, cfg.ema) if cfg.ema else None     # evaluated and kept as "best" instead
    train_tf, eval_tf = make_transforms(cfg, dataset, world)
    loader = DataLoader(*resident(dataset.train_images, dataset.train_labels, cfg.device), cfg.batch_size, shuffle=True,
                        seed=cfg.seed, drop_last=len(dataset.train_images) >= cfg.batch_size,
                        device=cfg.device, transform=train_tf, shard=world.shard)
    test_loader = DataLoader(*resident(dataset.test_images, dataset.test_labels, cfg.device), cfg.eval_batch_size,
                             device=cfg.device, transform=eval_tf, shard=world.shard)
    steps_per_epoch = len(loader)
    if resume_from:                          # the plan the run started with (its budget was measured then)
        saved = read_training_state(latest, resume_from[2], ema=ema is not None)        # every field checked
        plan, note = saved_plan(saved, cfg, steps_per_epoch)
        check_state_fits(saved, plan, steps_per_epoch, latest)
        if note:
            log(note)
    else:
        plan = _plan_run(cfg, steps_per_epoch, started, model, objective, loader,
                         test_loader, log)
    sched = optim.LRScheduler(opt, lambda s: optim.warmup_cosine(s, plan.total_steps, plan.warmup_steps,
                                                                cfg.lr, cfg.min_lr))

    # progress: epochs done, best test accuracy, the sums of an interrupted epoch ("partial"), and the
    # metrics of an epoch trained but interrupted while being evaluated ("trained").
    history, state = [], {"epoch": 0, "best_acc": -1.0, "partial": None, "trained": None, "plan": plan.as_dict()}
    if cfg.resume:
        model_ckpt, extra, meta = resume_from
        model.load_state_dict(model_ckpt.state_dict())
        try:
            opt.load_state_dict(unflatten_optimizer(extra, saved["optimizer"]))
        except ValueError as exc:                      # its own check: the groups and moments fit the model
            raise damaged(latest, str(exc).removeprefix("load_state_dict: ")) from None
        sched.load_state_dict(saved["scheduler"])
        loader.load_state_dict(saved["loader"])
        if ema is not None:
            try:
                ema.load_state_dict({"step": saved["ema_step"], **extra})
            except ValueError as exc:
                raise damaged(latest, str(exc)) from None
        backend.rng().bit_generator.state = saved["rng"]
        distributed.restart_rank_streams(world, train_tf, cfg.seed, sched.step_count)   # only rank 0's were saved
        state = {**state, **saved["progress"]}
        if world.writer:                  # read_log also drops from the files the rows the checkpoint missed
            history = read_log(out / "metrics.jsonl", lambda row: row["epoch"] <= state["epoch"], METRICS_KEYS)
            read_log(out / "steps.jsonl", lambda row: row["step"] <= sched.step_count, STEPS_KEYS)
        log(f"resumed {out} at epoch {state['epoch']} (step {sched.step_count})")
    if not cfg.resume and world.writer:   # what a run that crashed before its first checkpoint left
        for name in ("metrics.jsonl", "steps.jsonl", "best.safetensors"):
            (out / name).unlink(missing_ok=True)
    if world.writer:
        write_config(out, cfg)
    log(f"training {describe_model(model, created)} ({model.num_parameters() / 1e6:.2f}M parameters) on {dataset.name} "
        f"({len(dataset.train_images)} train / {len(dataset.test_images)} test images), "
        f"{_length(plan, steps_per_epoch)} on {cfg.device}; writing to {out}")
    if dataset.info.get("layout"):                          # a folder of images: which images it tests on
        log(f"{dataset.name}: {dataset.info['layout']}")
    if world.size > 1:
        log(distributed.describe(world, cfg))

    def checkpoint() -> bool:                            # rank 0's: the weights are the same on every rank
        """Save latest.safetensors; False, leaving the file as it was, when the weights are not all
        finite (a Ctrl-C may come up to CHECK_EVERY steps after the loss went NaN, before its check)."""
        if not _all_finite(model, opt):
            return False
        if world.writer:
            save_training_checkpoint(latest, model, opt, sched, loader, cfg, state, dataset, ema)
        return True

    drawn_at = -math.inf                                 # curves.png: after the first epoch, the last, every minute
    clock = RunClock(plan, sched.step_count)             # the whole run's pace and time left
    metric = getattr(objective, "metric", "test accuracy")

    def averaged():                                      # the weights evaluated and kept as the best
        return ema.applied() if ema is not None else contextlib.nullcontext()

    # TF32 matmuls for the whole run, if asked; NumPy's overflow warnings silenced: a loss that goes
    # NaN or infinite stops the run with one line that says so (and they would come before it).
    with backend.matmul_precision(cfg.precision), np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        try:
            while state["epoch"] < plan.epochs:
                epoch = state["epoch"] + 1
                if state["trained"] is None:                     # else only its evaluation is left to do
                    if loader.position == 0:
                        backend.manual_seed(world.seed(cfg.seed * 100_003 + epoch))  # dropout masks, per epoch
                    steps_log = out / "steps.jsonl" if world.writer else None
                    state["trained"] = _train_one_epoch(model, forward, objective, opt, sched, loader, cfg, epoch, state,
                                                        progress, latest, plan, steps_log, ema, clock)
                tick = time.perf_counter()
                with averaged():
                    test = objective.evaluate(forward, test_loader)
                eval_s = time.perf_counter() - tick
                if not math.isfinite(test["loss"]):       # weights gone bad: neither best nor latest gets them
                    raise TrainingDiverged(f"the test loss became {test['loss']} after epoch {epoch}; stopping. "
                                           f"{last_good(latest)}")
                row = {**state["trained"], "test_loss": test["loss"], "test_acc": test["acc"],
                       "epochs_trained": round(sched.step_count / steps_per_epoch, 4)}  # < epoch if cut short
                if ema is not None and epoch == plan.epochs:        # what the average gained, once, at the end
                    row["test_acc_without_ema"] = objective.evaluate(forward, test_loader)["acc"]
                if world.writer:
                    append_row(out / "metrics.jsonl", row)          # before the epoch counts as done: see read_log
                history.append(row)
                # best = highest test accuracy, ties broken by the lower test loss. Recorded once the file is
                # in place, and before the epoch counts as done: stopped in between, the checkpoint holds the
                # old best and this epoch still to evaluate, and the resumed run saves this best again.
                if (test["acc"], -test["loss"]) > (state["best_acc"], -state.get("best_loss", math.inf)):
                    if world.writer:
                        with averaged():
                            io.save(model, best_path, metadata={"epoch": str(epoch), **dataset_metadata(dataset)})
                    state["best_acc"], state["best_loss"], state["best_epoch"] = test["acc"], test["loss"], epoch
                if cfg.time_budget is not None and not resume_from:   # a resumed run keeps its plan
                    plan = world.broadcast(_keep_to_budget(plan, cfg, started, history, eval_s, sched.step_count,
                                                           steps_per_epoch, log))       # rank 0's pace decides
                    clock.plan = plan
                    state["plan"] = plan.as_dict()
                state.update(epoch=epoch, partial=None, trained=None)
                if not checkpoint():
                    raise TrainingDiverged(f"the weights are not finite any more after epoch {epoch}; stopping. "
                                           f"{last_good(latest)}")
                last_epoch = epoch == plan.epochs or epoch == stop_after_epoch
                if world.writer and (last_epoch or time.perf_counter() - drawn_at >= CURVES_EVERY_SECONDS):  # ~0.7 s
                    training_curves(history, read_log(out / "steps.jsonl", keys=STEPS_KEYS), out / "curves.png",
                                    _loss_note(cfg, objective))
                    drawn_at = time.perf_counter()
                log(f"epoch {epoch}/{plan.epochs}  train loss {row['train_loss']:.4f} acc {100 * row['train_acc']:.2f}%  "
                    f"{getattr(objective, 'test_label', 'test')} loss {row['test_loss']:.4f} acc "
                    f"{100 * row['test_acc']:.2f}%  lr {row['lr']:.2e}  {row['seconds']:.1f}s"
                    + (f"  (EMA of the weights; without it {100 * row['test_acc_without_ema']:.2f}%)"
                       if "test_acc_without_ema" in row else "")
                    + ("" if epoch == plan.epochs else f"  ({clock.describe(sched.step_count)})"))
                if stop_after_epoch is not None and epoch >= stop_after_epoch:
                    break
                stop_together(world)                      # a signal that came during the evaluation
        except KeyboardInterrupt as stop:                 # Ctrl-C, or Stopped (SIGTERM, SIGHUP)
            why = "interrupted" if getattr(stop, "signum", signal.SIGINT) == signal.SIGINT else f"stopped by {stop}"
            if checkpoint():
                log(f"\n{why}: saved {latest}; continue with the same command plus --resume")
            else:
                log(f"\n{why}: the weights are not finite any more (the loss diverged after its last check), so the "
                    f"checkpoint was not saved. {last_good(latest)}")
            if getattr(stop, "together", False):
                world.part()                              # the others wait until rank 0 has saved
            raise
    result = {**(history[-1] if history else {}), "best_acc": state["best_acc"], "best_epoch": state.get("best_epoch"),
              "metric": metric, "seconds": clock.elapsed(), "out": str(out)}
    if stop_after_epoch is None or state["epoch"] >= plan.epochs:       # a finished run, not one stopped early
        log(summary(result, metric, clock.elapsed(), out, sorted(p.name for p in out.iterdir()) if world.writer else []))
    return result


def _loss_note(cfg, objective) -> str:
    """How the training loss differs from the test loss (plain cross-entropy), for curves.png's legend."""
    if getattr(objective, "label_smoothing", 0) == 0 and not (cfg.mixup or cfg.cutmix):
        return ""
    parts = [f"label smoothing {objective.label_smoothing:g}"] if getattr(objective, "label_smoothing", 0) else []
    parts += ["on Mixup/CutMix targets"] if cfg.mixup or cfg.cutmix else []
    return ", ".join(parts)


def _length(plan, steps_per_epoch: int) -> str:
    """ "3 epochs x 468 steps", or for a last epoch cut short "12869 steps (27.50 epochs of 468)"."""
    if plan.total_steps == plan.epochs * steps_per_epoch:
        return f"{plan.epochs} epoch{'' if plan.epochs == 1 else 's'} x {steps_per_epoch} steps"
    return f"{plan.total_steps} steps ({plan.total_steps / steps_per_epoch:.2f} epochs of {steps_per_epoch})"


def _keep_to_budget(plan, cfg, started, history, eval_s, steps_done, steps_per_epoch, log):
    """The plan after an epoch, refitted to the time budget at the recent pace (budget.recent_pace)."""
    plan, message = budget.keep_to_budget(plan, budget.parse_duration(cfg.time_budget), time.perf_counter() - started,
                                          budget.recent_pace(history, steps_per_epoch),
                                          eval_s + budget.EPOCH_OVERHEAD_SECONDS, steps_done, steps_per_epoch)
    if message:
        log(message)
    return plan


def _plan_run(cfg, steps_per_epoch, started, model, objective, loader, test_loader,
              log) -> budget.Plan:
    """The run's steps and warmup: from --epochs, or from --time-budget after timing a few steps and
    an evaluation on a copy of the model (budget.py)."""
    warmup_from_recipe = "warmup_epochs" in cfg.from_recipe     # a recipe's warmup may be shortened
    if cfg.time_budget is None:
        total = cfg.epochs * steps_per_epoch
        warmup, note = budget.warmup_steps_for(cfg.warmup_epochs, steps_per_epoch, total, warmup_from_recipe)
        if note:
            log(note)
        return budget.Plan(total, warmup, cfg.epochs)
    timing = _time_run(cfg, model, objective, loader, test_loader), time.perf_counter() - started
    (step_s, epoch_s), elapsed = distributed.world().broadcast(timing)   # rank 0's: every rank plans the same
    plan, message = budget.plan_for_budget(budget.parse_duration(cfg.time_budget), elapsed,
                                           step_s, epoch_s, steps_per_epoch, cfg.warmup_epochs, warmup_from_recipe)
    log(message)
    return plan


def _time_run(cfg, model, objective, loader, test_loader, steps: int = 12, warmup: int = 3) -> tuple:
    """(seconds per training step, seconds of evaluation and checkpointing per epoch), measured on
    copies of the model, optimizer and augmentation, so that the run itself is left untouched. The
    step time is the median of ``steps`` real steps (data, augmentation, update) after ``warmup``."""
    trial, point = copy.deepcopy(model), copy.deepcopy(backend.rng().bit_generator.state)
    forward = kernels.fuse(trial)                          # as the run will step
    opt = make_optimizer(cfg, trial)
    batches = DataLoader(loader.images, loader.labels, loader.batch_size, shuffle=True, seed=cfg.seed + 7,
                         device=cfg.device, transform=copy.deepcopy(loader.transform), shard=loader.shard)
    times = []
    trial.train()
    for i, (x, y) in enumerate(batches):
        tick = time.perf_counter()
        loss, _ = _gradients(trial, forward, objective, cfg, x, y)
        opt.step()
        float(loss.data)                                   # waits for a GPU to finish the step
        times.append(time.perf_counter() - tick)
        if i + 1 == warmup + steps:
            break
    step_s = float(np.median(times[warmup:] or times))
    n_test = len(test_loader.images)
    sample = min(n_test, 2 * test_loader.batch_size)
    tick = time.perf_counter()
    objective.evaluate(forward, DataLoader(test_loader.images[:sample], test_loader.labels[:sample],
                                         test_loader.batch_size, device=cfg.device, transform=test_loader.transform,
                                         shard=test_loader.shard))
    eval_s = (time.perf_counter() - tick) * n_test / max(sample, 1)
    backend.rng().bit_generator.state = point           # the trial's dropout draws never happened
    return step_s, eval_s + budget.EPOCH_OVERHEAD_SECONDS


def _gradients(model, forward, objective, cfg, x, y) -> tuple:
    """Forward, loss, backward (and clipping) of one step: (loss Tensor, correct count); the update
    is the caller's. ``forward`` is the model or kernels.fuse(model). The training loop and the
    budget's timing trial run the same step."""
    loss, correct = objective.step(forward, x, y)                                   # forward
    model.zero_grad()
    loss.backward()                                                                 # backward
    distributed.average_gradients(model, len(x))    # the ranks' mean gradient (one process: nothing), then
    if cfg.grad_clip:                               # clipping by the norm of that, the global batch's
        optim.clip_grad_norm(model.parameters(), cfg.grad_clip)
    return loss, correct


def _all_finite(model, opt) -> bool:
    """Whether every weight and optimizer moment is finite: a checkpoint of anything else resumes into NaN."""
    arrays = [p.data for p in model.parameters()]
    arrays += [v for entry in opt.state.values() for v in entry.values() if getattr(v, "ndim", 0)]
    return all(bool(backend.get_array_module(a).isfinite(a).all()) for a in arrays)


def _silent(*args, **kwargs) -> None:
    """The log of ranks other than 0."""


def _resume_point(loader) -> tuple:
    """Data order, augmentation and dropout random state at a step boundary (where a resume restarts)."""
    return loader.state_dict(), copy.deepcopy(backend.rng().bit_generator.state)


def _go_back_to(loader, point) -> None:
    loader.load_state_dict(point[0])
    backend.rng().bit_generator.state = copy.deepcopy(point[1])


def _train_one_epoch(model, forward, objective, opt, sched, loader, cfg, epoch, state, progress, latest, plan,
                     steps_log: Path, ema=None, clock=None) -> dict:
    """One pass over the training data (continuing a partial epoch after a resume; ending early at
    the plan's last step). The running sums stay on the device, read back once every
    ``CHECK_EVERY`` steps (no host sync per step); each read appends the interval's mean loss,
    accuracy and learning rate to ``steps_log`` (steps.jsonl, the curves' training line).
    Interrupted (Ctrl-C), it leaves the loader and random state as they were after the last complete
    step, and that step's sums in state["partial"]: the checkpoint resumes with the step it lost."""
    model.train()
    world = distributed.world()
    done = state.get("partial") or {"loss": 0.0, "correct": 0.0, "seen": 0, "seconds": 0.0}
    loss_sum, correct_sum, seen = 0.0, 0.0, 0
    start, last = time.perf_counter(), dict(done)          # last: the totals at the previous check
    steps_here = min(len(loader), plan.total_steps - sched.step_count + loader.position)
    bar = _progress_bar(steps_here, loader.position, f"epoch {epoch}/{plan.epochs}", progress, clock,
                        lambda: sched.step_count)
    resume_at = _resume_point(loader)

    def totals(across_ranks: bool = True):
        # Every rank's sums, at the checks, where all ranks are at the same step. Interrupted, a rank
        # cannot meet the others (they may be a step apart): rank 0's own sums go into the checkpoint.
        sums = (loss_sum, correct_sum, seen)
        loss, correct, n = world.sum_over_ranks(*sums) if across_ranks else map(float, sums)
        return {"loss": done["loss"] + loss, "correct": done["correct"] + correct,
                "seen": done["seen"] + int(n), "seconds": done["seconds"] + time.perf_counter() - start}

    try:
        for step_in_epoch, (x, y) in enumerate(loader, start=loader.position + 1):
            loss, correct = _gradients(model, forward, objective, cfg, x, y)        # forward, backward
            with ctrl_c_after_block():
                opt.step()                                                          # update
                sched.step()
                if ema is not None:
                    ema.update()                                                    # the weights' average
                loss_sum = loss_sum + loss.data * len(y)
                correct_sum = correct_sum + correct
                seen += len(y)
                resume_at = _resume_point(loader)
            last_step = step_in_epoch == steps_here
            if step_in_epoch % CHECK_EVERY == 0 or last_step:
                stop_together(world)                 # every rank is at this step: stop here if any was signalled
                t = totals()
                mean_loss = t["loss"] / t["seen"]
                if not math.isfinite(mean_loss):
                    raise TrainingDiverged(f"the loss became {mean_loss} at epoch {epoch}, step {step_in_epoch}; "
                                           f"stopping. {last_good(latest)}")
                log_interval(steps_log, sched, epoch - 1 + step_in_epoch / len(loader), t, last)
                last = t
                if bar is not None:
                    bar.set_postfix(loss=f"{mean_loss:.4f}", acc=f"{100 * t['correct'] / t['seen']:.1f}%",
                                    img_s=f"{(t['seen'] - done['seen']) / max(time.perf_counter() - start, 1e-9):.0f}")
            if bar is not None:
                bar.update(1)
            if last_step and steps_here < len(loader):       # the plan ends inside this epoch
                break
    except KeyboardInterrupt as stop:
        _go_back_to(loader, resume_at)  # the step in progress is lost: a resume does it again
        # the interrupted epoch's sums go into the checkpoint: every rank's when they stopped together
        state["partial"] = totals(across_ranks=getattr(stop, "together", False))
        raise
    finally:
        if bar is not None:
            bar.close()
    t = totals()
    return {"epoch": epoch, "train_loss": t["loss"] / max(t["seen"], 1), "train_acc": t["correct"] / max(t["seen"], 1),
            "lr": float(sched.last_lr), "seconds": t["seconds"]}


# What the rows of metrics.jsonl and steps.jsonl must hold (a resume reads them back; the curves plot them).
METRICS_KEYS = ("epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr", "seconds")
STEPS_KEYS = ("step", "epoch", "train_loss", "train_acc", "lr")

# The running sums are read back (and a point of the curves written) every this many steps.
CHECK_EVERY = 20
# curves.png is redrawn at most this often (and after the first and last epochs): drawn after each of
# a 30-minute Fashion-MNIST run's 74 epochs, it took 3% of the budget.
CURVES_EVERY_SECONDS = 60.0
