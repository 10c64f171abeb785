"""Using a trained model: loading a checkpoint for inference, evaluation over a test split (accuracy,
confusion matrix), and top-k prediction on image files."""
from __future__ import annotations

import json

import numpy as np

from .. import backend, io
from .. import functional as F
from ..autograd import no_grad
from ..data.images import open_image, prepare
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


def read_image(path, channels: int, size: int, resize: str = "crop") -> np.ndarray:
    """An image file -> (C, size, size) float32 in [0, 1]: converted to RGB or greyscale as the model
    expects and fitted to its input as ``resize`` says (tinyvit.data.images: "crop", the default,
    keeps the aspect: short side resized, centre cropped). Raises ValueError naming the file for one
    that is missing, not an image, truncated or too large to decode safely."""
    return read_images([path], channels, size, resize)[0][0].astype(np.float32) / 255.0


def read_images(paths, channels: int, size: int, resize: str = "crop", invert: bool = False) -> tuple:
    """((B, C, size, size) uint8, [Preparation]) for image files, prepared as the folder dataset
    prepares its training images (tinyvit.data.images.prepare); ``invert``: 255 - pixels after."""
    images = np.empty((len(paths), channels, size, size), np.uint8)
    preps = []
    for i, path in enumerate(paths):
        check_file(str(path), "image file")
        images[i], prep = prepare(open_image(path), channels, size, resize)
        preps.append(prep)
    return (255 - images if invert else images), preps


# How far from the training images an input may be before predict says so.
WORST_CUT = 0.25            # a centre crop that cuts more than this share of the long side
WORST_SQUASH = 4 / 3        # squashing an aspect over this
POLARITY_MARGIN = 0.15      # a training mean this far from mid-grey has a polarity (dark or light background)


def input_warnings(prep, pixels: np.ndarray, info: dict, inverted: bool = False) -> list:
    """What about one prepared image (``pixels``: (C, S, S) uint8 as the model sees it) is far from
    the model's training images, one sentence each: smaller than the input (upscaled, blurred), a
    crop or squash that changed much, and for a grey model a brightness on the other side of mid-grey
    from the training images' mean (Fashion-MNIST is light clothes on black; a product photo is dark
    on white, which such a model reads as something else)."""
    notes = []
    if min(prep.width, prep.height) < prep.size:
        notes.append(f"{prep.width}x{prep.height} is smaller than the model's {prep.size}x{prep.size} input: upscaled, "
                     "so blurrier than the images it learned from")
    if prep.resize == "crop" and prep.cut > WORST_CUT:
        notes.append(f"the centre crop cut {100 * prep.cut:.0f}% of the image; --resize pad keeps all of it")
    if prep.resize == "squash" and prep.aspect > WORST_SQUASH:
        notes.append(f"squashed from {prep.aspect:.2f}:1 to square: shapes are distorted (the default --resize crop "
                     "keeps them)")
    trained = info.get("mean")
    if prep.channels == 1 and trained and info.get("name") is not None:
        seen, mean = float(pixels.mean()) / 255, float(trained[0])
        if abs(mean - 0.5) > POLARITY_MARGIN and (seen - 0.5) * (mean - 0.5) < 0 and abs(seen - mean) > 0.3:
            light = "light" if seen > 0.5 else "dark"
            fix = "remove --invert" if inverted else "--invert flips it"
            notes.append(f"mostly {light} (mean brightness {seen:.2f}) where the training images are mostly "
                         f"{'dark' if light == 'light' else 'light'} ({mean:.2f}): the model may misread it; {fix}")
    return notes


def predict_batches(model, info, paths, topk: int = 5, device="cpu", batch_size: int = 64, resize: str = "crop",
                    invert: bool = False):
    """For each image file, in order: (path, Preparation, [warnings], [(class name, probability)] top
    ``topk``). Files are read ``batch_size`` at a time, so memory does not grow with their number; a
    generator, so results come as each batch is done."""
    cfg = model.config
    mean = np.asarray(info["mean"], np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(info["std"], np.float32).reshape(1, -1, 1, 1)
    dtype = next(iter(model.parameters())).dtype
    model.eval()
    for start in range(0, len(paths), batch_size):
        batch = list(paths[start:start + batch_size])
        pixels, preps = read_images(batch, cfg.in_channels, cfg.image_size, resize, invert)
        x = backend.to_device(((pixels / np.float32(255) - mean) / std).astype(dtype), device)
        with no_grad():
            probs = backend.to_numpy(F.softmax(model(x), axis=-1).data)
        order = np.argsort(-probs, axis=1)[:, :min(topk, probs.shape[1])]
        for i, path in enumerate(batch):
            yield (path, preps[i], input_warnings(preps[i], pixels[i], info, invert),
                   [(info["classes"][j], float(probs[i, j])) for j in order[i]])


def predict_files(model, info, paths, topk: int = 5, device="cpu", resize: str = "crop"):
    """Top-k (class name, probability) for each image file, normalised as in training."""
    return [top for _, _, _, top in predict_batches(model, info, paths, topk, device, resize=resize)]
