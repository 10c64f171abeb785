"""Named models: the paper's Table 1 (and ViT-Ti/S of DeiT), plus small presets for 32x32 and 28x28
images, with parameter counts and FLOPs computed from the config alone (no arrays allocated).
Names with a "+" are hybrids (a ResNet feature map as tokens, "r50+vit-b/16"): models/hybrid.py."""
from __future__ import annotations

import re
from dataclasses import replace

from .vit import ViT, ViTConfig

# Table 1 of the paper (ViT-Base, Large, Huge) and the smaller widths of DeiT (Touvron et al. 2021).
# size -> (dim, depth, heads, mlp_dim)
VIT_SIZES = {
    "ti": (192, 12, 3, 768),
    "s": (384, 12, 6, 1536),
    "b": (768, 12, 12, 3072),
    "l": (1024, 24, 16, 4096),
    "h": (1280, 32, 16, 5120),
}

# Small presets that train in minutes on a GPU. "cifar": 32x32 RGB, "mnist": 28x28 grey.
# The CIFAR width/depth are the usual from-scratch CIFAR ViT (e.g. dim 192, depth 6, 3 heads).
SMALL = {
    "cifar": dict(image_size=32, in_channels=3, num_classes=10, dim=192, depth=6, num_heads=3, mlp_dim=384),
    "mnist": dict(image_size=28, in_channels=1, num_classes=10, dim=128, depth=4, num_heads=4, mlp_dim=256),
}

_NAME = re.compile(r"^vit-(ti|s|b|l|h|cifar|mnist)/(\d+)$")


def config_for(name: str, **overrides) -> ViTConfig:
    """The ViTConfig of a named variant, e.g. "vit-b/16", "vit-l/32", "vit-cifar/4", "vit-mnist/2";
    for a hybrid ("r50+vit-b/16") its HybridConfig."""
    if "+" in name:
        from . import hybrid
        return hybrid.config_for(name, **overrides)
    m = _NAME.match(name.lower())
    if not m:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(known_names())} "
                         "(any patch size after the slash)")
    size, patch = m.group(1), int(m.group(2))
    if size in VIT_SIZES:
        dim, depth, heads, mlp = VIT_SIZES[size]
        cfg = ViTConfig(image_size=224, patch_size=patch, dim=dim, depth=depth, num_heads=heads, mlp_dim=mlp)
    else:
        cfg = ViTConfig(patch_size=patch, **SMALL[size])
    return replace(cfg, **overrides)


def known_names():
    from .hybrid import known_names as hybrid_names
    return ["vit-ti/16", "vit-s/16", "vit-b/16", "vit-b/32", "vit-l/16", "vit-l/32", "vit-h/14",
            "vit-cifar/4", "vit-cifar/2", "vit-mnist/4", "vit-mnist/2"] + hybrid_names()


def create(name: str, **overrides) -> ViT:
    """Build a named model; keyword arguments override config fields (num_classes=10, ...)."""
    if "+" in name:
        from .hybrid import create as create_hybrid
        return create_hybrid(name, **overrides)
    return ViT(config_for(name, **overrides))


def count_parameters(cfg: ViTConfig) -> int:
    """Number of parameters of ViT(cfg), computed from the config (matches the built model).
    A config with its own ``count_parameters`` method (HybridConfig: ResNet + ViT) is asked."""
    if hasattr(cfg, "count_parameters"):
        return cfg.count_parameters()
    d, c, p = cfg.dim, cfg.in_channels, cfg.patch_size
    n = cfg.num_patches
    total = (c * p * p + 1) * d                                     # patch embedding E and bias
    total += d if cfg.pool == "token" else 0                        # class token
    if cfg.posemb == "learned-1d":
        total += (n + cfg.num_prefix_tokens) * d
    elif cfg.posemb == "learned-2d":
        total += 2 * cfg.grid_size * (d // 2)
    per_block = 4 * d                                               # two LayerNorms
    per_block += d * 3 * d + (3 * d if cfg.qkv_bias else 0)         # qkv
    per_block += d * d + d                                          # output projection
    per_block += 2 * d * cfg.mlp_dim + cfg.mlp_dim + d              # MLP
    total += cfg.depth * per_block + 2 * d                          # blocks, final norm
    width = d
    if cfg.representation_size:
        total += d * cfg.representation_size + cfg.representation_size
        width = cfg.representation_size
    if cfg.num_classes:
        total += width * cfg.num_classes + cfg.num_classes
    return total


def forward_flops(cfg: ViTConfig) -> int:
    """Multiply-add FLOPs (2 per MAC) of one image's forward pass: every matmul, attention included;
    element-wise ops are ignored, as is usual. A config with its own ``forward_flops`` is asked."""
    if hasattr(cfg, "forward_flops"):
        return cfg.forward_flops()
    d, t = cfg.dim, cfg.num_patches + cfg.num_prefix_tokens
    flops = 2 * cfg.num_patches * cfg.in_channels * cfg.patch_size ** 2 * d   # patch embedding
    per_block = 2 * t * d * 3 * d          # qkv
    per_block += 2 * 2 * t * t * d         # q k^T and A v over all heads
    per_block += 2 * t * d * d             # output projection
    per_block += 2 * 2 * t * d * cfg.mlp_dim
    flops += cfg.depth * per_block
    width = d
    if cfg.representation_size:
        flops += 2 * d * cfg.representation_size
        width = cfg.representation_size
    return flops + 2 * width * cfg.num_classes


def training_flops(cfg: ViTConfig) -> int:
    """Forward + backward FLOPs per image, the usual 3x forward (backward costs two matmuls per one)."""
    return 3 * forward_flops(cfg)
