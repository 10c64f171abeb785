"""Checkpoints (safetensors) and importing other people's ViT weights (timm, the official .npz).

Three layers, from the bottom up:

    save_arrays(path, arrays, metadata)     any {name: array} -> one .safetensors file, written atomically
    load_arrays(path) -> (arrays, metadata)

    save(model, path, arrays=None, metadata=None)    a model + its arch and config (+ optional extras)
    load(path, device=None, dtype=None) -> model     rebuilt from the file alone, in eval mode
    load_checkpoint(path) -> (model, arrays, metadata)   the same plus the extras (training resume)
    read_state_dict(path) -> {name: array}           only the model's arrays

    from_timm_state_dict(sd) / to_timm_state_dict(state)     timm's names are ours, the layouts differ
    from_official_npz(path)                                   google-research/vision_transformer's .npz
    config_from_timm_state_dict(sd), config_from_official_npz(path)   the ViTConfig the weights imply
    load_pretrained(path_or_state_dict, **config_overrides)   any of the above -> a ready ViT

Nothing here ever unpickles: safetensors files hold raw bytes plus a JSON header, and .npz files are
read with ``numpy.load(..., allow_pickle=False)``. A PyTorch ``.pth`` is a pickle, so we ask for it to
be converted to safetensors first (with torch, by whoever trusts the file).

Layouts (see DESIGN.md): our 2-D weights are (in, out) and y = x W + b; PyTorch's Linear stores
(out, in). Our patch embedding E is (C*P*P, D) with patches flattened in (C, P, P) order, i.e. a
PyTorch conv kernel (D, C, P, P) reshaped to (D, C*P*P) and transposed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import uuid
import warnings
import zipfile
from collections.abc import Mapping

import numpy as np

from . import __version__, backend

FORMAT = "tinyvit"
EXTRA_PREFIX = "extra/"   # extra arrays (optimizer state, ...) live under this prefix; "/" never
#                           appears in a module's dotted parameter names, so they cannot collide.
RESERVED_METADATA = ("format", "arch", "config", "tinyvit_version")


# ==================================================================== 1. arrays <-> a file


def _safetensors():
    """The safetensors package, imported on first use (it is an optional dependency)."""
    try:
        import safetensors
        import safetensors.numpy
    except ImportError as exc:  # pragma: no cover - the test environment has it
        raise ImportError("checkpoints need the safetensors package: pip install safetensors "
                          "(or pip install 'tinyvit[test]')") from exc
    return safetensors


def _contiguous(array) -> np.ndarray:
    """A C-contiguous array (np.ascontiguousarray would turn a 0-d array into 1-d)."""
    return np.asarray(array, order="C")


def _host_array(value) -> np.ndarray:
    """A C-contiguous NumPy array from a NumPy/CuPy array or a Tensor (safetensors needs host bytes)."""
    from .autograd import Tensor
    value = value.data if isinstance(value, Tensor) else value
    return _contiguous(backend.to_numpy(value))


def _write_safetensors(path: str, arrays: dict, metadata: dict) -> None:
    """Write ``arrays`` and ``metadata`` to ``path`` in the safetensors format (the one writer
    ``save_arrays`` uses; tests replace it to simulate a crash halfway through)."""
    _safetensors().numpy.save_file(arrays, path, metadata=metadata)


def _fsync_directory(directory: str) -> None:
    """Make a rename inside ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_arrays(path, arrays: Mapping, metadata: Mapping | None = None) -> None:
    """Write ``{name: array}`` and string ``metadata`` to a .safetensors file, atomically.

    Arrays may be NumPy or CuPy arrays or Tensors; they are copied to the host. The file is first
    written to a temporary file in the same directory, flushed and fsynced, and only then renamed
    onto ``path`` (``os.replace`` is atomic), so ``path`` always holds either the old file or the
    complete new one, never a torn mix. On any error the temporary file is removed.
    """
    path = os.fspath(path)
    host = {}
    for name, value in arrays.items():
        if not isinstance(name, str):
            raise TypeError(f"save_arrays: array names must be strings, got {name!r}")
        host[name] = _host_array(value)
    metadata = dict(metadata or {})
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"save_arrays: metadata must map str to str, got {key!r}: {value!r} "
                            "(encode other values with json.dumps)")

    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot save {path}: the directory {directory} does not exist")
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    open(tmp, "xb").close()                  # claim a fresh name (normal permissions, never clobbers)
    try:
        _write_safetensors(tmp, host, metadata)
        with open(tmp, "rb+") as f:          # the bytes are on disk before the rename makes them visible
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:                    # KeyboardInterrupt too: never leave the temporary file
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)


def _check_file(path: str, what: str = "file") -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} not found: {path}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what} {path} is a directory, not a file")


def load_arrays(path) -> tuple[dict, dict]:
    """Read a .safetensors file: ({name: numpy array}, {metadata key: str}).

    Raises FileNotFoundError naming a missing file, and ValueError("... is truncated or corrupted")
    for a file whose header or length is not valid safetensors."""
    path = os.fspath(path)
    _check_file(path)
    st = _safetensors()
    try:
        with st.safe_open(path, framework="numpy") as f:
            metadata = dict(f.metadata() or {})
            arrays = {name: f.get_tensor(name) for name in f.keys()}
    except st.SafetensorError as exc:
        kind = _sniff(path)
        if kind in ("npz", "pickle"):
            raise ValueError(f"{path} is a {kind} file, not safetensors; official .npz weights load with "
                             "tinyvit.io.load_pretrained, and pickles are never loaded") from exc
        raise ValueError(f"{path} is not a valid safetensors file: it is truncated or corrupted ({exc})") from exc
    return arrays, metadata


# ==================================================================== 2. models <-> a file


def save(model, path, arrays: Mapping | None = None, metadata: Mapping | None = None) -> None:
    """Save ``model`` (its state_dict, arch and config) to a .safetensors file, atomically.

    arrays: optional extra arrays saved alongside, e.g. optimizer state ({"adam.m.blocks.0...": ...});
            they are stored under the prefix "extra/" and come back from ``load_checkpoint``.
    metadata: optional extra str -> str entries (e.g. {"epoch": "12"}); the keys "format", "arch",
            "config" and "tinyvit_version" are ours.
    The file's metadata: {"format": "tinyvit", "arch": model.arch, "config": JSON of the config
    dataclass, "tinyvit_version": ...}, enough for ``load`` to rebuild the model with no other input.
    """
    metadata = dict(metadata or {})
    clash = [k for k in metadata if k in RESERVED_METADATA]
    if clash:
        raise ValueError(f"save: metadata keys {clash} are reserved by tinyvit ({list(RESERVED_METADATA)})")
    header = {
        "format": FORMAT,
        "arch": model.arch,
        "config": json.dumps(dataclasses.asdict(model.config), sort_keys=True),
        "tinyvit_version": __version__,
    }
    tensors = dict(model.state_dict())
    for name, value in (arrays or {}).items():
        tensors[EXTRA_PREFIX + name] = value
    save_arrays(path, tensors, {**header, **metadata})


def _split_checkpoint(path, arrays: dict, metadata: dict):
    """(model state, extra arrays, user metadata, arch, config dict) of a tinyvit file's contents."""
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is a safetensors file but not a tinyvit checkpoint (its metadata has no "
                         f"'format': 'tinyvit'); to import timm or other weights use tinyvit.io.load_pretrained")
    try:
        arch, config = metadata["arch"], json.loads(metadata["config"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: the checkpoint's 'arch'/'config' metadata is missing or not JSON ({exc})") from exc
    state = {k: v for k, v in arrays.items() if not k.startswith(EXTRA_PREFIX)}
    extra = {k[len(EXTRA_PREFIX):]: v for k, v in arrays.items() if k.startswith(EXTRA_PREFIX)}
    user = {k: v for k, v in metadata.items() if k not in RESERVED_METADATA}
    return state, extra, user, arch, config


def _build(path, arch: str, config: dict):
    """tinyvit.models.from_config, with errors that name the file."""
    from . import models
    try:
        return models.from_config(arch, config)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: cannot rebuild the model (arch {arch!r}, config {config}): {exc}") from exc


def _floating_dtype(state: Mapping):
    """The one floating dtype of a state dict's arrays (None when there are none or several)."""
    dtypes = {np.dtype(a.dtype) for a in state.values() if np.dtype(a.dtype).kind == "f"}
    return dtypes.pop() if len(dtypes) == 1 else None


def _finish(model, state, device, dtype, strict=True):
    """Cast/move ``model``, copy ``state`` in (strict) and switch to eval mode."""
    dtype = dtype if dtype is not None else _floating_dtype(state)
    model.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=strict)
    return model.eval()


def load_checkpoint(path, device=None, dtype=None):
    """Load a file written by ``save``: (model in eval mode, extra arrays, extra metadata).

    device: "cpu" / "cuda" / "cuda:N" for the model (None: the host). dtype: the model's floating
    dtype (None: the checkpoint's own). The extra arrays stay on the host as NumPy arrays."""
    arrays, metadata = load_arrays(path)
    state, extra, user, arch, config = _split_checkpoint(path, arrays, metadata)
    model = _finish(_build(path, arch, config), state, device, dtype)
    return model, extra, user


def load(path, device=None, dtype=None):
    """Rebuild the model saved with ``save(model, path)``, from the file alone; eval mode."""
    return load_checkpoint(path, device=device, dtype=dtype)[0]


def read_state_dict(path) -> dict:
    """Only the model's {name: array} of a tinyvit checkpoint (no extras), for
    ``model.load_state_dict(read_state_dict(path))`` into a model built another way."""
    arrays, metadata = load_arrays(path)
    return _split_checkpoint(path, arrays, metadata)[0]


# ==================================================================== 3. foreign weights: shared tools


def _to_numpy(value) -> np.ndarray:
    """A NumPy copy of a torch tensor (without importing torch), a CuPy/NumPy array or a Tensor."""
    from .autograd import Tensor
    if isinstance(value, Tensor):
        value = value.data
    elif hasattr(value, "detach") and hasattr(value, "cpu"):   # a torch.Tensor
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":               # NumPy has no bfloat16
            value = value.float()
        value = value.numpy()
    return np.array(backend.to_numpy(value), order="C", copy=True)


def _template_regex(template: str) -> re.Pattern:
    """'blocks.{i}.attn.qkv.weight' -> a regex that matches 'blocks.11.attn.qkv.weight' (i = '11')."""
    pattern = re.escape(template)
    pattern = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>\\d+)", pattern)
    return re.compile(pattern + r"\Z")


def _match(name: str, templates):
    """(template, {field: value}) of the first template that ``name`` fits, or (None, None)."""
    for template in templates:
        m = _template_regex(template).match(name)
        if m:
            return template, m.groupdict()
    return None, None


def _report_unknown(unknown, source: str, strict, hint: str = "") -> None:
    """Unused tensors: a ValueError listing them (strict=True), a warning (False), nothing (None)."""
    if not unknown or strict is None:
        return
    message = f"{source}: {len(unknown)} tensor(s) tinyvit's ViT has no place for: {', '.join(sorted(unknown))}"
    if hint:
        message += f". {hint}"
    if strict:
        raise ValueError(message + " (pass strict=False to drop them)")
    warnings.warn(message + " (dropped)", stacklevel=3)


# ==================================================================== 4. timm / PyTorch


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


def from_timm_state_dict(sd: Mapping, strict: bool = True) -> dict:
    """A timm/PyTorch ViT state dict -> ours: {name: NumPy array} in our layouts.

    Values may be torch tensors (converted with .detach().cpu().numpy(); torch is never imported
    here) or arrays. Linear weights are transposed, the patch conv kernel flattened. Tensors we have
    no place for raise a ValueError listing them (strict) or are dropped with a warning.
    timm's ``no_embed_class`` models (position embeddings for the patches only, DeiT-III) get a zero
    row for the class token, which is the same computation in our Eq. 1 order.
    """
    state, unknown = {}, []
    for name, value in sd.items():
        template, _ = _match(name, TIMM_VIT_LAYOUTS)
        if template is None:
            unknown.append(name)
            continue
        layout, array = TIMM_VIT_LAYOUTS[template], _to_numpy(value)
        if layout == "conv":
            array = _contiguous(conv_to_patch_weight(array))
        elif layout == "linear":
            array = _contiguous(array.T)
        state[name] = array
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
    out, unknown = {}, []
    for name, value in state.items():
        template, _ = _match(name, TIMM_VIT_LAYOUTS)
        if template is None:
            unknown.append(name)
            continue
        layout, array = TIMM_VIT_LAYOUTS[template], _to_numpy(value)
        if layout == "conv":
            array = patch_to_conv_weight(array, in_channels)
        elif layout == "linear":
            array = array.T
        out[name] = _contiguous(array)
    if unknown:
        raise ValueError(f"to_timm_state_dict: timm's ViT has no tensors named {', '.join(unknown)} "
                         "(e.g. learned-2d position embeddings)")
    return out


# ==================================================================== 5. the official .npz (Flax)

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


def read_official_npz(path_or_mapping) -> dict:
    """The official checkpoint's {flat name: NumPy array}, with any known prefix removed.
    Reads .npz files with allow_pickle=False: object arrays (pickles) are refused."""
    if isinstance(path_or_mapping, Mapping):
        arrays = {k: _to_numpy(v) for k, v in path_or_mapping.items()}
    else:
        path = os.fspath(path_or_mapping)
        _check_file(path, "official .npz checkpoint")
        try:
            with np.load(path, allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
        except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
            raise ValueError(f"{path} is not a readable .npz file (truncated or corrupted, or holding "
                             f"pickled objects, which are never loaded): {exc}") from exc
    for prefix in OFFICIAL_PREFIXES:
        if f"{prefix}embedding/kernel" in arrays:
            return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
    return arrays


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


# ==================================================================== 6. the config a checkpoint implies


def _is_square(n: int) -> bool:
    return n >= 0 and int(round(n ** 0.5)) ** 2 == n


def _default_heads(dim: int) -> int:
    """Heads of the standard widths (Table 1 of the paper, DeiT's Ti/S), else head size 64 (timm's)."""
    from .models.variants import VIT_SIZES
    known = {d: h for d, _, h, _ in VIT_SIZES.values()}
    if dim in known:
        return known[dim]
    if dim % 64 == 0:
        return dim // 64
    raise ValueError(f"the number of heads of a width-{dim} model is not stored in its weights; pass num_heads=")


def config_from_state_dict(state: Mapping, patch_size: int, in_channels: int, **overrides):
    """The ViTConfig a state dict in OUR names and layouts implies; ``overrides`` win.

    dim, depth, mlp_dim, num_classes (0 without a head), representation_size, qkv_bias, pool
    ("token" with a class token, else "gap"), posemb and image_size (patch grid * patch size) are
    read from the shapes; num_heads is not in the weights (pass it, or a standard width's is used)."""
    from .models.vit import ViTConfig
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
    from .models import resnet
    from .models.hybrid import HybridConfig
    from .models.vit import ViTConfig
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
    if vit.posemb in ("learned-1d", "learned-2d"):                      # the grid is in the weights
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
    widths other than the standard ones."""
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


# ==================================================================== 7. load_pretrained: any source -> a ViT


def _sniff(path: str) -> str:
    """'safetensors', 'npz', 'pickle' or 'unknown', from the file's first bytes (not its name)."""
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:2] == b"PK":                                      # a zip: .npz, or torch.save's zip pickle
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except zipfile.BadZipFile:
            return "unknown"
        if names and all(n.endswith(".npy") for n in names):
            return "npz"
        return "pickle" if any(n.endswith(".pkl") for n in names) else "unknown"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):   # a pickle, protocol 2-5
        return "pickle"
    if len(head) == 9 and head[8:9] == b"{":                   # safetensors: u64 header length, then JSON
        return "safetensors"
    return "unknown"


_PICKLE_HELP = ("{path} is a pickle (a PyTorch .pth/.bin/.pt), and tinyvit never unpickles files: "
                "unpickling runs code. If you trust it, convert it once with PyTorch:\n"
                "    import torch, safetensors.torch\n"
                "    sd = torch.load('{path}', map_location='cpu', weights_only=True)\n"
                "    sd = sd.get('model', sd.get('state_dict', sd))\n"
                "    safetensors.torch.save_file({{k: v.contiguous() for k, v in sd.items()}}, 'model.safetensors')\n"
                "then load the .safetensors file.")


def _read_source(source, hints: dict):
    """(our state dict, arch, the config the checkpoint itself implies) for any source. ``hints``:
    config fields the weights do not store (num_heads for timm, ...), used while inferring."""
    from .models import ARCHS, model_class
    if isinstance(source, Mapping):
        arrays, metadata, where = dict(source), {}, "state dict"
    else:
        where = os.fspath(source)
        _check_file(where, "pretrained weights")
        kind = _sniff(where)
        if kind == "pickle":
            raise ValueError(_PICKLE_HELP.format(path=where))
        if kind == "npz":
            arrays, metadata = read_official_npz(where), {}
        elif kind == "safetensors":
            arrays, metadata = load_arrays(where)
        else:
            raise ValueError(f"{where}: not a safetensors or .npz file (or truncated or corrupted)")

    if metadata.get("format") == FORMAT:                      # our own checkpoint: the config is in it
        state, _, _, arch, config = _split_checkpoint(where, arrays, metadata)
        if arch not in ARCHS:
            raise ValueError(f"{where}: unknown architecture {arch!r}; known: {sorted(ARCHS)}")
        return state, arch, model_class(arch).config_class.from_dict(config)
    if any(k.endswith("embedding/kernel") for k in arrays):   # the official Flax names
        state = from_official_npz(arrays)
        return state, "hybrid" if _is_hybrid(state) else "vit", config_from_official_npz(arrays, **hints)
    kernel = arrays.get("patch_embed.proj.weight")
    if kernel is not None and len(kernel.shape) == 4:         # timm / PyTorch layouts
        arch = "hybrid" if _is_hybrid(arrays) else "vit"
        return from_timm_state_dict(arrays), arch, config_from_timm_state_dict(arrays, **hints)
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
    from .models import resize_pos_embed
    state, reset = dict(state), []
    if old.representation_size != new.representation_size:
        reset += ["pre_logits.", "head."]
    elif old.num_classes != new.num_classes:
        reset += ["head."]
    state = {k: v for k, v in state.items() if not k.startswith(tuple(reset))}

    old_grid, new_grid = old.grid_size, new.grid_size        # patches per side (hybrids: of the feature map)
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
                    **config_overrides):
    """Build a ViT from pretrained weights of any supported kind and load them; eval mode.

    source: a path to an official .npz (google-research/vision_transformer), a tinyvit .safetensors,
            a timm .safetensors (torch layouts), or a state dict (timm names in torch layouts,
            official flat names, or ours). PyTorch pickles (.pth) are refused with a recipe to convert.
    config_overrides: ViTConfig fields that differ from what the weights imply, typically
            num_classes= (a new zero-initialised head for fine-tuning), image_size= (position
            embeddings resized), num_heads= (not stored in timm weights), dropout rates.
    device, dtype: as for ``load`` (dtype None: the checkpoint's own).
    """
    from .models import from_config
    hints = {k: v for k, v in config_overrides.items() if k not in _ADAPTABLE}
    state, arch, old = _read_source(source, hints)
    new = dataclasses.replace(old, **config_overrides)
    state, reset = adapt_state_dict(state, old, new, resize_method)
    model = from_config(arch, dataclasses.asdict(new))
    for name, value in model.state_dict().items():             # the reset head keeps its init
        if name not in state and name.startswith(tuple(reset)):
            state[name] = value
    return _finish(model, state, device, dtype)
