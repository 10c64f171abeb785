"""The fast path: the same ops as tinyvit/ops/, rewritten for speed, each tested equal to its reference.

    kernels/cpu/    NumPy kernels: cache-sized blocks shared among threads, fused neighbours
                    (residual add + LayerNorm, bias + GELU, the attention chain), the optimizer update
                    of many tensors at once
    kernels/cuda/   CuPy kernels (CUDA C++), each used once its GPU tests passed (cuda/passed.json)
    fusion.py       fuse(model): the ViT encoder fused across layers, one explicit step the
                    training loop takes (never a hidden replacement of the model's code)

ops/, nn/ and models/ never import this package: tinyvit.functional (the switchboard) asks
``kernel_for(name, *arrays)`` which implementation to run, and falls back to the reference when it
answers None. The choice depends on three things only, never on train/eval mode:

    the setting      use_kernels(False) (a call, or a ``with`` block), or TINYVIT_KERNELS=0 in the
                     environment, or ``--kernels off`` on the command line; on by default
    the array module NumPy arrays get kernels/cpu; CuPy arrays get kernels/cuda's, but only those
                     whose GPU tests have passed (kernels/cuda/passed.json), unless the setting
                     is "all" (use_kernels("all"), TINYVIT_KERNELS=all, ``--kernels all``)
    the dtype        float32 and float64 (the gradient checks run the kernels in float64 too)
"""
from __future__ import annotations

import importlib
import os

import numpy as np

from ..autograd import Tensor
from ..backend import get_array_module

_OFF_WORDS = ("0", "off", "false", "no")
ALL = "all"                        # also the CUDA kernels not yet recorded as passed on a GPU


def _from_environment():
    word = os.environ.get("TINYVIT_KERNELS", "1").strip().lower()
    return ALL if word == ALL else word not in _OFF_WORDS


_enabled = _from_environment()     # True, False or ALL


def kernels_enabled() -> bool:
    """True when the switchboard picks kernels (the default)."""
    return bool(_enabled)


class use_kernels:
    """Turn the kernels on or off, for the rest of the program or for a ``with`` block:

        tinyvit.use_kernels(False)              # from here on, every op runs its reference
        with tinyvit.use_kernels(False): ...    # only inside the block; the old setting comes back
        tinyvit.use_kernels("all")              # also CUDA kernels not yet recorded as passed on a GPU
    """

    def __init__(self, enabled=True):
        global _enabled
        if not (isinstance(enabled, bool) or enabled == ALL):
            raise TypeError(f"use_kernels: expected True, False or {ALL!r}, got {enabled!r}")
        self.previous = _enabled
        _enabled = enabled

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _enabled
        _enabled = self.previous
        return False


# op name -> "module:attribute" of its CPU kernel, a Function with the reference's signature (or, for
# "optimizer_step", the function documented in that module).
CPU_KERNELS = {
    "linear": "linear:Linear",
    "patch_embed": "linear:PatchEmbed",
    "layer_norm": "layernorm:LayerNorm",
    "gelu": "gelu:GELU",
    "gelu_tanh": "gelu:GELUTanh",
    "multi_head_attention": "attention:MultiHeadAttention",
    "optimizer_step": "optim:step",
}

# The CUDA kernels, by the same names (kernels/cuda/); each runs only once kernels/cuda/passed.json
# records that its GPU tests passed, or when the setting is "all".
CUDA_KERNELS: dict = {
    "linear": "linear:Linear",
    "patch_embed": "linear:PatchEmbed",
    "layer_norm": "layernorm:LayerNorm",
    "gelu": "gelu:GELU",
    "gelu_tanh": "gelu:GELUTanh",
    "optimizer_step": "optim:step",
    "multi_head_attention": "attention:MultiHeadAttention",
    "cross_entropy": "loss:CrossEntropy",
}

_KERNEL_DTYPES = (np.float32, np.float64)


def _load(package: str, where: str):
    module, attribute = where.split(":")
    return getattr(importlib.import_module(f"{__name__}.{package}.{module}"), attribute)


def kernel_for(name: str, *arrays):
    """The kernel that computes op ``name`` for these arrays, or None (then run the reference): None
    when kernels are off, when the op has no kernel for the arrays' module, or for other dtypes."""
    if not _enabled:
        return None
    arrays = [a.data if isinstance(a, Tensor) else a for a in arrays if a is not None]
    if not arrays or any(getattr(a, "dtype", None) not in _KERNEL_DTYPES for a in arrays):
        return None
    xp = get_array_module(*arrays)
    if xp is np:
        where = CPU_KERNELS.get(name)
        return None if where is None else _load("cpu", where)
    where = CUDA_KERNELS.get(name)
    if where is None or (_enabled != ALL and name not in _cuda_passed()):
        return None
    return _load("cuda", where)


def fuse(model):
    """``forward = kernels.fuse(model)``: the model with its encoder fused across layers, or the model
    itself when there is nothing to fuse (kernels/fusion.py; like nanoGPT's torch.compile line)."""
    from .fusion import fuse as fused           # imported on first use: fusion imports the models,
    return fused(model)                         # which import this package (through tinyvit.functional)


def _cuda_passed() -> dict:
    from .cuda import passed_kernels
    return passed_kernels()
