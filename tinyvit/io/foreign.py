"""Shared tools for importing foreign weights (timm.py, official.py, config.py).

Name templates such as 'blocks.{i}.attn.qkv.weight' matched against real names, a NumPy copy of
any tensor (torch, CuPy, ours) without importing torch, and one way to report tensors we have no
place for (an error, a warning, or nothing).
"""
from __future__ import annotations

import re
import warnings

import numpy as np

from .. import backend


def _to_numpy(value) -> np.ndarray:
    """A NumPy copy of a torch tensor (without importing torch), a CuPy/NumPy array or a Tensor."""
    from ..autograd import Tensor
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


class UnknownTensors(ValueError):
    """Tensors a converter has no place for (strict=True); ``names`` lists them, ``hint`` says why.
    load_pretrained, which takes no ``strict``, turns it into its own message."""

    def __init__(self, message: str, names: list, hint: str):
        super().__init__(message)
        self.names, self.hint = names, hint


def _report_unknown(unknown, source: str, strict, hint: str = "") -> None:
    """Unused tensors: a ValueError listing them (strict=True), a warning (False), nothing (None)."""
    if not unknown or strict is None:
        return
    message = f"{source}: {len(unknown)} tensor(s) tinyvit's ViT has no place for: {', '.join(sorted(unknown))}"
    if hint:
        message += f". {hint}"
    if strict:
        raise UnknownTensors(message + f" ({source}(..., strict=False) drops them, and the result then computes "
                             "something else than the original model)", sorted(unknown), hint)
    warnings.warn(message + " (dropped)", stacklevel=3)


def _is_square(n: int) -> bool:
    return n >= 0 and int(round(n ** 0.5)) ** 2 == n
