"""Models: ViT (vit.py), named variants (variants.py), position embeddings (posemb.py)."""
from .posemb import resize_pos_embed, sincos_2d
from .variants import config_for, count_parameters, create, forward_flops, known_names, training_flops
from .vit import ViT, ViTConfig

ARCHS = {"vit": (ViT, ViTConfig)}


def from_config(arch: str, config: dict):
    """Rebuild a model from its ``arch`` name and ``dataclasses.asdict(config)`` (checkpoint loading)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; known: {sorted(ARCHS)}")
    model_cls, config_cls = ARCHS[arch]
    return model_cls(config_cls.from_dict(dict(config)))


__all__ = ["ViT", "ViTConfig", "create", "config_for", "known_names", "count_parameters", "forward_flops",
           "training_flops", "resize_pos_embed", "sincos_2d", "from_config", "ARCHS"]
