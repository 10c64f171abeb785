"""The official google-research/vision_transformer (vit_jax, Flax) .npz checkpoints.

    read_official_npz(path) -> {flat name: array}    allow_pickle=False, known prefixes removed,
                                                      names and norm shapes as the published files'
    check_npz_sizes(path)                             what the members' headers declare, before reading
    from_official_npz(path) -> our state dict         via the table OFFICIAL_VIT_NAMES

The layout converters (hwio_to_patch_weight, heads_to_qkv_weight, ...) and the generic
``convert_by_table`` that applies a {our template: (their templates, fn[, offset])} table.
"""
from __future__ import annotations

import math
import os
import re
import zipfile
from collections.abc import Mapping

import numpy as np

from .arrays import check_file, _contiguous
from .foreign import _report_unknown, _template_regex, _to_numpy


# Names and layouts of google-research/vision_transformer, vit_jax/models_vit.py: the Conv
# 'embedding' (kernel HWIO), param 'cls', Encoder 'Transformer' with AddPositionEmbs
# 'posembed_input'/'pos_embedding', blocks 'encoderblock_{i}' holding LayerNorm_0,
# MultiHeadDotProductAttention_1 (DenseGeneral query/key/value kernels (D, H, dh), out (H, dh, D)),
# LayerNorm_2 and MlpBlock_3 (Dense_0, Dense_1), then 'encoder_norm', 'pre_logits', 'head'.
# Flax Dense kernels are already (in, out), like ours. Files are flat {"a/b/c": array} as written by
# vit_jax/checkpoint.py (np.load(..., allow_pickle=False) there too).


def hwio_to_patch_weight(kernel: np.ndarray) -> np.ndarray:
    """Flax conv kernel (P, P, C, D) (HWIO, on NHWC images) -> our E (C*P*P, D), rows in (C, P, P) order."""
    ph, pw, c, d = kernel.shape
    return kernel.transpose(2, 0, 1, 3).reshape(c * ph * pw, d)


def hwio_to_conv_weight(kernel: np.ndarray) -> np.ndarray:
    """Flax conv kernel (kh, kw, in, out) -> ours and PyTorch's (out, in, kh, kw)."""
    return kernel.transpose(3, 2, 0, 1)


def heads_to_qkv_weight(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Three (D, H, dh) kernels -> our fused (D, 3D) = [q | k | v], head h at columns h*dh:(h+1)*dh."""
    return np.concatenate([w.reshape(w.shape[0], -1) for w in (q, k, v)], axis=1)


def heads_to_qkv_bias(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Three (H, dh) biases -> our (3D,)."""
    return np.concatenate([b.reshape(-1) for b in (q, k, v)])


def heads_to_proj_weight(out: np.ndarray) -> np.ndarray:
    """The output projection's (H, dh, D) kernel -> our (D, D) (rows are the concatenated heads)."""
    return out.reshape(-1, out.shape[-1])


_BLOCK = "Transformer/encoderblock_{i}/"
_MHA = _BLOCK + "MultiHeadDotProductAttention_1/"

# Our name template -> (official name template(s), function of those arrays -> ours; None = as is
# [, offset: their numbers minus ours, for names counted from 1]).
OFFICIAL_VIT_NAMES = {
    "patch_embed.proj.weight": (("embedding/kernel",), hwio_to_patch_weight),
    "patch_embed.proj.bias": (("embedding/bias",), None),
    "cls_token": (("cls",), None),
    "pos_embed": (("Transformer/posembed_input/pos_embedding",), None),
    "blocks.{i}.norm1.weight": ((_BLOCK + "LayerNorm_0/scale",), None),
    "blocks.{i}.norm1.bias": ((_BLOCK + "LayerNorm_0/bias",), None),
    "blocks.{i}.attn.qkv.weight": ((_MHA + "query/kernel", _MHA + "key/kernel", _MHA + "value/kernel"),
                                   heads_to_qkv_weight),
    "blocks.{i}.attn.qkv.bias": ((_MHA + "query/bias", _MHA + "key/bias", _MHA + "value/bias"),
                                 heads_to_qkv_bias),
    "blocks.{i}.attn.proj.weight": ((_MHA + "out/kernel",), heads_to_proj_weight),
    "blocks.{i}.attn.proj.bias": ((_MHA + "out/bias",), None),
    "blocks.{i}.norm2.weight": ((_BLOCK + "LayerNorm_2/scale",), None),
    "blocks.{i}.norm2.bias": ((_BLOCK + "LayerNorm_2/bias",), None),
    "blocks.{i}.mlp.fc1.weight": ((_BLOCK + "MlpBlock_3/Dense_0/kernel",), None),
    "blocks.{i}.mlp.fc1.bias": ((_BLOCK + "MlpBlock_3/Dense_0/bias",), None),
    "blocks.{i}.mlp.fc2.weight": ((_BLOCK + "MlpBlock_3/Dense_1/kernel",), None),
    "blocks.{i}.mlp.fc2.bias": ((_BLOCK + "MlpBlock_3/Dense_1/bias",), None),
    "norm.weight": (("Transformer/encoder_norm/scale",), None),
    "norm.bias": (("Transformer/encoder_norm/bias",), None),
    "pre_logits.fc.weight": (("pre_logits/kernel",), None),
    "pre_logits.fc.bias": (("pre_logits/bias",), None),
    "head.weight": (("head/kernel",), None),
    "head.bias": (("head/bias",), None),
}

# The hybrid's ResNet (vit_jax/models_vit.py: conv_root, gn_root, then ResNetStage 'block{s}' of
# ResidualUnit 'unit{u}', both counted from 1; models_resnet.py: conv1-3, gn1-3, conv_proj, gn_proj).
# Its 1x1 'embedding' kernel (1, 1, C', D) is the ViT entry above.
_UNIT, _OUR_UNIT = "block{s}/unit{b}/", "patch_embed.backbone.stages.{s}.blocks.{b}."
OFFICIAL_VIT_NAMES.update({
    "patch_embed.backbone.stem.conv.weight": (("conv_root/kernel",), hwio_to_conv_weight),
    "patch_embed.backbone.stem.norm.weight": (("gn_root/scale",), None),
    "patch_embed.backbone.stem.norm.bias": (("gn_root/bias",), None),
    _OUR_UNIT + "conv1.weight": ((_UNIT + "conv1/kernel",), hwio_to_conv_weight, 1),
    _OUR_UNIT + "norm1.weight": ((_UNIT + "gn1/scale",), None, 1),
    _OUR_UNIT + "norm1.bias": ((_UNIT + "gn1/bias",), None, 1),
    _OUR_UNIT + "conv2.weight": ((_UNIT + "conv2/kernel",), hwio_to_conv_weight, 1),
    _OUR_UNIT + "norm2.weight": ((_UNIT + "gn2/scale",), None, 1),
    _OUR_UNIT + "norm2.bias": ((_UNIT + "gn2/bias",), None, 1),
    _OUR_UNIT + "conv3.weight": ((_UNIT + "conv3/kernel",), hwio_to_conv_weight, 1),
    _OUR_UNIT + "norm3.weight": ((_UNIT + "gn3/scale",), None, 1),
    _OUR_UNIT + "norm3.bias": ((_UNIT + "gn3/bias",), None, 1),
    _OUR_UNIT + "downsample.conv.weight": ((_UNIT + "conv_proj/kernel",), hwio_to_conv_weight, 1),
    _OUR_UNIT + "downsample.norm.weight": ((_UNIT + "gn_proj/scale",), None, 1),
    _OUR_UNIT + "downsample.norm.bias": ((_UNIT + "gn_proj/bias",), None, 1),
})

# Prefixes some releases put before every name (as timm's npz loader checks): the old fine-tuning
# checkpoints store the optimizer's target, big_vision stores "params/".
OFFICIAL_PREFIXES = ("opt/target/", "params/")

# Flax renamed its auto-named submodules. The pre-Linen flax.nn, which wrote the published files,
# numbered them across types (the table's LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2,
# MlpBlock_3); Linen, which the current vit_jax/models_vit.py uses, numbers them per type
# (LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0). vit_jax/checkpoint.py's
# load accepts both (flax's convert_pre_linen renames old to new); we rename new to old. Neither
# naming uses the other's names, so a file says which it is.
_LINEN_TO_PUBLISHED = {"MultiHeadDotProductAttention_0": "MultiHeadDotProductAttention_1",
                       "LayerNorm_1": "LayerNorm_2", "MlpBlock_0": "MlpBlock_3"}
_BLOCK_CHILD = re.compile(r"(Transformer/encoderblock_\d+/)([^/]+)(/.+)")

# A norm's scale or bias: (C,), but flax before 0.3.6 stored GroupNorm's as (1, 1, 1, C), and the
# published hybrid checkpoints keep that shape (google-research/vision_transformer issue 156; the
# official loader squeezes them in _fix_groupnorm, timm's flattens them).
_NORM_PARAM = re.compile(r"(?:.*/)?(?:gn\d+|gn_root|gn_proj|LayerNorm_\d+|encoder_norm)/(?:scale|bias)")


def _published_names(arrays: dict) -> dict:
    """``arrays`` with the encoder blocks' Linen names (current vit_jax) renamed to the published
    pre-Linen ones of OFFICIAL_VIT_NAMES; a file that mixes the two namings is refused."""
    children = {name: m for name in arrays if (m := _BLOCK_CHILD.fullmatch(name))}
    linen = sorted(n for n, m in children.items() if m.group(2) in _LINEN_TO_PUBLISHED)
    if not linen:
        return arrays
    published = sorted(n for n, m in children.items() if m.group(2) in _LINEN_TO_PUBLISHED.values())
    if published:
        raise ValueError(f"the checkpoint mixes Flax Linen names ({linen[0]}) with pre-Linen ones ({published[0]}): "
                         "it is not a file vit_jax wrote")
    renamed = {}
    for name, value in arrays.items():
        m = children.get(name)
        if m and m.group(2) in _LINEN_TO_PUBLISHED:
            name = m.group(1) + _LINEN_TO_PUBLISHED[m.group(2)] + m.group(3)
        renamed[name] = value
    return renamed


def _norm_vector(name: str, array: np.ndarray) -> np.ndarray:
    """A norm's scale or bias as (C,), from (C,) or older flax's (1, 1, 1, C); other shapes refused."""
    if array.ndim == 1:
        return array
    if array.ndim == 4 and array.shape[:3] == (1, 1, 1):
        return array.reshape(-1)
    raise ValueError(f"{name} has shape {array.shape}, but a norm's scale and bias are (C,) or, as older flax "
                     "saved them, (1, 1, 1, C): the file is damaged or not a vit_jax checkpoint")


# NumPy allocates the array a member's header declares before it reads the member, so a few bytes can
# ask for gigabytes, and a deflated member of zeros inflates a thousandfold. Weights barely compress:
# together the members may hold at most this many times the file's own size, plus NPZ_SLACK_BYTES
# (for small files and the zero biases of a fresh head).
MAX_NPZ_INFLATION = 8
NPZ_SLACK_BYTES = 64 << 20


def check_npz_sizes(path) -> None:
    """Refuse an .npz (ValueError naming the member) before NumPy allocates anything for it: a member
    whose .npy header declares other bytes than the zip says it holds, a member of pickled objects, or
    members that together inflate far beyond the file (MAX_NPZ_INFLATION, NPZ_SLACK_BYTES). Reads the
    zip's directory and each member's header alone."""
    from numpy.lib import format as npy
    size = os.path.getsize(path)
    limit = MAX_NPZ_INFLATION * size + NPZ_SLACK_BYTES
    total = 0
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            total += info.file_size
            if not info.filename.endswith(".npy"):
                continue
            with z.open(info) as f:
                try:
                    version = npy.read_magic(f)
                    read = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}.get(version)
                    shape, _, dtype = read(f) if read else npy._read_array_header(f, version)
                except ValueError as exc:
                    raise ValueError(f"{path}: {info.filename} is not a readable .npy array ({exc})") from None
                header = f.tell()
            declared = math.prod(shape) * dtype.itemsize
            what = f"{path}: {info.filename} declares shape {shape} of {dtype} = {declared} bytes"
            if dtype.hasobject:
                raise ValueError(f"{what} of pickled Python objects, which are never loaded")
            if header + declared != info.file_size:
                raise ValueError(f"{what}, but holds {info.file_size - header}: the file is damaged or crafted; "
                                 "use the checkpoint as published")
            if total > limit:
                raise ValueError(f"{what}; with the members before it {total} bytes, more than {MAX_NPZ_INFLATION} "
                                 f"times the file's {size} (weights barely compress): not a checkpoint, or crafted; "
                                 "use the checkpoint as published")


def read_official_npz(path_or_mapping) -> dict:
    """The official checkpoint's {flat name: NumPy array} in the form OFFICIAL_VIT_NAMES reads, as
    vit_jax/checkpoint.py's load normalises a file: any known prefix removed, the current code's
    Linen block names renamed to the published ones, norm scales and biases (1, 1, 1, C) made (C,).
    Reads .npz files with allow_pickle=False: object arrays (pickles) are refused."""
    if isinstance(path_or_mapping, Mapping):
        arrays = {k: _to_numpy(v) for k, v in path_or_mapping.items()}
    else:
        path = os.fspath(path_or_mapping)
        check_file(path, "official .npz checkpoint")
        try:
            check_npz_sizes(path)
        except (OSError, zipfile.BadZipFile, EOFError) as exc:
            raise ValueError(f"{path} is not a readable .npz file (truncated or corrupted): {exc}") from exc
        try:
            with np.load(path, allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
        except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
            raise ValueError(f"{path} is not a readable .npz file (truncated or corrupted, or holding "
                             f"pickled objects, which are never loaded): {exc}") from exc
    for prefix in OFFICIAL_PREFIXES:
        if f"{prefix}embedding/kernel" in arrays:
            arrays = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
            break
    arrays = _published_names(arrays)
    return {k: _norm_vector(k, v) if _NORM_PARAM.fullmatch(k) else v for k, v in arrays.items()}


def convert_by_table(arrays: Mapping, table: Mapping, source: str = "checkpoint", strict: bool = True) -> dict:
    """Rename and re-lay-out ``arrays`` with a table {our template: (their templates, fn[, offset])}.

    Each entry's first foreign template is matched against every name (``{i}`` matches a number);
    the other foreign names of the entry are filled in with the same numbers, and ``fn`` turns the
    list of arrays into ours. ``offset`` (default 0) is subtracted from the numbers for our name
    (1 where they count from 1). Names no entry consumes are reported (an error when strict)."""
    state, used = {}, set()
    for ours, (theirs, fn, *offset) in table.items():
        offset = offset[0] if offset else 0
        pattern = _template_regex(theirs[0])
        for name in arrays:
            m = pattern.match(name)
            if not m:
                continue
            names = [t.format(**m.groupdict()) for t in theirs]
            missing = [n for n in names if n not in arrays]
            if missing:
                raise ValueError(f"{source}: {name} is there but {', '.join(missing)} is missing")
            parts = [arrays[n] for n in names]
            numbers = {k: int(v) - offset for k, v in m.groupdict().items()}
            state[ours.format(**numbers)] = _contiguous(fn(*parts) if fn else parts[0])
            used.update(names)
    _report_unknown([n for n in arrays if n not in used], source, strict)
    return state


def from_official_npz(path_or_mapping, strict: bool = True) -> dict:
    """An official google-research/vision_transformer ViT checkpoint (.npz path, or its
    {name: array} mapping) -> our state dict {name: NumPy array}."""
    return convert_by_table(read_official_npz(path_or_mapping), OFFICIAL_VIT_NAMES,
                            source="from_official_npz", strict=strict)
