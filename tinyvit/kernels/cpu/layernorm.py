"""LayerNorm on the CPU, fast: the same numbers as ops/norm.py's LayerNorm, plus the two fusions
the ViT encoder uses across layers (kernels/fusion.py, kernels.fuse):

    LayerNorm        both passes over cache-sized blocks of rows shared among threads, temporaries in
                     per-thread scratch arrays, outputs on 64-byte cache lines (kernels/cpu/threads.py)
    AddLayerNorm     the residual add of Eq. 2 (or 3) and the LayerNorm that reads its result, in one
                     pass: s = x + branch, y = LN(s)
    FoldNormAffine   a LayerNorm's scale and shift folded into the dense layer that reads it, so the
                     LayerNorm itself only standardises

The derivation is the reference's (ops/norm.py): with g = dL/dx_hat and n the row length,
dL/dx = inv_std * (g - mean(g) - x_hat * mean(g * x_hat)).
Tests: tests/test_kernels_cpu_layernorm.py proves each equal to the reference, forward and every gradient.
"""
from __future__ import annotations

from ...autograd import Function
from ...backend import get_array_module
from ...ops.common import require_float, require_same_dtype, shape_of
from ...ops.norm import require_eps, require_vector
from .threads import empty_like, for_each_block, row_blocks, scratch


def _row_dot_mean(a, b):
    """mean(a * b) of each row of two (R, n) arrays, as (R, 1), by einsum: no (R, n) temporary, about
    3x faster than (a * b).mean(axis=-1) on rows as short as LayerNorm's."""
    total = get_array_module(a).einsum("ij,ij->i", a, b)[:, None]
    total *= 1.0 / a.shape[-1]
    return total


class LayerNorm(Function):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta over the last axis (the LN of Eq. 2-4).

    x: (..., D)   gamma, beta: (D,) or None   ->   y: (..., D)
    Backward: dL/dx as in the module docstring with g = gy * gamma,
              dL/dgamma = sum over rows of gy * x_hat,  dL/dbeta = sum over rows of gy.

    Both passes run over cache-sized blocks of rows (threads.for_each_block), write straight into
    their outputs and keep their temporaries in the thread's scratch arrays (threads.scratch).
    Forward saves x itself with each row's mean and 1/std rather than x_hat, and backward rebuilds
    x - mean block by block, in the cache; without gamma and beta, y is x_hat and is saved instead.
    """

    def forward(self, x, gamma, beta, eps):
        x2 = x.reshape(-1, x.shape[-1])                                        # (R, D)
        _, y = self._normalize(x2, None, gamma, beta, eps)
        return y.reshape(x.shape)

    def backward(self, gy):
        dx, dgamma, dbeta = self._grads(gy.reshape(self.saved[0].shape), None, self.needs_input_grad[:3])
        return (dx.reshape(gy.shape) if dx is not None else None), dgamma, dbeta

    def _normalize(self, x2, branch2, gamma, beta, eps):
        """s = x2 (+ branch2 if given) and y = LN(s), both (R, D), computed block by block; saves
        what _grads needs and returns (s, y)."""
        xp = get_array_module(x2)
        s = x2 if branch2 is None else empty_like(x2)
        y = empty_like(x2)
        mean = xp.empty((x2.shape[0], 1), dtype=x2.dtype)                     # (R, 1)
        inv_std = xp.empty_like(mean)                                          # (R, 1)
        by_n = xp.full((x2.shape[1], 1), 1.0 / x2.shape[1], dtype=x2.dtype)   # s @ by_n: row means

        def normalize(r):                                                      # one block of rows
            y_r = y[r]
            if branch2 is not None:
                xp.add(x2[r], branch2[r], out=s[r])                            # the residual add, in the cache
            xp.matmul(s[r], by_n, out=mean[r])                                 # BLAS: 3x einsum's speed
            xp.subtract(s[r], mean[r], out=y_r)                                # s - mean, in y's block
            var = _row_dot_mean(y_r, y_r)
            var += eps                                                         # eps a Python float: dtype stays
            xp.divide(1.0, xp.sqrt(var, out=var), out=inv_std[r])
            y_r *= inv_std[r]                                                  # x_hat
            if gamma is not None:
                y_r *= gamma
            if beta is not None:
                y_r += beta

        for_each_block(normalize, row_blocks(x2))                              # cache-sized, threaded
        if gamma is None and beta is None:       # y is x_hat itself: save it (the layer after holds it
            self.save(y, None, inv_std, None)    # anyway), and backward needs no s - mean
        else:
            self.save(s, mean, inv_std, gamma)
        return s, y

    def _grads(self, g2, g_add, need):
        """(dL/ds (+ g_add if given), dL/dgamma, dL/dbeta) from g2 = dL/dy, all rows (R, D); need:
        which of the three are wanted."""
        if self.saved[1] is None:                                              # saved: x_hat, not s
            return self._grads_from_x_hat(g2, g_add, need[0]), None, None
        s2, mean, inv_std, gamma = self.saved
        xp = get_array_module(s2)
        need_x, need_gamma, need_beta = need
        n = s2.shape[1]
        dx = empty_like(s2) if need_x else None
        weight = gamma if gamma is not None else xp.ones(n, dtype=s2.dtype)   # g = gy * weight
        ones = xp.ones(s2.shape[0], dtype=s2.dtype)                           # (R,)

        # The sums over rows and along rows are BLAS matrix-vector products (v @ A, A @ v): no
        # temporary, faster than einsum, and accurate in float32 even for long rows.
        def block_grads(r):                                                    # one block of rows
            gy_r, inv = g2[r], inv_std[r]                                      # (k, D), (k, 1)
            dbeta = ones[r] @ gy_r if need_beta else None                      # sum over rows of gy
            if not (need_x or need_gamma):
                return None, dbeta
            xc, gy_xc = scratch("layer_norm", 2, gy_r)
            xp.subtract(s2[r], mean[r], out=xc)                                # s - mean = x_hat / inv
            xp.multiply(gy_r, xc, out=gy_xc)
            dgamma = inv[:, 0] @ gy_xc if need_gamma else None                 # sum over rows of gy x_hat
            if need_x:
                # dx = inv (g - mean(g) - x_hat mean(g x_hat)) = inv g - (xc inv^2 mean(g x_hat) + inv mean(g))
                mean_g = (gy_r @ weight)[:, None] / n                          # (k, 1)
                mean_gx = (gy_xc @ weight)[:, None] * inv / n                  # mean(g x_hat), (k, 1)
                xc *= inv * inv * mean_gx
                xc += inv * mean_g
                dx_r = xp.multiply(gy_r, inv, out=dx[r])
                if gamma is not None:
                    dx_r *= gamma
                dx_r -= xc
                if g_add is not None:
                    dx_r += g_add[r]                                           # the residual's gradient, in the cache
            return dgamma, dbeta

        partial = for_each_block(block_grads, row_blocks(s2))                 # cache-sized, threaded
        dgamma = sum(p[0] for p in partial) if need_gamma else None
        dbeta = sum(p[1] for p in partial) if need_beta else None
        return dx, dgamma, dbeta

    def _grads_from_x_hat(self, g2, g_add, need_x):
        """dL/ds (+ g_add if given) from g2 = dL/dx_hat when forward saved x_hat (no scale or shift):
        dx = inv (g - mean(g) - x_hat mean(g x_hat)), three row-broadcast passes where rebuilding
        s - mean would take a fourth (each costs 3-4x a plain pass on rows of 192)."""
        if not need_x:
            return None
        x_hat, _, inv_std, _ = self.saved
        xp = get_array_module(x_hat)
        n = x_hat.shape[1]
        dx = empty_like(x_hat)
        by_n = xp.full(n, 1.0 / n, dtype=x_hat.dtype)                         # A @ by_n: row means

        def block_grads(r):                                                    # one block of rows
            gy_r, x_hat_r, dx_r = g2[r], x_hat[r], dx[r]
            (t,) = scratch("layer_norm", 1, gy_r)
            xp.multiply(gy_r, x_hat_r, out=t)
            mean_gx = (t @ by_n)[:, None]                                      # mean(g x_hat), (k, 1)
            mean_g = (gy_r @ by_n)[:, None]                                    # mean(g), (k, 1)
            xp.multiply(x_hat_r, mean_gx, out=t)
            xp.subtract(gy_r, t, out=dx_r)
            dx_r -= mean_g
            dx_r *= inv_std[r]
            if g_add is not None:
                dx_r += g_add[r]                                               # the residual's gradient, in the cache

        for_each_block(block_grads, row_blocks(x_hat))                        # cache-sized, threaded
        return dx


class AddLayerNorm(LayerNorm):
    """The residual add of Eq. 2 (or 3) and the LayerNorm that reads its result, in one pass:

    x, branch: (..., D)   gamma, beta: (D,) or None   ->   s = x + branch,  y = LN(s) * gamma + beta
    Backward, from gs = dL/ds (the residual stream's gradient) and gy = dL/dy (either may be None):
        dL/dx = dL/dbranch = gs + LayerNorm's dL/ds from gy,  dL/dgamma, dL/dbeta as LayerNorm's.

    The same numbers as s = x + branch followed by layer_norm(s), but each block of s is normalised
    while it is still in the cache, and in backward the residual's gradient is added to LayerNorm's
    in the block that computes it: the (R, D) streams of a separate add and of the gradient
    accumulation are saved (two per residual connection each way).
    """

    def forward(self, x, branch, gamma, beta, eps):
        d = x.shape[-1]
        s, y = self._normalize(x.reshape(-1, d), branch.reshape(-1, d), gamma, beta, eps)
        return s.reshape(x.shape), y.reshape(x.shape)

    def backward(self, gs, gy):
        need_x = self.needs_input_grad[0] or self.needs_input_grad[1]
        need = (need_x,) + tuple(self.needs_input_grad[2:4])
        if gy is None:                                    # only the residual stream carries a gradient
            return gs, gs, None, None
        shape = gy.shape
        g_add = None if gs is None else gs.reshape(self.saved[0].shape)
        dx, dgamma, dbeta = self._grads(gy.reshape(self.saved[0].shape), g_add, need)
        if dx is not None:
            dx = dx.reshape(shape)
        return dx, dx, dgamma, dbeta


class FoldNormAffine(Function):
    """A LayerNorm's scale and shift folded into the dense layer that reads it:

        (x_hat * gamma + beta) W + b = x_hat (diag(gamma) W) + (beta W + b)

    gamma, beta: (D,)   weight: (D, O)   bias: (O,) or None   ->   w: (D, O), b: (O,)
    Backward, from gw = dL/dw and gb = dL/db (either may be None):
        dL/dgamma = sum over o of gw * W,  dL/dW = gamma gw + beta^T gb (outer product),
        dL/dbeta = W gb,  dL/dbias = gb.
    All arrays are the size of the weights, not of the activations: folding spares the LayerNorm two
    passes over the (R, D) activations forward (the scale and the shift) and three backward (the
    scale and the two sums over rows that gave dL/dgamma and dL/dbeta).
    """

    def forward(self, gamma, beta, weight, bias):
        w = gamma[:, None] * weight
        b = beta @ weight
        if bias is not None:
            b += bias
        self.save(gamma, beta, weight)
        return w, b

    def backward(self, gw, gb):
        gamma, beta, weight = self.saved
        xp = get_array_module(weight)
        need_gamma, need_beta, need_weight, need_bias = self.needs_input_grad[:4]
        dgamma = dbeta = dweight = dbias = None
        if gw is not None:
            if need_gamma:
                dgamma = xp.einsum("io,io->i", gw, weight)
            if need_weight:
                dweight = gamma[:, None] * gw
        if gb is not None:
            if need_beta:
                dbeta = weight @ gb
            if need_weight:
                outer = beta[:, None] * gb
                dweight = outer if dweight is None else dweight + outer
            if need_bias:
                dbias = gb
        return dgamma, dbeta, dweight, dbias


def add_layer_norm(x, branch, weight, bias, eps=1e-6):
    """The residual add and the LayerNorm after it, fused: returns (s, y) with s = x + branch and
    y = layer_norm(s, weight, bias, eps). x, branch: (..., D) of one shape; weight, bias: (D,) or None.

    The pre-norm block's "x = x + MSA(LN(x)); then LN(x)" (Eq. 2-3) in one pass over memory each way."""
    require_float("add_layer_norm", x=x, branch=branch, weight=weight, bias=bias)
    require_same_dtype("add_layer_norm", x=x, branch=branch, weight=weight, bias=bias)
    sx, sb = shape_of(x), shape_of(branch)
    if not sx:
        raise ValueError("add_layer_norm: x must have at least one axis (the normalised one), got a scalar")
    if sb != sx:
        raise ValueError(f"add_layer_norm: branch must have x's shape {sx} (no broadcasting), got {sb}")
    require_vector("add_layer_norm", "weight", weight, sx[-1], f"x's last axis of {sx}")
    require_vector("add_layer_norm", "bias", bias, sx[-1], f"x's last axis of {sx}")
    return AddLayerNorm.apply(x, branch, weight, bias, require_eps("add_layer_norm", eps))


def fold_norm_affine(norm_weight, norm_bias, weight, bias):
    """A LayerNorm's scale and shift folded into the next dense layer: returns (w, b) with
    x_hat w + b = (x_hat * norm_weight + norm_bias) weight + bias for every x_hat.

    norm_weight, norm_bias: (D,)   weight: (D, O) (our (in, out) layout)   bias: (O,) or None.
    With x_hat = layer_norm(x, None, None) (or add_layer_norm's), linear(x_hat, w, b) equals
    linear(layer_norm(x, norm_weight, norm_bias), weight, bias), gradients included."""
    op = "fold_norm_affine"
    require_float(op, norm_weight=norm_weight, norm_bias=norm_bias, weight=weight, bias=bias)
    require_same_dtype(op, norm_weight=norm_weight, norm_bias=norm_bias, weight=weight, bias=bias)
    if norm_weight is None or norm_bias is None or weight is None:
        raise ValueError(f"{op}: norm_weight, norm_bias and weight are required (only bias may be None)")
    sw = shape_of(weight)
    if len(sw) != 2:
        raise ValueError(f"{op}: weight must be 2-D (in, out), got shape {sw}")
    require_vector(op, "norm_weight", norm_weight, sw[0], f"one per input of weight {sw}")
    require_vector(op, "norm_bias", norm_bias, sw[0], f"one per input of weight {sw}")
    require_vector(op, "bias", bias, sw[1], f"one per output of weight {sw}")
    return FoldNormAffine.apply(norm_weight, norm_bias, weight, bias)
