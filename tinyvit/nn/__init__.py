"""Modules: Parameter, Module, containers and the layers a ViT is built from (PyTorch's names).

    import tinyvit.nn as nn
    mlp = nn.Sequential(nn.Linear(2, 16), nn.GELU(), nn.Linear(16, 1))
"""
from . import init
from .layers import (GELU, MLP, Conv2d, Dropout, DropPath, GroupNorm, LayerNorm, Linear, MultiHeadAttention,
                     ReLU, Tanh)
from .module import Identity, Module, ModuleList, Parameter, Sequential
from .relative import RelativeMultiHeadAttention

__all__ = [
    "Parameter", "Module", "Sequential", "ModuleList", "Identity",
    "Linear", "LayerNorm", "GELU", "ReLU", "Tanh", "Dropout", "DropPath", "MultiHeadAttention",
    "RelativeMultiHeadAttention", "MLP",
    "Conv2d", "GroupNorm", "init",
]
