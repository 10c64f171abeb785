"""The pieces a training run is built from, each from the run's TrainConfig: the model, the data,
the optimizer, the augmentation, and where the images live.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .. import backend, optim
from ..data import Augment, DataError, find_layout, is_folder_name, load_dataset
from ..data.folder import DEFAULT_SIZE
from ..models import config_for, create
from ..models.variants import SMALL, VIT_SIZES
from .recipes import PRESET_BY_SHAPE, TrainConfig, parse_randaug, recipe_for


def run_dir(cfg: TrainConfig) -> Path:
    """The run folder: --out, or runs/DATASET-MODEL (MODEL: the model's name, the preset's when the
    recipe names none), numbered as timm numbers its runs when that holds a run already:
    runs/DATASET-MODEL-2, -3, ... (see next_run_folder)."""
    if cfg.out:
        return Path(cfg.out).expanduser()
    return next_run_folder(Path("runs") / f"{dataset_label(cfg.dataset)}-{planned_model_name(cfg).replace('/', '-')}",
                           cfg.resume)


def next_run_folder(base: Path, resume: bool = False) -> Path:
    """``base`` or the first of base-2, base-3, ... that holds no run (no latest.safetensors, and no
    run starting there: its .lock free), so that a second run without --out gets a folder of its
    own. Resuming: the last of them that holds a run (the latest run of that name)."""
    candidates = [base] + [base.with_name(f"{base.name}-{n}") for n in range(2, 1000)]
    if resume:
        held = [path for path in candidates if (path / "latest.safetensors").exists()]
        return held[-1] if held else base
    return next(path for path in candidates if not (path / "latest.safetensors").exists() and not _locked(path))


def _locked(folder: Path) -> bool:
    """Whether a run holds ``folder``'s lock now (run_folder.RunFolderLock: an flock on .lock)."""
    try:
        import fcntl
    except ImportError:                              # Windows: no locks
        return False
    try:
        fd = os.open(folder / ".lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)                                 # also drops the lock taken to test it


def dataset_label(name: str) -> str:
    """How a dataset names its runs: its name, or a folder's own name ("photos/shoes/" -> "shoes")."""
    return Path(name).expanduser().resolve().name if is_folder_name(name) else name


def planned_model_name(cfg: TrainConfig) -> str:
    """The name of the model a run will train, before its data is loaded: cfg.model, or the preset for
    the dataset's images (PRESET_BY_SHAPE; a folder's shape from its image files' headers). "vit"
    where no preset fits (model_name then refuses the run, naming what to pass)."""
    if cfg.model:
        return cfg.model
    args = cfg.dataset_args
    if is_folder_name(cfg.dataset):
        channels = args.get("channels") or _folder_channels(cfg.dataset)
        shape = (args.get("image_size") or DEFAULT_SIZE.get(channels), channels)
    else:
        recipe = recipe_for(cfg.dataset)
        if recipe.get("model"):
            return recipe["model"]
        shape = (args.get("image_size", 32), args.get("channels", 3))       # make_synthetic's defaults
    return PRESET_BY_SHAPE.get(shape, "vit")


def _folder_channels(folder) -> int:
    """1 if every image file of the folder is greyscale, else 3 (from the files' headers)."""
    from ..data.images import GREY_MODES, image_mode
    try:
        _, splits = find_layout(folder)
        modes = {image_mode(p) for split in splits.values() for p, _ in split}
    except DataError:
        return 3                                     # loading the data reports the problem
    return 1 if modes <= set(GREY_MODES) else 3


def model_name(cfg: TrainConfig, dataset) -> str:
    """cfg.model, or the preset for the dataset's images (PRESET_BY_SHAPE)."""
    name = cfg.model or PRESET_BY_SHAPE.get((dataset.image_size, dataset.channels))
    if name is None:
        raise ValueError(f"no preset fits {dataset.channels}-channel {dataset.image_size}x{dataset.image_size} "
                         f"images; pass --model (see `tinyvit models`) and --model-arg image_size=...")
    return name


# family -> (dim, depth, heads, mlp_dim): vit-b/16, vit-mnist/7, ... (the sizes a name after "vit-" gives)
FAMILIES = {**VIT_SIZES, **{name: tuple(s[k] for k in ("dim", "depth", "num_heads", "mlp_dim"))
                            for name, s in SMALL.items()}}


def describe_model(model, name: str | None = None) -> str:
    """A model's name for runs and logs: ``name`` when given, else the named variant whose sizes it
    has (a checkpoint does not store the name it was created by), else its sizes. ``model``: a model,
    or a config dict as a checkpoint's header holds it."""
    if name:
        return name
    cfg = model.get("config", model) if isinstance(model, dict) else getattr(model, "config", None)
    get = cfg.get if isinstance(cfg, dict) else lambda key, default=None: getattr(cfg, key, default)
    keys = ("dim", "depth", "num_heads", "mlp_dim")
    if cfg is None or any(get(k) is None for k in (*keys, "patch_size")):
        return getattr(model, "arch", type(model).__name__)
    for family, sizes in FAMILIES.items():           # any patch size after the slash names a variant
        if tuple(get(k) for k in keys) == sizes:
            return f"vit-{family}/{get('patch_size')}"
    return f"vit-d{get('dim')}-l{get('depth')}/{get('patch_size')}"


def input_shape(cfg: TrainConfig, model=None) -> dict:
    """{"channels", "image_size"} of the model a run trains: ``model``'s, or cfg.model's (with its
    --model-arg overrides); {} when the preset is still to be chosen from the data. A folder dataset
    is read at this shape (so fine-tuning a grey 28x28 model on colour photos reads them grey at 28)."""
    if model is not None:
        return {"channels": model.config.in_channels, "image_size": model.config.image_size}
    if not cfg.model:
        return {}
    try:
        config = config_for(cfg.model)
    except ValueError:
        return {}                                    # an unknown name is refused later, naming the known ones
    return {"channels": cfg.model_args.get("in_channels", config.in_channels),
            "image_size": cfg.model_args.get("image_size", config.image_size)}


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


def load_data(name: str, data_dir=None, dataset_args: dict | None = None, shape: dict | None = None):
    """``load_dataset`` with a run's [dataset] settings; a setting the dataset's loader does not take
    (or of the wrong type) is a ValueError naming them, not a traceback. ``shape`` (input_shape):
    the model's channels and image size, which a folder of images is read at unless [dataset] says."""
    args = dict(dataset_args or {})
    if is_folder_name(name):
        args = {**(shape or {}), **args}
    try:
        return load_dataset(name, root=data_dir, **args)
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
