"""Regularizers that act only in training: dropout (ViT applies it after every dense layer except the
qkv projection, and after adding the position embeddings, appendix B.1) and stochastic depth, "drop
path", on each residual branch (as in the DeiT and AugReg ViT recipes).

Masks come from tinyvit.backend.random_uniform, seeded by tinyvit.manual_seed, so a run repeats
exactly and under CuPy the mask is drawn on the GPU.
"""
from __future__ import annotations

import numbers

from ..autograd import Function, Tensor
from ..backend import get_array_module, random_uniform
from .common import require_float, shape_of


class Dropout(Function):
    """Inverted dropout (Srivastava et al. 2014): each element is kept with probability 1 - p and
    scaled by 1 / (1 - p), so the expected output equals the input and evaluation needs no rescaling.

    x: any shape -> y: same shape
      y = x * keep / (1 - p),  keep ~ Bernoulli(1 - p) element-wise
      dL/dx = gy * keep / (1 - p)
    """

    def forward(self, x, p):
        xp = get_array_module(x)
        keep = random_uniform(xp, x.shape, x.dtype) >= p      # bool: P(u >= p) = 1 - p
        scale = 1.0 / (1.0 - p)
        self.save(keep, scale)
        y = x * keep
        y *= scale
        return y

    def backward(self, gy):
        keep, scale = self.saved
        gx = gy * keep
        gx *= scale
        return gx


class DropPath(Function):
    """Stochastic depth (Huang et al. 2016): each sample's whole residual branch is dropped with
    probability p, survivors scaled by 1 / (1 - p); x_{l+1} = x_l + drop_path(f(x_l)).

    x: (B, ...) -> y: same shape
      y = x * m,  m: (B, 1, ..., 1) = keep_b / (1 - p),  keep_b ~ Bernoulli(1 - p) per sample
      dL/dx = gy * m
    """

    def forward(self, x, p):
        xp = get_array_module(x)
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        mask = (random_uniform(xp, shape, x.dtype) >= p).astype(x.dtype)
        mask *= 1.0 / (1.0 - p)
        self.save(mask)
        return x * mask

    def backward(self, gy):
        (mask,) = self.saved
        return gy * mask


# ---------------------------------------------------------------- the functions users call


def _check_p(op, p) -> float:
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"{op}: p must be a number in [0, 1), got {type(p).__name__}")
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{op}: p must be in [0, 1), got {p} (p is the probability of dropping)")
    return p


def _unchanged(x):
    return x if isinstance(x, Tensor) else Tensor(x)


def dropout(x, p, training):
    """Inverted dropout with drop probability p; the identity when not training or p == 0."""
    require_float("dropout", x=x)
    p = _check_p("dropout", p)
    if not training or p == 0.0:
        return _unchanged(x)
    return Dropout.apply(x, p)


def drop_path(x, p, training):
    """Stochastic depth on x (B, ...): drops whole samples with probability p; the identity when
    not training or p == 0."""
    require_float("drop_path", x=x)
    p = _check_p("drop_path", p)
    if not shape_of(x):
        raise ValueError(f"drop_path: x must have a batch axis (B, ...), got shape {shape_of(x)}")
    if not training or p == 0.0:
        return _unchanged(x)
    return DropPath.apply(x, p)
