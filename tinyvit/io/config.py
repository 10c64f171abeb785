"""The config a checkpoint implies: ViTConfig / HybridConfig fields read from the weights' shapes.

    config_from_state_dict(state, patch_size, in_channels)    our names and layouts
    hybrid_config_from_state_dict(state)                      a hybrid (ResNet + ViT) in our names
    config_from_timm_state_dict(sd), config_from_official_npz(path)   foreign weights
    state_shapes(config)                     the other way: the (name, shape) of every array a config implies

What the weights do not store (num_heads, the GELU flavour, ...) comes from ``overrides``, or from
the standard widths and each source's conventions.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from .foreign import _is_square
from .official import from_official_npz, read_official_npz
from .timm import _hybrid_embed_channels, from_timm_state_dict


def _default_heads(dim: int) -> int:
    """Heads of the standard widths (Table 1 of the paper, DeiT's Ti/S); any other width is refused
    rather than guessed (weights do not store the head count, and a wrong one loads without error)."""
    from ..models.variants import VIT_SIZES
    known = {d: h for d, _, h, _ in VIT_SIZES.values()}
    if dim in known:
        return known[dim]
    raise ValueError(f"the number of heads of a width-{dim} model is not stored in its weights, and {dim} is no "
                     f"standard width ({', '.join(map(str, sorted(known)))}): pass num_heads=")


def config_from_state_dict(state: Mapping, patch_size: int, in_channels: int, **overrides):
    """The ViTConfig a state dict in OUR names and layouts implies; ``overrides`` win.

    dim, depth, mlp_dim, num_classes (0 without a head), representation_size, qkv_bias, pool
    ("token" with a class token, else "gap"), posemb and image_size (patch grid * patch size) are
    read from the shapes; num_heads is not in the weights (pass it, or a standard width's is used)."""
    from ..models.vit import ViTConfig
    dim = state["patch_embed.proj.bias"].shape[0] if "patch_embed.proj.bias" in state \
        else state["patch_embed.proj.weight"].shape[1]
    blocks = {int(m.group(1)) for m in (re.match(r"blocks\.(\d+)\.", k) for k in state) if m}
    cfg = dict(patch_size=patch_size, in_channels=in_channels, dim=dim, depth=len(blocks),
               pool="token" if "cls_token" in state else "gap",
               representation_size=state["pre_logits.fc.weight"].shape[1] if "pre_logits.fc.weight" in state else None,
               num_classes=state["head.weight"].shape[1] if "head.weight" in state else 0,
               qkv_bias="blocks.0.attn.qkv.bias" in state)
    if blocks:
        cfg["mlp_dim"] = state["blocks.0.mlp.fc1.weight"].shape[1]
    if "pos_embed" in state:
        cfg["posemb"] = "learned-1d"
        grid = state["pos_embed"].shape[1] - (1 if cfg["pool"] == "token" else 0)
    elif "pos_embed_row" in state:
        cfg["posemb"] = "learned-2d"
        gh, gw = state["pos_embed_row"].shape[0], state["pos_embed_col"].shape[0]
        grid = gh * gw if gh == gw else -1
    elif "blocks.0.attn.rel_pos" in state:                            # (2T - 1, D): T tokens
        cfg["posemb"] = "relative"
        grid = (state["blocks.0.attn.rel_pos"].shape[0] + 1) // 2 - (1 if cfg["pool"] == "token" else 0)
    else:
        cfg["posemb"], grid = "none", None
    if grid is not None and "image_size" not in overrides:
        if not _is_square(grid):
            raise ValueError(f"the position embeddings cover {grid} patches, not a square grid; pass image_size=")
        cfg["image_size"] = int(round(grid ** 0.5)) * patch_size
    cfg.update(overrides)
    if "num_heads" not in cfg:
        cfg["num_heads"] = _default_heads(cfg["dim"])
    return ViTConfig(**cfg)


def hybrid_config_from_state_dict(state: Mapping, **overrides):
    """The HybridConfig a hybrid's state dict in OUR names and layouts implies; ``overrides`` win.

    From the backbone's shapes: units per stage, width factor (root channels / 64), root ("bit" for
    a 7x7 root conv, else "light") and image channels; the patch size P from E's rows / C'^2; the
    Transformer's fields as config_from_state_dict on the feature map, whose grid times the ResNet
    stride times P is image_size. resnet_groups is not in the weights (default 32: pass it)."""
    from ..models import resnet
    from ..models.hybrid import HybridConfig
    from ..models.vit import ViTConfig
    prefix = "patch_embed.backbone."
    root = state[prefix + "stem.conv.weight"]                           # (64 wf, C, k, k)
    units = {}
    for name in state:
        m = re.match(r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.", name)
        if m:
            units[int(m.group(1))] = max(units.get(int(m.group(1)), 0), int(m.group(2)) + 1)
    layers = tuple(units[s] for s in sorted(units))
    kind = "bit" if root.shape[2] == 7 else "light"
    width_factor = root.shape[0] / 64
    width_factor = int(width_factor) if width_factor.is_integer() else width_factor
    channels = _hybrid_embed_channels(state)
    rows = state["patch_embed.proj.weight"].shape[0]
    patch = int(round((rows / channels) ** 0.5))
    if channels * patch * patch != rows:
        raise ValueError(f"the hybrid's patch embedding has {rows} rows, not C' * P * P for its {channels} "
                         "feature channels")
    own = {"image_size", "in_channels", "patch_size"}
    vit_names = {f.name for f in dataclasses.fields(ViTConfig)} - own
    vit = config_from_state_dict({k: v for k, v in state.items() if not k.startswith(prefix)}, patch, channels,
                                 **{k: v for k, v in overrides.items() if k in vit_names})
    cfg = dict(dataclasses.asdict(vit), patch_size=patch, in_channels=int(root.shape[1]), resnet_layers=layers,
               resnet_width_factor=width_factor, resnet_root=kind)
    if vit.posemb in ("learned-1d", "learned-2d", "relative"):          # the grid is in the weights
        cfg["image_size"] = vit.image_size * resnet.total_stride(layers, kind)
    else:
        cfg["image_size"] = HybridConfig.image_size
    cfg.update(overrides)
    try:
        return HybridConfig(**cfg)
    except ValueError as exc:
        if "resnet_groups" in str(exc) and "resnet_groups" not in overrides:
            raise ValueError(f"{exc} (the GroupNorm groups are not stored in the weights: "
                             "pass resnet_groups=)") from exc
        raise


def _is_hybrid(state: Mapping) -> bool:
    return any(k.startswith("patch_embed.backbone.") for k in state)


def config_from_timm_state_dict(sd: Mapping, **overrides):
    """The ViTConfig of a timm ViT state dict (torch layouts), or the HybridConfig of a timm hybrid
    (vit_base_r50_s16_224, ...). timm uses exact GELU and LayerNorm eps 1e-6. Pass num_heads= for
    widths other than the standard ones, and pool= unless told by a timm name (neither is stored:
    timm.timm_unstored_fields)."""
    from .timm import timm_unstored_fields
    overrides.update(timm_unstored_fields(sd, None, overrides.get("num_heads"), overrides.get("pool")))
    if _is_hybrid(sd):
        overrides.setdefault("gelu_approximate", "none")
        return hybrid_config_from_state_dict(from_timm_state_dict(sd, strict=None), **overrides)
    kernel = sd["patch_embed.proj.weight"]                      # (D, C, P, P)
    _, c, ph, pw = tuple(kernel.shape)
    if ph != pw:
        raise ValueError(f"non-square patches {ph}x{pw} are not supported")
    overrides.setdefault("gelu_approximate", "none")
    return config_from_state_dict(from_timm_state_dict(sd, strict=None), ph, c, **overrides)


def config_from_official_npz(arrays, **overrides):
    """The ViTConfig of an official checkpoint (path or {name: array}): dim, depth, heads (from the
    (D, H, dh) query kernel), mlp_dim, patch size and channels (from the HWIO embedding kernel),
    num_classes, representation_size, pool ("token" if 'cls' is there, else "gap") and image_size
    (from the position-embedding length). The official MlpBlock uses flax's nn.gelu, whose default
    is the tanh approximation, so gelu_approximate="tanh"."""
    arrays = read_official_npz(arrays)
    ph, pw, c, _ = arrays["embedding/kernel"].shape
    if ph != pw:
        raise ValueError(f"non-square patches {ph}x{pw} are not supported")
    query = arrays.get("Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel")
    if query is not None:
        overrides.setdefault("num_heads", query.shape[1])
    overrides.setdefault("gelu_approximate", "tanh")
    if "conv_root/kernel" in arrays:                          # a hybrid (R50+ViT-B/16, ...)
        return hybrid_config_from_state_dict(from_official_npz(arrays, strict=None), **overrides)
    return config_from_state_dict(from_official_npz(arrays, strict=None), ph, c, **overrides)


# ---------------------------------------------------------------- config -> shapes, no arrays


def state_shapes(config):
    """Yield (name, shape) for every array in the state dict of the model ``config`` describes (a
    ViTConfig, HybridConfig or MaskedConfig), computed from its numbers alone: nothing is allocated.

    Checkpoint loading compares a file's header with these before building the model, so a config
    that describes a huge model next to small tensors is refused instead of allocated. A generator:
    the caller stops at the first mismatch, so a config with absurdly many blocks costs nothing."""
    from ..models.masked import MaskedConfig
    if isinstance(config, MaskedConfig):      # MaskedPatchViT: the encoder as vit.*, [mask], a head
        for name, shape in _vit_shapes(config.encoder_config()):
            yield "vit." + name, shape
        yield "mask_token", (config.dim,)
        yield from _linear("head", config.dim, math.prod(config.target_shape))
        return
    yield from _vit_shapes(config)


def _linear(name: str, fan_in: int, fan_out: int, bias: bool = True):
    yield f"{name}.weight", (fan_in, fan_out)
    if bias:
        yield f"{name}.bias", (fan_out,)


def _norm(name: str, dim: int):
    yield f"{name}.weight", (dim,)
    yield f"{name}.bias", (dim,)


def _vit_shapes(cfg):
    """ViT's arrays (and HybridViT's, whose patch embedding runs on a ResNet), names as timm's."""
    from ..models.hybrid import HybridConfig
    d = cfg.dim
    if isinstance(cfg, HybridConfig):
        for name, shape in _resnet_shapes(cfg):
            yield "patch_embed.backbone." + name, shape
        yield from _linear("patch_embed.proj", cfg.feature_channels * cfg.patch_size ** 2, d)
    else:
        yield from _linear("patch_embed.proj", cfg.in_channels * cfg.patch_size ** 2, d)
    if cfg.pool == "token":
        yield "cls_token", (1, 1, d)
    if cfg.posemb == "learned-1d":
        yield "pos_embed", (1, cfg.num_tokens, d)
    elif cfg.posemb == "learned-2d":
        yield "pos_embed_row", (cfg.grid_size, d // 2)
        yield "pos_embed_col", (cfg.grid_size, d // 2)
    for i in range(cfg.depth):
        yield from _norm(f"blocks.{i}.norm1", d)
        yield from _linear(f"blocks.{i}.attn.qkv", d, 3 * d, bias=cfg.qkv_bias)
        if cfg.posemb == "relative":
            yield f"blocks.{i}.attn.rel_pos", (2 * cfg.num_tokens - 1, d)
        yield from _linear(f"blocks.{i}.attn.proj", d, d)
        yield from _norm(f"blocks.{i}.norm2", d)
        yield from _linear(f"blocks.{i}.mlp.fc1", d, cfg.mlp_dim)
        yield from _linear(f"blocks.{i}.mlp.fc2", cfg.mlp_dim, d)
    yield from _norm("norm", d)
    width = d
    if cfg.representation_size:
        yield from _linear("pre_logits.fc", d, cfg.representation_size)
        width = cfg.representation_size
    if cfg.num_classes:
        yield from _linear("head", width, cfg.num_classes)


def _resnet_shapes(cfg):
    """The hybrid's ResNet (tinyvit/models/resnet.py): weight-standardised convs (out, in, k, k), no
    bias, each followed by a GroupNorm; a unit projects its shortcut when its channels or stride change."""
    from ..models import resnet

    def conv(name, c_in, c_out, k):
        yield f"{name}.weight", (c_out, c_in, k, k)

    width = resnet.root_width(cfg.resnet_width_factor)
    yield from conv("stem.conv", cfg.in_channels, width, 7 if cfg.resnet_root == "bit" else 3)
    yield from _norm("stem.norm", width)
    channels = width
    for s, (units, mid) in enumerate(zip(cfg.resnet_layers, resnet.stage_widths(cfg.resnet_layers,
                                                                                   cfg.resnet_width_factor))):
        for i in range(units):
            unit, c_in = f"stages.{s}.blocks.{i}", channels if i == 0 else 4 * mid
            if c_in != 4 * mid or (i == 0 and s > 0):
                yield from conv(f"{unit}.downsample.conv", c_in, 4 * mid, 1)
                yield from _norm(f"{unit}.downsample.norm", 4 * mid)
            yield from conv(f"{unit}.conv1", c_in, mid, 1)
            yield from _norm(f"{unit}.norm1", mid)
            yield from conv(f"{unit}.conv2", mid, mid, 3)
            yield from _norm(f"{unit}.norm2", mid)
            yield from conv(f"{unit}.conv3", mid, 4 * mid, 1)
            yield from _norm(f"{unit}.norm3", 4 * mid)
        channels = 4 * mid
