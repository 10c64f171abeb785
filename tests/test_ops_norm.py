"""layer_norm, group_norm, weight_standardize: gradient checks, NumPy references, PyTorch parity, errors.

Through tinyvit.functional on both paths (BOTH_PATHS): the reference ops of tinyvit/ops/norm.py and,
for layer_norm, the kernel the switchboard picks (kernels/cpu/layernorm.py). The kernel-only fusions
(add_layer_norm, fold_norm_affine) and the kernel's blocks and threads are tested in
tests/test_kernels_cpu_layernorm.py."""
import numpy as np
import pytest

import tinyvit as tv
import tinyvit.functional as F
from tinyvit.backend import to_numpy
from tinyvit.gradcheck import GradcheckError
from tinyvit.ops import norm as norm_ops

from helpers import assert_close, const, param, torch_parity

BOTH_PATHS = True   # every test runs with the kernels and with the reference ops (conftest.py)


# ---------------------------------------------------------------- NumPy references (written plainly)


def ref_layer_norm(x, w, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps)
    return y * (1 if w is None else w) + (0 if b is None else b)


def ref_group_norm(x, groups, w, b, eps):
    y = np.empty_like(x)
    per = x.shape[1] // groups
    for g in range(groups):                          # a loop over groups is fine in a reference
        chunk = x[:, g * per:(g + 1) * per]
        axes = tuple(range(1, x.ndim))
        mu = chunk.mean(axis=axes, keepdims=True)
        var = ((chunk - mu) ** 2).mean(axis=axes, keepdims=True)
        y[:, g * per:(g + 1) * per] = (chunk - mu) / np.sqrt(var + eps)
    channel = (1, -1) + (1,) * (x.ndim - 2)
    return y * w.reshape(channel) + b.reshape(channel)


def ref_weight_standardize(w, eps):
    out = np.empty_like(w)
    for o in range(w.shape[0]):
        out[o] = (w[o] - w[o].mean()) / np.sqrt(w[o].var() + eps)
    return out


# ---------------------------------------------------------------- layer_norm

LN_SHAPES = [(3, 5), (1, 1, 4), (2, 3, 7), (4, 1), (1, 2)]


@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layer_norm_gradcheck_every_input(xp, rng, shape):
    d = shape[-1]
    x = param(xp, rng, *shape, scale=2.0)
    w = param(xp, rng, d)
    b = param(xp, rng, d)
    tv.gradcheck(lambda x, w, b: F.layer_norm(x, w, b), [x, w, b])


@pytest.mark.parametrize("which", [0, 1, 2])
def test_layer_norm_gradcheck_one_input_at_a_time(xp, rng, which):
    """Only one input wants a gradient: the skipped branches must not break the one that runs."""
    arrays = [rng.standard_normal((2, 3, 6)), rng.standard_normal(6), rng.standard_normal(6)]
    inputs = [tv.Tensor(xp.asarray(a), requires_grad=(i == which)) for i, a in enumerate(arrays)]
    tv.gradcheck(lambda x, w, b: F.layer_norm(x, w, b), inputs)
    for i, t in enumerate(inputs):
        assert (t.grad is None) == (i != which)


def test_layer_norm_without_affine_gradcheck(xp, rng):
    x = param(xp, rng, 2, 5)
    tv.gradcheck(lambda x: F.layer_norm(x, None, None), [x])


def test_layer_norm_forward_matches_numpy(xp, rng):
    x, w, b = rng.standard_normal((2, 3, 8)), rng.standard_normal(8), rng.standard_normal(8)
    y = F.layer_norm(xp.asarray(x), xp.asarray(w), xp.asarray(b), eps=1e-5)
    assert_close(y, ref_layer_norm(x, w, b, 1e-5), rtol=1e-12, atol=1e-12)
    y = to_numpy(F.layer_norm(xp.asarray(x), None, None).data)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(-1), 1, rtol=1e-5)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float32, 1e-4)])
def test_layer_norm_torch_parity(torch, rng, dtype, rtol):
    x, w, b = rng.standard_normal((2, 5, 12)) * 3 + 1, rng.standard_normal(12), rng.standard_normal(12)
    torch_parity(torch, lambda x, w, b: F.layer_norm(x, w, b),
                 lambda x, w, b: torch.nn.functional.layer_norm(x, (12,), w, b, eps=1e-6),
                 [x, w, b], dtype, rtol)


def test_a_wrong_backward_is_caught(xp, rng):
    """The checks above can fail: LayerNorm's backward without the variance term is rejected."""

    class BrokenLayerNorm(norm_ops.LayerNorm):
        def backward(self, gy):
            x_hat, inv_std, gamma = self.saved
            g = gy.reshape(x_hat.shape) * gamma
            dx = inv_std * (g - g.mean(-1, keepdims=True))          # forgot - x_hat * mean(g * x_hat)
            return dx.reshape(gy.shape), None, None

    x = param(xp, rng, 2, 5)
    w = const(xp, rng.standard_normal(5))
    b = const(xp, rng.standard_normal(5))
    with pytest.raises(GradcheckError):
        tv.gradcheck(lambda x: BrokenLayerNorm.apply(x, w, b, 1e-6), [x])


# ---------------------------------------------------------------- group_norm

GN_CASES = [((2, 6, 3, 5), 3), ((1, 4, 1, 1), 2), ((3, 4), 2), ((2, 6, 5), 1), ((2, 3, 2, 2), 3),
            ((1, 1, 2, 3), 1)]


@pytest.mark.parametrize("shape,groups", GN_CASES)
def test_group_norm_gradcheck_every_input(xp, rng, shape, groups):
    c = shape[1]
    x = param(xp, rng, *shape, scale=2.0)
    w = param(xp, rng, c)
    b = param(xp, rng, c)
    tv.gradcheck(lambda x, w, b: F.group_norm(x, groups, w, b), [x, w, b])


@pytest.mark.parametrize("which", [0, 1, 2])
def test_group_norm_gradcheck_one_input_at_a_time(xp, rng, which):
    arrays = [rng.standard_normal((2, 4, 3, 2)), rng.standard_normal(4), rng.standard_normal(4)]
    inputs = [tv.Tensor(xp.asarray(a), requires_grad=(i == which)) for i, a in enumerate(arrays)]
    tv.gradcheck(lambda x, w, b: F.group_norm(x, 2, w, b), inputs)


@pytest.mark.parametrize("shape,groups", GN_CASES)
def test_group_norm_forward_matches_numpy(xp, rng, shape, groups):
    x, w, b = rng.standard_normal(shape), rng.standard_normal(shape[1]), rng.standard_normal(shape[1])
    y = F.group_norm(xp.asarray(x), groups, xp.asarray(w), xp.asarray(b))
    assert y.shape == shape
    assert_close(y, ref_group_norm(x, groups, w, b, 1e-5), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float32, 1e-4)])
@pytest.mark.parametrize("shape,groups", [((2, 8, 5, 3), 4), ((3, 6), 3)])
def test_group_norm_torch_parity(torch, rng, dtype, rtol, shape, groups):
    c = shape[1]
    x, w, b = rng.standard_normal(shape) * 2 - 1, rng.standard_normal(c), rng.standard_normal(c)
    torch_parity(torch, lambda x, w, b: F.group_norm(x, groups, w, b),
                 lambda x, w, b: torch.nn.functional.group_norm(x, groups, w, b, eps=1e-5),
                 [x, w, b], dtype, rtol)


# ---------------------------------------------------------------- weight_standardize

WS_SHAPES = [(4, 3, 3, 3), (1, 2, 1, 1), (5, 7), (3, 1, 2, 2), (2, 3, 1, 1)]


@pytest.mark.parametrize("shape", WS_SHAPES)
def test_weight_standardize_gradcheck(xp, rng, shape):
    w = param(xp, rng, *shape, scale=0.5)
    tv.gradcheck(lambda w: F.weight_standardize(w), [w])


@pytest.mark.parametrize("shape", WS_SHAPES)
def test_weight_standardize_forward_matches_numpy(xp, rng, shape):
    w = rng.standard_normal(shape) * 0.1 + 0.3
    y = F.weight_standardize(xp.asarray(w), eps=1e-5)
    assert_close(y, ref_weight_standardize(w, 1e-5), rtol=1e-10, atol=1e-12)


def test_weight_standardize_default_eps_is_bits():
    """BiT's official code adds 1e-10 to the variance (see the comment in tinyvit/ops/norm.py)."""
    assert norm_ops.BIT_WS_EPS == 1e-10
    w = np.random.default_rng(3).standard_normal((3, 2, 3, 3))
    assert_close(F.weight_standardize(w), ref_weight_standardize(w, 1e-10), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float32, 1e-4)])
def test_weight_standardize_torch_parity(torch, rng, dtype, rtol):
    eps = 1e-6

    def torch_ws(w):
        var, mean = torch.var_mean(w, dim=[1, 2, 3], keepdim=True, unbiased=False)
        return (w - mean) / torch.sqrt(var + eps)

    torch_parity(torch, lambda w: F.weight_standardize(w, eps=eps), torch_ws,
                 [rng.standard_normal((6, 3, 3, 3)) * 0.05], dtype, rtol)


# ---------------------------------------------------------------- float32 stays float32


def test_float32_in_float32_out(xp, rng):
    f32 = np.float32
    x = param(xp, rng, 2, 4, 3, 3, dtype=f32)
    gamma, beta = param(xp, rng, 3, dtype=f32), param(xp, rng, 3, dtype=f32)   # layer_norm over W=3
    w, b = param(xp, rng, 4, dtype=f32), param(xp, rng, 4, dtype=f32)          # group_norm over C=4
    k = param(xp, rng, 4, 4, 3, 3, dtype=f32)
    outs = [F.layer_norm(x, gamma, beta), F.group_norm(x, 2, w, b), F.weight_standardize(k)]
    assert [y.dtype for y in outs] == [f32] * 3
    for y in outs:
        y.backward(xp.asarray(rng.standard_normal(y.shape), dtype=f32))
    for t in (x, gamma, beta, w, b, k):
        assert t.grad is not None and t.grad.dtype == f32


# ---------------------------------------------------------------- bad inputs


def test_layer_norm_errors():
    x = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\).*got \(3,\)"):
        F.layer_norm(x, np.ones(3, np.float32), None)
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        F.layer_norm(x, None, np.ones((1, 4), np.float32))
    with pytest.raises(TypeError, match="x must be a floating-point array.*int64"):
        F.layer_norm(np.zeros((2, 4), np.int64), None, None)
    with pytest.raises(TypeError, match="one floating dtype.*x float32.*weight float64"):
        F.layer_norm(x, np.ones(4), None)
    with pytest.raises(ValueError, match="eps"):
        F.layer_norm(x, None, None, eps=-1.0)


def test_group_norm_errors():
    x = np.zeros((2, 6, 3, 3), np.float32)
    w = np.ones(6, np.float32)
    with pytest.raises(ValueError, match=r"C=6.*not divisible by num_groups=4"):
        F.group_norm(x, 4, w, w)
    with pytest.raises(ValueError, match="num_groups must be a positive integer"):
        F.group_norm(x, 0, w, w)
    with pytest.raises(ValueError, match=r"weight must have shape \(6,\)"):
        F.group_norm(x, 3, np.ones(3, np.float32), w)
    with pytest.raises(ValueError, match=r"\(B, C, \.\.\.\)"):
        F.group_norm(np.zeros(6, np.float32), 3, w, w)
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        F.group_norm(np.zeros((2, 6), np.uint8), 3, w, w)


def test_weight_standardize_errors():
    with pytest.raises(ValueError, match=r"\(out, in, kh, kw\).*got shape \(5,\)"):
        F.weight_standardize(np.zeros(5, np.float32))
    with pytest.raises(TypeError, match="floating-point"):
        F.weight_standardize(np.zeros((2, 3, 3, 3), np.int32))
