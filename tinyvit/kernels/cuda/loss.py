"""Softmax cross-entropy on the GPU: the same function as ops/loss.py's CrossEntropy, with log-softmax,
the loss and its gradient fused into two CUDA kernels, one block per row of logits.

    forward    m_i = max_k x_ik,  s_i = log sum_k exp(x_ik - m_i)      (stable log-sum-exp)
               z_ik = (x_ik - m_i) - s_i                 log-probabilities, never stored
               loss_i = -(1 - eps) sum_k t_ik z_ik - (eps / K) sum_k z_ik
                        (t: one-hot labels, sum_k t_ik z_ik = z_i,label; or probabilities)
               loss = mean_i loss_i                       a device scalar: no host synchronisation
    backward   dx_ik = (g / n) (exp(z_ik) - (1 - eps) t_ik - eps / K)
               dt_ik = -(g / n) (1 - eps) z_ik            (probability targets that want a gradient)

Saved for backward: the logits (the input itself, no copy), m and s (two numbers per row), where
the reference keeps all of z: the gradient recomputes exp(z) as it writes. z is formed as the
reference forms it, (x - m) - s, not x - (m + s), which would round m + s to the precision of large
logits. g, the upstream gradient, stays on the GPU: the backward kernel reads it from device
memory, so a training step never waits for the loss to reach the host. Labels are int64 (others
are converted); probabilities have the logits' dtype. float32 (accumulating in float32) and float64.
A label outside [0, K) (only F.cross_entropy(..., check_labels=False) lets one through: the range
check costs a host read) reads nothing, neither another row nor past the logits: that row's loss, so
the mean, and its row of dL/dlogits are NaN, as visible as a wrong label should be.

Tests: tests/test_kernels_cuda_loss.py (GPU: equal to the reference, loss and every gradient).
"""
from __future__ import annotations

import numpy as np

from ...autograd import Function
from ...backend import get_array_module
from . import entry, kernel, load_source

WARP = 32
MAX_THREADS = 512          # threads per block (a row): 16 warps
PER_THREAD = 4             # aim for about this many classes per thread before adding warps
MAX_GRID_X = 2 ** 31 - 1

SOURCE = load_source("loss.cu")          # the CUDA C++ of the kernels below

NULL = np.uintp(0)     # a null pointer argument (CuPy passes a NumPy scalar by value: 8 bytes, as a pointer)


def launch_config(n: int, k: int):
    """(grid, block) for n rows of K classes: a block per row, of a whole number of warps giving each
    thread about PER_THREAD classes, at least one warp and at most MAX_THREADS threads."""
    if not 1 <= n <= MAX_GRID_X:
        raise ValueError(f"cross_entropy kernel: {n} rows, at most {MAX_GRID_X}")
    warps = -(-k // (PER_THREAD * WARP))
    threads = min(MAX_THREADS, max(1, warps) * WARP)
    return (n,), (threads,)


def _launch(name, dtype, n, k, args):
    grid, block = launch_config(n, k)
    kernel(SOURCE, entry(name, dtype))(grid, block, args)


class CrossEntropy(Function):
    """Mean cross-entropy between softmax(logits) and a target, fused with log-softmax (the
    reference's signature and formulas; see the module docstring for the kernels).

    logits: (..., K)   target: (...) integer labels in [0, K), or (..., K) probabilities  ->  loss: ()
    (a label outside [0, K): a NaN loss, and NaN in its row of dL/dlogits)
    label_smoothing eps: t' = (1 - eps) t + eps / K. The loss is a 0-d array on the GPU.
    """

    def forward(self, logits, target, label_smoothing):
        xp = get_array_module(logits)
        k = logits.shape[-1]
        x = xp.ascontiguousarray(logits).reshape(-1, k)              # (n, K)
        n, dtype = x.shape[0], x.dtype
        labels = probs = None
        if target.dtype.kind == "f":                                 # probabilities (..., K)
            probs = xp.ascontiguousarray(target, dtype=dtype).reshape(n, k)
        else:                                                        # labels (...)
            labels = xp.ascontiguousarray(target.reshape(n), dtype=np.int64)
        eps = dtype.type(label_smoothing)
        row_loss = xp.empty(n, dtype)
        row_max = xp.empty(n, dtype)                                 # m_i = max_k x_ik
        row_log_sum = xp.empty(n, dtype)                             # s_i = log sum_k exp(x_ik - m_i)
        _launch("cross_entropy_forward", dtype, n, k,
                (x, NULL if labels is None else labels, NULL if probs is None else probs, row_loss, row_max,
                 row_log_sum, np.int32(k), eps))
        self.save(x, labels, probs, row_max, row_log_sum, eps, logits.shape, target.shape)
        return row_loss.mean()                                       # 0-d, on the device

    def backward(self, gy):
        x, labels, probs, row_max, row_log_sum, eps, logits_shape, target_shape = self.saved
        xp = get_array_module(x)
        n, k = x.shape
        want_logits = self.needs_input_grad[0]
        want_target = probs is not None and self.needs_input_grad[1]
        if not (want_logits or want_target):
            return None, None, None
        g = xp.ascontiguousarray(xp.asarray(gy, dtype=x.dtype)).reshape(1)   # stays on the device
        dlogits = xp.empty_like(x) if want_logits else None
        dtarget = xp.empty_like(x) if want_target else None
        _launch("cross_entropy_backward", x.dtype, n, k,
                (x, NULL if labels is None else labels, NULL if probs is None else probs, row_max, row_log_sum,
                 g, NULL if dlogits is None else dlogits, NULL if dtarget is None else dtarget,
                 np.int32(k), np.int64(n), eps))
        return (None if dlogits is None else dlogits.reshape(logits_shape),
                None if dtarget is None else dtarget.reshape(target_shape), None)
