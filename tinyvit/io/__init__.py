"""Checkpoints (safetensors) and importing other people's ViT weights (timm, the official .npz).

Three layers, from the bottom up:

    save_arrays(path, arrays, metadata)     any {name: array} -> one .safetensors file, written atomically
    load_arrays(path) -> (arrays, metadata)

    save(model, path, arrays=None, metadata=None)    a model + its arch and config (+ optional extras)
    load(path, device=None, dtype=None) -> model     rebuilt from the file alone, in eval mode
    load_checkpoint(path) -> (model, arrays, metadata)   the same plus the extras (training resume)
    read_state_dict(path) -> {name: array}           only the model's arrays

    from_timm_state_dict(sd) / to_timm_state_dict(state)     timm's names are ours, the layouts differ
    save_timm(model, path), timm_model_kwargs(config)         a file timm's VisionTransformer(**kwargs) loads
    from_official_npz(path)                                   google-research/vision_transformer's .npz
    config_from_timm_state_dict(sd), config_from_official_npz(path)   the ViTConfig the weights imply
    load_pretrained(path_or_state_dict, **config_overrides)   any of the above -> a ready ViT

The package, one topic a module (each imports only the ones above it):

    arrays.py       {name: array} <-> a .safetensors file, atomic writes; file helpers (_sniff, ...)
    checkpoint.py   tinyvit's own checkpoints: model + arch + config + extras; save, load, ...
    foreign.py      shared tools for foreign weights: name templates, unknown-tensor reports
    timm.py         timm / PyTorch state dicts (TIMM_VIT_LAYOUTS)
    official.py     the official vit_jax .npz (OFFICIAL_VIT_NAMES, convert_by_table)
    config.py       the ViTConfig / HybridConfig a state dict implies
    pretrained.py   load_pretrained and adapt_state_dict: any source -> a ready model

Everything public is importable from ``tinyvit.io`` itself, as listed in ``__all__``.

Nothing here ever unpickles: safetensors files hold raw bytes plus a JSON header, and .npz files are
read with ``numpy.load(..., allow_pickle=False)``. A PyTorch ``.pth`` is a pickle, so we ask for it to
be converted to safetensors first (with torch, by whoever trusts the file).

Layouts (see DESIGN.md): our 2-D weights are (in, out) and y = x W + b; PyTorch's Linear stores
(out, in). Our patch embedding E is (C*P*P, D) with patches flattened in (C, P, P) order, i.e. a
PyTorch conv kernel (D, C, P, P) reshaped to (D, C*P*P) and transposed.
"""
from .arrays import load_arrays, save_arrays
from .checkpoint import EXTRA_PREFIX, FORMAT, RESERVED_METADATA, load, load_checkpoint, read_state_dict, save
from .config import (config_from_official_npz, config_from_state_dict, config_from_timm_state_dict,
                     hybrid_config_from_state_dict)
from .official import (OFFICIAL_PREFIXES, OFFICIAL_VIT_NAMES, convert_by_table, from_official_npz,
                       heads_to_proj_weight, heads_to_qkv_bias, heads_to_qkv_weight, hwio_to_conv_weight,
                       hwio_to_patch_weight, read_official_npz)
from .pretrained import adapt_state_dict, load_pretrained
from .timm import (TIMM_VIT_LAYOUTS, conv_to_patch_weight, from_timm_state_dict, patch_to_conv_weight, save_timm,
                   timm_model_kwargs, to_timm_state_dict)

__all__ = [
    # arrays.py
    "save_arrays", "load_arrays",
    # checkpoint.py
    "FORMAT", "EXTRA_PREFIX", "RESERVED_METADATA", "save", "load", "load_checkpoint", "read_state_dict",
    # timm.py
    "TIMM_VIT_LAYOUTS", "conv_to_patch_weight", "patch_to_conv_weight", "from_timm_state_dict",
    "to_timm_state_dict", "timm_model_kwargs", "save_timm",
    # official.py
    "hwio_to_patch_weight", "hwio_to_conv_weight", "heads_to_qkv_weight", "heads_to_qkv_bias",
    "heads_to_proj_weight", "OFFICIAL_VIT_NAMES", "OFFICIAL_PREFIXES", "read_official_npz", "convert_by_table",
    "from_official_npz",
    # config.py
    "config_from_state_dict", "hybrid_config_from_state_dict", "config_from_timm_state_dict",
    "config_from_official_npz",
    # pretrained.py
    "adapt_state_dict", "load_pretrained",
]
