"""Your own images: a folder with one sub-folder per class (torchvision's ImageFolder layout).

    shoes/boot/1.jpg  shoes/boot/2.png  shoes/sandal/a.jpg ...      one folder: a validation split
                                                                    (val_fraction of each class) is held out
    shoes/train/boot/...  shoes/val/boot/...  (or test/)           the given split

The class names are the sub-folders' names, sorted (so class i is the same however the files are
listed); files whose names end in IMAGE_EXTENSIONS are read, at any depth below their class
folder, everything else (and hidden files) is left alone. Each image is decoded once, converted to
grey or RGB and resized to ``image_size`` (images.prepare: short side, then centre crop): the
dataset is an ImageDataset in memory like the others, its mean and std measured on its training
images. Which colours and size: the model's when a model is known (the training loop and the
commands that load a checkpoint pass them), else grey if every image is greyscale and colour
otherwise, at the size of the preset for such images (28 grey, 32 colour; see DEFAULT_SIZE).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .dataset import ImageDataset
from .errors import DataFileMissing, DataFormatError
from .images import GREY_MODES, IMAGE_EXTENSIONS, image_mode, open_image, prepare

# The input sizes of the presets for grey and colour images (vit-mnist/*, vit-cifar/*): a folder
# loaded without a model gets the size its preset takes, so that `--dataset DIR` trains without flags.
DEFAULT_SIZE = {1: 28, 3: 32}
# Names of the split folders: the first found of each.
TRAIN_NAMES, VAL_NAMES = ("train",), ("val", "valid", "validation", "test")


def is_folder_name(name: str) -> bool:
    """Whether a --dataset value names a folder rather than a built-in dataset."""
    from . import DATASET_KEYS
    return str(name).lower().replace("_", "-") not in DATASET_KEYS


def find_layout(root) -> tuple:
    """(classes, {split: [(path, label), ...]}) of a folder: split "train" and, with train/ and val/
    (or test/) folders, "val". Reads names only, no pixels; every problem is a one-line DataError
    naming the folder and the fix."""
    root = Path(root).expanduser()
    if not root.exists():
        raise DataFileMissing(f"no folder at {root}: give --dataset a built-in name (cifar10, cifar100, "
                              "fashion-mnist, synthetic) or the path of a folder with one sub-folder of images per class")
    if not root.is_dir():
        raise DataFormatError(f"{root} is a file; --dataset takes a folder with one sub-folder of images per class")
    subfolders = {p.name: p for p in _children(root) if p.is_dir()}
    train = next((subfolders[n] for n in TRAIN_NAMES if n in subfolders), None)
    val = next((subfolders[n] for n in VAL_NAMES if n in subfolders), None)
    if train is None and val is not None and len(subfolders) == 1:
        raise DataFormatError(f"{root} holds {val.name}/ but no train/ folder: put the training images in "
                              f"{root / 'train'}/<class>/")
    if train is None:                                        # one folder of classes
        classes, files = _classes(root)
        return classes, {"train": files}
    classes, files = _classes(train)
    if val is None:
        return classes, {"train": files}
    val_classes, val_files = _classes(val, allow_one=True)
    extra = sorted(set(val_classes) - set(classes))
    if extra:
        raise DataFormatError(f"{val} has class folders {extra} that {train} lacks: a model trained on {train} "
                              "cannot predict them; add them to train/ or remove them from "
                              f"{val.name}/")
    index = {name: i for i, name in enumerate(classes)}
    return classes, {"train": files, "val": [(path, index[val_classes[label]]) for path, label in val_files]}


def _children(folder: Path) -> list:
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


def _classes(folder: Path, allow_one: bool = False) -> tuple:
    """(sorted class names, [(image path, label)]) of a folder of class folders."""
    classes = [p.name for p in _children(folder) if p.is_dir()]
    if not classes:
        loose = [p for p in _children(folder) if p.suffix.lower() in IMAGE_EXTENSIONS]
        found = f" (it holds {len(loose)} images directly)" if loose else ""
        raise DataFormatError(f"{folder} has no class folders{found}: put each class's images in "
                              f"{folder}/<class name>/, one folder per class")
    if len(classes) == 1 and not allow_one:
        raise DataFormatError(f"{folder} has one class folder ({classes[0]}): a classifier needs two or more; "
                              "add a folder of images for each class")
    files = []
    for label, name in enumerate(classes):
        found = sorted(p for p in (folder / name).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS
                       and p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))
        if not found:
            raise DataFormatError(f"{folder / name} holds no images ({', '.join(IMAGE_EXTENSIONS)}): add some, "
                                  "or remove the folder")
        files += [(p, label) for p in found]
    return classes, files


def load_image_folder(path, image_size: int | None = None, channels: int | None = None, val_fraction: float = 0.2,
                      seed: int = 0) -> ImageDataset:
    """The images under ``path`` as an ImageDataset (see the module docstring for the layouts).

    image_size, channels: the model's input (None: chosen from the images, DEFAULT_SIZE);
    val_fraction, seed: with one folder, the share of each class held out as the test split, drawn
    at random with ``seed`` (each class keeps at least one training image and, with two or more,
    gives at least one). Raises DataError (one line, naming the file or folder) for a missing
    folder, no class folders, one class, an empty class, or a file that is not an image."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    if channels not in (None, 1, 3):
        raise ValueError(f"channels must be 1 (grey) or 3 (RGB), got {channels}")
    root = Path(path).expanduser().resolve()
    classes, splits = find_layout(root)
    if channels is None:                                 # grey only if every image is (headers only)
        modes = {image_mode(p) for split in splits.values() for p, _ in split}
        channels = 1 if modes <= set(GREY_MODES) else 3
    image_size = image_size or DEFAULT_SIZE[channels]
    if "val" in splits:
        train, test, layout = splits["train"], splits["val"], "train/ and val/ folders"
    else:
        train, test = _hold_out(splits["train"], len(classes), val_fraction, seed)
        layout = f"one folder, {100 * val_fraction:.0f}% of each class held out (seed {seed})"
        if not test:
            raise DataFormatError(f"{root}: too few images to hold out a validation split (each class needs two or "
                                  "more); add images, or give train/ and val/ folders")
    train_x, train_y = _decode(train, channels, image_size)
    test_x, test_y = _decode(test, channels, image_size)
    pixels = train_x.reshape(len(train_x), channels, -1).transpose(1, 0, 2).reshape(channels, -1) / 255.0
    source = {"folder": str(root), "val_fraction": val_fraction, "seed": seed}
    return ImageDataset(root.name, train_x, train_y, test_x, test_y, classes=classes, mean=tuple(pixels.mean(1)),
                        std=tuple(np.maximum(pixels.std(1), 1e-3)),
                        info={"folder": str(root), "layout": layout, "checkpoint": source})


def _hold_out(files: list, num_classes: int, fraction: float, seed: int) -> tuple:
    """(train, held out) lists: of each class, round(fraction * n) files at random (at least one when
    the class has two or more, never all), so every class is in both splits in proportion."""
    rng = np.random.default_rng(seed)
    train, held = [], []
    for label in range(num_classes):
        mine = [f for f in files if f[1] == label]
        n = len(mine)
        k = min(max(round(fraction * n), 1 if n >= 2 else 0), n - 1)
        chosen = set(rng.permutation(n)[:k].tolist())
        held += [f for i, f in enumerate(mine) if i in chosen]
        train += [f for i, f in enumerate(mine) if i not in chosen]
    return train, held


def _decode(files: list, channels: int, size: int) -> tuple:
    """[(path, label)] -> ((N, C, size, size) uint8, (N,) int64), each image prepared as predict does."""
    images = np.empty((len(files), channels, size, size), np.uint8)
    for i, (path, _) in enumerate(files):
        images[i], _ = prepare(open_image(path), channels, size)
    return images, np.array([label for _, label in files], dtype=np.int64)
