"""The BiT ResNet that feeds the hybrid model (paper section 3.1 "Hybrid Architecture" and section
4.1 "Model Variants": "ResNet ... but replace the Batch Normalization layers with Group Normalization
and used standardized convolutions", after BiT, Kolesnikov et al. 2020).

    root:    7x7/2 StdConv -> GroupNorm -> ReLU -> 3x3/2 max-pool            (B, C, H, W) -> (B, w, H/4, W/4)
    stage s: units of  1x1 StdConv -> GN -> ReLU -> 3x3/stride StdConv -> GN -> ReLU -> 1x1 StdConv -> GN,
             added to the shortcut (a 1x1/stride StdConv + GN where the shape changes), then ReLU;
             stage s has mid width w 2^s, output 4 w 2^s, and halves the resolution (but stage 0)

The model is the one the ViT paper trained, the official google-research/vision_transformer code
(vit_jax/models_resnet.py: StdConv, ResidualUnit, ResNetStage; the root in vit_jax/models_vit.py).
It differs from BiT's own ResNet-v2 (big_transfer) in being *post*-activation: each GroupNorm
follows its conv, the sum is followed by a ReLU, the projection shortcut has its own GroupNorm
(BiT's pre-activation units put GN+ReLU before each conv and have no GN on the shortcut). Every conv
uses TensorFlow's 'SAME' padding (flax's default), which for a stride-2 conv on an even size pads one
pixel more after than before; we reproduce it exactly, so official and timm weights see the same
windows (see WS_EPS for the one numerical difference). For 28-32 px images a "light" root (3x3/1
StdConv -> GN -> ReLU, no max-pool; ours) keeps the resolution. Layouts (units per stage):

    R26  (2, 2, 2, 2)     R50  (3, 4, 6, 3)     R101 (3, 4, 23, 3)     (+ R14 (1, 1, 1, 1), ours)
    and the hybrid's "stage 4 removed, its units moved into stage 3": R50 -> (3, 4, 9), stride 16

Parameter names follow timm's ResNetV2 (stem.conv, stem.norm, stages.0.blocks.0.conv1, norm1, ...,
downsample.conv, downsample.norm), so that a hybrid's names are timm's vit_base_r50_s16_224 ones.
"""
from __future__ import annotations

import math

import numpy as np

from .. import functional as F
from .. import nn
from ..backend import get_array_module, get_default_dtype
from ..nn import init

# GroupNorm: 32 groups as BiT and the official code; epsilon 1e-6, flax nn.GroupNorm's default
# (timm's GroupNormAct uses 1e-5).
GN_GROUPS = 32
GN_EPS = 1e-6
# Weight standardization. The official code (models_resnet.py, weight_standardize) computes
# (w - mean) / (std + 1e-5); our engine's op (F.weight_standardize, BiT's formula) computes
# (w - mean) / sqrt(var + eps). No eps makes the two identical; we use the eps of timm's port of the
# official hybrid weights (StdConv2dSame(eps=1e-8) in vision_transformer_hybrid.py; our op's default
# is BiT's 1e-10). Each output channel then differs from the official code by a factor of about
# 1 + 1e-5 / std(w) (5e-4 for a LeCun-initialised 3x3x256 kernel), which the GroupNorm after every
# conv largely absorbs.
WS_EPS = 1e-8

# Units per stage of the standard depths (depth = 2 + 3 * units: root conv, 3 convs per unit, head).
LAYOUTS = {
    "r14": (1, 1, 1, 1),
    "r26": (2, 2, 2, 2),
    "r50": (3, 4, 6, 3),
    "r101": (3, 4, 23, 3),
    "r152": (3, 8, 36, 3),
}
ROOTS = ("bit", "light")  # "bit": 7x7/2 conv + 3x3/2 max-pool (ImageNet); "light": 3x3/1 conv, no pool


def without_last_stage(layout):
    """Section 4.1's hybrid variant (ii): "remove stage 4, place the same number of layers in stage 3".
    (3, 4, 6, 3) -> (3, 4, 9): a 2x smaller total stride, a 4x longer token sequence."""
    layout = tuple(layout)
    if len(layout) < 2:
        raise ValueError(f"a layout needs two stages to merge the last into the one before, got {layout}")
    return layout[:-2] + (layout[-2] + layout[-1],)


def root_width(width_factor) -> int:
    """Channels of the root: 64 times the width factor (BiT's "R50x2" is width_factor 2)."""
    return int(64 * width_factor)


def root_stride(root: str) -> int:
    return 4 if root == "bit" else 1


def total_stride(layers, root: str = "bit") -> int:
    """Downsampling of the whole ResNet: the root's, then 2 per stage after the first."""
    return root_stride(root) * 2 ** max(len(layers) - 1, 0)


def out_channels(layers, width_factor=1) -> int:
    """Channels of the last stage's output: 4 * (64 wf) * 2^(stages - 1), or the root's if none."""
    w = root_width(width_factor)
    return 4 * w * 2 ** (len(layers) - 1) if layers else w


def stage_widths(layers, width_factor=1):
    """The mid (bottleneck) width of each stage: 64 wf, 128 wf, 256 wf, ... (official ResNetStage)."""
    return [root_width(width_factor) * 2 ** s for s in range(len(layers))]


# ---------------------------------------------------------------- 'SAME' padding


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow/flax 'SAME' padding along one axis: the output has ceil(size / stride) positions,
    the total padding max((out - 1) stride + kernel - size, 0) is split with the smaller half
    before, the extra pixel after. E.g. 7x7/2 on 224: (2, 3); 3x3/2 on 112: (0, 1); 3x3/1: (1, 1)."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _pad_after(x, rows: int, cols: int, value: float):
    """(B, C, H, W) -> (B, C, H + rows, W + cols): ``rows`` rows at the bottom and ``cols`` columns at
    the right filled with ``value`` (constants, so the gradient just skips them)."""
    xp = get_array_module(x)
    if rows:
        b, c, _, w = x.shape
        x = F.concat([x, xp.full((b, c, rows, w), value, dtype=x.dtype)], axis=2)
    if cols:
        b, c, h, _ = x.shape
        x = F.concat([x, xp.full((b, c, h, cols), value, dtype=x.dtype)], axis=3)
    return x


def conv2d_same(x, w, stride: int = 1):
    """F.conv2d with 'SAME' padding: x (B, C_in, H, W), w (C_out, C_in, kh, kw) -> (B, C_out, ceil(H/s), ceil(W/s)).
    The symmetric part of the padding goes to conv2d, the extra pixel after (if any) is appended."""
    (top, bottom), (left, right) = (same_padding(x.shape[2], w.shape[2], stride),
                                    same_padding(x.shape[3], w.shape[3], stride))
    x = _pad_after(x, bottom - top, right - left, 0.0)
    return F.conv2d(x, w, None, stride=stride, padding=(top, left))


def max_pool2d_same(x, kernel: int = 3, stride: int = 2):
    """Max pooling with 'SAME' padding by -inf (flax nn.max_pool(..., padding='SAME'), as the
    official root): (B, C, H, W) -> (B, C, ceil(H/s), ceil(W/s))."""
    (top, bottom), (left, right) = same_padding(x.shape[2], kernel, stride), same_padding(x.shape[3], kernel, stride)
    x = _pad_after(x, bottom - top, right - left, -np.inf)
    return F.max_pool2d(x, kernel, stride, padding=(top, left))


# ---------------------------------------------------------------- layers


class StdConv2d(nn.Module):
    """Weight-standardized convolution (Qiao et al. 2019; BiT's StdConv, official models_resnet.StdConv):
    each output channel's kernel is standardised to zero mean and unit variance before the conv.

    x: (B, in, H, W)  weight: (out, in, k, k)  ->  (B, out, ceil(H/stride), ceil(W/stride)), 'SAME'
    padding as flax's nn.Conv. No bias (a GroupNorm follows every one). The weight starts LeCun-normal,
    flax's default (its scale does not matter: standardization removes it)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, eps: float = WS_EPS):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.eps = kernel_size, stride, eps
        self.weight = nn.Parameter(np.zeros((out_channels, in_channels, kernel_size, kernel_size),
                                            dtype=get_default_dtype()))
        init.lecun_normal_(self.weight)

    def forward(self, x):
        shape = tuple(x.shape)
        if len(shape) != 4 or shape[1] != self.in_channels:
            raise ValueError(f"StdConv2d expects (B, {self.in_channels}, H, W), got {shape}")
        return conv2d_same(x, F.weight_standardize(self.weight, eps=self.eps), self.stride)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, eps={self.eps}")


def group_norm(channels: int, groups: int = GN_GROUPS):
    """nn.GroupNorm with the official code's epsilon; raises naming both numbers if they do not fit."""
    if channels % groups:
        raise ValueError(f"GroupNorm: {channels} channels cannot form {groups} groups "
                         "(change the width factor or the number of groups)")
    return nn.GroupNorm(groups, channels, eps=GN_EPS)


class Downsample(nn.Module):
    """The projection shortcut (official ResidualUnit's conv_proj + gn_proj; timm's DownsampleConv):
    1x1 StdConv with the unit's stride, then GroupNorm. (B, in, H, W) -> (B, out, H/s, W/s)."""

    def __init__(self, in_channels, out_channels, stride, groups=GN_GROUPS):
        super().__init__()
        self.conv = StdConv2d(in_channels, out_channels, 1, stride)
        self.norm = group_norm(out_channels, groups)

    def forward(self, x):
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """The post-activation bottleneck unit of the official hybrid (models_resnet.ResidualUnit):

        y = ReLU(shortcut(x) + GN3(conv3(ReLU(GN2(conv2(ReLU(GN1(conv1(x)))))))))

    conv1 1x1 in -> mid, conv2 3x3 mid -> mid with the stride (on the 3x3, as BiT), conv3 1x1
    mid -> 4 mid. The shortcut is x itself, or a projection (Downsample) when the channels or the
    resolution change. GN3's scale starts at zero (official scale_init=zeros), so every unit starts
    as ReLU(shortcut(x)): the deep net starts shallow.
    x: (B, in, H, W) -> (B, 4 mid, ceil(H/stride), ceil(W/stride))."""

    def __init__(self, in_channels: int, mid_channels: int, stride: int = 1, groups: int = GN_GROUPS):
        super().__init__()
        out = 4 * mid_channels
        # Official: needs_projection = x.shape[-1] != features * 4 or strides != (1, 1)
        self.downsample = Downsample(in_channels, out, stride, groups) if in_channels != out or stride != 1 else None
        self.conv1 = StdConv2d(in_channels, mid_channels, 1)
        self.norm1 = group_norm(mid_channels, groups)
        self.conv2 = StdConv2d(mid_channels, mid_channels, 3, stride)
        self.norm2 = group_norm(mid_channels, groups)
        self.conv3 = StdConv2d(mid_channels, out, 1)
        self.norm3 = group_norm(out, groups)
        init.zeros_(self.norm3.weight)                                  # official gn3 scale_init=zeros

    def forward(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.norm1(self.conv1(x)))                           # (B, mid, H, W)
        y = F.relu(self.norm2(self.conv2(y)))                           # (B, mid, H/s, W/s)
        y = self.norm3(self.conv3(y))                                   # (B, 4 mid, H/s, W/s)
        return F.relu(shortcut + y)


class Stage(nn.Module):
    """``units`` bottleneck units of mid width ``mid_channels``; the first has the stride (official
    ResNetStage: unit1 strided, the rest stride 1). Parameters: blocks.0..., as timm's ResNetStage."""

    def __init__(self, in_channels: int, mid_channels: int, units: int, stride: int, groups: int = GN_GROUPS):
        super().__init__()
        self.blocks = nn.ModuleList([Bottleneck(in_channels if i == 0 else 4 * mid_channels, mid_channels,
                                                stride if i == 0 else 1, groups) for i in range(units)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Root(nn.Module):
    """The root ("stem") block. "bit" (official conv_root/gn_root, vit_jax/models_vit.py):
    7x7/2 StdConv -> GN -> ReLU -> 3x3/2 max-pool, (B, C, H, W) -> (B, w, H/4, W/4).
    "light" (ours, for 28-32 px images): 3x3/1 StdConv -> GN -> ReLU, (B, C, H, W) -> (B, w, H, W)."""

    def __init__(self, in_channels: int, width: int, kind: str = "bit", groups: int = GN_GROUPS):
        super().__init__()
        if kind not in ROOTS:
            raise ValueError(f"root must be one of {ROOTS}, got {kind!r}")
        self.kind = kind
        self.conv = StdConv2d(in_channels, width, 7 if kind == "bit" else 3, 2 if kind == "bit" else 1)
        self.norm = group_norm(width, groups)

    def forward(self, x):
        x = F.relu(self.norm(self.conv(x)))
        return max_pool2d_same(x, 3, 2) if self.kind == "bit" else x

    def extra_repr(self):
        return f"kind={self.kind!r}"


class ResNet(nn.Module):
    """The BiT-style ResNet backbone of the hybrid (no pooling, no head): images -> feature map.

    images (B, C, H, W) -> features (B, out_channels, H / stride, W / stride), where
    out_channels = 4 * 64 wf * 2^(S-1) and stride = 4 * 2^(S-1) for the "bit" root and S stages.
    layers: units per stage, e.g. (3, 4, 9) for the paper's R50 hybrid (16x16 px per token),
    (3, 4, 6, 3) for the full R50 (32x32), () for the root alone. Official code: the ResNet part
    of vit_jax/models_vit.VisionTransformer (stage s has mid width 64 wf 2^s, first stride 1 then 2)."""

    def __init__(self, layers=(3, 4, 9), width_factor=1, in_channels: int = 3, root: str = "bit",
                 groups: int = GN_GROUPS):
        super().__init__()
        self.layers, self.width_factor, self.in_channels = tuple(layers), width_factor, in_channels
        self.stem = Root(in_channels, root_width(width_factor), root, groups)
        stages, channels = [], root_width(width_factor)
        for s, (units, mid) in enumerate(zip(self.layers, stage_widths(self.layers, width_factor))):
            stages.append(Stage(channels, mid, units, 1 if s == 0 else 2, groups))
            channels = 4 * mid
        self.stages = nn.ModuleList(stages)
        self.out_channels = channels
        self.stride = total_stride(self.layers, root)

    def forward(self, images):
        shape = tuple(images.shape)
        if len(shape) != 4 or shape[1] != self.in_channels:
            raise ValueError(f"ResNet expects images of shape (B, {self.in_channels}, H, W), got {shape}")
        x = self.stem(images)
        for stage in self.stages:
            x = stage(x)
        return x

    def extra_repr(self):
        return f"layers={self.layers}, width_factor={self.width_factor}, stride={self.stride}"


# ---------------------------------------------------------------- sizes from the layout alone


def _conv_count(c_in, c_out, k):
    return c_in * c_out * k * k


def count_parameters(layers, width_factor=1, in_channels=3, root="bit") -> int:
    """Parameters of ResNet(layers, width_factor, in_channels, root), from the numbers alone."""
    w = root_width(width_factor)
    total = _conv_count(in_channels, w, 7 if root == "bit" else 3) + 2 * w     # root conv + GN
    channels = w
    for s, (units, mid) in enumerate(zip(layers, stage_widths(layers, width_factor))):
        for i in range(units):
            c_in = channels if i == 0 else 4 * mid
            total += _conv_count(c_in, mid, 1) + _conv_count(mid, mid, 3) + _conv_count(mid, 4 * mid, 1)
            total += 2 * (mid + mid + 4 * mid)                                    # three GroupNorms
            if c_in != 4 * mid or (i == 0 and s > 0):
                total += _conv_count(c_in, 4 * mid, 1) + 2 * 4 * mid              # projection + GN
        channels = 4 * mid
    return total


def forward_flops(layers, width_factor=1, in_channels=3, root="bit", image_size=224) -> int:
    """Multiply-add FLOPs (2 per MAC) of the convolutions for one image (norms, ReLUs, pooling ignored)."""
    w = root_width(width_factor)
    k, s = (7, 2) if root == "bit" else (3, 1)
    size = math.ceil(image_size / s)
    flops = 2 * size * size * _conv_count(in_channels, w, k)
    size = math.ceil(size / 2) if root == "bit" else size                        # the max-pool
    channels = w
    for st, (units, mid) in enumerate(zip(layers, stage_widths(layers, width_factor))):
        for i in range(units):
            stride = 2 if (i == 0 and st > 0) else 1
            c_in = channels if i == 0 else 4 * mid
            out = math.ceil(size / stride)
            flops += 2 * size * size * _conv_count(c_in, mid, 1)
            flops += 2 * out * out * (_conv_count(mid, mid, 3) + _conv_count(mid, 4 * mid, 1))
            if c_in != 4 * mid or stride != 1:
                flops += 2 * out * out * _conv_count(c_in, 4 * mid, 1)
            size = out
        channels = 4 * mid
    return flops
