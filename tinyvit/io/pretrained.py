"""load_pretrained: any supported weights (ours, timm, the official .npz, a state dict) -> a ready model.

    load_pretrained(path_or_state_dict, **config_overrides)
    adapt_state_dict(state, old_config, new_config)   new head / new image size, for fine-tuning

Pickles (PyTorch .pth) are refused with a recipe to convert them to safetensors.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from .arrays import check_file, _sniff, load_arrays
from .checkpoint import FORMAT, _check_header_fits, _finish, _model_config, _split_checkpoint
from .config import (_is_hybrid, config_from_official_npz, config_from_state_dict, config_from_timm_state_dict,
                     hybrid_config_from_state_dict)
from .foreign import UnknownTensors, _to_numpy
from .official import from_official_npz, read_official_npz
from .timm import from_timm_state_dict, refuse_fc_norm, timm_unstored_fields


_PICKLE_HELP = ("{path} is a pickle (a PyTorch .pth/.bin/.pt), and tinyvit never unpickles files: "
                "unpickling runs code. If you trust it, convert it once with PyTorch:\n"
                "    import torch, safetensors.torch\n"
                "    sd = torch.load('{path}', map_location='cpu', weights_only=True)\n"
                "    sd = sd.get('model', sd.get('state_dict', sd))\n"
                "    safetensors.torch.save_file({{k: v.contiguous() for k, v in sd.items()}}, 'model.safetensors')\n"
                "then load the .safetensors file.")


_SAFETENSORS_DTYPE = {"float16": "F16", "float32": "F32", "float64": "F64"}     # as checkpoint's header check names them


def _refuse_unknown(where, convert):
    """``convert()``, with tensors it has no place for refused in load_pretrained's own words (its
    converters' strict=False advice is not for load_pretrained, which loads exactly or not at all)."""
    try:
        return convert()
    except UnknownTensors as exc:
        raise ValueError(f"{where}: {len(exc.names)} tensor(s) tinyvit's ViT has no place for: {', '.join(exc.names)}"
                         f"{'. ' + exc.hint if exc.hint else ''}; load_pretrained loads only weights that compute what "
                         "their model computes") from None


def _read_source(source, hints: dict, timm_name: str | None = None):
    """(our state dict, arch, the config the checkpoint itself implies) for any source. ``hints``:
    config fields the weights do not store (num_heads for timm, ...), used while inferring;
    ``timm_name``: a timm state dict's model name, which says its heads and pooling."""
    from ..models import ARCHS
    if isinstance(source, Mapping):
        arrays, metadata, where = dict(source), {}, "state dict"
    else:
        where = os.fspath(source)
        check_file(where, "pretrained weights")
        kind = _sniff(where)
        if kind == "pickle":
            raise ValueError(_PICKLE_HELP.format(path=where))
        if kind == "npz":
            arrays, metadata = read_official_npz(where), {}
        elif kind == "safetensors":
            arrays, metadata = load_arrays(where)
        else:
            raise ValueError(f"{where}: not a safetensors or .npz file (or truncated or corrupted)")

    kernel = arrays.get("patch_embed.proj.weight")
    is_timm = kernel is not None and len(kernel.shape) == 4        # the patch embedding as a torch conv kernel
    if timm_name is not None and not is_timm:
        raise ValueError(f"timm_name= is for timm state dicts, and {where} is not one: leave timm_name out")
    if metadata.get("format") == FORMAT:                      # our own checkpoint: the config is in it
        state, _, _, arch, config = _split_checkpoint(where, arrays, metadata)
        if arch not in ARCHS:
            raise ValueError(f"{where}: unknown architecture {arch!r}; known: {sorted(ARCHS)}")
        model_config = _model_config(where, arch, config)
        # a config that does not fit the arrays (a crafted file) is refused before a model is built
        specs = {k: (_SAFETENSORS_DTYPE.get(str(v.dtype), str(v.dtype)), tuple(v.shape)) for k, v in state.items()}
        _check_header_fits(where, model_config, specs)
        return state, arch, model_config
    if any(k.endswith("embedding/kernel") for k in arrays):   # the official Flax names
        state = _refuse_unknown(where, lambda: from_official_npz(arrays))
        return state, "hybrid" if _is_hybrid(state) else "vit", config_from_official_npz(arrays, **hints)
    if is_timm:                                               # timm / PyTorch layouts
        arch = "hybrid" if _is_hybrid(arrays) else "vit"
        refuse_fc_norm(arrays)                                 # before the pooling is asked about
        state = _refuse_unknown(where, lambda: from_timm_state_dict(arrays))
        hints = {**hints, **timm_unstored_fields(arrays, timm_name, hints.get("num_heads"), hints.get("pool"))}
        return state, arch, config_from_timm_state_dict(arrays, **hints)
    if kernel is not None and len(kernel.shape) == 2 and _is_hybrid(arrays):   # our names, a hybrid
        state = {k: _to_numpy(v) for k, v in arrays.items()}
        return state, "hybrid", hybrid_config_from_state_dict(state, **hints)
    if kernel is not None and len(kernel.shape) == 2:         # already our names and layouts
        c = hints.get("in_channels", 3)
        p = hints.get("patch_size", int(round((kernel.shape[0] / c) ** 0.5)))
        state = {k: _to_numpy(v) for k, v in arrays.items()}
        return state, "vit", config_from_state_dict(state, p, c, **hints)
    raise ValueError(f"{where}: not a ViT checkpoint tinyvit knows (no 'patch_embed.proj.weight' "
                     "or 'embedding/kernel')")


def adapt_state_dict(state: Mapping, old, new, resize_method: str = "bilinear") -> tuple[dict, list]:
    """Fit a checkpoint's state dict (config ``old``) to a model of config ``new``, as the official
    code's load_pretrained does for fine-tuning (vit_jax/checkpoint.py):

    - another num_classes or representation_size: the head is dropped (the new model keeps its
      zero-initialised head); another representation_size (None included) drops pre-logits too;
    - another image size: the learned position embeddings are interpolated in 2-D to the new grid
      (paper, section 3.2) with ``tinyvit.models.resize_pos_embed`` (bilinear as the official code,
      or "bicubic" as timm).
    Returns (new state dict, prefixes of the names the new model must initialise itself)."""
    from ..models import resize_pos_embed
    state, reset = dict(state), []
    if old.representation_size != new.representation_size:
        reset += ["pre_logits.", "head."]
    elif old.num_classes != new.num_classes:
        reset += ["head."]
    state = {k: v for k, v in state.items() if not k.startswith(tuple(reset))}

    old_grid, new_grid = old.grid_size, new.grid_size        # patches per side (hybrids: of the feature map)
    if old_grid != new_grid and new.posemb == "relative":
        # a table per offset of a 1-D raster order: at another grid the same offset joins other pairs
        # of patches, and the paper (appendix D.4) fine-tunes no such model at another resolution
        raise ValueError(f"relative position embeddings cover the {old_grid}x{old_grid} patch grid of "
                         f"image_size={old.image_size}; they cannot be carried to a {new_grid}x{new_grid} grid: "
                         f"keep image_size={old.image_size}")
    if old_grid != new_grid:
        if "pos_embed" in state and new.posemb == "learned-1d":
            prefix = 1 if new.pool == "token" else 0
            state["pos_embed"] = resize_pos_embed(state["pos_embed"], old_grid, new_grid,
                                                  method=resize_method, num_prefix_tokens=prefix)
        for name in ("pos_embed_row", "pos_embed_col"):       # learned-2d: two 1-D tables
            if name in state and new.posemb == "learned-2d":
                table = state[name][None]                      # (1, g, D/2): a g x 1 grid
                state[name] = resize_pos_embed(table, (old_grid, 1), (new_grid, 1),
                                               method=resize_method, num_prefix_tokens=0)[0]
    return state, reset


# Config fields that describe the new model rather than the weights: load_pretrained adapts the
# weights to them instead of inferring them.
_ADAPTABLE = ("num_classes", "representation_size", "image_size")


def load_pretrained(source, *, device=None, dtype=None, resize_method: str = "bilinear",
                    timm_name: str | None = None, **config_overrides):
    """Build a ViT from pretrained weights of any supported kind and load them; eval mode.

    source: a path to an official .npz (google-research/vision_transformer), a tinyvit .safetensors,
            a timm .safetensors (torch layouts), or a state dict (timm names in torch layouts,
            official flat names, or ours). PyTorch pickles (.pth) are refused with a recipe to convert.
    timm_name: for timm weights, timm's model name ("vit_base_patch16_224", "deit_small_patch16_224",
            "vit_base_r50_s16_384", ...), which says what the state dict does not: the heads and the
            pooling. Without it pass pool= ("token" for timm's global_pool='token', "gap" for 'avg')
            and, for a width other than timm's standard sizes, num_heads=.
    config_overrides: ViTConfig fields that differ from what the weights imply, typically
            num_classes= (a new zero-initialised head for fine-tuning), image_size= (position
            embeddings resized), num_heads= and pool= (not stored in timm weights), dropout rates.
    device, dtype: as for ``load`` (dtype None: the checkpoint's own).
    resize_method: "bilinear" (the official code) or "bicubic" (timm) for new position-embedding grids.
    """
    from ..models import from_config
    hints = {k: v for k, v in config_overrides.items() if k not in _ADAPTABLE}
    state, arch, old = _read_source(source, hints, timm_name)
    new = dataclasses.replace(old, **config_overrides)
    state, reset = adapt_state_dict(state, old, new, resize_method)
    model = from_config(arch, dataclasses.asdict(new))
    for name, value in model.state_dict().items():             # the reset head keeps its init
        if name not in state and name.startswith(tuple(reset)):
            state[name] = value
    return _finish(model, state, device, dtype)
