"""The hybrid architecture of section 3.1: a ResNet's feature map, not raw image patches, as the
token sequence of a Vision Transformer.

    "As an alternative to raw image patches, the input sequence can be formed from feature maps of a
    CNN. In this hybrid model, the patch embedding projection E (Eq. 1) is applied to patches
    extracted from a CNN feature map. As a special case, the patches can have spatial size 1x1."

    images (B, C, H, W) --ResNet--> (B, C', H/s, W/s) --P x P patches, E--> (B, N, D),  N = (H / (s P))^2
    then the class token, E_pos and the encoder exactly as ViT (Eq. 1-4).

HybridViT subclasses ViT and only replaces the patch embedding (``make_patch_embed``); the grid of
the position embeddings is image_size / (s P) (``HybridConfig.grid_size``). The backbone is the
official code's (vit_jax/models_vit.py + models_resnet.py), see tinyvit/models/resnet.py.

Named like the paper (section 4.1, Table 6): "r50+vit-b/16" is R50 with stage 4 removed and its units
moved into stage 3, (3, 4, 9), so 16x16 pixels per token (14x14 tokens at 224 px); "r50+vit-b/32"
keeps the full (3, 4, 6, 3) R50 (7x7 tokens); "r26+vit-s/32" is R26 (2, 2, 2, 2). The number after
the slash is the pixels per token side, s * P; "r50x2+..." doubles the ResNet's width. Small presets
for 32x32 and 28x28 images use a light root (3x3/1 conv, no max-pool) and narrow R14 units:
"r14+vit-cifar/4", "r14+vit-mnist/4" (8x8 and 7x7 tokens).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields

from .. import functional as F
from .. import nn
from . import resnet
from .vit import ViT, ViTConfig


def _as_layout(value):
    """(3, 4, 9), [3, 4, 9] (from JSON) or "3,4,9" (from --model-arg) -> (3, 4, 9); None if it is not
    a tuple of positive unit counts."""
    if isinstance(value, str):
        text = value.strip("()[] ")
        try:
            value = [int(v) for v in text.split(",")] if text else []
        except ValueError:
            return None
    if not isinstance(value, (tuple, list)):
        return None
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1 for v in value):
        return None
    return tuple(int(v) for v in value)


@dataclass
class HybridConfig(ViTConfig):
    """A ViTConfig (the Transformer, unchanged) plus the ResNet that makes the tokens.
    Defaults: R50+ViT-B/16 at 224 px, (3, 4, 9) units, 1x1 patches, 14x14 tokens, 1000 classes.

    patch_size is P on the *feature map* (the official hybrid configs' patches.size = (1, 1));
    the pixels per token side are ``effective_patch_size`` = resnet stride * P."""
    patch_size: int = 1
    resnet_layers: tuple = (3, 4, 9)      # units per stage; () is the root alone
    resnet_width_factor: float = 1        # root width 64 * factor (BiT's R50x2: 2)
    resnet_root: str = "bit"              # "bit": 7x7/2 conv + max-pool (stride 4); "light": 3x3/1 conv
    resnet_groups: int = resnet.GN_GROUPS  # GroupNorm groups (32 as BiT; the narrow presets use fewer)

    def __post_init__(self):
        layout = _as_layout(self.resnet_layers)
        problems = []
        if layout is None:
            problems.append(f"resnet_layers must be positive unit counts per stage such as (3, 4, 9), "
                            f"got {self.resnet_layers!r}")
        else:
            self.resnet_layers = layout
        if self.resnet_root not in resnet.ROOTS:
            problems.append(f"resnet_root must be one of {resnet.ROOTS}, got {self.resnet_root!r}")
        if not (isinstance(self.resnet_width_factor, (int, float)) and self.resnet_width_factor > 0
                and resnet.root_width(self.resnet_width_factor) >= 1):
            problems.append(f"resnet_width_factor must be positive (64 * factor >= 1 channel), "
                            f"got {self.resnet_width_factor!r}")
        elif not isinstance(self.resnet_groups, int) or isinstance(self.resnet_groups, bool) or self.resnet_groups < 1:
            problems.append(f"resnet_groups must be a positive integer, got {self.resnet_groups!r}")
        elif layout is not None:
            wf = self.resnet_width_factor
            widths = [resnet.root_width(wf)] + resnet.stage_widths(layout, wf)
            bad = [w for w in widths if w % self.resnet_groups]
            if bad:
                problems.append(f"the ResNet widths {widths} (width factor {self.resnet_width_factor}) are not all "
                                f"divisible by resnet_groups={self.resnet_groups}")
        sizes = self.size_problems()
        if sizes:                                       # the check below divides by patch_size
            raise ValueError("invalid HybridConfig: " + "; ".join(sizes))
        if not problems and self.image_size % self.effective_patch_size:
            problems.append(f"image_size {self.image_size} is not divisible by the pixels per token "
                            f"{self.effective_patch_size} (ResNet stride {self.resnet_stride} x patch_size "
                            f"{self.patch_size} on the feature map)")
        try:
            super().__post_init__()
        except ValueError as exc:
            problems.insert(0, str(exc).replace("invalid ViTConfig: ", ""))
        if problems:
            raise ValueError("invalid HybridConfig: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, d: dict) -> "HybridConfig":
        """From ``dataclasses.asdict`` (or its JSON, where resnet_layers became a list)."""
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown HybridConfig fields: {sorted(unknown)}")
        return cls(**d)

    # ----- sizes (no arrays needed)
    @property
    def resnet_stride(self) -> int:
        """s: the ResNet's total downsampling (16 for (3, 4, 9) with the "bit" root, 32 for (3, 4, 6, 3))."""
        return resnet.total_stride(self.resnet_layers, self.resnet_root)

    @property
    def effective_patch_size(self) -> int:
        """Pixels per token side, s * P: the "/16" of "R50+ViT-B/16"."""
        return self.resnet_stride * self.patch_size

    @property
    def feature_size(self) -> int:
        """Side of the ResNet feature map, image_size / s."""
        return self.image_size // self.resnet_stride

    @property
    def feature_channels(self) -> int:
        """C', the channels of the feature map the patch embedding E sees (1024 for (3, 4, 9))."""
        return resnet.out_channels(self.resnet_layers, self.resnet_width_factor)

    @property
    def grid_size(self) -> int:
        """Tokens per side, image_size / (s P); ViT sizes its position embeddings from it."""
        return self.image_size // self.effective_patch_size

    def transformer_config(self) -> ViTConfig:
        """The plain ViT that runs on the feature map: image_size = H/s, in_channels = C', same P."""
        vit = {f.name: getattr(self, f.name) for f in fields(ViTConfig)}
        return ViTConfig(**{**vit, "image_size": self.feature_size, "in_channels": self.feature_channels})

    def count_parameters(self) -> int:
        """The ResNet's parameters plus those of the ViT on its feature map."""
        return (resnet.count_parameters(self.resnet_layers, self.resnet_width_factor, self.in_channels,
                                        self.resnet_root) + self.transformer_config().count_parameters())

    def forward_flops(self) -> int:
        """Multiply-add FLOPs of one image: the ResNet's convolutions plus the ViT on the feature map."""
        return (resnet.forward_flops(self.resnet_layers, self.resnet_width_factor, self.in_channels,
                                     self.resnet_root, self.image_size)
                + self.transformer_config().forward_flops())


class HybridEmbed(nn.Module):
    """Eq. 1's x_p E on a CNN feature map (section 3.1): images -> ResNet -> P x P patches -> D.

    images (B, C, H, W) -> backbone -> (B, C', H/s, W/s) -> tokens (B, N, D), N = (H / (s P))^2.
    proj.weight is E: (C' P P, D), patches in (C', P, P) order as ViT's; with P = 1 it is a 1x1 conv.
    Names as timm's HybridEmbed: backbone.*, proj.weight, proj.bias."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.in_channels, self.patch_size, self.pixels = cfg.in_channels, cfg.patch_size, cfg.effective_patch_size
        self.backbone = resnet.ResNet(cfg.resnet_layers, cfg.resnet_width_factor, cfg.in_channels,
                                      cfg.resnet_root, cfg.resnet_groups)
        self.proj = nn.Linear(cfg.feature_channels * cfg.patch_size ** 2, cfg.dim)
        # Official: the 'embedding' flax Conv with its default LeCun-normal kernel, zero bias.
        nn.init.lecun_normal_(self.proj.weight)

    def forward(self, images):
        shape = tuple(images.shape)
        if len(shape) != 4 or shape[1] != self.in_channels or shape[2] % self.pixels or shape[3] % self.pixels:
            raise ValueError(f"expected images of shape (B, {self.in_channels}, H, W) with H and W multiples of "
                             f"{self.pixels} (ResNet stride x patch size), got {shape}")
        features = self.backbone(images)                                  # (B, C', H/s, W/s)
        return F.patch_embed(features, self.proj.weight, self.proj.bias, self.patch_size)   # (B, N, D)


class HybridViT(ViT):
    """R+ViT: ViT whose patch embedding runs on a ResNet's feature map. images (B, C, H, W) -> logits.
    Everything after the patch embedding (class token, E_pos, encoder, head) is ViT's own code."""
    arch = "hybrid"
    config_class = HybridConfig

    @staticmethod
    def make_patch_embed(cfg):
        return HybridEmbed(cfg)
