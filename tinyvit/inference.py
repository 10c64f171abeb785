"""Using a trained checkpoint: evaluation with a confusion matrix, and top-k prediction on image files."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import backend, io
from . import functional as F
from .autograd import no_grad


def load_for_inference(path, device="cpu"):
    """(model in eval mode, dataset info {name, classes, mean, std}) from a training checkpoint.
    Checkpoints saved by tinyvit.save without dataset info get generic class names and no
    normalisation beyond [0, 1] scaling."""
    model, _, meta = io.load_checkpoint(path, device=device)
    if "dataset" in meta:
        info = json.loads(meta["dataset"])
    else:
        k, c = model.config.num_classes, model.config.in_channels
        info = {"name": None, "classes": [f"class {i}" for i in range(k)], "mean": [0.0] * c, "std": [1.0] * c}
    return model, info


def check_fits(model, dataset) -> None:
    """Raise if the dataset's images or classes do not fit the model, naming both."""
    cfg = model.config
    if (dataset.channels, dataset.image_size) != (cfg.in_channels, cfg.image_size):
        raise ValueError(f"the model takes {cfg.in_channels}x{cfg.image_size}x{cfg.image_size} images but "
                         f"{dataset.name} has {dataset.channels}x{dataset.image_size}x{dataset.image_size}")
    if dataset.num_classes != cfg.num_classes:
        raise ValueError(f"the model predicts {cfg.num_classes} classes but {dataset.name} has {dataset.num_classes}")


def confusion_matrix(labels, preds, num_classes: int) -> np.ndarray:
    """(K, K) counts: row = true class, column = predicted class."""
    m = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(m, (np.asarray(labels), np.asarray(preds)), 1)
    return m


def format_report(matrix: np.ndarray, classes) -> str:
    """Accuracy, per-class accuracy and the confusion matrix as text."""
    total = matrix.sum()
    lines = [f"accuracy {100 * np.trace(matrix) / max(total, 1):.2f}% ({np.trace(matrix)}/{total})", "",
             "per-class accuracy:"]
    width = max(len(c) for c in classes)
    for i, name in enumerate(classes):
        n = matrix[i].sum()
        lines.append(f"  {name:<{width}}  {100 * matrix[i, i] / max(n, 1):6.2f}%  ({matrix[i, i]}/{n})")
    lines += ["", "confusion matrix (rows: true class, columns: predicted):"]
    cell = max(5, len(str(matrix.max())) + 1)
    lines.append(" " * (width + 2) + "".join(f"{i:>{cell}}" for i in range(len(classes))))
    for i, name in enumerate(classes):
        lines.append(f"  {name:<{width}}" + "".join(f"{v:>{cell}}" for v in matrix[i]))
    return "\n".join(lines)


def read_image(path, channels: int, size: int) -> np.ndarray:
    """An image file -> (C, size, size) float32 in [0, 1]: converted to RGB or greyscale as the model
    expects and resized (bicubic) to its input size."""
    from PIL import Image, UnidentifiedImageError
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no image file at {path}")
    try:
        with Image.open(path) as img:
            img = img.convert("RGB" if channels == 3 else "L").resize((size, size), Image.BICUBIC)
            array = np.asarray(img, dtype=np.float32) / 255.0
    except UnidentifiedImageError:
        raise ValueError(f"{path} is not an image Pillow can read") from None
    return array.transpose(2, 0, 1) if array.ndim == 3 else array[None]


def predict_files(model, info, paths, topk: int = 5, device="cpu"):
    """Top-k (class name, probability) for each image file, normalised as in training."""
    cfg = model.config
    images = np.stack([read_image(p, cfg.in_channels, cfg.image_size) for p in paths])
    mean = np.asarray(info["mean"], np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(info["std"], np.float32).reshape(1, -1, 1, 1)
    dtype = next(iter(model.parameters())).dtype
    x = backend.to_device(((images - mean) / std).astype(dtype), device)
    with no_grad():
        probs = backend.to_numpy(F.softmax(model(x), axis=-1).data)
    k = min(topk, probs.shape[1])
    order = np.argsort(-probs, axis=1)[:, :k]
    return [[(info["classes"][j], float(probs[i, j])) for j in order[i]] for i in range(len(paths))]
