"""What training minimises: an objective is the part of a run that knows its task.

    build_model(cfg, dataset) -> model      the model a new run trains
    check(model, dataset)                    refuses a model that does not fit the data (one line)
    step(model, x, y) -> (loss, correct)     one batch's loss Tensor and its number of right answers
                                             (a device scalar: no host read per step)
    evaluate(model, loader) -> {"loss", "acc", ...}   over a whole split, eval mode, no graph

``model`` in ``step`` and ``evaluate`` is what the loop runs: the model itself, or
``tinyvit.kernels.fuse(model)`` (the same model with its encoder fused across layers). Both
objectives below use the same loop, checkpoints and resume (training/loop.py).
"""
from __future__ import annotations

from dataclasses import fields

import numpy as np

from .. import functional as F
from ..autograd import no_grad
from ..backend import get_array_module
from ..evaluation import check_fits, evaluate
from ..models import ViTConfig, config_for
from ..models.masked import MaskedConfig, MaskedPatchViT, make_targets, quantize_3bit
from .components import check_trainable, create_for_dataset, model_name


class Classification:
    """Supervised training: cross-entropy on (possibly soft, mixed) targets."""
    name = "classification"
    metric = "test accuracy"              # what "best" means, in the run's summary
    test_label = "test"                   # the evaluation's loss and accuracy, in the epoch lines

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def build_model(self, cfg, dataset):
        """The model named by cfg.model (or the preset for the dataset's images), sized for the data."""
        return create_for_dataset(model_name(cfg, dataset), dataset, **{"drop_path": cfg.drop_path, **cfg.model_args})

    def check(self, model, dataset) -> None:
        check_fits(model, dataset)

    def step(self, model, x, y):
        """-> (loss Tensor, number of correct predictions as a device scalar). Mixed targets count
        as their larger part."""
        logits = model(x)
        # the dataset checked its labels when loaded: no range check, which would wait for the GPU
        loss = F.cross_entropy(logits, y, label_smoothing=self.label_smoothing, check_labels=False)
        hard = y if y.ndim == 1 else y.argmax(axis=-1)
        return loss, (logits.data.argmax(axis=-1) == hard).sum()

    def evaluate(self, model, loader) -> dict:
        return evaluate(model, loader)


class MaskedPrediction:
    """Self-supervised pre-training by masked patch prediction (section 4.6; the model and its loss
    are models/masked.py's). Labels are
    never read. "acc" is the accuracy of the masked-patch predictions (for pixels-l2: whether the
    regressed patch has the right 3-bit mean colour).

    mean, std: the normalisation the data pipeline applied (per channel); ``check`` takes them from
    the dataset when training through ``train``."""
    name = "masked-patch-prediction"
    # The pretext task's own numbers, which say nothing of classification (few-shot or fine-tuning does).
    metric = "masked-patch accuracy (test images)"
    test_label = "test masked-patch"

    def __init__(self, mean=None, std=None, eval_seed: int = 0):
        self.mean, self.std, self.eval_seed = mean, std, eval_seed

    def build_model(self, cfg, dataset):
        """A MaskedPatchViT: the named ViT (or the preset for the images) as encoder, sized for the
        data, with cfg.model_args overriding ViTConfig and MaskedConfig fields (target=..., mask_rate=...)."""
        name = model_name(cfg, dataset)
        base = config_for(name, image_size=dataset.image_size, in_channels=dataset.channels, num_classes=0,
                          drop_path=cfg.drop_path)
        settings = {f.name: getattr(base, f.name) for f in fields(ViTConfig)}
        settings.update(cfg.model_args)
        config = MaskedConfig.from_dict(settings)
        check_trainable(config)
        return MaskedPatchViT(config)

    def check(self, model, dataset) -> None:
        """The images must fit the model; remember the dataset's normalisation (targets need [0, 1] pixels)."""
        cfg = model.config
        if not isinstance(model, MaskedPatchViT):
            raise ValueError(f"masked patch prediction needs a MaskedPatchViT, got {type(model).__name__}")
        if (dataset.channels, dataset.image_size) != (cfg.in_channels, cfg.image_size):
            raise ValueError(f"the model takes {cfg.in_channels}x{cfg.image_size}x{cfg.image_size} images but "
                             f"{dataset.name} has {dataset.channels}x{dataset.image_size}x{dataset.image_size}")
        self.mean, self.std = tuple(dataset.mean), tuple(dataset.std)

    def pixels(self, x):
        """Undo the data pipeline's normalisation: (B, C, H, W) normalised -> pixels in [0, 1]."""
        if self.mean is None or self.std is None:
            raise ValueError("MaskedPrediction needs the data's mean and std to recover [0, 1] pixels: "
                             "pass them, or call check(model, dataset) first")
        xp = get_array_module(x)
        mean = xp.asarray(self.mean, dtype=x.dtype).reshape(1, -1, 1, 1)
        std = xp.asarray(self.std, dtype=x.dtype).reshape(1, -1, 1, 1)
        return xp.clip(x * std + mean, 0.0, 1.0)

    def targets(self, model, x):
        """Every patch's target for the normalised batch x (B, C, H, W)."""
        return make_targets(model.config.target, self.pixels(x), x, model.config.patch_size)

    def _correct(self, model, pred, target):
        """Fraction of right predictions among the chosen patches (a device scalar)."""
        if model.config.target != "pixels-l2":
            return (pred.data.argmax(axis=-1) == target).mean()
        cfg, xp = model.config, get_array_module(target)
        c = cfg.in_channels
        mean = xp.asarray(self.mean, dtype=target.dtype)
        std = xp.asarray(self.std, dtype=target.dtype)

        def colour(flat):                                    # (M, C*P*P) normalised -> (M,) 3-bit mean
            return quantize_3bit(xp.clip(flat.reshape(len(flat), c, -1).mean(axis=-1) * std + mean, 0, 1))
        return (colour(pred.data) == colour(target)).mean()

    def step(self, model, x, y):
        """-> (loss Tensor, correct predictions counted per image as a device scalar). y is ignored."""
        loss, pred, target = model.loss(x, self.targets(model, x))
        return loss, self._correct(model, pred, target) * x.shape[0]

    def evaluate(self, model, loader) -> dict:
        """Mean loss and accuracy over a loader, eval mode, no graph; the same corruption every call
        (a generator seeded with eval_seed), so that epochs are compared on the same task."""
        model.eval()
        rng = np.random.default_rng(self.eval_seed)
        total_loss, correct, seen = 0.0, 0.0, 0
        with no_grad():
            for x, _ in loader:
                loss, pred, target = model.loss(x, self.targets(model, x), rng=rng)
                total_loss += float(loss.item()) * len(x)
                correct += float(self._correct(model, pred, target)) * len(x)
                seen += len(x)
        return {"loss": total_loss / max(seen, 1), "acc": correct / max(seen, 1)}
