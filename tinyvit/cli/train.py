"""`tinyvit train`, `finetune`, `eval` and `predict`: supervised training and using its checkpoints."""
from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import replace
from pathlib import Path

from ..backend import PRECISIONS
from . import UsageError, add_kernels_flag, check_device, key_values, model_args, read_toml

# Flags of `train` and `finetune` that map one-to-one onto TrainConfig fields.
TRAIN_FLAGS = ("dataset", "model", "data_dir", "epochs", "batch_size", "lr", "min_lr", "weight_decay",
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
    for name in TRAIN_FLAGS:
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


def _duration_flag(text) -> float:
    try:
        return _minutes(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--time-budget: ")) from None


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


def _dataset_args(pairs) -> dict:
    """--dataset-arg KEY=VALUE pairs: options of the dataset loader."""
    return key_values(pairs, "--dataset-arg", "train_size=1000")


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
        result = train(cfg, model=model, objective=objective)
    except KeyboardInterrupt as stop:                      # training.Stopped carries SIGTERM's or SIGHUP's number
        return 128 + getattr(stop, "signum", signal.SIGINT)
    except (TrainingDiverged, RunFolderInUse) as exc:
        print(f"tinyvit: {distributed.rank_prefix()}{exc}", file=sys.stderr)
        return 1
    if not distributed.world().writer:                     # rank 0 reports for all
        return 0
    print(f"done: best test accuracy {100 * result['best_acc']:.2f}%, final {100 * result.get('test_acc', 0):.2f}%; "
          f"checkpoints and metrics in {result['out']}")
    return 0


def cmd_train(args) -> int:
    """Train a ViT from scratch."""
    cfg = _train_config(args)
    _check_model(cfg)
    return _run_training(cfg)


def cmd_finetune(args) -> int:
    """Fine-tune a checkpoint with the paper's recipe (appendix B.1.1)."""
    from ..training import FINETUNE_RECIPE, load_data, prepare_finetune
    cfg = _train_config(args, recipe=FINETUNE_RECIPE)
    if cfg.out is None:
        cfg = replace(cfg, out=str(Path("runs") / f"finetune-{Path(args.checkpoint).stem}-{cfg.dataset}"))
    if cfg.model:
        raise UsageError("--model: finetune takes its model from CHECKPOINT (--model-arg and --drop-path "
                         "change its settings)")
    if cfg.resume:
        model = None  # the checkpoint in --out has everything
    else:
        info = load_data(cfg.dataset, cfg.data_dir, cfg.dataset_args)
        model = prepare_finetune(args.checkpoint, info.num_classes, args.image_size, args.resize_method,
                                 **{"drop_path": cfg.drop_path, **cfg.model_args})
    return _run_training(cfg, model=model)


def cmd_eval(args) -> int:
    """Accuracy, per-class accuracy and confusion matrix of a checkpoint on a dataset's test split."""
    from ..data import Augment, DataLoader
    from ..evaluation import check_fits, confusion_matrix, evaluate, format_report, load_for_inference
    from ..training import load_data
    positive(args, "limit", "batch_size")
    dataset_args = _dataset_args(args.dataset_arg)
    model, info = load_for_inference(args.checkpoint, device=args.device)
    ds = load_data(args.dataset, args.data_dir, dataset_args)
    if args.limit is not None:
        ds = ds.subset(None, args.limit)
    check_fits(model, ds)
    loader = DataLoader(ds.test_images, ds.test_labels, args.batch_size, device=args.device,
                        transform=Augment(ds.mean, ds.std))
    result = evaluate(model, loader)
    matrix = confusion_matrix(result["labels"], result["preds"], ds.num_classes)
    print(f"{args.checkpoint} on {ds.name} test ({len(ds.test_images)} images), loss {result['loss']:.4f}")
    print(format_report(matrix, ds.classes))
    if args.json:
        per_class = matrix.diagonal() / matrix.sum(axis=1).clip(min=1)
        Path(args.json).write_text(json.dumps({"accuracy": result["acc"], "loss": result["loss"],
                                               "classes": list(ds.classes), "per_class_accuracy": per_class.tolist(),
                                               "confusion": matrix.tolist()}))
    return 0


def cmd_predict(args) -> int:
    """Top-5 classes with probabilities for image files."""
    from ..evaluation import load_for_inference, predict_files
    if args.topk < 1:
        raise UsageError(f"--topk must be >= 1, got {args.topk}")
    model, info = load_for_inference(args.checkpoint, device=args.device)
    for path, top in zip(args.images, predict_files(model, info, args.images, args.topk, args.device)):
        print(path)
        for name, p in top:
            print(f"  {100 * p:6.2f}%  {name}")
    return 0



def register(sub) -> None:
    p = sub.add_parser("train", help="train a ViT from scratch (default: CIFAR-10, the small patch-4 preset)",
                       description="Train a ViT. Unset flags come from --config, then from the dataset's recipe "
                                   "(tinyvit/training/recipes.py RECIPES).")
    _add_train_flags(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("finetune", help="fine-tune a checkpoint with the paper's recipe (SGD, clip 1, new zero head)")
    p.add_argument("checkpoint", help="a .safetensors checkpoint (tinyvit train's best/latest, or tinyvit.save)")
    p.add_argument("--image-size", type=int, default=None,
                   help="fine-tune at this resolution (position embeddings are 2D-interpolated)")
    p.add_argument("--resize-method", choices=("bilinear", "bicubic"), default="bilinear",
                   help="position-embedding interpolation: bilinear (official code) or bicubic (timm)")
    _add_train_flags(p)
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("eval", help="accuracy, per-class accuracy and confusion matrix of a checkpoint")
    p.add_argument("checkpoint")
    p.add_argument("--dataset", required=True, choices=("cifar10", "cifar100", "fashion-mnist", "synthetic"))
    p.add_argument("--data-dir", default=None)
    p.add_argument("--dataset-arg", action="append", metavar="KEY=VALUE",
                   help="a dataset option, as in the [dataset] table of `train --config` (e.g. test_size=500)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=500)
    p.add_argument("--limit", type=int, default=None, help="evaluate on the first N test images only")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    add_kernels_flag(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("predict", help="top-5 classes with probabilities for image files")
    p.add_argument("checkpoint")
    p.add_argument("images", nargs="+", help="image files (any format Pillow reads)")
    p.add_argument("--topk", type=int, default=5)
    p.add_argument("--device", default="cpu")
    add_kernels_flag(p)
    p.set_defaults(func=cmd_predict)


def _add_train_flags(p, skip=()) -> None:
    """The flags `train` and `finetune` share; all default to None = "recipe/config value".
    ``skip``: flags to leave out, by TrainConfig name (`pretrain` has no labels to smooth or mix)."""
    def a(*names, **kw):
        if names[0][2:].replace("-", "_") not in skip:
            p.add_argument(*names, **kw)
    a("--config", help="TOML file with these settings (flags override it)")
    a("--dataset", choices=("cifar10", "cifar100", "fashion-mnist", "synthetic"))
    a("--model", help="a named model (see `tinyvit models`); default: the preset for the dataset")
    a("--model-arg", action="append", metavar="KEY=VALUE", help="override a ViTConfig field, e.g. dim=64 (repeatable)")
    a("--data-dir", help="where datasets are found or downloaded (default $TINYVIT_DATA or ~/.cache/tinyvit/data)")
    a("--epochs", type=int)
    a("--time-budget", type=_duration_flag, metavar="DURATION",
      help="train for this long instead of --epochs (30m, 2h, 1h30m, 90s; training and evaluation "
           "fit in it: the steps are counted from a timed trial, the schedule laid over them)")
    a("--batch-size", type=int)
    a("--lr", type=float, help="peak learning rate (after warmup)")
    a("--min-lr", type=float)
    a("--weight-decay", type=float)
    a("--warmup-epochs", type=float)
    a("--optimizer", choices=("adamw", "adam", "sgd"))
    a("--momentum", type=float, help="SGD momentum")
    a("--grad-clip", type=float, help="clip gradients to this global norm")
    a("--label-smoothing", type=float)
    a("--mixup", type=float, help="Mixup alpha (0: off)")
    a("--cutmix", type=float, help="CutMix alpha (0: off)")
    a("--randaug", help="RandAugment N,M (e.g. 2,9; 0: off)")
    a("--erasing", type=float, help="random erasing probability")
    a("--crop-padding", type=int, help="random crop with this padding (0: off)")
    a("--flip", action=argparse.BooleanOptionalAction, default=None, help="random horizontal flips")
    a("--drop-path", type=float, help="stochastic depth rate")
    a("--ema", type=float, metavar="DECAY",
      help="evaluate and keep an exponential moving average of the weights with this decay (e.g. 0.999; 0: off)")
    a("--device", help="cpu, cuda or cuda:N")
    a("--precision", choices=PRECISIONS,
      help="matrix products: fp32 (default) or tf32 (TF32 tensor cores, --device cuda only)")
    a("--seed", type=int)
    a("--out", help="run folder for checkpoints and metrics (default runs/DATASET-MODEL)")
    a("--resume", action="store_true", default=None, help="continue the run in --out from latest.safetensors")
    a("--eval-batch-size", type=int)
    a("--train-limit", type=int, help="use only the first N training images (quick runs)")
    a("--test-limit", type=int, help="evaluate on the first N test images")
    add_kernels_flag(p)


