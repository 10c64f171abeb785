"""The `tinyvit` command. The only place that parses command-line arguments.

Each subcommand is a small function taking the parsed arguments; the work is done by the library
(tinyvit.models, tinyvit.train, ...), so everything here is also reachable from Python.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import __version__


class UsageError(Exception):
    """A bad flag value or config file: printed as one line, exit status 2."""


def _parse_value(text: str):
    """'64' -> 64, '0.1' -> 0.1, 'true' -> True, 'none' -> None, anything else stays a string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _model_args(pairs) -> dict:
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise UsageError(f"--model-arg needs KEY=VALUE (e.g. dim=64), got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.strip().replace("-", "_")] = _parse_value(value.strip())
    return out


def _read_toml(path) -> dict:
    """A TOML run description: top-level keys are `tinyvit train` flags (dashes or underscores),
    an optional [model] table holds ViTConfig overrides and [dataset] the dataset's options."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise UsageError("--config needs Python >= 3.11 or `pip install tomli`") from None
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--config: no file at {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path}: not valid TOML ({exc})") from None
    out = {k.replace("-", "_"): v for k, v in data.items() if not isinstance(v, dict)}
    if "model" in data and isinstance(data["model"], dict):
        out["model_args"] = dict(data["model"])
    if "dataset" in data and isinstance(data["dataset"], dict):
        out["dataset_args"] = dict(data["dataset"])
    unknown = [k for k, v in data.items() if isinstance(v, dict) and k not in ("model", "dataset")]
    if unknown:
        raise UsageError(f"--config {path}: unknown tables {unknown} (known: [model], [dataset])")
    return out


# Flags of `train` and `finetune` that map one-to-one onto TrainConfig fields.
TRAIN_FLAGS = ("dataset", "model", "data_dir", "epochs", "batch_size", "lr", "min_lr", "weight_decay",
               "warmup_epochs", "optimizer", "momentum", "grad_clip", "label_smoothing", "mixup", "cutmix",
               "randaug", "erasing", "crop_padding", "flip", "drop_path", "device", "seed", "out", "resume",
               "eval_batch_size", "train_limit", "test_limit")


def _train_config(args, defaults=None):
    """TrainConfig from: its defaults <- `defaults` (finetune's recipe) <- the TOML file <- flags."""
    from .train import TrainConfig
    settings = dict(defaults or {})
    if getattr(args, "config", None):
        settings.update(_read_toml(args.config))
    for name in TRAIN_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            settings[name] = value
    if getattr(args, "model_arg", None):
        settings["model_args"] = {**settings.get("model_args", {}), **_model_args(args.model_arg)}
    try:
        return TrainConfig.from_dict(settings)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _run_training(cfg, model=None) -> int:
    from .train import TrainingDiverged, train
    try:
        result = train(cfg, model=model)
    except KeyboardInterrupt:
        return 130
    except TrainingDiverged as exc:
        print(f"tinyvit: {exc}", file=sys.stderr)
        return 1
    print(f"done: best test accuracy {100 * result['best_acc']:.2f}%, final {100 * result.get('test_acc', 0):.2f}%; "
          f"checkpoints and metrics in {result['out']}")
    return 0


def cmd_train(args) -> int:
    """Train a ViT from scratch."""
    cfg = _train_config(args)
    try:
        cfg.resolved()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return _run_training(cfg)


def cmd_finetune(args) -> int:
    """Fine-tune a checkpoint with the paper's recipe (appendix B.1.1)."""
    from .data import load_dataset
    from .train import FINETUNE_DEFAULTS, prepare_finetune
    cfg = _train_config(args, defaults=FINETUNE_DEFAULTS)
    if cfg.resume:
        model = None  # the checkpoint in --out has everything
    else:
        info = load_dataset(cfg.dataset, root=cfg.data_dir, **cfg.dataset_args)
        model = prepare_finetune(args.checkpoint, info.num_classes, args.image_size, args.resize_method)
    if cfg.out is None:
        cfg.out = str(Path("runs") / f"finetune-{Path(args.checkpoint).stem}-{cfg.dataset}")
    return _run_training(cfg, model=model)


def cmd_eval(args) -> int:
    """Accuracy, per-class accuracy and confusion matrix of a checkpoint on a dataset's test split."""
    from .data import Augment, DataLoader, load_dataset
    from .inference import check_fits, confusion_matrix, format_report, load_for_inference
    from .train import evaluate
    model, info = load_for_inference(args.checkpoint, device=args.device)
    ds = load_dataset(args.dataset, root=args.data_dir)
    if args.limit:
        ds = ds.subset(None, args.limit)
    check_fits(model, ds)
    loader = DataLoader(ds.test_images, ds.test_labels, args.batch_size, device=args.device,
                        transform=Augment(ds.mean, ds.std))
    result = evaluate(model, loader)
    matrix = confusion_matrix(result["labels"], result["preds"], ds.num_classes)
    print(f"{args.checkpoint} on {ds.name} test ({len(ds.test_images)} images), loss {result['loss']:.4f}")
    print(format_report(matrix, ds.classes))
    if args.json:
        Path(args.json).write_text(json.dumps({"accuracy": result["acc"], "loss": result["loss"],
                                               "classes": list(ds.classes), "confusion": matrix.tolist()}))
    return 0


def cmd_predict(args) -> int:
    """Top-5 classes with probabilities for image files."""
    from .inference import load_for_inference, predict_files
    model, info = load_for_inference(args.checkpoint, device=args.device)
    for path, top in zip(args.images, predict_files(model, info, args.images, args.topk, args.device)):
        print(path)
        for name, p in top:
            print(f"  {100 * p:6.2f}%  {name}")
    return 0


def cmd_models(args) -> int:
    """List the named variants with parameter counts and training FLOPs per image."""
    from .models import config_for, count_parameters, known_names, training_flops
    print(f"{'name':<14}{'image':>6}{'patch':>6}{'tokens':>7}{'dim':>6}{'depth':>6}{'heads':>6}"
          f"{'mlp':>6}{'params':>10}{'train GFLOPs/img':>18}")
    for name in known_names():
        cfg = config_for(name, **({"num_classes": args.num_classes} if args.num_classes else {}))
        print(f"{name:<14}{cfg.image_size:>6}{cfg.patch_size:>6}{cfg.num_patches:>7}{cfg.dim:>6}{cfg.depth:>6}"
              f"{cfg.num_heads:>6}{cfg.mlp_dim:>6}{count_parameters(cfg) / 1e6:>9.2f}M"
              f"{training_flops(cfg) / 1e9:>18.3f}")
    print("\nAny patch size works after the slash (vit-l/32, vit-cifar/2). Counts: 1000 classes at 224 px "
          "for the paper's models, 10 classes for the small presets; --num-classes changes that.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tinyvit",
        description="The Vision Transformer (Dosovitskiy et al., 2020) from scratch on NumPy/CuPy.")
    parser.add_argument("--version", action="version", version=f"tinyvit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("models", help="list the named model variants with parameters and FLOPs")
    p.add_argument("--num-classes", type=int, default=None, help="head size used for the counts")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("train", help="train a ViT from scratch (default: CIFAR-10, the small patch-4 preset)",
                       description="Train a ViT. Unset flags come from --config, then from the dataset's recipe "
                                   "(tinyvit/train.py RECIPES).")
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
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=500)
    p.add_argument("--limit", type=int, default=None, help="evaluate on the first N test images only")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("predict", help="top-5 classes with probabilities for image files")
    p.add_argument("checkpoint")
    p.add_argument("images", nargs="+", help="image files (any format Pillow reads)")
    p.add_argument("--topk", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_predict)
    return parser


def _add_train_flags(p) -> None:
    """The flags `train` and `finetune` share; all default to None = "recipe/config value"."""
    a = p.add_argument
    a("--config", help="TOML file with these settings (flags override it)")
    a("--dataset", choices=("cifar10", "cifar100", "fashion-mnist", "synthetic"))
    a("--model", help="a named model (see `tinyvit models`); default: the preset for the dataset")
    a("--model-arg", action="append", metavar="KEY=VALUE", help="override a ViTConfig field, e.g. dim=64 (repeatable)")
    a("--data-dir", help="where datasets are found or downloaded (default $TINYVIT_DATA or ~/.cache/tinyvit/data)")
    a("--epochs", type=int)
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
    a("--device", help="cpu, cuda or cuda:N")
    a("--seed", type=int)
    a("--out", help="run folder for checkpoints and metrics (default runs/DATASET-MODEL)")
    a("--resume", action="store_true", default=None, help="continue the run in --out from latest.safetensors")
    a("--eval-batch-size", type=int)
    a("--train-limit", type=int, help="use only the first N training images (quick runs)")
    a("--test-limit", type=int, help="evaluate on the first N test images")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from .data import DataError
    try:
        return args.func(args)
    except UsageError as exc:
        parser.exit(2, f"tinyvit {args.command}: error: {exc}\n")
    except (DataError, FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"tinyvit {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
