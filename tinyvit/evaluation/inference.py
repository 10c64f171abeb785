"""Using a trained model: loading a checkpoint for inference, evaluation over a test split (accuracy,
confusion matrix), and top-k prediction on image files."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np

from .. import backend, io
from .. import functional as F
from ..autograd import no_grad
from ..io.arrays import check_file


def load_for_inference(path, device="cpu"):
    """(model in eval mode, dataset info {name, classes, mean, std}) from a training checkpoint.
    The model is in the default dtype (float32), as the images fed to it are, whatever the file's
    (a float64 or float16 checkpoint). Checkpoints saved by tinyvit.save without dataset info get
    generic class names and no normalisation beyond [0, 1] scaling. Raises ValueError for weights
    that are not all finite or dataset info that cannot normalise the model's images: either would
    print meaningless numbers."""
    model, _, meta = io.load_checkpoint(path, device=device, dtype=backend.get_default_dtype())
    bad = [name for name, value in model.state_dict().items() if not np.isfinite(backend.to_numpy(value)).all()]
    if bad:
        raise ValueError(f"{path}: the weights {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} hold NaN or "
                         "infinite values (the run diverged); use an earlier checkpoint, such as the run's "
                         "best.safetensors")
    k, c = model.config.num_classes, model.config.in_channels
    if "dataset" not in meta:
        return model, {"name": None, "classes": [f"class {i}" for i in range(k)], "mean": [0.0] * c, "std": [1.0] * c}
    return model, _dataset_info(path, meta["dataset"], c, k)


# How to mend a checkpoint whose dataset info is damaged or incomplete.
RESAVE = ("use the checkpoint the training run wrote, or re-save the model with tinyvit.save(model, path, "
          "metadata={'dataset': json.dumps({'name': ..., 'classes': [...], 'mean': [...], 'std': [...]})})")


def _dataset_info(path, text: str, channels: int, num_classes: int) -> dict:
    """A checkpoint's dataset metadata (JSON: name, classes, mean, std), checked to normalise the model's
    ``channels`` and to name its ``num_classes`` classes (a pre-trained encoder has none of its own)."""
    try:
        info = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: its 'dataset' metadata is not valid JSON ({exc}); {RESAVE}") from None
    needed = ("classes", "mean", "std") if num_classes else ("mean", "std")
    missing = [key for key in needed if not isinstance(info, dict) or key not in info]
    if missing:
        raise ValueError(f"{path}: its 'dataset' metadata has no {' or '.join(missing)}; {RESAVE}")
    try:
        mean, std = (np.asarray(info[key], np.float64) for key in ("mean", "std"))
        fits = (mean.shape == std.shape == (channels,) and np.isfinite(mean).all() and np.isfinite(std).all()
                and (std > 0).all() and (not num_classes or len(info["classes"]) == num_classes))
    except (ValueError, TypeError):
        fits = False
    if not fits:
        names = f"{num_classes} class names and " if num_classes else ""
        raise ValueError(f"{path}: its dataset info does not fit the model (it needs {names}{channels} finite "
                         f"means and positive standard deviations); the file was damaged or edited: {RESAVE}")
    return info


def check_not_empty(dataset, splits=("train", "test")) -> None:
    """Raise if a split is empty: a run would measure nothing (once "accuracy 0.00%" and exit 0)."""
    for split in splits:
        if len(getattr(dataset, f"{split}_images")) == 0:
            where = f" (in {dataset.info['folder']})" if dataset.info.get("folder") else ""
            raise ValueError(f"{dataset.name} has no {split} images{where}: there is nothing to "
                             f"{'train on' if split == 'train' else 'evaluate'}; give it a {split} split "
                             "(--data-dir, or the [dataset] settings of --config)")


def check_fits(model, dataset) -> None:
    """Raise if the dataset's test split is empty, or its images or classes do not fit the model,
    naming both."""
    check_not_empty(dataset, ("test",))
    cfg = model.config
    if (dataset.channels, dataset.image_size) != (cfg.in_channels, cfg.image_size):
        raise ValueError(f"the model takes {cfg.in_channels}x{cfg.image_size}x{cfg.image_size} images but "
                         f"{dataset.name} has {dataset.channels}x{dataset.image_size}x{dataset.image_size}")
    if dataset.num_classes != cfg.num_classes:
        raise ValueError(f"the model predicts {cfg.num_classes} classes but {dataset.name} has {dataset.num_classes}")


def evaluate(model, loader) -> dict:
    """Mean loss, accuracy and the predictions over a loader (eval mode, no graph). Sums and
    predictions stay on the device until the end: one read back to the host, not one per batch."""
    model.eval()
    total_loss, correct, seen, preds, labels = 0.0, 0, 0, [], []
    with no_grad():
        for x, y in loader:
            logits = model(x)
            total_loss = total_loss + F.cross_entropy(logits, y, check_labels=False).data * len(y)
            pred = logits.data.argmax(axis=-1)
            correct = correct + (pred == y).sum()
            seen += len(y)
            preds.append(pred)
            labels.append(y)
    if not preds:
        return {"loss": 0.0, "acc": 0.0, "preds": np.zeros(0, int), "labels": np.zeros(0, int)}
    xp = backend.get_array_module(preds[0])
    return {"loss": float(total_loss) / seen, "acc": int(correct) / seen,
            "preds": backend.to_numpy(xp.concatenate(preds)), "labels": backend.to_numpy(xp.concatenate(labels))}


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
    expects and resized (bicubic) to its input size. 16-bit greyscale is scaled to 8 bits first.
    Raises ValueError for a file that is not an image, is truncated, or has more pixels than Pillow
    decodes safely (Image.MAX_IMAGE_PIXELS: a tiny file can unpack to gigabytes)."""
    from PIL import Image, UnidentifiedImageError
    path = Path(path)
    check_file(str(path), "image file")
    try:
        with warnings.catch_warnings():
            # Pillow only warns of an image over MAX_IMAGE_PIXELS (it refuses one over twice that): refuse both.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                img = _eight_bit(img, path).convert("RGB" if channels == 3 else "L")
                array = np.asarray(img.resize((size, size), Image.BICUBIC), dtype=np.float32) / 255.0
    except UnidentifiedImageError:
        raise ValueError(f"{path} is not an image Pillow can read") from None
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise ValueError(f"{path} is too large to decode safely ({exc}); shrink it first") from None
    except OSError as exc:                          # Pillow's "image file is truncated", "broken data stream"
        raise ValueError(f"{path} is truncated or damaged ({exc}); save or copy it again") from None
    return array.transpose(2, 0, 1) if array.ndim == 3 else array[None]


def _eight_bit(img, path):
    """A Pillow image whose conversion to RGB or L keeps its brightness. Pillow opens 16-bit greyscale
    (PNG, TIFF) as mode "I;16" ("I", 32-bit integers, in older versions) and its convert("L") clips
    every value above 255 to white: scale 0..65535 to 0..255 instead (v / 257, so 257 k -> k)."""
    from PIL import Image
    if img.mode == "F":
        raise ValueError(f"{path} holds floating-point pixels, which have no fixed range; save it as an 8- or "
                         "16-bit image")
    if not img.mode.startswith("I"):
        return img
    values = np.asarray(img, dtype=np.int64)
    if values.min() < 0 or values.max() > 65535:
        raise ValueError(f"{path} holds {img.mode} pixels outside 0..65535; save it as an 8- or 16-bit image")
    return Image.fromarray(((values + 128) // 257).astype(np.uint8))


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
