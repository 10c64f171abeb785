"""timm / PyTorch ViT state dicts: the names are ours, the layouts differ.

    from_timm_state_dict(sd) -> our state dict      (torch tensors or arrays in; torch never imported)
    to_timm_state_dict(state_or_model) -> timm's
    timm_unstored_fields(sd, timm_name, num_heads, pool) -> {"num_heads", "pool"}

TIMM_VIT_LAYOUTS says, for each of our name templates, how timm stores the tensor; the patch
embedding's conv kernel converts with conv_to_patch_weight / patch_to_conv_weight.

A timm state dict stores neither the number of heads nor the pooling: they come from the caller
(num_heads=, pool=) or from a standard timm model name (timm_name=), never from a guess.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from .arrays import _contiguous
from .foreign import _is_square, _match, _report_unknown, _to_numpy


# Our name template -> how timm stores the tensor. The names are the same (ours follow timm);
# "linear": PyTorch's (out, in) = our (in, out) transposed; "conv": the patch embedding's conv
# kernel (D, C, P, P) = our (C*P*P, D); "same": identical. The hybrid model adds its entries here.
TIMM_VIT_LAYOUTS = {
    "patch_embed.proj.weight": "conv",
    "patch_embed.proj.bias": "same",
    "cls_token": "same",
    "pos_embed": "same",
    "blocks.{i}.norm1.weight": "same",
    "blocks.{i}.norm1.bias": "same",
    "blocks.{i}.attn.qkv.weight": "linear",     # (3D, D) <-> (D, 3D); q|k|v rows, heads within each
    "blocks.{i}.attn.qkv.bias": "same",
    "blocks.{i}.attn.proj.weight": "linear",
    "blocks.{i}.attn.proj.bias": "same",
    "blocks.{i}.norm2.weight": "same",
    "blocks.{i}.norm2.bias": "same",
    "blocks.{i}.mlp.fc1.weight": "linear",
    "blocks.{i}.mlp.fc1.bias": "same",
    "blocks.{i}.mlp.fc2.weight": "linear",
    "blocks.{i}.mlp.fc2.bias": "same",
    "norm.weight": "same",
    "norm.bias": "same",
    "pre_logits.fc.weight": "linear",
    "pre_logits.fc.bias": "same",
    "head.weight": "linear",
    "head.bias": "same",
    # The hybrid (timm's vit_base_r50_s16_224: HybridEmbed with a ResNetV2 backbone). Conv kernels
    # are (out, in, kh, kw) in both; the 1x1 projection is patch_embed.proj above ("conv").
    "patch_embed.backbone.stem.conv.weight": "same",
    "patch_embed.backbone.stem.norm.weight": "same",
    "patch_embed.backbone.stem.norm.bias": "same",
    "patch_embed.backbone.stages.{s}.blocks.{b}.conv{k}.weight": "same",
    "patch_embed.backbone.stages.{s}.blocks.{b}.norm{k}.weight": "same",
    "patch_embed.backbone.stages.{s}.blocks.{b}.norm{k}.bias": "same",
    "patch_embed.backbone.stages.{s}.blocks.{b}.downsample.conv.weight": "same",
    "patch_embed.backbone.stages.{s}.blocks.{b}.downsample.norm.weight": "same",
    "patch_embed.backbone.stages.{s}.blocks.{b}.downsample.norm.bias": "same",
}

# timm builds a hybrid without ResNet stages (vit_tiny_r_s16_p8_224: layers=()) from the stem alone
# (vision_transformer_hybrid._resnetv2 returns create_resnetv2_stem's conv, norm and pool), so the
# stem's tensors have no "stem." in their names there: timm's name -> ours.
_TIMM_STEM_ONLY = {f"patch_embed.backbone.{layer}.{p}": f"patch_embed.backbone.stem.{layer}.{p}"
                   for layer, p in (("conv", "weight"), ("norm", "weight"), ("norm", "bias"))}

# timm's standard ViT sizes (vision_transformer.py, deit.py, vision_transformer_hybrid.py): width and
# heads. They are the only timm widths whose heads we take without being told.
TIMM_VIT_SIZES = {"tiny": (192, 3), "small": (384, 6), "base": (768, 12), "large": (1024, 16), "huge": (1280, 16)}
# Their plain names, all with a class token read by the head (timm's default global_pool='token'):
# vit_base_patch16_224, deit_small_patch16_224, the hybrids vit_base_r50_s16_384, vit_tiny_r_s16_p8_224
# and their aliases vit_base_resnet50_384; a pretrained tag after a dot is ignored.
_TIMM_NAME = re.compile(r"(?:vit|deit)_(tiny|small|base|large|huge)_(?:patch\d+|r\d*_s\d+(?:_p\d+)?|resnet50)"
                        r"_\d+(?:_in21k)?")

_TIMM_HINT = ("timm features without a tinyvit equivalent (fc_norm, reg_token, layer scale 'ls1/ls2', "
              "q/k norms, norm_pre) cannot be imported")


def conv_to_patch_weight(kernel: np.ndarray) -> np.ndarray:
    """A conv kernel (D, C, P, P) -> our patch embedding E (C*P*P, D)."""
    return kernel.reshape(kernel.shape[0], -1).T


def patch_to_conv_weight(weight: np.ndarray, in_channels: int) -> np.ndarray:
    """Our patch embedding E (C*P*P, D) -> a conv kernel (D, C, P, P)."""
    rows, dim = weight.shape
    p = int(round((rows / in_channels) ** 0.5))
    if in_channels * p * p != rows:
        raise ValueError(f"patch embedding of shape {weight.shape} is not (C*P*P, D) with C={in_channels}; "
                         "pass the model's in_channels")
    return weight.T.reshape(dim, in_channels, p, p)


def _relayout(state: Mapping, convert_conv) -> tuple[dict, list]:
    """({name: C-contiguous NumPy array}, [names TIMM_VIT_LAYOUTS does not know]): the patch
    embedding through ``convert_conv``, linear weights transposed (our (in, out) <-> PyTorch's
    (out, in)), everything else as it is. The same names both ways, so one loop serves both."""
    out, unknown = {}, []
    for name, value in state.items():
        template, _ = _match(name, TIMM_VIT_LAYOUTS)
        if template is None:
            unknown.append(name)
            continue
        layout, array = TIMM_VIT_LAYOUTS[template], _to_numpy(value)
        if layout == "conv":
            array = convert_conv(array)
        elif layout == "linear":
            array = array.T
        out[name] = _contiguous(array)
    return out, unknown


def refuse_fc_norm(sd: Mapping) -> None:
    """A ValueError for timm weights with an fc_norm, which no tinyvit ViT computes (load_pretrained's check)."""
    if "fc_norm.weight" in sd:
        raise ValueError("these timm weights have an fc_norm: the model averages the patch tokens and then normalises "
                         "the average (timm's global_pool='avg' with fc_norm, as MAE and BEiT fine-tune), while "
                         "tinyvit's pool='gap' normalises every token before averaging (the paper's code), so they "
                         "would compute something else and cannot be loaded; timm's *_gap_* models (fc_norm=False) "
                         "load with pool='gap'")


def from_timm_state_dict(sd: Mapping, strict: bool = True) -> dict:
    """A timm/PyTorch ViT state dict -> ours: {name: NumPy array} in our layouts.

    Values may be torch tensors (converted with .detach().cpu().numpy(); torch is never imported
    here) or arrays. Linear weights are transposed, the patch conv kernel flattened. Tensors we have
    no place for raise a ValueError listing them (strict) or are dropped with a warning.
    timm's ``no_embed_class`` models (position embeddings for the patches only, DeiT-III) get a zero
    row for the class token, which is the same computation in our Eq. 1 order. A stem-only hybrid's
    ``patch_embed.backbone.conv/norm`` become our ``patch_embed.backbone.stem.conv/norm``.
    """
    state, unknown = _relayout({_TIMM_STEM_ONLY.get(k, k): v for k, v in sd.items()}, conv_to_patch_weight)
    _report_unknown(unknown, "from_timm_state_dict", strict, _TIMM_HINT)
    pos = state.get("pos_embed")
    if pos is not None and "cls_token" in state and _is_square(pos.shape[1]) and not _is_square(pos.shape[1] - 1):
        state["pos_embed"] = np.concatenate([np.zeros_like(pos[:, :1]), pos], axis=1)  # no_embed_class
    return state


def _hybrid_embed_channels(state: Mapping) -> int | None:
    """C', the channels of a hybrid's feature map (its backbone's last conv's output), or None for a ViT."""
    convs = {}
    for name in state:
        m = re.fullmatch(r"patch_embed\.backbone\.(?:stem\.conv|stages\.(\d+)\.blocks\.(\d+)\.conv3)\.weight", name)
        if m:
            convs[(-1, -1) if m.group(1) is None else (int(m.group(1)), int(m.group(2)))] = name
    return int(state[convs[max(convs)]].shape[0]) if convs else None


def to_timm_state_dict(state, in_channels: int | None = None) -> dict:
    """Our state dict (or a model) -> timm/PyTorch layouts, {name: NumPy array}.

    in_channels is needed to fold the patch embedding back into (D, C, P, P); it is read from the
    model when a model is given (for a hybrid, the ResNet's output channels, read from the state
    too), and defaults to 3 otherwise."""
    if hasattr(state, "state_dict"):
        in_channels = in_channels or getattr(state.config, "feature_channels", state.config.in_channels)
        state = state.state_dict()
    in_channels = in_channels or _hybrid_embed_channels(state) or 3
    out, unknown = _relayout(state, lambda w: patch_to_conv_weight(w, in_channels))
    if unknown:
        raise ValueError(f"to_timm_state_dict: timm's ViT has no tensors named {', '.join(unknown)} "
                         "(e.g. learned-2d position embeddings)")
    if not any(name.startswith("patch_embed.backbone.stages.") for name in out):      # timm's stem-only names
        ours = {v: k for k, v in _TIMM_STEM_ONLY.items()}
        out = {ours.get(k, k): v for k, v in out.items()}
    return out


def timm_unstored_fields(sd: Mapping, timm_name: str | None = None, num_heads: int | None = None,
                         pool: str | None = None) -> dict:
    """{"num_heads": H, "pool": "token"|"gap"} of a timm ViT state dict, which stores neither.

    Given values win; missing ones come from ``timm_name`` (a standard timm model name, see
    _TIMM_NAME, whose width must be the weights'). Without a name, num_heads comes from a standard
    width's (TIMM_VIT_SIZES) and pool must be given: timm pools with the class token
    (global_pool='token', our "token") or by averaging (global_pool='avg', our "gap", which has no
    class token), and the weights are the same either way. Anything else is a one-line ValueError
    naming the argument to pass."""
    dim = int(sd["patch_embed.proj.weight"].shape[0])                  # (D, C, P, P)
    if timm_name is not None:
        m = _TIMM_NAME.fullmatch(timm_name.split(".")[0])
        if not m:
            raise ValueError(f"timm_name={timm_name!r} is not a standard timm ViT name such as "
                             "'vit_base_patch16_224' or 'vit_base_r50_s16_384': pass num_heads= and pool= instead")
        width, heads = TIMM_VIT_SIZES[m.group(1)]
        if width != dim:
            raise ValueError(f"timm_name={timm_name!r} is {width} wide but the weights are {dim} wide: "
                             "pass the model's own name, or num_heads= and pool=")
        num_heads, pool = num_heads or heads, pool or "token"
    if num_heads is None:
        standard = {width: heads for width, heads in TIMM_VIT_SIZES.values()}
        if dim not in standard:
            raise ValueError(f"a timm state dict does not store the number of heads, and width {dim} is no "
                             "standard timm size: pass num_heads= (or timm_name=)")
        num_heads = standard[dim]
    has_class_token = "cls_token" in sd
    if pool is None:
        raise ValueError("a timm state dict does not store how the model pools: pass pool='token' (timm's "
                         "global_pool='token', its default) or pool='gap' (global_pool='avg'), or timm_name=")
    if pool == "token" and not has_class_token:
        raise ValueError("pool='token' but the weights have no cls_token: pass pool='gap' (timm's global_pool='avg')")
    if pool == "gap" and has_class_token:
        raise ValueError("the weights have a cls_token, and timm's global_pool='avg' with a class token has no "
                         "tinyvit equivalent (our 'gap' model has none): only pool='token' loads them")
    return {"num_heads": num_heads, "pool": pool}


def timm_model_kwargs(config) -> dict:
    """The keyword arguments of timm's VisionTransformer that build the model ``config`` (a ViTConfig)
    describes, so that ``VisionTransformer(**kwargs).load_state_dict(to_timm_state_dict(model))``
    computes what ``model`` computes. A ValueError names what timm's ViT does not express: a hybrid,
    position embeddings other than learned 1-D, a pre-logits layer, another LayerNorm epsilon."""
    problems = []
    if hasattr(config, "resnet_layers") or hasattr(config, "feature_channels"):
        problems.append("a hybrid (timm builds those from its own ResNet classes)")
    if config.posemb != "learned-1d":
        problems.append(f"posemb={config.posemb!r} (timm's ViT learns 1-D position embeddings)")
    if config.representation_size:
        problems.append("a pre-logits layer (representation_size; timm's ViT has none)")
    if config.ln_eps != 1e-6:
        problems.append(f"LayerNorm eps {config.ln_eps} (timm's ViT uses 1e-6)")
    if problems:
        raise ValueError(f"timm's VisionTransformer cannot express {'; '.join(problems)}")
    kwargs = dict(img_size=config.image_size, patch_size=config.patch_size, in_chans=config.in_channels,
                  num_classes=config.num_classes, embed_dim=config.dim, depth=config.depth,
                  num_heads=config.num_heads, mlp_ratio=config.mlp_dim / config.dim, qkv_bias=config.qkv_bias)
    if config.pool == "gap":           # averaging the normalised tokens: no class token, no norm after pooling
        kwargs.update(global_pool="avg", class_token=False, fc_norm=False)
    else:
        kwargs.update(global_pool="token")
    if config.gelu_approximate == "tanh":
        kwargs["act_layer"] = "gelu_tanh"
    return kwargs


def save_timm(model, path, metadata: dict | None = None) -> dict:
    """Write ``model`` as a timm state dict (timm's names, PyTorch layouts) to a .safetensors file that
    ``safetensors.torch.load_file`` reads; its metadata holds the VisionTransformer keyword
    arguments (JSON, "timm_kwargs"), which are returned."""
    import json

    from .arrays import save_arrays
    kwargs = timm_model_kwargs(model.config)
    save_arrays(path, to_timm_state_dict(model),
                {"format": "pt", "timm_kwargs": json.dumps(kwargs), **(metadata or {})})
    return kwargs
