"""An independent R+ViT hybrid in plain PyTorch, the reference for tinyvit's hybrid parity tests.

Written from the official google-research/vision_transformer code (vit_jax/models_resnet.py:
StdConv, ResidualUnit, ResNetStage; the root in vit_jax/models_vit.py) and timm's port
(resnetv2.py Bottleneck/DownsampleConv with StdConv2dSame, vision_transformer_hybrid.py HybridEmbed),
NOT by translating tinyvit: torch's own conv2d, group_norm, max_pool2d and F.pad do the work.

    root: 7x7/2 StdConv -> GN -> ReLU -> 3x3/2 max-pool ('SAME', -inf padding)   ("bit")
          3x3/1 StdConv -> GN -> ReLU                                             ("light")
    unit: relu(shortcut(x) + GN(conv1x1(relu(GN(conv3x3/s(relu(GN(conv1x1(x)))))))))
    then a P x P conv (the projection E) on the feature map, and tinyvit.bench.torch_vit.TorchViT's Transformer.

Weight standardization: (w - mean) / sqrt(var + eps) per output channel (timm's StdConv2dSame),
every conv padded TensorFlow-'SAME' (the extra pixel after). GroupNorm eps 1e-6 (flax's default).
Takes tinyvit's HybridConfig field names (``TorchHybrid(**dataclasses.asdict(cfg))``).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from tinyvit.bench.torch_vit import TorchViT


def pad_same(x, kernel, stride, value=0.0):
    """TensorFlow 'SAME' padding of an NCHW tensor for a kernel x kernel window with ``stride``."""
    pads = []
    for size in (x.shape[-1], x.shape[-2]):                         # F.pad wants (left, right, top, bottom)
        out = math.ceil(size / stride)
        total = max((out - 1) * stride + kernel - size, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads, value=value)


class StdConv2dSame(nn.Conv2d):
    def __init__(self, cin, cout, kernel, stride=1, eps=1e-8):
        super().__init__(cin, cout, kernel, stride=stride, bias=False)
        self.eps = eps

    def forward(self, x):
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), unbiased=False, keepdim=True)
        w = (w - mean) / torch.sqrt(var + self.eps)
        return F.conv2d(pad_same(x, self.kernel_size[0], self.stride[0]), w, stride=self.stride)


def gn(channels, groups):
    return nn.GroupNorm(groups, channels, eps=1e-6)


class Downsample(nn.Module):
    def __init__(self, cin, cout, stride, groups):
        super().__init__()
        self.conv = StdConv2dSame(cin, cout, 1, stride)
        self.norm = gn(cout, groups)

    def forward(self, x):
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, stride, groups):
        super().__init__()
        cout = 4 * mid
        self.downsample = Downsample(cin, cout, stride, groups) if (cin != cout or stride != 1) else None
        self.conv1, self.norm1 = StdConv2dSame(cin, mid, 1), gn(mid, groups)
        self.conv2, self.norm2 = StdConv2dSame(mid, mid, 3, stride), gn(mid, groups)
        self.conv3, self.norm3 = StdConv2dSame(mid, cout, 1), gn(cout, groups)

    def forward(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        return F.relu(shortcut + self.norm3(self.conv3(y)))


class Stage(nn.Module):
    def __init__(self, cin, mid, units, stride, groups):
        super().__init__()
        self.blocks = nn.Sequential(*[Bottleneck(cin if i == 0 else 4 * mid, mid, stride if i == 0 else 1, groups)
                                      for i in range(units)])

    def forward(self, x):
        return self.blocks(x)


class TorchResNet(nn.Module):
    """timm-named (stem.conv, stem.norm, stages.i.blocks.j...) post-activation ResNet, no head."""

    def __init__(self, layers, width_factor, in_channels, root, groups):
        super().__init__()
        width = int(64 * width_factor)
        self.root = root
        self.stem = nn.Module()
        self.stem.conv = StdConv2dSame(in_channels, width, 7 if root == "bit" else 3, 2 if root == "bit" else 1)
        self.stem.norm = gn(width, groups)
        stages, cin = [], width
        for s, units in enumerate(layers):
            mid = width * 2 ** s
            stages.append(Stage(cin, mid, units, 1 if s == 0 else 2, groups))
            cin = 4 * mid
        self.stages = nn.Sequential(*stages)
        self.out_channels = cin
        self.stride = (4 if root == "bit" else 1) * 2 ** max(len(layers) - 1, 0)

    def forward(self, x):
        x = F.relu(self.stem.norm(self.stem.conv(x)))
        if self.root == "bit":
            x = F.max_pool2d(pad_same(x, 3, 2, value=float("-inf")), 3, 2)
        return self.stages(x)


class TorchHybrid(TorchViT):
    """ResNet features -> TorchViT (whose patch_embed.proj is the P x P projection on the feature map)."""

    def __init__(self, resnet_layers=(3, 4, 9), resnet_width_factor=1, resnet_root="bit", resnet_groups=32,
                 image_size=224, in_channels=3, patch_size=1, **vit):
        backbone = TorchResNet(resnet_layers, resnet_width_factor, in_channels, resnet_root, resnet_groups)
        super().__init__(image_size=image_size // backbone.stride, patch_size=patch_size,
                         in_channels=backbone.out_channels, **vit)
        self.patch_embed.backbone = backbone

    def forward(self, x, return_attention=False):
        return super().forward(self.patch_embed.backbone(x), return_attention=return_attention)
