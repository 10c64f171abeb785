"""The layers of a Vision Transformer (and of the BiT ResNet for the hybrid), each a thin Module over
tinyvit.functional. Parameter names follow timm (attn.qkv.weight, mlp.fc1.weight, ...); 2-D weights
use our layout (in_features, out_features), y = x W + b.
"""
from __future__ import annotations

import math

import numpy as np

from .. import backend
from .. import functional as F
from . import init
from .module import Module, Parameter


def _empty(*shape):
    """A new Parameter of the default dtype, to be filled by an init function."""
    return Parameter(np.zeros(shape, dtype=backend.get_default_dtype()))


def _pair(v, name):
    v = (v, v) if isinstance(v, int) else tuple(v)
    if len(v) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints, got {v}")
    return v


class Linear(Module):
    """y = x W + b, every dense layer of Eq. 1-4.

    x: (..., in_features)  weight: (in_features, out_features)  bias: (out_features,)  ->  y: (..., out_features)
    Init as the official ViT code's Dense layers: Xavier-uniform weight, zero bias.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = init.xavier_uniform_(_empty(in_features, out_features))
        self.bias = init.zeros_(_empty(out_features)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class LayerNorm(Module):
    """LN(x) = (x - mean) / sqrt(var + eps) * weight + bias over the last axis (the LN of Eq. 2-4).

    x: (..., dim)  weight, bias: (dim,)  ->  (..., dim). eps=1e-6 as the official ViT code."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = init.ones_(_empty(dim))
        self.bias = init.zeros_(_empty(dim))

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, eps=self.eps)

    def extra_repr(self):
        return f"{self.dim}, eps={self.eps}"


class GELU(Module):
    """GELU(x) = x * Phi(x) (approximate="none", exact erf) or its tanh approximation ("tanh")."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self):
        return f"approximate={self.approximate!r}"


class ReLU(Module):
    """y = max(x, 0)."""

    def forward(self, x):
        return F.relu(x)


class Tanh(Module):
    """y = tanh(x) (the official ViT's pre-logits layer ends with it)."""

    def forward(self, x):
        return F.tanh(x)


def _check_p(p, what):
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{what}: probability must be in [0, 1), got {p}")
    return float(p)


class Dropout(Module):
    """While training, zero each element with probability p and scale the rest by 1/(1-p);
    the identity in eval mode (and when p == 0)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = _check_p(p, "Dropout")

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        return F.dropout(x, self.p, self.training)

    def extra_repr(self):
        return f"p={self.p}"


class DropPath(Module):
    """Stochastic depth: while training, drop a whole residual branch per sample with probability p
    (scaling kept ones by 1/(1-p)); the identity in eval mode."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = _check_p(p, "DropPath")

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        return F.drop_path(x, self.p, self.training)

    def extra_repr(self):
        return f"p={self.p}"


class MultiHeadAttention(Module):
    """Multi-head self-attention, MSA of Eq. 2 (appendix A, Eq. 5-8), then dropout on its output.

    x: (B, N, dim)  ->  (B, N, dim); with return_attention=True also the weights A: (B, heads, N, N).
    qkv: Linear(dim, 3*dim), columns ordered q | k | v, heads split within each; proj: Linear(dim, dim).
    The qkv weight is Xavier-initialised as three separate (dim, dim) matrices, as the official code's
    separate query/key/value Dense layers are (bound sqrt(6 / (dim + dim)), not sqrt(6 / (dim + 3 dim))).
    attn_dropout: dropout on the attention weights; proj_dropout: after the output projection
    (appendix B.1: dropout after every dense layer except the qkv ones).
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True,
                 attn_dropout: float = 0.0, proj_dropout: float = 0.0):
        super().__init__()
        if num_heads <= 0 or dim % num_heads:
            raise ValueError(f"MultiHeadAttention: dim={dim} is not divisible by num_heads={num_heads}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.attn_dropout = _check_p(attn_dropout, "MultiHeadAttention attn_dropout")
        self.qkv = Linear(dim, 3 * dim, bias=qkv_bias)
        bound = math.sqrt(6.0 / (dim + dim))
        init.uniform_(self.qkv.weight, -bound, bound)
        self.proj = Linear(dim, dim)
        self.proj_drop = Dropout(proj_dropout)

    def forward(self, x, return_attention: bool = False):
        out = F.multi_head_attention(x, self.qkv.weight, self.qkv.bias, self.proj.weight, self.proj.bias,
                                     self.num_heads, attn_dropout=self.attn_dropout, training=self.training,
                                     return_attention=return_attention)
        if return_attention:
            out, attn = out
            return self.proj_drop(out), attn
        return self.proj_drop(out)

    def extra_repr(self):
        return f"dim={self.dim}, num_heads={self.num_heads}, attn_dropout={self.attn_dropout}"


class MLP(Module):
    """The transformer's MLP block (Eq. 3): fc1 -> GELU -> dropout -> fc2 -> dropout.

    x: (..., dim)  ->  (..., out_dim or dim), hidden width hidden_dim (4 * dim in ViT).
    Biases start at N(0, 1e-6^2) as the official MlpBlock's (and timm's jax init)."""

    def __init__(self, dim: int, hidden_dim: int, dropout: float = 0.0, approximate: str = "none",
                 out_dim: int | None = None):
        super().__init__()
        out_dim = dim if out_dim is None else out_dim
        self.fc1 = Linear(dim, hidden_dim)
        self.act = GELU(approximate)
        self.drop1 = Dropout(dropout)
        self.fc2 = Linear(hidden_dim, out_dim)
        self.drop2 = Dropout(dropout)
        init.normal_(self.fc1.bias, std=1e-6)
        init.normal_(self.fc2.bias, std=1e-6)

    def forward(self, x):
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class Conv2d(Module):
    """2-D convolution (the hybrid's ResNet, and the patch embedding written as a conv).

    x: (B, in, H, W)  weight: (out, in, kh, kw)  bias: (out,)  ->  (B, out, H', W'),
    H' = (H + 2 padding - kh) // stride + 1. He-normal weight (std sqrt(2 / (in kh kw))), zero bias."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, bias: bool = True):
        super().__init__()
        kh, kw = _pair(kernel_size, "kernel_size")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding = (kh, kw), stride, padding
        self.weight = init.kaiming_normal_(_empty(out_channels, in_channels, kh, kw))
        self.bias = init.zeros_(_empty(out_channels)) if bias else None

    def forward(self, x):
        return F.conv2d(x, self.weight, self.bias, stride=self.stride, padding=self.padding)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}")


class GroupNorm(Module):
    """Group normalisation (Wu & He 2018; BiT uses it): normalise each group of num_channels/num_groups
    channels of each sample over (channels in group, H, W), then per-channel weight and bias.
    x: (B, C, H, W)  weight, bias: (C,)."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5):
        super().__init__()
        if num_groups <= 0 or num_channels % num_groups:
            raise ValueError(f"GroupNorm: num_channels={num_channels} is not divisible by num_groups={num_groups}")
        self.num_groups, self.num_channels, self.eps = num_groups, num_channels, eps
        self.weight = init.ones_(_empty(num_channels))
        self.bias = init.zeros_(_empty(num_channels))

    def forward(self, x):
        return F.group_norm(x, self.num_groups, self.weight, self.bias, eps=self.eps)

    def extra_repr(self):
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}"
