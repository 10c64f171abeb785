"""`tinyvit eval` and `tinyvit predict`: using a trained checkpoint. Both take the classes and the
normalisation from the checkpoint; eval also its dataset, unless --dataset names another."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from . import UsageError, add_kernels_flag, key_values
from .flags import add_dataset_flags


def dataset_args(pairs) -> dict:
    """--dataset-arg KEY=VALUE pairs: options of the dataset loader."""
    return key_values(pairs, "--dataset-arg", "train_size=1000")


def checkpoint_dataset(path, info: dict, name, pairs) -> tuple:
    """(dataset name or folder, loader options) for a command given a checkpoint: --dataset when
    given, else the dataset the checkpoint was trained on (its metadata: a built-in name, or a
    folder with the seed and share of its held-out split, so that eval sees the same held-out images)."""
    from ..data import is_folder_name
    options = dataset_args(pairs)
    if name:
        return name, options
    if info.get("folder"):
        folder = info["folder"]
        if not Path(folder).is_dir():
            raise UsageError(f"{path} was trained on the images in {folder}, which is not there now: pass "
                             "--dataset DIR (the folder, moved) or another dataset")
        split = {k: info[k] for k in ("val_fraction", "seed") if k in info}
        return folder, {**split, **options}
    trained_on = info.get("name")
    if trained_on == "cifar100-coarse":
        return "cifar100", {"label": "coarse", **options}
    if trained_on and not is_folder_name(trained_on):
        return trained_on, options
    raise UsageError(f"{path} does not say which dataset it was trained on: pass --dataset (cifar10, cifar100, "
                     "fashion-mnist, synthetic, or a folder of images)")


def refuse_pretrained_encoder(path, model, command: str) -> None:
    """A masked-patch-prediction checkpoint has no classifier: say what to do with it."""
    if hasattr(model, "to_vit") or not getattr(model.config, "num_classes", 0):
        raise UsageError(f"{path} is a pre-trained encoder (tinyvit pretrain) with no classifier, so it has nothing "
                         f"to {command}: fine-tune it first (tinyvit finetune {path} --dataset ...) and use that run's "
                         "best.safetensors; `tinyvit fewshot` measures its features as they are")


def cmd_eval(args) -> int:
    """Accuracy, per-class accuracy and confusion matrix of a checkpoint on a dataset's test split."""
    from ..data import Augment, DataLoader
    from ..evaluation import check_fits, confusion_matrix, evaluate, format_report, load_for_inference
    from ..training.components import input_shape, load_data
    from .train import positive
    positive(args, "limit", "batch_size")
    model, info = load_for_inference(args.checkpoint, device=args.device)
    refuse_pretrained_encoder(args.checkpoint, model, "evaluate")
    name, options = checkpoint_dataset(args.checkpoint, info, args.dataset, args.dataset_arg)
    ds = load_data(name, args.data_dir, options, input_shape(None, model))
    if args.limit is not None:
        ds = ds.subset(None, args.limit)
    check_fits(model, ds)
    loader = DataLoader(ds.test_images, ds.test_labels, args.batch_size, device=args.device,
                        transform=Augment(ds.mean, ds.std))
    result = evaluate(model, loader)
    matrix = confusion_matrix(result["labels"], result["preds"], ds.num_classes)
    split = "held-out" if ds.info.get("layout", "").startswith("one folder") else "test"
    source = "" if args.dataset else " (the checkpoint's dataset; --dataset evaluates on another)"
    print(f"{args.checkpoint} on {ds.name} {split} ({len(ds.test_images)} images){source}, loss {result['loss']:.4f}")
    print(format_report(matrix, ds.classes))
    if args.json:
        per_class = matrix.diagonal() / matrix.sum(axis=1).clip(min=1)
        Path(args.json).write_text(json.dumps({"accuracy": result["acc"], "loss": result["loss"],
                                               "classes": list(ds.classes), "per_class_accuracy": per_class.tolist(),
                                               "confusion": matrix.tolist()}))
    return 0


def cmd_predict(args) -> int:
    """Top-k classes for image files, each with how it was prepared and what about it is far from the
    training images; a batch of files at a time, with a progress bar for long lists on a terminal."""
    from ..evaluation import load_for_inference
    from ..evaluation.inference import predict_batches
    if args.topk < 1:
        raise UsageError(f"--topk must be >= 1, got {args.topk}")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    model, info = load_for_inference(args.checkpoint, device=args.device)
    refuse_pretrained_encoder(args.checkpoint, model, "predict")
    if args.invert and model.config.in_channels != 1:
        raise UsageError("--invert is for grey models (light-on-dark images such as Fashion-MNIST's); this model "
                         "takes colour images")
    bar = _bar(len(args.images), args.batch_size)
    write = bar.write if bar is not None else print
    warned = 0
    for path, prep, warnings, top in predict_batches(model, info, args.images, args.topk, args.device,
                                                     args.batch_size, args.resize, args.invert):
        write(f"{path}  ({prep.describe()}{', inverted' if args.invert else ''})")
        for warning in warnings:
            write(f"  note: {warning}")
        warned += bool(warnings)
        for name, p in top:
            write(f"  {100 * p:6.2f}%  {name}")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if warned and not info.get("name"):
        print("(the checkpoint holds no training statistics, so brightness was not compared)", file=sys.stderr)
    return 0


def _bar(total: int, batch_size: int):
    """tqdm's bar on stderr for more than one batch of files on a terminal, else None."""
    if total <= batch_size or not sys.stderr.isatty():
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="image", leave=False, file=sys.stderr)


def register(sub) -> None:
    p = sub.add_parser("eval", help="accuracy, per-class accuracy and confusion matrix of a checkpoint",
                       description="Evaluate a checkpoint on a dataset's test split (a folder's held-out images): "
                                   "accuracy, accuracy per class and the confusion matrix. The dataset, classes "
                                   "and normalisation come from the checkpoint unless --dataset names another.")
    p.add_argument("checkpoint", help="a .safetensors checkpoint (tinyvit train's best/latest, or tinyvit.save)")
    add_dataset_flags(p, "the checkpoint's own", "test_size=500")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--batch-size", type=int, default=500, help="images per forward pass")
    p.add_argument("--limit", type=int, default=None, help="evaluate on the first N test images only (default: all)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results to this JSON file")
    add_kernels_flag(p)
    p.set_defaults(func=cmd_eval)

    from ..data import RESIZE_MODES
    p = sub.add_parser("predict", help="top-5 classes with probabilities for image files",
                       description="Classify image files with a checkpoint: each image is converted to the "
                                   "model's colours and fitted to its square input (by default keeping its "
                                   "aspect: short side resized, centre cropped), said in one line, with a note "
                                   "where it is far from the training images (smaller, much cut, or for a grey "
                                   "model the opposite brightness: Fashion-MNIST is light clothes on black).")
    p.add_argument("checkpoint", help="a trained checkpoint (tinyvit train's or finetune's best.safetensors)")
    p.add_argument("images", nargs="+", help="image files (any format Pillow reads)")
    p.add_argument("--topk", type=int, default=5, help="classes shown per image")
    p.add_argument("--resize", choices=RESIZE_MODES, default="crop",
                   help="crop: short side to the input size, centre crop (keeps the aspect); pad: long side, "
                        "padded with the border colour (keeps everything); squash: both sides (distorts)")
    p.add_argument("--invert", action="store_true",
                   help="invert brightness (grey models): a dark object on white as light on black")
    p.add_argument("--batch-size", type=int, default=64, help="images read and classified at a time")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    add_kernels_flag(p)
    p.set_defaults(func=cmd_predict)
