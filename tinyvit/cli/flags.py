"""The flags `train`, `finetune` and `pretrain` share, with their help, and `--print-config`: the
resolved settings of a run as TOML that `--config` reads back.

Every flag defaults to None, "not given": its value then comes from --config, else from the recipe
(the dataset's, fine-tuning's or pre-training's; tinyvit/training/recipes.py), else from
TrainConfig's own default. --help says which, and --print-config shows the result.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, fields

from ..backend import PRECISIONS
from . import add_kernels_flag

RECIPE = "default: the recipe's"

# flag -> (help, argparse keywords); "{default}" is TrainConfig's default for settings no recipe gives.
TRAIN_FLAGS = {
    "--config": ("a TOML file of these settings (flags override it; --print-config writes one)", {}),
    "--print-config": ("print the run's resolved settings as TOML (each from a flag, --config, the recipe or "
                       "its default) and the run folder, then exit", dict(action="store_true", default=None)),
    "--dataset": ("cifar10, cifar100, fashion-mnist, synthetic, or the path of a folder of your images "
                  "(DIR/<class>/*.jpg, or DIR/train/<class>/ and DIR/val/<class>/); default: {default}",
                  dict(metavar="NAME_OR_DIR")),
    "--model": ("a named model (`tinyvit models`); default: the recipe's (vit-cifar/4 for CIFAR, vit-mnist/7 for "
                "Fashion-MNIST), else the preset for the images' shape", {}),
    "--model-arg": ("override a ViTConfig field, e.g. dim=64 (repeatable)", dict(action="append", metavar="KEY=VALUE")),
    "--data-dir": ("where the built-in datasets are found or downloaded (default $TINYVIT_DATA or "
                   "~/.cache/tinyvit/data)", {}),
    "--epochs": (f"passes over the training images; {RECIPE}", dict(type=int)),
    "--time-budget": ("train for this long instead of --epochs (30m, 2h, 1h30m, 90s): the steps are counted from a "
                      "timed trial so that training and its evaluations fit, the schedule laid over them; "
                      "default: none, --epochs decides", dict(metavar="DURATION")),
    "--batch-size": (f"images per optimizer step; {RECIPE}", dict(type=int)),
    "--lr": (f"peak learning rate, reached after the warmup; {RECIPE}", dict(type=float)),
    "--min-lr": ("learning rate at the end of the cosine decay; default: {default}", dict(type=float)),
    "--weight-decay": (f"decoupled weight decay (none on biases, norms, tokens, position embeddings); {RECIPE}",
                       dict(type=float)),
    "--warmup-epochs": (f"linear warmup, in epochs (a recipe's is cut to 10% of a short run, which says so); {RECIPE}",
                        dict(type=float)),
    "--optimizer": ("adamw, adam or sgd; default: the recipe's, else {default}", dict(choices=("adamw", "adam", "sgd"))),
    "--momentum": ("SGD momentum; default: the recipe's, else {default}", dict(type=float)),
    "--grad-clip": ("clip the gradients to this global norm (the paper: 1); default: the recipe's, else none",
                    dict(type=float)),
    "--label-smoothing": (f"label smoothing of the training loss (curves.png says so); {RECIPE}", dict(type=float)),
    "--mixup": (f"Mixup alpha, 0: off; {RECIPE}", dict(type=float)),
    "--cutmix": (f"CutMix alpha, 0: off; {RECIPE}", dict(type=float)),
    "--randaug": (f"RandAugment N,M (e.g. 2,9), 0: off; {RECIPE}", {}),
    "--erasing": (f"random erasing probability; {RECIPE}", dict(type=float)),
    "--crop-padding": (f"random crop after padding by this many pixels, 0: off; {RECIPE}", dict(type=int)),
    "--flip": (f"random horizontal flips; {RECIPE}", dict(action=argparse.BooleanOptionalAction, default=None)),
    "--drop-path": (f"stochastic depth rate; {RECIPE}", dict(type=float)),
    "--ema": (f"evaluate and keep an exponential moving average of the weights with this decay (e.g. 0.999), "
              f"0: off; {RECIPE}", dict(type=float, metavar="DECAY")),
    "--device": ("cpu, cuda or cuda:N; default: {default}", {}),
    "--precision": ("matrix products: fp32, or tf32 (TF32 tensor cores, --device cuda only); default: {default}",
                    dict(choices=PRECISIONS)),
    "--seed": ("seed of the weights, data order, augmentation and dropout; default: {default}", dict(type=int)),
    "--out": ("the run folder; default: runs/DATASET-MODEL, or the next free runs/DATASET-MODEL-2, -3, ... when "
              "that holds a run", {}),
    "--resume": ("continue the run in --out from its latest.safetensors (without --out: the last "
                 "runs/DATASET-MODEL[-N] that holds a run)", dict(action="store_true", default=None)),
    "--eval-batch-size": ("images per forward pass in evaluation; default: {default}", dict(type=int)),
    "--train-limit": ("train on the first N training images only (quick runs); default: all", dict(type=int)),
    "--test-limit": ("evaluate on the first N test images only; default: all", dict(type=int)),
}


def add_train_flags(p, skip=()) -> None:
    """The flags of TRAIN_FLAGS, less ``skip`` (TrainConfig names: `pretrain` has no labels to smooth or
    mix). Each defaults to None = "not given"; the help names where its value comes from then."""
    from ..training import TrainConfig
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    for flag, (text, options) in TRAIN_FLAGS.items():
        name = flag[2:].replace("-", "_")
        if name in skip:
            continue
        kind = options.get("type")
        if flag == "--time-budget":
            from .train import duration_flag
            kind = duration_flag
        text = text.replace("{default}", str(defaults.get(name))).replace("%", "%%")     # argparse formats help
        p.add_argument(flag, help=text,
                       **{**options, **({"type": kind} if kind else {})})
    add_kernels_flag(p)


def add_dataset_flags(p, default_note: str, example: str) -> None:
    """--dataset, --data-dir and --dataset-arg of the commands that read a checkpoint's data (eval,
    fewshot): ``default_note`` says what an unset --dataset means, ``example`` a --dataset-arg."""
    p.add_argument("--dataset", default=None, metavar="NAME_OR_DIR",
                   help=f"cifar10, cifar100, fashion-mnist, synthetic or a folder of images (default: {default_note})")
    p.add_argument("--data-dir", default=None,
                   help="where datasets are found or downloaded (default $TINYVIT_DATA or ~/.cache/tinyvit/data)")
    p.add_argument("--dataset-arg", action="append", metavar="KEY=VALUE",
                   help=f"a dataset option, as in the [dataset] table of `train --config` (e.g. {example})")


def format_config(cfg, run_folder, command: str, note: str = "") -> str:
    """A resolved TrainConfig as TOML that `--config` reads back: top-level settings, a [model] table
    (its name and ViTConfig overrides) and a [dataset] table (name and loader options); each value
    a recipe gave is marked, unset ones are comments. ``run_folder``: where the run would write."""
    settings = asdict(cfg)
    from_recipe = set(settings.pop("from_recipe"))
    model, model_args = settings.pop("model"), settings.pop("model_args")
    dataset, dataset_args = settings.pop("dataset"), settings.pop("dataset_args")
    settings.pop("resume")
    lines = [f"# tinyvit {command}: the settings of this run, resolved (--config FILE reads them back){note}",
             f"# run folder: {run_folder}", ""]
    if not dataset_args:
        lines.append(f"dataset = {_toml(dataset)}")
    for key, value in settings.items():
        if value is None:
            lines.append(f"# {key}: not set")
        else:
            lines.append(f"{key} = {_toml(value)}" + ("    # the recipe's" if key in from_recipe else ""))
    if model is not None or model_args:
        lines += ["", "[model]"] + ([f"name = {_toml(model)}" + ("    # the recipe's" if "model" in from_recipe else "")]
                                    if model is not None else [])
        lines += [f"{k} = {_toml(v)}" for k, v in model_args.items()]
    elif "model" in from_recipe or model is None:
        lines.append("# model: the preset for the images' shape")
    if dataset_args:
        lines += ["", "[dataset]", f"name = {_toml(dataset)}"] + [f"{k} = {_toml(v)}" for k, v in dataset_args.items()]
    return "\n".join(lines)


def _toml(value) -> str:
    """A TOML value: strings and numbers as JSON writes them (TOML's basic strings are JSON's), booleans lowercase."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)
