"""Input validation shared by the ops: messages that name the problem, its shapes and the fix; and
``widened``, the float32 in which ops compute what would overflow float16."""
from __future__ import annotations

import numpy as np

from ..autograd import Tensor
from ..backend import refuse_torch


def widened(x):
    """x itself, or float16 x as float32. float16 holds no more than 65504: a square (erf's, a
    variance's), an attention score or a sum of log-probabilities of ordinary activations can exceed
    it and give inf or NaN where float32 gives a number; the ops that compute one do it in float32
    and round the result back to float16."""
    return x.astype(np.float32) if x.dtype.itemsize < 4 else x

# ---------------------------------------------------------------- input validation


def shape_of(x):
    """Shape of a Tensor, an array, or () for a Python number."""
    return tuple(getattr(x, "shape", ()))


def dtype_of(x):
    return x.dtype if hasattr(x, "dtype") else None


def require_float(op: str, **named) -> None:
    """Raise TypeError if any named Tensor/array is not floating point (e.g. int pixels or labels)."""
    for name, x in named.items():
        if x is None:
            continue
        refuse_torch(x)                        # before its torch.dtype meets NumPy's
        dt = dtype_of(x)
        if dt is not None and dt.kind != "f":
            raise TypeError(f"{op}: {name} must be a floating-point array, got dtype {dt} "
                            f"(shape {shape_of(x)}); convert with .astype(np.float32)")


def require_ndim(op: str, name: str, x, ndims, meaning: str) -> None:
    """Raise ValueError unless x.ndim is in ``ndims``; ``meaning`` spells the expected layout."""
    nd = len(shape_of(x))
    if nd not in (ndims if isinstance(ndims, (tuple, list)) else (ndims,)):
        raise ValueError(f"{op}: {name} must be {meaning}, got shape {shape_of(x)}")


def is_tensor(x) -> bool:
    return isinstance(x, Tensor)


def require_same_dtype(op: str, **named) -> None:
    """Raise TypeError unless every named array has one dtype (NumPy would upcast float32 silently)."""
    dtypes = {name: x.dtype for name, x in named.items() if x is not None and hasattr(x, "dtype")}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{name} {dt}" for name, dt in dtypes.items())
        raise TypeError(f"{op}: inputs must share one floating dtype, got {listing}; convert with .astype() first")
