"""Input validation shared by the ops: messages that name the problem, its shapes and the fix."""
from __future__ import annotations

from ..backend import refuse_torch

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


def require_same_dtype(op: str, **named) -> None:
    """Raise TypeError unless every named array has one dtype (NumPy would upcast float32 silently)."""
    dtypes = {name: x.dtype for name, x in named.items() if x is not None and hasattr(x, "dtype")}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{name} {dt}" for name, dt in dtypes.items())
        raise TypeError(f"{op}: inputs must share one floating dtype, got {listing}; convert with .astype() first")
