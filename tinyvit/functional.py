"""The lowercase functions users call, ``import tinyvit.functional as F``: thin wrappers over tinyvit.ops.

Every function accepts Tensors or raw arrays and returns a Tensor.
"""
from .ops.activation import gelu, log_softmax, softmax
from .ops.attention import multi_head_attention
from .ops.basic import (add, cast, concat, div, exp, getitem, linear, log, matmul, max, mean, mul, neg,
                        permute, pow, relu, reshape, sqrt, sub, sum, tanh, transpose, where)
from .ops.conv import conv2d, max_pool2d
from .ops.loss import cross_entropy, mse
from .ops.norm import add_layer_norm, fold_norm_affine, group_norm, layer_norm, weight_standardize
from .ops.patch import patch_embed
from .ops.regularize import drop_path, dropout

__all__ = [
    "add", "sub", "mul", "div", "neg", "pow", "exp", "log", "sqrt", "tanh", "relu", "cast",
    "sum", "mean", "max", "reshape", "transpose", "permute", "getitem", "concat", "where",
    "matmul", "linear", "gelu", "softmax", "log_softmax", "cross_entropy", "mse", "layer_norm",
    "add_layer_norm", "fold_norm_affine", "group_norm", "weight_standardize", "dropout", "drop_path", "patch_embed",
    "multi_head_attention", "conv2d", "max_pool2d",
]
