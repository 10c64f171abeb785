"""`tinyvit train` and `finetune`: supervised training from scratch and from a checkpoint (the flags
they share, and --print-config, are flags.py's; eval and predict are predict.py's)."""
from __future__ import annotations

import argparse
import signal
from dataclasses import replace
from pathlib import Path

from . import UsageError, check_device, model_args, read_toml, report
from .flags import add_train_flags, format_config

# Flags of `train` and `finetune` that map one-to-one onto TrainConfig fields.
CONFIG_FLAGS = ("dataset", "model", "data_dir", "epochs", "batch_size", "lr", "min_lr", "weight_decay",
               "warmup_epochs", "optimizer", "momentum", "grad_clip", "label_smoothing", "mixup", "cutmix",
               "randaug", "erasing", "crop_padding", "flip", "drop_path", "ema", "device", "precision", "seed", "out", "resume",
               "eval_batch_size", "train_limit", "test_limit", "time_budget")


def _train_config(args, recipe=None):
    """The run's TrainConfig, resolved (each None filled from the dataset's recipe) and checked once:
    its defaults <- ``recipe`` (fine-tuning's or pre-training's) <- the TOML file <- flags. A bad
    value is a usage error, before any data is loaded; notes on the recipe (a short run without its
    augmentation) are printed."""
    from ..training import TrainConfig
    settings = dict(recipe or {})
    if getattr(args, "config", None):
        settings.update(read_toml(args.config))
    for name in CONFIG_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            settings[name] = value
    if isinstance(settings.get("time_budget"), str):         # "30m" in a TOML file
        settings["time_budget"] = _minutes(settings["time_budget"])
    if getattr(args, "model_arg", None):
        settings["model_args"] = {**settings.get("model_args", {}), **model_args(args.model_arg)}
    # what still has the recipe's value came from the recipe (a short run may shorten its warmup)
    settings["from_recipe"] = [k for k, v in (recipe or {}).items() if settings.get(k) is v]
    notes = []
    try:
        cfg = TrainConfig.from_dict(settings).resolved(notes)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    check_device(cfg.device)                 # a device from --config: refused as the flag would be
    for note in notes:
        print(note)
    return cfg


def _minutes(text) -> float:
    """--time-budget's argument ("30m", "2h", "90s", "45") in minutes; a usage error otherwise."""
    from ..training.budget import parse_duration
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def duration_flag(text) -> float:
    try:
        return _minutes(text)
    except UsageError as exc:
        message = str(exc).removeprefix("--time-budget: ").removeprefix("--time-budget ")   # argparse names it
        raise argparse.ArgumentTypeError(message) from None


def _check_model(cfg) -> None:
    """The model name and its --model-arg / [model] settings must be ones the named models know."""
    from dataclasses import fields

    from ..models import ViTConfig, config_for
    try:
        known = {f.name for f in fields(config_for(cfg.model) if cfg.model else ViTConfig)}
    except ValueError as exc:                      # names the known models
        raise UsageError(str(exc)) from None
    unknown = sorted(set(cfg.model_args) - known)
    if unknown:
        raise UsageError(f"unknown model settings {unknown} (--model-arg or [model]); known: {sorted(known)}")


def positive(args, *names) -> None:
    """Each named integer flag, when given, must be >= 1 (a limit of 0 or -5 would silently use no
    images or drop some; a batch of 0 never ends)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _run_training(cfg, model=None, objective=None) -> int:
    """Run train() and turn how it ended into an exit status: 0 done; 1 diverged or the run folder in
    use by another run; 128 + the signal's number when stopped: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP
    (what a shell reports for a process the signal ended; the checkpoint is saved either way). In a
    data-parallel run (mpirun), a status other than 0 ends every rank (tinyvit.cli.main)."""
    from .. import distributed
    from ..kernels.cpu.threads import retain_freed_memory
    from ..training import RunFolderInUse, TrainingDiverged, train
    retain_freed_memory()             # the same large arrays every step: keep their memory mapped
    try:
        train(cfg, model=model, objective=objective)
    except KeyboardInterrupt as stop:                      # training.Stopped carries SIGTERM's or SIGHUP's number
        return 128 + getattr(stop, "signum", signal.SIGINT)
    except (TrainingDiverged, RunFolderInUse) as exc:
        report(f"tinyvit: {distributed.rank_prefix()}{exc}")            # under mpirun: once, by rank 0
        return 1
    return 0                                               # train() ended with its summary


def print_config(cfg, command: str, note: str = "") -> int:
    """--print-config: the resolved settings and the run folder, then exit (nothing is loaded)."""
    from ..training.components import run_dir
    print(format_config(cfg, run_dir(cfg), command, note))
    return 0


def cmd_train(args) -> int:
    """Train a ViT from scratch."""
    cfg = _train_config(args)
    _check_model(cfg)
    if args.print_config:
        return print_config(cfg, "train")
    return _run_training(cfg)


def cmd_finetune(args) -> int:
    """Fine-tune a checkpoint with the paper's recipe (appendix B.1.1): a new zero head for the
    dataset's classes, its images read at the checkpoint's input shape (or --image-size)."""
    from ..io.arrays import read_header
    from ..training import FINETUNE_RECIPE, prepare_finetune
    from ..training.components import dataset_label, describe_model, next_run_folder
    positive(args, "image_size")
    cfg = _train_config(args, recipe=FINETUNE_RECIPE)
    cfg = replace(cfg, finetune_from=str(Path(args.checkpoint).resolve()))   # a resume checks it is the same
    if cfg.model:
        raise UsageError("--model: finetune takes its model from CHECKPOINT (--model-arg and --drop-path "
                         "change its settings)")
    if cfg.out is None:                      # runs/finetune-MODEL-DATASET, numbered as train's folders
        header = read_header(args.checkpoint)[1]
        label = describe_model(_json_config(header)).replace("/", "-")
        cfg = replace(cfg, out=str(next_run_folder(Path("runs") / f"finetune-{label}-{dataset_label(cfg.dataset)}",
                                                   cfg.resume)))
    if args.print_config:
        return print_config(cfg, "finetune", f"; the model: {args.checkpoint} with a new head")
    if cfg.resume:
        model = None  # the checkpoint in --out has everything
    else:
        classes = _num_classes(cfg)
        model = prepare_finetune(args.checkpoint, classes, args.image_size, args.resize_method,
                                 **{"drop_path": cfg.drop_path, **cfg.model_args})
    return _run_training(cfg, model=model)


def _json_config(header: dict) -> dict:
    import json
    try:
        return json.loads(header.get("config", "{}"))
    except ValueError:
        return {}                            # loading the checkpoint names the damage


def _num_classes(cfg) -> int:
    """The classes of the run's dataset: a folder's from its sub-folders' names (no image decoded:
    train() reads the images at the model's input shape), a built-in dataset's by loading it."""
    from ..data import find_layout, is_folder_name
    from ..training import load_data
    if is_folder_name(cfg.dataset):
        return len(find_layout(cfg.dataset)[0])
    return load_data(cfg.dataset, cfg.data_dir, cfg.dataset_args).num_classes


def register(sub) -> None:
    p = sub.add_parser("train", help="train a ViT from scratch (default: CIFAR-10, the small patch-4 preset)",
                       description="Train a ViT from scratch. A flag not given comes from --config, else from the "
                                   "dataset's recipe (tinyvit/training/recipes.py RECIPES), else from TrainConfig's "
                                   "default; --print-config shows every value a run will use.")
    add_train_flags(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("finetune", help="fine-tune a checkpoint with the paper's recipe (SGD, clip 1, new zero head)",
                       description="Fine-tune a checkpoint on a dataset (section 3.2, appendix B.1.1): its head "
                                   "replaced by a zero one for the dataset's classes, SGD with momentum, clipping at "
                                   "norm 1, warmup then cosine (FINETUNE_RECIPE; flags override it). A folder of "
                                   "images is read at the checkpoint's input size and colours.")
    p.add_argument("checkpoint", help="a .safetensors checkpoint (tinyvit train's best/latest, or tinyvit.save)")
    p.add_argument("--image-size", type=int, default=None,
                   help="fine-tune at this resolution (position embeddings are 2D-interpolated); default: the "
                        "checkpoint's")
    p.add_argument("--resize-method", choices=("bilinear", "bicubic"), default="bilinear",
                   help="position-embedding interpolation: bilinear (official code) or bicubic (timm)")
    add_train_flags(p)
    p.set_defaults(func=cmd_finetune)
