"""kernels/cpu/layernorm.py (LayerNorm, AddLayerNorm, FoldNormAffine, add_layer_norm, fold_norm_affine)
against ops/norm.py's LayerNorm: outputs and every gradient, float64 and float32, many small blocks of
rows, 1 and 2 threads (the shared helpers and the meta-test are in test_kernels_cpu.py).

float32 tolerance: rtol 1e-5 and atol 1e-5 times the array's largest magnitude (at least 1). The
kernel takes the row means and the sums over rows as BLAS products (s @ 1/n, ones @ gy) and rebuilds
s - mean in backward where the reference keeps x_hat, so each element rounds differently by a few
ulps; dL/dgamma and dL/dbeta sum many such terms, block by block (measured: at most 2e-7 of
|reference| + scale, so the bounds leave a 50x margin).
"""
import numpy as np
import pytest

import tinyvit as tv
import tinyvit.functional as F
from tinyvit.gradcheck import GradcheckError
from tinyvit.kernels.cpu import layernorm as k_layernorm
from tinyvit.ops import norm

from helpers import assert_close, param, torch_parity
from kernel_checks import F64, assert_kernel_equals_reference, cpu_kernel

TOL = {np.float64: (F64["rtol"], F64["atol"]), np.float32: (1e-5, 1e-5)}

# rows of 24 (two per block of 64) in an odd count, rows of 100 (longer than a block), rows of one
# element (x_hat = 0), a single row
LN_SHAPES = [(7, 5, 24), (3, 100), (9, 1), (1, 1, 4)]
# which of gamma, beta are given: both random, none (the kernel saves x_hat), gamma = 1 and beta = 0
# (the kernel saves s and rebuilds s - mean: the same numbers as none), one of the two
AFFINE = ["random", "none", "unit", "gamma", "beta"]


def affine(kind, rng, d):
    gamma, beta = rng.standard_normal(d), rng.standard_normal(d)
    return {"random": (gamma, beta), "none": (None, None), "unit": (np.ones(d), np.zeros(d)),
            "gamma": (gamma, None), "beta": (None, beta)}[kind]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", LN_SHAPES)
@pytest.mark.parametrize("kind,wants", [(kind, wants) for kind in AFFINE for wants in ("all", "x", "params")
                                        if (kind, wants) != ("none", "params")])   # none: no parameters
def test_layer_norm_equals_reference(small_blocks, dtype, shape, kind, wants):
    """The "layer_norm" kernel: y and dL/dx, dL/dgamma, dL/dbeta equal the reference's, for every
    combination of scale and shift (each of the kernel's two saved forms), rows shorter and longer
    than a block, inputs far from zero mean, and gradients wanted for all inputs, x only or the
    parameters only. eps 1e-6, and 0.5 on rows of 24 and of 1: a row of one element has variance 0,
    so 1/std = 1/sqrt(eps), 1000 for eps = 1e-6, and its dL/dx (exactly 0) comes out of the kernel as
    a difference of two terms of 1000 |g|, whose float32 rounding (~1e-4) the reference's order of
    operations happens to avoid; with eps 0.5 both are exact to float32 precision."""
    rng = np.random.default_rng(shape[-1] + len(kind))
    d = shape[-1]
    arrays = [rng.standard_normal(shape) * 2 + 3, *affine(kind, rng, d)]
    wants = {"all": (1, 1, 1), "x": (1, 0, 0), "params": (0, 1, 1)}[wants]
    eps = 0.5 if d in (24, 1) else 1e-6
    kernel = cpu_kernel("layer_norm")
    assert_kernel_equals_reference(lambda x, g, b: kernel.apply(x, g, b, eps), lambda x, g, b: norm.LayerNorm.apply(x, g, b, eps),
                                   arrays, [rng.standard_normal(shape)], dtype, TOL[dtype], wants_grad=wants,
                                   names=["x", "gamma", "beta"])


# ---------------------------------------------------------------- add_layer_norm: residual add + LayerNorm


def add_then_layer_norm(x, branch, gamma, beta):
    """The reference: s = x + branch, y = LayerNorm(s) (ops/norm.py)."""
    s = x + branch
    return s, norm.LayerNorm.apply(s, gamma, beta, 1e-6)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(5, 3, 24), (3, 100)])
@pytest.mark.parametrize("kind", ["random", "none", "unit"])
@pytest.mark.parametrize("used", ["both", "s", "y"])
def test_add_layer_norm_equals_add_then_layer_norm(small_blocks, dtype, shape, kind, used):
    """AddLayerNorm (the encoder's fused residual add + LN): s, y and every input's gradient equal
    x + branch followed by the reference LayerNorm, with an upstream gradient on both outputs or on
    only one (the other receives None), without scale and shift (x_hat saved) and with them."""
    rng = np.random.default_rng(len(kind) + shape[-1])
    arrays = [rng.standard_normal(shape) * 2 + 1, rng.standard_normal(shape), *affine(kind, rng, shape[-1])]
    gs, gy = rng.standard_normal(shape), rng.standard_normal(shape)
    upstream = [gs if used != "y" else None, gy if used != "s" else None]
    assert_kernel_equals_reference(k_layernorm.add_layer_norm, add_then_layer_norm, arrays, upstream, dtype,
                                   TOL[dtype], names=["x", "branch", "gamma", "beta"])


@pytest.mark.parametrize("shape", [(3, 5), (2, 3, 7), (1, 1, 4)])
@pytest.mark.parametrize("affine_", [True, False])
def test_add_layer_norm_gradcheck_every_input(small_blocks, rng, shape, affine_):
    """Both outputs (s = x + branch and y = LN(s)) get a random upstream gradient."""
    d = shape[-1]
    x, branch = param(np, rng, *shape, scale=2.0), param(np, rng, *shape)
    if affine_:
        w, b = param(np, rng, d), param(np, rng, d)
        tv.gradcheck(lambda x, r, w, b: k_layernorm.add_layer_norm(x, r, w, b), [x, branch, w, b])
    else:
        tv.gradcheck(lambda x, r: k_layernorm.add_layer_norm(x, r, None, None), [x, branch])


@pytest.mark.parametrize("which", ["s", "y"])
def test_add_layer_norm_gradcheck_one_output_used(rng, which):
    """Only the residual stream s, or only the normalised y, feeds the loss."""
    x, branch, w, b = (param(np, rng, 2, 3, 6), param(np, rng, 2, 3, 6), param(np, rng, 6), param(np, rng, 6))
    pick = 0 if which == "s" else 1
    tv.gradcheck(lambda x, r, w, b: k_layernorm.add_layer_norm(x, r, w, b)[pick], [x, branch, w, b])
    if which == "s":                    # LN's parameters are not on the path of s
        assert w.grad is None and b.grad is None


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float32, 1e-4)])
def test_add_layer_norm_torch_parity(torch, rng, dtype, rtol):
    """add_layer_norm against PyTorch's x + r and layer_norm: both outputs under one upstream gradient."""
    x, r = rng.standard_normal((2, 5, 12)) * 3 + 1, rng.standard_normal((2, 5, 12))
    w, b = rng.standard_normal(12), rng.standard_normal(12)

    def ours(x, r, w, b):
        s, y = k_layernorm.add_layer_norm(x, r, w, b)
        return F.concat([s, y], axis=0)                    # both outputs under one upstream gradient

    def theirs(x, r, w, b):
        s = x + r
        return torch.cat([s, torch.nn.functional.layer_norm(s, (12,), w, b, eps=1e-6)], dim=0)

    torch_parity(torch, ours, theirs, [x, r, w, b], dtype, rtol)


def test_add_layer_norm_errors():
    """add_layer_norm validates like layer_norm, and branch must have x's shape (no broadcasting)."""
    x = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="branch must have x's shape"):
        k_layernorm.add_layer_norm(x, np.zeros((2, 1, 4)), None, None)
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        k_layernorm.add_layer_norm(x, x, np.ones(3), None)
    with pytest.raises(ValueError, match="at least one axis"):
        k_layernorm.add_layer_norm(np.array(1.0), np.array(1.0), None, None)
    with pytest.raises(ValueError, match="eps"):
        k_layernorm.add_layer_norm(x, x, None, None, eps=-1.0)
    with pytest.raises(TypeError, match="one floating dtype"):
        k_layernorm.add_layer_norm(x, x.astype(np.float32), None, None)
    with pytest.raises(TypeError, match="floating-point"):
        k_layernorm.add_layer_norm(x.astype(np.int64), x, None, None)


def test_a_wrong_add_layer_norm_backward_is_caught(rng):
    """Dropping the residual's own gradient from dL/dx is rejected by the gradient check."""

    class Broken(k_layernorm.AddLayerNorm):
        def backward(self, gs, gy):
            return super().backward(None, gy)

    x, r = param(np, rng, 2, 5), param(np, rng, 2, 5)
    with pytest.raises(GradcheckError):
        tv.gradcheck(lambda x, r: Broken.apply(x, r, None, None, 1e-6), [x, r])


# ---------------------------------------------------------------- fold_norm_affine


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("used", ["both", "w", "b"])
def test_fold_norm_affine_gradcheck(rng, with_bias, used):
    """Both folded outputs (w = diag(gamma) W, b = beta W + bias), or only one of them, feed the loss."""
    g, beta, w = param(np, rng, 5), param(np, rng, 5), param(np, rng, 5, 7)
    ins = [g, beta, w] + ([param(np, rng, 7)] if with_bias else [])

    def fold(*a):
        out = k_layernorm.fold_norm_affine(*a, *([] if with_bias else [None]))
        return out if used == "both" else out[0 if used == "w" else 1]

    tv.gradcheck(fold, ins)


@pytest.mark.parametrize("with_bias", [True, False])
def test_folded_linear_equals_norm_then_linear(small_blocks, rng, with_bias):
    """linear(layer_norm(x, None, None), w', b') with (w', b') = fold_norm_affine(gamma, beta, W, bias)
    equals linear(layer_norm(x, gamma, beta), W, bias): values and every gradient (float64)."""
    arrays = [rng.standard_normal((3, 4, 6)) * 2, rng.standard_normal(6), rng.standard_normal(6),
              rng.standard_normal((6, 5)), rng.standard_normal(5) if with_bias else None]
    upstream = rng.standard_normal((3, 4, 5))
    grads = []
    for folded in (True, False):
        x, g, beta, w, b = [None if a is None else tv.Tensor(a.copy(), requires_grad=True) for a in arrays]
        if folded:
            w2, b2 = k_layernorm.fold_norm_affine(g, beta, w, b)
            y = F.linear(F.layer_norm(x, None, None), w2, b2)
        else:
            y = F.linear(F.layer_norm(x, g, beta), w, b)
        y.backward(upstream)
        grads.append([y.data] + [t.grad for t in (x, g, beta, w, b) if t is not None])
    for i, (a, b) in enumerate(zip(*grads)):
        assert_close(a, b, rtol=1e-10, atol=1e-12, what=f"item {i}")


def test_fold_norm_affine_errors():
    """fold_norm_affine names what is wrong: a weight that is not 2-D, vectors of the wrong length,
    a missing required input."""
    with pytest.raises(ValueError, match="weight must be 2-D"):
        k_layernorm.fold_norm_affine(np.ones(3), np.ones(3), np.ones(3), None)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        k_layernorm.fold_norm_affine(np.ones(4), np.ones(3), np.ones((3, 2)), None)
    with pytest.raises(ValueError, match="bias must have shape"):
        k_layernorm.fold_norm_affine(np.ones(3), np.ones(3), np.ones((3, 2)), np.ones(3))
    with pytest.raises(ValueError, match="are required"):
        k_layernorm.fold_norm_affine(None, np.ones(3), np.ones((3, 2)), None)
    with pytest.raises(TypeError, match="one floating dtype"):
        k_layernorm.fold_norm_affine(np.ones(3), np.ones(3), np.ones((3, 2), np.float32), None)
