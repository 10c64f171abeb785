"""Weight initialisation, in place on Parameters (PyTorch's names: ``init.xavier_uniform_(p)``).

Values are drawn on the host from tinyvit's seeded generator (``tinyvit.backend.rng()``, reset by
``tinyvit.manual_seed``), converted to the parameter's dtype and written into its array on its device,
so the same seed gives the same model on the CPU and on a GPU.

Fan-in and fan-out follow *our* layouts:
    Linear weight (in_features, out_features):      fan_in = shape[0],          fan_out = shape[1]
    Conv weight   (out, in, kh, kw):                fan_in = in * kh * kw,      fan_out = out * kh * kw
(PyTorch's Linear weight is (out, in), so its fans read the other way round.)
"""
from __future__ import annotations

import math

import numpy as np

from .. import backend


def _fill(param, values):
    """Write host ``values`` into ``param``'s array, in its dtype, on its device."""
    dest = param.data
    if tuple(np.shape(values)) != tuple(dest.shape):
        values = np.broadcast_to(values, dest.shape)
    values = np.asarray(values, dtype=dest.dtype)
    dest[...] = backend.to_device(values, backend.device_of(dest))
    return param


def calculate_fans(shape):
    """(fan_in, fan_out) of a weight of ``shape`` in our layouts (see the module docstring)."""
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"fan-in and fan-out need a weight with at least 2 axes, got shape {shape}")
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = int(np.prod(shape[2:]))
    return shape[1] * receptive, shape[0] * receptive


def zeros_(param):
    """param = 0."""
    return _fill(param, np.zeros(param.shape))


def ones_(param):
    """param = 1."""
    return _fill(param, np.ones(param.shape))


def uniform_(param, a: float = 0.0, b: float = 1.0):
    """param ~ U(a, b)."""
    return _fill(param, backend.rng().uniform(a, b, size=param.shape))


def normal_(param, mean: float = 0.0, std: float = 1.0):
    """param ~ N(mean, std^2)."""
    return _fill(param, backend.rng().normal(mean, std, size=param.shape))


def trunc_normal_(param, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0):
    """param ~ N(mean, std^2) conditioned on a <= value <= b; a and b are absolute values (as in
    PyTorch and timm: trunc_normal_(p, std=0.02) truncates at +-2, i.e. at 100 standard deviations).
    Drawn by rejection: values outside [a, b] are redrawn until none is left."""
    if not a < b:
        raise ValueError(f"trunc_normal_: need a < b, got a={a}, b={b}")
    rng = backend.rng()
    values = rng.normal(mean, std, size=param.shape)
    bad = (values < a) | (values > b)
    for _ in range(1000):
        if not bad.any():
            break
        values[bad] = rng.normal(mean, std, size=int(bad.sum()))
        bad = (values < a) | (values > b)
    else:  # the interval holds almost no probability mass: clip what is left
        np.clip(values, a, b, out=values)
    return _fill(param, values)


def xavier_uniform_(param, gain: float = 1.0):
    """Glorot & Bengio (2010): param ~ U(-bound, bound), bound = gain * sqrt(6 / (fan_in + fan_out)).
    The official ViT code initialises its Dense layers this way."""
    fan_in, fan_out = calculate_fans(param.shape)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(param, -bound, bound)


def kaiming_normal_(param, mode: str = "fan_in", gain: float = math.sqrt(2.0)):
    """He et al. (2015): param ~ N(0, std^2), std = gain / sqrt(fan), gain sqrt(2) for ReLU nets."""
    fan = _fan(param, mode)
    return normal_(param, 0.0, gain / math.sqrt(fan))


def lecun_normal_(param):
    """LeCun normal, flax's default for the ViT patch-embedding conv: a normal truncated at two
    standard deviations, rescaled so that its variance is 1 / fan_in."""
    fan_in, _ = calculate_fans(param.shape)
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # std of N(0,1) truncated to [-2, 2]
    return trunc_normal_(param, 0.0, std, -2.0 * std, 2.0 * std)


def _fan(param, mode):
    fan_in, fan_out = calculate_fans(param.shape)
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"mode must be 'fan_in' or 'fan_out', got {mode!r}")
    return fan_in if mode == "fan_in" else fan_out
