"""tinyvit's own checkpoints: a model, its arch and config (+ optional extras) in one .safetensors file.

    save(model, path, arrays=None, metadata=None)    a model + its arch and config (+ optional extras)
    load(path, device=None, dtype=None) -> model     rebuilt from the file alone, in eval mode
    load_checkpoint(path) -> (model, arrays, metadata)   the same plus the extras (training resume)
    read_state_dict(path) -> {name: array}           only the model's arrays

The file's metadata says what it is: FORMAT under "format", the arch, the config as JSON and the
tinyvit version (RESERVED_METADATA); extra arrays live under EXTRA_PREFIX. Writing is atomic
(``save_arrays`` in arrays.py).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import numpy as np

from .. import __version__
from .arrays import load_arrays, save_arrays

FORMAT = "tinyvit"
EXTRA_PREFIX = "extra/"   # extra arrays (optimizer state, ...) live under this prefix; "/" never
#                           appears in a module's dotted parameter names, so they cannot collide.
RESERVED_METADATA = ("format", "arch", "config", "tinyvit_version")


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
    from .. import models
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
