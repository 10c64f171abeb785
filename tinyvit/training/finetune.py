"""Fine-tuning a trained model on a new task (section 3.2, appendix B.1.1): `tinyvit finetune`.

The pre-training head is dropped and a zero-initialised linear layer for the new classes put in
its place; at a new resolution the position embeddings are interpolated in 2D over the new patch
grid. Training then runs through tinyvit.training.train with the paper's fine-tuning recipe
(recipes.FINETUNE_RECIPE).
"""
from __future__ import annotations

from dataclasses import fields, replace

from .. import io
from ..backend import get_default_dtype
from .components import check_trainable

def prepare_finetune(checkpoint, num_classes: int, image_size: int | None = None,
                     resize_method: str = "bilinear", **overrides):
    """A model initialised from ``checkpoint`` for fine-tuning: the whole head (pre-logits included)
    replaced by a zero-initialised linear layer for ``num_classes``, and, for a new ``image_size``,
    the position embeddings 2D-interpolated to the new patch grid (section 3.2). ``overrides``:
    config fields that need no new weights, e.g. drop_path=0.1, dropout=0.1. The model is in the
    default dtype (float32), as training's images are, whatever the checkpoint's."""
    old_model, _, _ = io.load_checkpoint(checkpoint, dtype=get_default_dtype())
    if hasattr(old_model, "to_vit"):                   # a pre-trained encoder (e.g. masked patch prediction)
        old_model = old_model.to_vit()
    old = old_model.config
    unknown = sorted(set(overrides) - {f.name for f in fields(old)})
    if unknown:
        raise ValueError(f"unknown model settings {unknown}; known: {sorted(f.name for f in fields(old))}")
    new = replace(old, **{"num_classes": num_classes, "representation_size": None,
                          "image_size": old.image_size if image_size is None else image_size, **overrides})
    check_trainable(new)                               # a new image size can make it too large to train here
    state = {k: v for k, v in old_model.state_dict().items() if not k.startswith(("head.", "pre_logits."))}
    state, _ = io.adapt_state_dict(state, replace(old, num_classes=num_classes, representation_size=None), new,
                                   resize_method)
    model = type(old_model)(new)                       # its head is zero-initialised
    missing, unexpected = model.load_state_dict(state, strict=False)
    leftover = [k for k in list(missing) + list(unexpected) if not k.startswith("head.")]
    if leftover:
        raise ValueError(f"{checkpoint}: cannot fine-tune from it, these tensors do not fit: {leftover}")
    return model
