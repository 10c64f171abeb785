"""Models, and nothing of training: ViT (vit.py, Eq. 1-4), the hybrid (hybrid.py, section 3.1; its
ResNet in resnet.py), masked patch prediction's model (masked.py, section 4.6), the named variants
(variants.py, Table 1) and position embeddings (posemb.py)."""
from .hybrid import HybridConfig, HybridViT
from .masked import MaskedConfig, MaskedPatchViT
from .posemb import resize_pos_embed, sincos_2d
from .variants import config_for, count_parameters, create, forward_flops, known_names, training_flops
from .vit import ViT, ViTConfig

# arch name (stored in checkpoints) -> model class; each model class has a ``config_class``.
ARCHS = {
    "vit": ViT,
    "hybrid": HybridViT,                # ResNet feature map as tokens (section 3.1)
    "masked-vit": MaskedPatchViT,       # masked patch prediction (section 4.6)
}


def model_class(arch: str):
    """The model class registered under ``arch``."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; known: {sorted(ARCHS)}")
    return ARCHS[arch]


def from_config(arch: str, config: dict):
    """Rebuild a model from its ``arch`` name and ``dataclasses.asdict(config)`` (checkpoint loading)."""
    model_cls = model_class(arch)
    return model_cls(model_cls.config_class.from_dict(dict(config)))


__all__ = ["ViT", "ViTConfig", "HybridViT", "HybridConfig", "MaskedPatchViT", "MaskedConfig", "create", "config_for",
           "known_names", "count_parameters", "forward_flops", "training_flops", "resize_pos_embed", "sincos_2d",
           "from_config", "model_class", "ARCHS"]
