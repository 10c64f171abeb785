"""tinyvit's own checkpoints: a model, its arch and config (+ optional extras) in one .safetensors file.

    save(model, path, arrays=None, metadata=None)    a model + its arch and config (+ optional extras)
    load(path, device=None, dtype=None) -> model     rebuilt from the file alone, in eval mode
    load_checkpoint(path) -> (model, arrays, metadata)   the same plus the extras (training resume)
    read_state_dict(path) -> {name: array}           only the model's arrays

The file's metadata says what it is: FORMAT under "format", the arch, the config as JSON and the
tinyvit version (RESERVED_METADATA); extra arrays live under EXTRA_PREFIX. Writing is atomic
(``save_arrays`` in arrays.py).

Loading trusts nothing in the file: before any model is built, the header's arrays are checked
against the shapes its config implies (``state_shapes``), so a config that describes a huge model
cannot make us allocate more than the file itself holds.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import numpy as np

from .. import __version__
from .arrays import check_json_depth, load_arrays, read_header, save_arrays
from .config import state_shapes

FORMAT = "tinyvit"
EXTRA_PREFIX = "extra/"   # extra arrays (optimizer state, ...) live under this prefix; "/" never
#                           appears in a module's dotted parameter names, so they cannot collide.
RESERVED_METADATA = ("format", "arch", "config", "tinyvit_version")
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")   # safetensors' names of the dtypes a model's weights may have
JSON_METADATA = ("config", "dataset", "training")   # the metadata values tinyvit writes as JSON


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
        check_json_depth(metadata.get("config", ""), f"{path}: its 'config' metadata")
        arch, config = metadata["arch"], json.loads(metadata["config"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: the checkpoint's 'arch'/'config' metadata is missing or not JSON ({exc}); the "
                         "file is damaged or was edited: use one written by tinyvit.save") from exc
    state = {k: v for k, v in arrays.items() if not k.startswith(EXTRA_PREFIX)}
    extra = {k[len(EXTRA_PREFIX):]: v for k, v in arrays.items() if k.startswith(EXTRA_PREFIX)}
    user = {k: v for k, v in metadata.items() if k not in RESERVED_METADATA}
    return state, extra, user, arch, config


def _model_config(path, arch: str, config: dict):
    """The config dataclass of the model the file describes (no arrays yet), with errors that name the file."""
    from .. import models
    try:
        return models.model_class(arch).config_class.from_dict(dict(config))
    except (ValueError, TypeError) as exc:                           # TypeError: a config that is not a dict
        raise ValueError(f"{path}: cannot rebuild the model (arch {arch!r}, config {config}): {exc}") from exc


def _check_header_fits(path, config, specs: Mapping) -> None:
    """Refuse a file whose model arrays are not exactly those its config implies: names, shapes and a
    floating dtype, read from the header (``specs``: {name: (dtype, shape)}) before anything is built.

    Once they match, the model is as large as the file, whatever its config says. The expected shapes
    come from a generator, left as soon as the file is shown short, so a config with absurdly many
    blocks costs no more than the file's own list of names."""
    seen, problems = set(), []
    for name, shape in state_shapes(config):
        seen.add(name)
        if name not in specs:
            problems.append(f"{name} is missing")
        elif specs[name][1] != shape:
            problems.append(f"{name} is {specs[name][1]} in the file but {shape} in its config")
        if len(problems) == 3 or len(seen) > len(specs):         # more names expected than the file has
            break
    else:
        problems += [f"{name} is not part of that model" for name in sorted(set(specs) - seen)]
    problems += [f"{name} is {dtype}, not floating point" for name, (dtype, _) in specs.items()
                 if dtype not in FLOAT_DTYPES]
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ValueError(f"{path}: its arrays do not fit the model its config describes ({'; '.join(problems[:3])}"
                         f"{more}); the file is damaged or was edited: use one written by tinyvit.save "
                         "(foreign weights load with tinyvit.io.load_pretrained)")


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
    dtype (None: the checkpoint's own). The extra arrays stay on the host as NumPy arrays.
    Raises ValueError, before building anything, when the file's arrays do not fit the model its
    config describes."""
    from ..models import model_class
    specs, metadata = read_header(path)
    for key in JSON_METADATA:                   # parsed later (by predict, a resume): of a sane depth
        if key in metadata:
            check_json_depth(metadata[key], f"{path}: its {key!r} metadata")
    state_specs, _, _, arch, config = _split_checkpoint(path, specs, metadata)
    model_config = _model_config(path, arch, config)
    _check_header_fits(path, model_config, state_specs)
    arrays, metadata = load_arrays(path)
    state, extra, user, _, _ = _split_checkpoint(path, arrays, metadata)
    model = _finish(model_class(arch)(model_config), state, device, dtype)
    return model, extra, user


def load(path, device=None, dtype=None):
    """Rebuild the model saved with ``save(model, path)``, from the file alone; eval mode."""
    return load_checkpoint(path, device=device, dtype=dtype)[0]


def read_state_dict(path) -> dict:
    """Only the model's {name: array} of a tinyvit checkpoint (no extras), for
    ``model.load_state_dict(read_state_dict(path))`` into a model built another way."""
    arrays, metadata = load_arrays(path)
    return _split_checkpoint(path, arrays, metadata)[0]
