"""The pieces a training run is built from, each from the run's TrainConfig: the model, the data,
the optimizer, the augmentation, and where the images live.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .. import backend, optim
from ..data import Augment, load_dataset
from ..models import config_for, create
from .recipes import PRESET_BY_SHAPE, TrainConfig, parse_randaug


def run_dir(cfg: TrainConfig) -> Path:
    """The run folder: --out, or runs/DATASET-MODEL."""
    if cfg.out:
        return Path(cfg.out).expanduser()
    name = (cfg.model or "preset").replace("/", "-")
    return Path("runs") / f"{cfg.dataset}-{name}"


def model_name(cfg: TrainConfig, dataset) -> str:
    """cfg.model, or the preset for the dataset's images (PRESET_BY_SHAPE)."""
    name = cfg.model or PRESET_BY_SHAPE.get((dataset.image_size, dataset.channels))
    if name is None:
        raise ValueError(f"no preset fits {dataset.channels}-channel {dataset.image_size}x{dataset.image_size} "
                         f"images; pass --model (see `tinyvit models`) and --model-arg image_size=...")
    return name


def create_for_dataset(name: str, dataset, **overrides):
    """The named model sized for the dataset: its image size, channels and classes (overrides win);
    one too large to train here is refused before it is built (check_trainable)."""
    sized = dict(image_size=dataset.image_size, in_channels=dataset.channels, num_classes=dataset.num_classes)
    check_trainable(config_for(name, **{**sized, **overrides}))
    return create(name, **{**sized, **overrides})


def check_trainable(config) -> None:
    """Refuse, before anything is allocated, a model whose training cannot fit this machine's memory:
    each parameter takes 16 bytes in float32 (the weight, its gradient, two optimizer moments), not
    counting the activations. (A --model-arg depth=100000000 once spent minutes building blocks;
    image_size=1000000000 asked for 1.7 EiB of position embeddings.)"""
    params = config.count_parameters()
    have = physical_memory()
    if have and 16 * params > have:
        raise ValueError(f"the model has {params:.3g} parameters: training it needs at least {_size(16 * params)} "
                         f"(weights, gradients and optimizer state in float32), more than this machine's "
                         f"{_size(have)} of memory; choose a smaller model (--model, or --model-arg dim, depth, "
                         "mlp_dim, image_size, patch_size)")


def physical_memory() -> int:
    """Bytes of memory this machine has (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def _size(nbytes: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"):
        if nbytes < 1000 or unit == "YB":
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1000


def load_data(name: str, data_dir=None, dataset_args: dict | None = None):
    """``load_dataset`` with a run's [dataset] settings; a setting the dataset's loader does not take
    (or of the wrong type) is a ValueError naming them, not a traceback."""
    try:
        return load_dataset(name, root=data_dir, **(dataset_args or {}))
    except TypeError as exc:
        raise ValueError(f"[dataset] settings {dataset_args} do not fit {name}: {exc}") from None


def make_optimizer(cfg: TrainConfig, model):
    """AdamW/Adam/SGD with no weight decay on biases, norms, class token and position embeddings."""
    groups = optim.param_groups_weight_decay(model, cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    cls = optim.AdamW if cfg.optimizer == "adamw" else optim.Adam
    return cls(groups, lr=cfg.lr)


def make_transforms(cfg: TrainConfig, dataset, world=None):
    """(training transform, evaluation transform). In data-parallel training (``world`` of several
    ranks) each rank augments its rows with a random stream of its own."""
    n, m = parse_randaug(cfg.randaug)
    if cfg.crop_padding > dataset.image_size:            # a pointless crop that pads images by gigabytes
        raise ValueError(f"--crop-padding {cfg.crop_padding} is more than the {dataset.image_size}-pixel images of "
                         f"{dataset.name}: give at most {dataset.image_size} (the recipes use 2 to 4; 0: no crop)")
    seed = cfg.seed + 1 if world is None else world.seed(cfg.seed + 1)
    train_tf = Augment(dataset.mean, dataset.std, dataset.num_classes, crop_padding=cfg.crop_padding,
                       flip=cfg.flip, randaug_n=n, randaug_m=m, mixup_alpha=cfg.mixup,
                       cutmix_alpha=cfg.cutmix, erasing_p=cfg.erasing, seed=seed)
    return train_tf, Augment(dataset.mean, dataset.std)


# Up to this many bytes of images live on the GPU for the whole run (CIFAR-10: 184 MB as uint8).
DEVICE_DATA_LIMIT = 2 << 30


def resident(images, labels, device):
    """The arrays a loader batches from. On a GPU, a split is copied there once, as uint8, so that each
    step gathers its batch on the device rather than copying it from the host (a larger split stays
    on the host and its batches travel each step)."""
    if device == "cpu" or images.nbytes > DEVICE_DATA_LIMIT:
        return images, labels
    return backend.to_device(images, device), backend.to_device(labels, device)


def resize_images(images: np.ndarray, size: int) -> np.ndarray:
    """uint8 (N, C, H, W) -> (N, C, size, size), bicubic with Pillow (once, before training at a
    new resolution)."""
    from PIL import Image
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    out = np.empty(images.shape[:2] + (size, size), dtype=np.uint8)
    for i, img in enumerate(images):                    # data preparation, once per run
        for c, plane in enumerate(img):
            out[i, c] = np.asarray(Image.fromarray(plane).resize((size, size), Image.BICUBIC))
    return out
