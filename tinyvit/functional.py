"""The lowercase functions users call, ``import tinyvit.functional as F``, and the one switchboard
that decides, per call, whether the reference op (tinyvit/ops/) or its kernel (tinyvit/kernels/)
computes it: the kernel when kernels are on and one exists for the arrays' module and dtype
(tinyvit.kernels.kernel_for), the reference otherwise: each ops/ function takes ``function=``, the
Function that computes it, and runs its own reference when that is None. Both give the same numbers (the tests prove
it); the reference is the one to read beside the paper.

Every function accepts Tensors or raw arrays and returns a Tensor.
"""
from .kernels import kernel_for
from .ops import activation, attention, basic, loss, norm, patch
from .ops.activation import log_softmax, softmax
from .ops.basic import (add, cast, concat, div, exp, getitem, log, matmul, max, mean, mul, neg, permute, pow,
                        relu, reshape, sqrt, sub, sum, tanh, transpose, where)
from .ops.conv import conv2d, max_pool2d
from .ops.loss import mse
from .ops.norm import group_norm, weight_standardize
from .ops.regularize import drop_path, dropout

__all__ = [
    "add", "sub", "mul", "div", "neg", "pow", "exp", "log", "sqrt", "tanh", "relu", "cast",
    "sum", "mean", "max", "reshape", "transpose", "permute", "getitem", "concat", "where",
    "matmul", "linear", "gelu", "softmax", "log_softmax", "cross_entropy", "mse", "layer_norm",
    "group_norm", "weight_standardize", "dropout", "drop_path", "patch_embed",
    "multi_head_attention", "conv2d", "max_pool2d"
]


def linear(x, w, b=None):
    """y = x @ w + b with w of shape (in_features, out_features), as the paper's x E.
    Reference: ops/basic.py Linear; kernel: kernels/cpu/linear.py."""
    return basic.linear(x, w, b, function=kernel_for("linear", x, w, b))


def patch_embed(images, w, b, patch_size):
    """Eq. 1's x_p E: images (B, C, H, W) -> tokens (B, N, D), w: (C*P*P, D), b: (D,) or None.
    Reference: ops/patch.py; kernel: kernels/cpu/linear.py."""
    return patch.patch_embed(images, w, b, patch_size, function=kernel_for("patch_embed", images, w, b))


def layer_norm(x, weight, bias, eps=1e-6):
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias (x: (..., D)).
    Reference: ops/norm.py; kernels: kernels/cpu/layernorm.py, kernels/cuda/layernorm.py."""
    return norm.layer_norm(x, weight, bias, eps, function=kernel_for("layer_norm", x, weight, bias))


def gelu(x, approximate="none"):
    """GELU, y = x Phi(x): exact with approximate="none" (erf), the tanh form with "tanh".
    Reference: ops/activation.py; kernels: kernels/cpu/gelu.py, kernels/cuda/gelu.py."""
    name = "gelu" if approximate == "none" else "gelu_tanh"
    return activation.gelu(x, approximate, function=kernel_for(name, x))


def cross_entropy(logits, target, label_smoothing=0.0, check_labels=True):
    """Mean cross-entropy of logits (..., K) against integer labels (...) or probabilities (..., K),
    label smoothing eps mixing the target with the uniform distribution: (1 - eps) t + eps / K.
    check_labels=False skips the labels' range check (a host read on a GPU) for labels checked before.
    Reference: ops/loss.py; kernel: kernels/cuda/loss.py."""
    return loss.cross_entropy(logits, target, label_smoothing, check_labels,
                              function=kernel_for("cross_entropy", logits))


def multi_head_attention(x, w_qkv, b_qkv, w_proj, b_proj, num_heads, attn_dropout=0.0, training=False,
                         return_attention=False):
    """Multi-head self-attention (appendix A, Eq. 5-8) on tokens x: (B, N, D) -> (B, N, D); see
    ops/attention.py for the arguments. Reference: ops/attention.py; kernels: kernels/cpu/attention.py,
    kernels/cuda/attention.py."""
    kernel = kernel_for("multi_head_attention", x, w_qkv, b_qkv, w_proj, b_proj)
    return attention.multi_head_attention(x, w_qkv, b_qkv, w_proj, b_proj, num_heads, attn_dropout, training,
                                          return_attention, function=kernel)
