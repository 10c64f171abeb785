"""What a run is: the recipes (per dataset, for fine-tuning and for pre-training) and TrainConfig,
every knob of a run (the CLI flags and the TOML --config file map onto its fields). Each default is
written here once. tinyvit.training.train runs one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .. import backend
from ..data import is_folder_name
from ..data.randaugment import OPS as RANDAUGMENT_OPS

from . import budget

# Every value a recipe sets (TrainConfig's fields left None are taken from the dataset's recipe). The
# base is what a dataset's recipe does not change: no augmentation or regularisation, a short run.
BASE_RECIPE = dict(epochs=10, batch_size=128, lr=1e-3, weight_decay=0.05, warmup_epochs=1, label_smoothing=0.0,
                   mixup=0.0, cutmix=0.0, randaug="", erasing=0.0, crop_padding=0, flip=False, drop_path=0.0,
                   ema=0.0)

# CIFAR: the from-scratch recipe of Lee, Lee & Song (2021), "Vision Transformer for Small-Size
# Datasets" (AdamW lr 1e-3, weight decay 0.05, batch 128, 10 warmup epochs then cosine, label
# smoothing 0.1, Mixup 0.8 / CutMix 1.0, RandAugment-style policy, random erasing 0.25, stochastic
# depth 0.1), run for 200 epochs since our default model is smaller than theirs.
CIFAR_RECIPE = dict(BASE_RECIPE, model="vit-cifar/4", epochs=200, warmup_epochs=10, label_smoothing=0.1,
                    mixup=0.8, cutmix=1.0, randaug="2,9", erasing=0.25, drop_path=0.1, crop_padding=4, flip=True)
RECIPES = {
    "cifar10": CIFAR_RECIPE,
    "cifar100": CIFAR_RECIPE,
    # Fashion-MNIST: patch 7 (16 tokens), light augmentation, 60 epochs (about 25 minutes on 2 CPU
    # cores). Chosen by the runs in docs/results.md: at equal time patch 7 beats patch 4 (89.69% against
    # 88.54% in 15-minute budgets), and crop + flip pays once a run is long enough to overfit without.
    "fashion-mnist": dict(BASE_RECIPE, model="vit-mnist/7", epochs=60, lr=2e-3, label_smoothing=0.1,
                          crop_padding=2, flip=True),
    # The synthetic set is for tests and offline demos: no augmentation, a few epochs, batch 64.
    "synthetic": dict(BASE_RECIPE, model=None, epochs=5, batch_size=64),
    # A folder of your own images (--dataset DIR): the preset for its images' shape, no augmentation
    # (a flip or crop may not suit them: turn them on with flags). Usually fine-tuned rather than trained.
    "folder": dict(BASE_RECIPE, model=None),
}


def recipe_for(dataset: str) -> dict:
    """The recipe of a dataset name, or RECIPES["folder"] for the path of a folder of images. A name
    that is neither a built-in dataset nor an existing folder is a ValueError saying both."""
    if not is_folder_name(dataset):
        key = {"cifar-10": "cifar10", "cifar-100": "cifar100", "fashionmnist": "fashion-mnist",
               "fmnist": "fashion-mnist"}.get(dataset.lower().replace("_", "-"), dataset.lower().replace("_", "-"))
        return RECIPES[key]
    if not Path(dataset).expanduser().is_dir():
        raise ValueError(f"unknown dataset {dataset!r}: give one of {', '.join(k for k in RECIPES if k != 'folder')}, "
                         "or the path of a folder of images with one sub-folder per class (no folder is there)")
    return RECIPES["folder"]

# With no --model and a recipe that names none, the model for the dataset's images: the recipes' own.
PRESET_BY_SHAPE = {(32, 3): RECIPES["cifar10"]["model"], (28, 1): RECIPES["fashion-mnist"]["model"]}

# The paper's fine-tuning recipe (section 3.2, appendix B.1.1): SGD with momentum 0.9, no weight
# decay, gradient clipping at global norm 1, a short warmup then cosine decay; the learning rate from
# {0.001, 0.003, 0.01, 0.03}; no augmentation. `tinyvit finetune` starts from it.
FINETUNE_RECIPE = dict(optimizer="sgd", momentum=0.9, weight_decay=0.0, grad_clip=1.0, lr=0.01, warmup_epochs=1,
                       epochs=10, label_smoothing=0.0, mixup=0.0, cutmix=0.0, randaug="", erasing=0.0, drop_path=0.0)

# Masked patch prediction (appendix B.1.2) in TrainConfig's terms. "1M steps (ca. 14 epochs) ... warmup
# of 10k steps" -> 14 epochs with 0.14 of an epoch of warmup. B.1.2 names no weight decay (B.1's 0.1
# is for supervised pre-training), so none; batch size 4096 does not fit a small machine, so the
# dataset's recipe batch size is used, with the paper's learning rate unscaled. No augmentation.
# `tinyvit pretrain` starts from it.
PRETRAIN_RECIPE = dict(optimizer="adam", lr=2e-4, weight_decay=0.0, epochs=14, warmup_epochs=0.14,
                       label_smoothing=0.0, mixup=0.0, cutmix=0.0, randaug="", erasing=0.0,
                       crop_padding=0, flip=False, drop_path=0.0)

# A recipe's augmentation is for long runs: a run given fewer epochs than this trains without the
# recipe's crop, flip, RandAugment, Mixup/CutMix and erasing (flags set explicitly are kept). Measured
# on Fashion-MNIST (docs/results.md): 2 epochs of vit-mnist/4 reach 78.96% with crop and flip, 85.27%
# without; after 14 epochs (15 minutes) still 88.54% against 89.05%.
SHORT_RUN_EPOCHS = 10
# The most epochs (and warmup epochs) a run may ask for: more is a typo, whose plan would overflow.
MAX_EPOCHS = 100_000
AUGMENTATION_OFF = dict(crop_padding=0, flip=False, randaug="", mixup=0.0, cutmix=0.0, erasing=0.0)


@dataclass
class TrainConfig:
    """Every knob of a run; the CLI flags and the TOML --config file map onto these fields.
    ``None`` means "the dataset's recipe value" (see RECIPES)."""
    dataset: str = "cifar10"
    model: str | None = None
    model_args: dict = field(default_factory=dict)     # ViTConfig overrides, e.g. {"dim": 64}
    data_dir: str | None = None
    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    min_lr: float = 1e-6
    weight_decay: float | None = None
    warmup_epochs: float | None = None
    optimizer: str = "adamw"                           # adamw | adam | sgd
    momentum: float = 0.9                              # SGD only
    grad_clip: float | None = None                     # global-norm clipping (the paper: 1.0)
    label_smoothing: float | None = None
    mixup: float | None = None
    cutmix: float | None = None
    randaug: str | None = None                         # "N,M": N ops of magnitude M; "" or "0" off
    erasing: float | None = None
    crop_padding: int | None = None
    flip: bool | None = None
    drop_path: float | None = None
    ema: float | None = None                           # decay of an average of the weights (0: off; optim.WeightEMA)
    device: str = "cpu"
    precision: str = "fp32"                            # "tf32": TF32 tensor-core matmuls (--device cuda)
    seed: int = 0
    out: str | None = None
    resume: bool = False
    eval_batch_size: int = 500
    train_limit: int | None = None                     # use only the first N training images
    test_limit: int | None = None
    dataset_args: dict = field(default_factory=dict)   # e.g. synthetic sizes
    time_budget: float | None = None                   # minutes: the run's length is measured to fit (budget.py)
    from_recipe: list = field(default_factory=list)    # the settings a recipe gave (resolved() records them)
    finetune_from: str | None = None                   # the checkpoint `tinyvit finetune` started from (its path)

    def __post_init__(self):
        self.validate()                                # every value is checked where it enters: here

    def resolved(self, notes: list | None = None) -> "TrainConfig":
        """The config with every None filled in from the dataset's recipe (less its augmentation for a
        short run; ``notes``, if given, receives a line saying so). A resolved config is returned as
        it is, so resolving is done once however often it is asked for."""
        if self.is_resolved():
            return self
        filled = {key: value for key, value in recipe_for(self.dataset).items() if getattr(self, key) is None}
        cfg = replace(self, **filled, from_recipe=[*self.from_recipe, *filled])
        dropped = cfg.augmentation_dropped()
        if dropped:
            cfg = replace(cfg, **{key: AUGMENTATION_OFF[key] for key in dropped})
            if notes is not None:
                flags = ", ".join("--" + key.replace("_", "-") for key in dropped)
                notes.append(f"a {cfg.epochs}-epoch run is short: trained without the recipe's {flags} "
                             f"(a run of {SHORT_RUN_EPOCHS} epochs or more uses them; a flag sets one anyway)")
        return cfg

    def augmentation_dropped(self) -> list:
        """The recipe's augmentation settings a short run leaves out (SHORT_RUN_EPOCHS): those the
        recipe filled in and turned on, for a run of fewer epochs. A time budget keeps them: its
        length is known only once it has been timed."""
        if self.time_budget is not None or self.epochs >= SHORT_RUN_EPOCHS:
            return []
        return [key for key, off in AUGMENTATION_OFF.items() if key in self.from_recipe and getattr(self, key) != off]

    def is_resolved(self) -> bool:
        """Whether every setting a recipe gives is filled in (by resolved(), a recipe or the caller)."""
        try:
            recipe = recipe_for(self.dataset)
        except ValueError:
            return False
        return all(getattr(self, key) is not None for key in recipe)

    def validate(self) -> None:
        """Raise a ValueError naming every bad value (each as the flag that sets it)."""
        recipe_for(self.dataset)                         # a ValueError names the datasets and folders it takes
        if self.time_budget is not None:
            if self.epochs is not None and "epochs" not in self.from_recipe:
                raise ValueError("invalid training configuration: pass --epochs or --time-budget, not both "
                                 "(a time budget sets the number of steps)")
            budget.parse_duration(self.time_budget)               # a ValueError names the problem
        problems = []
        if self.optimizer not in ("adamw", "adam", "sgd"):
            problems.append(f"--optimizer must be adamw, adam or sgd, got {self.optimizer!r}")
        # a limit of 0 would train on nothing, and a negative one would slice images off the end
        for name in ("epochs", "batch_size", "eval_batch_size", "train_limit", "test_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.epochs is not None and self.epochs > MAX_EPOCHS:
            problems.append(f"--epochs must be at most {MAX_EPOCHS}, got {self.epochs}")
        if self.seed < 0:                                   # NumPy's generators take none below 0
            problems.append(f"--seed must be a whole number >= 0, got {self.seed}")
        if self.crop_padding is not None and self.crop_padding < 0:
            problems.append(f"--crop-padding must be >= 0 (0: no random crop), got {self.crop_padding}")
        # argparse's float() reads "nan" and "inf", and every comparison with NaN is False: test first
        numbers = {name: getattr(self, name) for name in ("lr", "min_lr", "weight_decay", "warmup_epochs", "momentum",
                                                          "grad_clip", "label_smoothing", "mixup", "cutmix",
                                                          "erasing", "drop_path", "ema") if getattr(self, name) is not None}
        problems += [f"--{name.replace('_', '-')} must be a finite number, got {value}"
                     for name, value in numbers.items() if not math.isfinite(value)]
        finite = {name: value for name, value in numbers.items() if math.isfinite(value)}
        for name in ("lr", "min_lr", "weight_decay", "warmup_epochs", "mixup", "cutmix"):
            if finite.get(name, 0) < 0:
                problems.append(f"--{name.replace('_', '-')} must be >= 0, got {finite[name]}")
        if finite.get("grad_clip", 0) < 0:          # a negative norm would turn every step into ascent
            problems.append(f"--grad-clip must be > 0 (or 0 for no clipping), got {finite['grad_clip']}")
        for name in ("erasing", "drop_path", "label_smoothing", "momentum", "ema"):
            if not 0 <= finite.get(name, 0) < 1:
                problems.append(f"--{name.replace('_', '-')} must be in [0, 1), got {finite[name]}")
        if finite.get("warmup_epochs", 0) > MAX_EPOCHS:
            problems.append(f"--warmup-epochs must be at most {MAX_EPOCHS}, got {finite['warmup_epochs']}")
        if finite.get("min_lr", 0) > finite.get("lr", math.inf):    # the cosine "decay" would raise the rate
            problems.append(f"--min-lr {finite['min_lr']} is above --lr {finite['lr']}: the schedule decays from "
                            "--lr to --min-lr; give a --min-lr <= --lr")
        if self.precision not in backend.PRECISIONS:
            extra = (" (bf16 is not supported yet: CuPy has no bfloat16 dtype; use tf32 on a GPU)"
                     if self.precision == "bf16" else "")
            problems.append(f"--precision must be fp32 or tf32, got {self.precision!r}{extra}")
        elif self.precision == "tf32" and not str(self.device).startswith("cuda"):
            problems.append("--precision tf32 needs --device cuda (TF32 is a format of NVIDIA tensor cores; "
                            "NumPy computes in full float32)")
        if self.randaug:
            try:
                parse_randaug(self.randaug)
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise ValueError("invalid training configuration: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """A TrainConfig from settings (a --config file's, flags'), each of its field's type: a
        ValueError names the first that is not, as the flag and the --config key that set it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown training settings {unknown}; known: {sorted(known - set(INTERNAL_FIELDS))}")
        kinds = {"int": ((int,), "a whole number"), "float": ((int, float), "a number"), "str": ((str,), "text"),
                 "bool": ((bool,), "true or false"), "dict": ((dict,), "a table")}
        for f in fields(cls):
            value = d.get(f.name)
            base = str(f.type).split("|")[0].strip()
            if value is None or base not in kinds:
                continue
            types, what = kinds[base]
            if not isinstance(value, types) or (base != "bool" and isinstance(value, bool)):
                flag = {"model_args": "--model-arg/[model]", "dataset_args": "[dataset]"}.get(
                    f.name, f"--{f.name.replace('_', '-')} (`{f.name} = ...` in a --config file)")
                raise ValueError(f"{flag} must be {what}, got {value!r}")
        return cls(**d)


# TrainConfig fields a run fills in itself, which neither a flag nor a --config file sets.
INTERNAL_FIELDS = ("from_recipe", "finetune_from")


def parse_randaug(spec: str) -> tuple[int, float]:
    """ "2,9" -> (2, 9.0): N ops per image at magnitude M (of 10). "" or "0" -> (0, 0)."""
    if spec in ("", "0", None):
        return 0, 0.0
    parts = str(spec).split(",")
    try:
        n, m = (int(parts[0]), float(parts[1]) if len(parts) > 1 else 9.0)
    except (ValueError, IndexError):
        raise ValueError(f"--randaug must look like N,M (e.g. 2,9), got {spec!r}") from None
    ops = len(RANDAUGMENT_OPS)                 # more rounds than ops would repeat them: a typo, and slow
    if not 0 <= n <= ops or not 0 <= m <= 10 or len(parts) > 2:
        raise ValueError(f"--randaug N,M needs 0 <= N <= {ops} (the number of ops) and 0 <= M <= 10, got {spec!r}")
    return n, m
