"""Named models: the paper's Table 1 (and ViT-Ti/S of DeiT), small presets for 32x32 and 28x28
images, and the hybrids of section 3.1 ("r50+vit-b/16": a ResNet's feature map as tokens), with
parameter counts and FLOPs computed from the config alone (no arrays allocated)."""
from __future__ import annotations

import re
from dataclasses import replace

from . import resnet
from .hybrid import HybridConfig, HybridViT
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

VIT_NAMES = ["vit-ti/16", "vit-s/16", "vit-b/16", "vit-b/32", "vit-l/16", "vit-l/32", "vit-h/14",
             "vit-cifar/4", "vit-cifar/2", "vit-mnist/4", "vit-mnist/2"]
HYBRID_NAMES = ["r50+vit-b/16", "r50+vit-b/32", "r50+vit-l/16", "r50+vit-l/32", "r26+vit-s/32", "r26+vit-b/32",
                "r14+vit-cifar/4", "r14+vit-mnist/4"]

_NAME = re.compile(r"^vit-(ti|s|b|l|h|cifar|mnist)/(\d+)$")
_HYBRID_NAME = re.compile(r"^(r\d+)(?:x(\d+))?\+vit-(ti|s|b|l|h|cifar|mnist)/(\d+)$")

# The small presets' ResNet: narrow (root 16 channels, stage widths 16, 32, 64 -> 256 features),
# GroupNorm groups of 2 channels at the root as BiT's (64 channels / 32 groups), and a light root.
SMALL_RESNET = dict(resnet_width_factor=0.25, resnet_groups=8, resnet_root="light")


def config_for(name: str, **overrides) -> ViTConfig:
    """The ViTConfig of a named variant, e.g. "vit-b/16", "vit-l/32", "vit-cifar/4", "vit-mnist/2";
    for a hybrid ("r50+vit-b/16") its HybridConfig. Keyword arguments override config fields."""
    if "+" in name:
        return hybrid_config_for(name, **overrides)
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


def hybrid_config_for(name: str, **overrides) -> HybridConfig:
    """The HybridConfig of a named hybrid, e.g. "r50+vit-b/16", "r26+vit-s/32", "r14+vit-cifar/4".

    The number after the slash is the pixels per token side: with the R50, /32 keeps the full
    (3, 4, 6, 3) ResNet (stride 32), /16 removes stage 4 and moves its units into stage 3, (3, 4, 9)
    (section 4.1, option (ii)); larger multiples add a patch size P > 1 on the feature map."""
    m = _HYBRID_NAME.match(name.lower())
    if not m:
        raise ValueError(f"unknown hybrid model {name!r}; known: {', '.join(HYBRID_NAMES)} "
                         f"(ResNets: {', '.join(resnet.LAYOUTS)}; 'r50x2+...' doubles the width)")
    depth, width, size, pixels = m.group(1), m.group(2), m.group(3), int(m.group(4))
    if depth not in resnet.LAYOUTS:
        raise ValueError(f"unknown ResNet {depth!r} in {name!r}; known: {', '.join(resnet.LAYOUTS)}")
    if size in VIT_SIZES:
        dim, vit_depth, heads, mlp = VIT_SIZES[size]
        base = dict(image_size=224, dim=dim, depth=vit_depth, num_heads=heads, mlp_dim=mlp, resnet_root="bit")
    else:
        base = {**SMALL[size], **SMALL_RESNET}
    base["resnet_width_factor"] = base.get("resnet_width_factor", 1) * (int(width) if width else 1)
    full = resnet.LAYOUTS[depth]
    stride = resnet.total_stride(full, base["resnet_root"])
    if pixels % stride == 0:                                   # (i) the output of stage 4
        layout, patch = full, pixels // stride
    elif pixels % (stride // 2) == 0:                          # (ii) stage 4 folded into stage 3
        layout, patch = resnet.without_last_stage(full), pixels // (stride // 2)
    else:
        raise ValueError(f"{name!r}: {depth.upper()}'s feature map has {stride // 2} (stage 4 moved into stage 3) "
                         f"or {stride} pixels per position; the number after the slash must be a multiple of "
                         f"{stride // 2}")
    cfg = HybridConfig(patch_size=patch, resnet_layers=layout, **base)
    return replace(cfg, **overrides)


def known_names() -> list:
    return VIT_NAMES + HYBRID_NAMES


def create(name: str, **overrides) -> ViT:
    """Build a named model (a ViT, or a HybridViT for a hybrid's name); keyword arguments override
    config fields (num_classes=10, ...)."""
    cfg = config_for(name, **overrides)
    return HybridViT(cfg) if isinstance(cfg, HybridConfig) else ViT(cfg)


def count_parameters(cfg: ViTConfig) -> int:
    """Number of parameters of the model cfg builds (cfg.count_parameters())."""
    return cfg.count_parameters()


def forward_flops(cfg: ViTConfig) -> int:
    """Multiply-add FLOPs of one image's forward pass (cfg.forward_flops())."""
    return cfg.forward_flops()


def training_flops(cfg: ViTConfig) -> int:
    """Forward + backward FLOPs per image, the usual 3x forward (backward costs two matmuls per one)."""
    return 3 * forward_flops(cfg)
