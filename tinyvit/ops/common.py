"""Small helpers shared by the ops: input validation with messages that name the problem, and the
cache blocking of element-wise formulas on NumPy."""
from __future__ import annotations

import numpy as np

from ..autograd import Tensor
from ..backend import get_array_module

# ---------------------------------------------------------------- cache blocking (NumPy)

# An element-wise formula of several steps (GELU's erf, LayerNorm, softmax) makes one temporary per
# step. On whole (B*N, D) arrays each temporary streams through main memory; evaluated on blocks of
# BLOCK_ELEMENTS elements (128 KiB of float32) the temporaries stay in the CPU cache and only the
# inputs and outputs travel: two to three times faster. A Python loop over blocks, each vectorized.
# On CuPy there is one block, the whole array: each step is a GPU kernel either way.
BLOCK_ELEMENTS = 1 << 15


def row_blocks(x2):
    """Slices of consecutive rows of the 2-D array x2, about BLOCK_ELEMENTS elements each
    (a single slice of all rows on CuPy)."""
    rows, length = x2.shape
    if get_array_module(x2) is not np:
        return [slice(None)]
    step = max(1, BLOCK_ELEMENTS // max(1, length))
    return [slice(start, start + step) for start in range(0, rows, step)]


def blockwise(fn, *arrays):
    """fn(*blocks) on consecutive blocks of BLOCK_ELEMENTS elements of the flattened arrays (all of
    one shape), put back together in that shape; fn must be element-wise. fn(*arrays) on CuPy."""
    if get_array_module(*arrays) is not np:
        return fn(*arrays)
    flats = [a.reshape(-1) for a in arrays]
    out = np.empty_like(flats[0])
    for start in range(0, out.size, BLOCK_ELEMENTS):
        out[start:start + BLOCK_ELEMENTS] = fn(*(f[start:start + BLOCK_ELEMENTS] for f in flats))
    return out.reshape(arrays[0].shape)


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
