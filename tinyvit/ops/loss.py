"""Losses: cross-entropy (fused with log-softmax, for classification heads) and mean squared error
(for regression targets such as the masked-patch prediction of the paper's self-supervision, B.1.2).
"""
from __future__ import annotations

import math

from ..autograd import Function, Tensor
from ..backend import get_array_module
from .common import dtype_of, require_float, shape_of


class CrossEntropy(Function):
    """Mean cross-entropy between softmax(logits) and a target distribution, fused with log-softmax.

    logits: (..., K)   target: (...) integer labels in [0, K), or (..., K) probabilities  ->  loss: ()
      z = log_softmax(logits)                          (stable: max subtracted, log-sum-exp)
      t = (1 - eps) onehot(label) + eps / K            (label smoothing eps, as in PyTorch;
                                                        probabilities get (1 - eps) t + eps / K)
      loss = -(1/n) sum_i sum_k t_ik z_ik              (n = number of leading positions i)
    Backward, never forming the softmax Jacobian:
      dL/dlogits = gy (softmax(logits) - t) / n,   dL/dt = -gy (1 - eps) z / n   (probabilities only)
    """

    float16_in_float32 = True            # the sum of the log-probabilities overflows float16

    def forward(self, logits, target, label_smoothing):
        xp = get_array_module(logits)
        k = logits.shape[-1]
        z = logits.reshape(-1, k)                                   # (n, K)
        z = z - z.max(axis=1, keepdims=True)
        z -= xp.log(xp.exp(z).sum(axis=1, keepdims=True))           # log-probabilities
        n, eps = z.shape[0], label_smoothing
        if target.dtype.kind == "f":                                # probabilities (..., K)
            t = target.reshape(n, k)
            total = (t * z).sum() * (1.0 - eps)
        else:                                                       # labels (...)
            t = target.reshape(n)
            total = z[xp.arange(n), t].sum() * (1.0 - eps)
        if eps:
            total += z.sum() * (eps / k)
        self.save(z, t, eps, logits.shape, target.shape)
        return xp.asarray(-total / n, dtype=logits.dtype)

    def backward(self, gy):
        z, t, eps, logits_shape, target_shape = self.saved
        xp = get_array_module(z)
        n, k = z.shape
        g = gy / n
        dlogits = dtarget = None
        if self.needs_input_grad[0]:
            p = xp.exp(z)                                           # softmax
            if t.ndim == 2:
                p -= (t * (1.0 - eps)) if eps else t
            else:
                p[xp.arange(n), t] -= 1.0 - eps
            if eps:
                p -= eps / k
            p *= g
            dlogits = p.reshape(logits_shape)
        if t.ndim == 2 and self.needs_input_grad[1]:
            dtarget = (z * (-(1.0 - eps) * g)).reshape(target_shape)
        return dlogits, dtarget, None


class MSE(Function):
    """Mean squared error over all elements.

    pred, target: the same shape  ->  loss: () = (1/n) sum (pred - target)^2
      dL/dpred = 2 gy (pred - target) / n,  dL/dtarget = -dL/dpred
    """

    float16_in_float32 = True            # a difference of 256 squared overflows float16

    def forward(self, pred, target):
        diff = pred - target
        self.save(diff)
        return (diff * diff).mean()

    def backward(self, gy):
        (diff,) = self.saved
        g = diff * (gy * (2.0 / diff.size))
        return (g if self.needs_input_grad[0] else None,
                -g if self.needs_input_grad[1] else None)


# ---------------------------------------------------------------- the functions users call


def _as_constant_target(op, target, like, cast_all):
    """A target that gets no gradient, as an array on ``like``'s device, converted to like's dtype
    (float targets always, any target with ``cast_all``), so that float64 or integer data cannot
    silently turn a float32 loss and its gradient into float64."""
    xp = get_array_module(like)
    if isinstance(target, Tensor):
        target = target.data
    if target is None or isinstance(target, (str, bytes)):
        raise TypeError(f"{op}: target must be an array or Tensor, got {type(target).__name__}")
    target = xp.asarray(target)
    if target.dtype != dtype_of(like) and (cast_all or target.dtype.kind == "f"):
        target = target.astype(dtype_of(like))
    return target


def cross_entropy(logits, target, label_smoothing=0.0, check_labels=True, function=None):
    """Mean cross-entropy of ``logits`` (..., K) against integer labels (...) or probabilities (..., K).

    label_smoothing eps in [0, 1] mixes the target with the uniform distribution: (1 - eps) t + eps / K.
    A probability target that is a Tensor with requires_grad gets a gradient too.
    check_labels: verify that integer labels lie in [0, K) (an index outside would pick a wrong
    logit: CuPy wraps indices around). On a GPU that reads two numbers back to the host, which waits
    for every queued kernel; a caller whose labels are checked already (the trainer: datasets check
    theirs when loaded) passes False and the step never waits.
    function: the Function that computes it, this reference unless tinyvit.functional passes a kernel."""
    require_float("cross_entropy", logits=logits)
    ls = shape_of(logits)
    if not ls or ls[-1] == 0:
        raise ValueError(f"cross_entropy: logits must have shape (..., K) with K >= 1 classes, got {ls}")
    n = math.prod(ls[:-1])
    if n == 0:
        raise ValueError(f"cross_entropy: logits of shape {ls} hold no positions to average over")
    eps = float(label_smoothing)
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (isinstance(target, Tensor) and target.requires_grad):
        target = _as_constant_target("cross_entropy", target, logits, cast_all=False)
    ts, kind, k = shape_of(target), dtype_of(target).kind, ls[-1]
    if ts == ls[:-1]:
        if kind == "f":
            raise TypeError(f"cross_entropy: target of shape {ts} has the shape of class labels for logits "
                            f"{ls} but dtype {dtype_of(target)}; labels must be integers "
                            f"(.astype(np.int64)), probabilities must have shape {ls}")
        if kind not in "iu":
            raise TypeError(f"cross_entropy: class labels must be integers, got dtype {dtype_of(target)}")
        xp = get_array_module(target)
        lo, hi = (int(v) for v in xp.stack((target.min(), target.max())).tolist()) if check_labels else (0, 0)
        if lo < 0 or hi >= k:
            raise ValueError(f"cross_entropy: labels must lie in [0, {k}) for logits of shape {ls}, "
                             f"got values from {lo} to {hi}")
    elif ts == ls:
        if kind != "f":
            raise TypeError(f"cross_entropy: a target of the logits' shape {ls} holds probabilities and must "
                            f"be floating point, got dtype {dtype_of(target)}; class labels have shape {ls[:-1]}")
        if dtype_of(target) != dtype_of(logits):
            raise TypeError(f"cross_entropy: probabilities are {dtype_of(target)} but logits are "
                            f"{dtype_of(logits)}; convert one of them")
    else:
        raise ValueError(f"cross_entropy: target of shape {ts} does not fit logits of shape {ls}: expected "
                         f"integer labels of shape {ls[:-1]} or probabilities of shape {ls}")
    return (function or CrossEntropy).apply(logits, target, eps)


def mse(pred, target):
    """Mean squared error over all elements; ``target`` has pred's shape and may be a constant array
    (it gets a gradient only when it is a Tensor with requires_grad)."""
    require_float("mse", pred=pred)
    if isinstance(target, Tensor) and target.requires_grad:
        if target.dtype != dtype_of(pred):
            raise TypeError(f"mse: target is {target.dtype} but pred is {dtype_of(pred)}; convert one of them")
    else:
        target = _as_constant_target("mse", target, pred, cast_all=True)
    if shape_of(target) != shape_of(pred):
        raise ValueError(f"mse: target of shape {shape_of(target)} does not match pred of shape {shape_of(pred)}")
    if not math.prod(shape_of(pred)):
        raise ValueError(f"mse: pred of shape {shape_of(pred)} is empty")
    return MSE.apply(pred, target)
