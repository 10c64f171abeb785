"""Models: ViT (vit.py), named variants (variants.py), position embeddings (posemb.py)."""
from .posemb import resize_pos_embed, sincos_2d
from .variants import config_for, count_parameters, create, forward_flops, known_names, training_flops
from .vit import ViT, ViTConfig

# arch name (stored in checkpoints) -> "module:Class"; each model class has a ``config_class``.
# Imported on demand so that a model family's module loads only when used.
ARCHS = {
    "vit": "vit:ViT",
    "hybrid": "hybrid:HybridViT",           # ResNet feature map as tokens (section 3.1)
    "masked-vit": "masked:MaskedPatchViT",  # masked patch prediction (section 4.6)
}


def model_class(arch: str):
    """The model class registered under ``arch``."""
    import importlib
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; known: {sorted(ARCHS)}")
    module, cls = ARCHS[arch].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def from_config(arch: str, config: dict):
    """Rebuild a model from its ``arch`` name and ``dataclasses.asdict(config)`` (checkpoint loading)."""
    model_cls = model_class(arch)
    return model_cls(model_cls.config_class.from_dict(dict(config)))


__all__ = ["ViT", "ViTConfig", "create", "config_for", "known_names", "count_parameters", "forward_flops",
           "training_flops", "resize_pos_embed", "sincos_2d", "from_config", "model_class", "ARCHS"]
