"""Normalisation: layer_norm (the LN of Eq. 2-4), group_norm and weight standardization (BiT's ResNet,
the hybrid model's backbone).

All three standardise rows of a 2-D view of their input,

    x_hat = (x - mean) / sqrt(var + eps)          (biased variance, over the last axis of the view)

and share one backward for that step. With g = dL/dx_hat and n the row length,

    dL/dx = inv_std * (g - mean(g) - x_hat * mean(g * x_hat))

(the two means are the Jacobian's rank-one corrections for the mean and the variance).
The fast LayerNorm, with the residual add fused in, is kernels/cpu/layernorm.py.
"""
from __future__ import annotations

from ..autograd import Function
from ..backend import get_array_module
from .common import require_float, require_ndim, require_same_dtype, shape_of


def _standardize_rows(x2, eps):
    """x2: (R, n) -> x_hat (R, n), inv_std (R, 1): each row to zero mean, unit (biased) variance."""
    xp = get_array_module(x2)
    x_hat = x2 - x2.mean(axis=-1, keepdims=True)
    inv_std = 1.0 / xp.sqrt((x_hat * x_hat).mean(axis=-1, keepdims=True) + eps)
    return x_hat * inv_std, inv_std


def _standardize_rows_backward(g, x_hat, inv_std):
    """dL/dx for x_hat = standardize_rows(x), given g = dL/dx_hat; all (R, n) but inv_std (R, 1)."""
    return inv_std * (g - g.mean(axis=-1, keepdims=True) - x_hat * (g * x_hat).mean(axis=-1, keepdims=True))


class LayerNorm(Function):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta over the last axis (the LN of Eq. 2-4).

    x: (..., D)   gamma, beta: (D,) or None   ->   y: (..., D)
    Backward: dL/dx as in the module docstring with g = gy * gamma,
              dL/dgamma = sum over rows of gy * x_hat,  dL/dbeta = sum over rows of gy.
    """

    float16_in_float32 = True            # a deviation of 256 squared overflows float16

    def forward(self, x, gamma, beta, eps):
        x_hat, inv_std = _standardize_rows(x.reshape(-1, x.shape[-1]), eps)    # (R, D), (R, 1)
        self.save(x_hat, inv_std, gamma)
        y = x_hat if gamma is None else x_hat * gamma
        if beta is not None:
            y = y + beta
        return y.reshape(x.shape)

    def backward(self, gy):
        x_hat, inv_std, gamma = self.saved
        g2 = gy.reshape(x_hat.shape)                                          # (R, D)
        dx = _standardize_rows_backward(g2 if gamma is None else g2 * gamma, x_hat, inv_std)
        dgamma = (g2 * x_hat).sum(axis=0) if gamma is not None else None
        dbeta = g2.sum(axis=0) if self.needs_input_grad[2] else None
        return dx.reshape(gy.shape), dgamma, dbeta


class GroupNorm(Function):
    """Group normalisation (Wu & He 2018), BiT's replacement for BatchNorm.

    x: (B, C, *spatial), e.g. NCHW (B, C, H, W) or (B, C)   gamma, beta: (C,) or None   ->   y: like x
    The C channels form G groups of C/G; each (sample, group) is standardised over its C/G channels
    and all spatial positions, then y = x_hat * gamma[c] + beta[c] per channel.
    Backward: the row backward on the (B*G, C/G * prod(spatial)) view with g = gy * gamma[c];
              dL/dgamma[c] = sum over batch and space of gy * x_hat, dL/dbeta[c] = sum of gy.
    """

    float16_in_float32 = True            # as LayerNorm

    def forward(self, x, num_groups, gamma, beta, eps):
        b, c = x.shape[0], x.shape[1]
        x_hat, inv_std = _standardize_rows(x.reshape(b * num_groups, -1), eps)  # (B*G, C/G*S)
        x_hat = x_hat.reshape(x.shape)
        channel = (1, c) + (1,) * (x.ndim - 2)              # gamma[c] broadcast over (B, C, ...)
        y = x_hat * gamma.reshape(channel) if gamma is not None else x_hat.copy()
        if beta is not None:
            y += beta.reshape(channel)
        self.save(x_hat, inv_std, gamma, channel)
        return y

    def backward(self, gy):
        x_hat, inv_std, gamma, channel = self.saved
        need_x, need_gamma, need_beta = self.needs_input_grad[0], self.needs_input_grad[2], self.needs_input_grad[3]
        axes = (0,) + tuple(range(2, gy.ndim))              # every axis but the channel
        dx = dgamma = dbeta = None
        if need_x:
            g = gy * gamma.reshape(channel) if gamma is not None else gy.copy()
            rows = inv_std.shape[0]
            dx = _standardize_rows_backward(g.reshape(rows, -1), x_hat.reshape(rows, -1), inv_std)
            dx = dx.reshape(gy.shape)
        if need_gamma:
            dgamma = (gy * x_hat).sum(axis=axes)
        if need_beta:
            dbeta = gy.sum(axis=axes)
        return dx, None, dgamma, dbeta


class WeightStandardize(Function):
    """Weight standardization (Qiao et al. 2019) of a conv kernel, as BiT's StdConv2d does it.

    w: (out, in, kh, kw) (any (out, ...))   ->   w_hat: same shape, where each output channel's
    kernel w[o] is standardised over (in, kh, kw):  w_hat[o] = (w[o] - mean) / sqrt(var + eps).
    Backward: LayerNorm's without the affine part, on the (out, in*kh*kw) view.
    """

    float16_in_float32 = True            # as LayerNorm

    def forward(self, w, eps):
        w_hat, inv_std = _standardize_rows(w.reshape(w.shape[0], -1), eps)   # (O, M), (O, 1)
        self.save(w_hat, inv_std)
        return w_hat.reshape(w.shape)

    def backward(self, gy):
        w_hat, inv_std = self.saved
        return _standardize_rows_backward(gy.reshape(w_hat.shape), w_hat, inv_std).reshape(gy.shape)


# ---------------------------------------------------------------- the functions users call


def require_vector(op, name, v, n, meaning):
    if v is not None and shape_of(v) != (n,):
        raise ValueError(f"{op}: {name} must have shape ({n},) ({meaning}), got {shape_of(v)}")


def require_eps(op, eps):
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise ValueError(f"{op}: eps must be a non-negative number, got {eps!r}")
    return float(eps)


def layer_norm(x, weight, bias, eps=1e-6, function=None):
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias.

    x: (..., D)  weight, bias: (D,) or None  ->  (..., D). eps=1e-6 as in the paper's code (timm's ViT).
    function: the Function that computes it, this reference unless tinyvit.functional passes a kernel."""
    require_float("layer_norm", x=x, weight=weight, bias=bias)
    require_same_dtype("layer_norm", x=x, weight=weight, bias=bias)
    sx = shape_of(x)
    if not sx:
        raise ValueError("layer_norm: x must have at least one axis (the normalised one), got a scalar")
    require_vector("layer_norm", "weight", weight, sx[-1], f"x's last axis of {sx}")
    require_vector("layer_norm", "bias", bias, sx[-1], f"x's last axis of {sx}")
    return (function or LayerNorm).apply(x, weight, bias, require_eps("layer_norm", eps))


def group_norm(x, num_groups, weight, bias, eps=1e-5):
    """GroupNorm on (B, C, *spatial) with ``num_groups`` groups of channels and per-channel weight, bias (C,).

    Raises ValueError if C is not divisible by num_groups."""
    require_float("group_norm", x=x, weight=weight, bias=bias)
    require_same_dtype("group_norm", x=x, weight=weight, bias=bias)
    sx = shape_of(x)
    if len(sx) < 2:
        raise ValueError(f"group_norm: x must be (B, C, ...) such as NCHW (B, C, H, W), got shape {sx}")
    c = sx[1]
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
        raise ValueError(f"group_norm: num_groups must be a positive integer, got {num_groups!r}")
    if c % num_groups:
        raise ValueError(f"group_norm: the number of channels C={c} (x of shape {sx}) is not divisible "
                         f"by num_groups={num_groups}")
    require_vector("group_norm", "weight", weight, c, f"one per channel of x {sx}")
    require_vector("group_norm", "bias", bias, c, f"one per channel of x {sx}")
    return GroupNorm.apply(x, num_groups, weight, bias, require_eps("group_norm", eps))


# eps: the official BiT code adds 1e-10 to the variance inside the square root (big_transfer's
# bit_pytorch/models.py StdConv2d and bit_jax/models.py StdConv, standardize(..., eps=1e-10)).
# timm's StdConv2d computes the same formula (via F.batch_norm) with eps=1e-6 by default and 1e-8 for
# its BiT ports; the ViT repository's hybrid backbone (vit_jax/models_resnet.py) instead divides by
# (std + 1e-5). We follow the official BiT code; pass eps= to match another checkpoint exactly.
BIT_WS_EPS = 1e-10


def weight_standardize(w, eps=BIT_WS_EPS):
    """BiT's weight standardization: each output channel's kernel to zero mean, unit variance.

    w: (out, in, kh, kw) (any (out, ...) with at least 2 axes)  ->  same shape;
    w_hat[o] = (w[o] - mean(w[o])) / sqrt(var(w[o]) + eps), statistics over (in, kh, kw)."""
    require_float("weight_standardize", w=w)
    require_ndim("weight_standardize", "w", w, tuple(range(2, 9)),
                 "a kernel (out, in, kh, kw) or another (out, ...) with at least 2 axes")
    return WeightStandardize.apply(w, require_eps("weight_standardize", eps))
