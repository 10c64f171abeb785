"""Arithmetic, reductions, shape ops, matmul and linear: gradcheck, NumPy forward, PyTorch parity.

Through tinyvit.functional on both paths (BOTH_PATHS): the reference ops of tinyvit/ops/basic.py and,
for linear, the kernel the switchboard picks (kernels/cpu/linear.py). The kernels' machinery (row
blocks, threads, cache-line-aligned outputs) is tested in tests/test_kernels_cpu.py."""
import numpy as np
import pytest

import tinyvit as tv
from tinyvit import functional as F
from tinyvit.backend import to_numpy
from tinyvit.gradcheck import gradcheck

from helpers import assert_close, param, torch_parity

BOTH_PATHS = True   # every test runs with the kernels and with the reference ops (conftest.py)

# (name, our function, NumPy reference, input shapes, torch function). Shapes cover broadcasting,
# odd sizes and size-1 axes. Inputs of log/sqrt/div are shifted positive in `positive`.
BINARY = [
    ("add", F.add, np.add, lambda t, a, b: a + b),
    ("sub", F.sub, np.subtract, lambda t, a, b: a - b),
    ("mul", F.mul, np.multiply, lambda t, a, b: a * b),
    ("div", F.div, np.divide, lambda t, a, b: a / b),
]
BINARY_SHAPES = [((3, 5), (3, 5)), ((2, 3, 5), (5,)), ((4, 1, 3), (2, 1)), ((1,), (2, 3)), ((), (3,))]

UNARY = [
    ("neg", F.neg, np.negative, lambda t, x: -x, False),
    ("exp", F.exp, np.exp, lambda t, x: t.exp(x), False),
    ("log", F.log, np.log, lambda t, x: t.log(x), True),
    ("sqrt", F.sqrt, np.sqrt, lambda t, x: t.sqrt(x), True),
    ("tanh", F.tanh, np.tanh, lambda t, x: t.tanh(x), False),
    ("relu", F.relu, lambda x: np.maximum(x, 0), lambda t, x: t.relu(x), False),
    ("pow3", lambda x: F.pow(x, 3), lambda x: x ** 3, lambda t, x: x ** 3, False),
    ("pow-0.5", lambda x: F.pow(x, -0.5), lambda x: x ** -0.5, lambda t, x: x ** -0.5, True),
]
UNARY_SHAPES = [(7,), (2, 3, 4), (1, 5, 1)]


def _inputs(rng, shapes, positive=False):
    arrays = [rng.standard_normal(s) for s in shapes]
    if positive:
        arrays = [np.abs(a) + 0.5 for a in arrays]
    return arrays


@pytest.mark.parametrize("name,fn,ref,tfn", BINARY, ids=[b[0] for b in BINARY])
@pytest.mark.parametrize("shapes", BINARY_SHAPES)
def test_binary_gradcheck_and_forward(xp, rng, name, fn, ref, tfn, shapes):
    a, b = _inputs(rng, shapes)
    if name == "div":
        b = np.abs(b) + 0.5
    ta, tb = tv.Tensor(xp.asarray(a), requires_grad=True), tv.Tensor(xp.asarray(b), requires_grad=True)
    assert_close(fn(ta, tb), ref(a, b), rtol=1e-12, what=name)
    gradcheck(fn, [ta, tb])


@pytest.mark.parametrize("name,fn,ref,tfn,positive", UNARY, ids=[u[0] for u in UNARY])
@pytest.mark.parametrize("shape", UNARY_SHAPES)
def test_unary_gradcheck_and_forward(xp, rng, name, fn, ref, tfn, positive, shape):
    (x,) = _inputs(rng, [shape], positive)
    if name == "relu":
        x = np.where(np.abs(x) < 1e-3, 0.1, x)  # keep finite differences away from the kink
    tx = tv.Tensor(xp.asarray(x), requires_grad=True)
    assert_close(fn(tx), ref(x), rtol=1e-12, what=name)
    gradcheck(fn, [tx])


REDUCTIONS = [
    ("sum", F.sum, np.sum), ("mean", F.mean, np.mean), ("max", F.max, np.max),
]


@pytest.mark.parametrize("name,fn,ref", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
@pytest.mark.parametrize("axis,keepdims", [(None, False), (0, False), (-1, True), ((0, 2), False), ((1,), True)])
def test_reductions(xp, rng, name, fn, ref, axis, keepdims):
    x = rng.standard_normal((3, 4, 5))
    tx = tv.Tensor(xp.asarray(x), requires_grad=True)
    assert_close(fn(tx, axis, keepdims), ref(x, axis=axis, keepdims=keepdims), rtol=1e-12, what=name)
    gradcheck(lambda t: fn(t, axis, keepdims), [tx])


def test_max_shares_gradient_between_ties(xp):
    x = tv.Tensor(xp.asarray([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]]), requires_grad=True)
    F.max(x, axis=1).backward(xp.asarray([1.0, 1.0]))
    np.testing.assert_array_equal(to_numpy(x.grad), [[0, 0.5, 0.5], [1, 0, 0]])


def test_shape_ops_gradcheck(xp, rng):
    x = param(xp, rng, 2, 3, 4)
    gradcheck(lambda t: F.reshape(t, (4, 6)), [x])
    gradcheck(lambda t: F.transpose(t, (2, 0, 1)), [x])
    gradcheck(lambda t: t.T, [x])
    gradcheck(lambda t: t[:, 1:, ::2], [x])
    gradcheck(lambda t: t[0, -1], [x])
    gradcheck(lambda t: t[:, [0, 2, 2, 0]], [x])               # repeated indices accumulate
    gradcheck(lambda t: t[np.array([1, 0, 1]), :, np.array([3, 3, 0])], [x])
    y = param(xp, rng, 2, 1, 4)
    gradcheck(lambda a, b: F.concat([a, b, a], axis=1), [x, y])
    cond = xp.asarray(rng.standard_normal((2, 3, 4)) > 0)
    gradcheck(lambda a, b: F.where(cond, a, b), [x, y])


def test_getitem_forward_matches_numpy(xp, rng):
    x = rng.standard_normal((4, 5))
    idx = np.array([3, 0, 3])
    assert_close(tv.Tensor(xp.asarray(x))[idx, 1:], x[idx, 1:], rtol=0)


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 1)),
                                   ((4,), (4, 3)), ((3, 4), (4,)), ((2, 1, 3, 4), (5, 4, 2)), ((5,), (5,))])
def test_matmul(xp, rng, sa, sb):
    a, b = param(xp, rng, *sa), param(xp, rng, *sb)
    assert_close(F.matmul(a, b), np.matmul(to_numpy(a.data), to_numpy(b.data)), rtol=1e-12)
    gradcheck(F.matmul, [a, b])


@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 4), (1, 1, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(xp, rng, shape, bias):
    x, w = param(xp, rng, *shape), param(xp, rng, 4, 3)
    b = param(xp, rng, 3) if bias else None
    ref = to_numpy(x.data) @ to_numpy(w.data) + (to_numpy(b.data) if bias else 0)
    assert_close(F.linear(x, w, b), ref, rtol=1e-12)
    gradcheck(lambda *t: F.linear(*t) if bias else F.linear(t[0], t[1]), [x, w] + ([b] if bias else []))


class CountingProducts(np.ndarray):
    """A NumPy array that counts the matrix products (np.matmul, ``@``, out= or not) it or a view
    of it (a transpose) takes part in; every result is a plain array."""
    products = 0

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if ufunc is np.matmul:
            CountingProducts.products += 1

        def plain(a):
            return a.view(np.ndarray) if isinstance(a, CountingProducts) else a
        if "out" in kwargs:
            kwargs["out"] = tuple(plain(o) for o in kwargs["out"])
        return getattr(ufunc, method)(*map(plain, inputs), **kwargs)


def test_linear_skips_input_gradient_when_not_needed(rng):
    """Backward computes no dL/dx = gy W^T for an input that wants no gradient (the images under a
    patch embedding, say): with W an array that counts the products it takes part in, backward makes
    none, as dL/dW = x^T gy and dL/db need no W; with x wanting a gradient, exactly that one."""
    for x_wants_grad, products in ((False, 0), (True, 1)):
        x = tv.Tensor(rng.standard_normal((3, 5, 4)), requires_grad=x_wants_grad)
        w = tv.Tensor(rng.standard_normal((4, 2)).view(CountingProducts), requires_grad=True)
        b = param(np, rng, 2)
        y = F.linear(x, w, b)
        CountingProducts.products = 0
        y.backward(rng.standard_normal(y.shape))
        assert CountingProducts.products == products, f"x wants a gradient: {x_wants_grad}"
        assert (x.grad is not None) == x_wants_grad and w.grad.shape == (4, 2) and b.grad.shape == (2,)


@pytest.mark.parametrize("source,target", [(np.float32, np.float64), (np.float64, np.float32),
                                           (np.float32, np.float16), (np.float16, np.float32)])
def test_cast_forward_and_backward(xp, rng, source, target):
    """Cast (Tensor.astype, Tensor.to(dtype=...), F.cast) gives the values NumPy's astype gives, in the
    new dtype, and its gradient is the upstream gradient converted back to the input's dtype."""
    values = rng.standard_normal((3, 4)).astype(source)
    g = rng.standard_normal((3, 4)).astype(target)
    for name, convert in (("astype", lambda t: t.astype(target)), ("F.cast", lambda t: F.cast(t, target)),
                          ("to", lambda t: (t * 1.0).to(dtype=target))):       # a non-leaf: through Cast
        x = tv.Tensor(xp.asarray(values), requires_grad=True)
        y = convert(x)
        assert y.dtype == target and type(y._ctx).__name__ == "Cast", name
        np.testing.assert_array_equal(to_numpy(y.data), values.astype(target), err_msg=name)
        y.backward(xp.asarray(g))
        assert x.grad.dtype == source, name
        np.testing.assert_array_equal(to_numpy(x.grad), g.astype(source), err_msg=name)


def test_cast_gradcheck(xp, rng):
    """float64 gradient checks with a random upstream gradient: a cast to float64 (the identity), and
    a round trip through float32 between two float64 ops (steps of 1e-2, so that float32's rounding,
    1e-7 of the values, stays far below the differences)."""
    x = param(xp, rng, 3, 4)
    gradcheck(lambda t: F.cast(t * t, np.float64), [x])
    gradcheck(lambda t: F.cast(F.cast(t * 3.0, np.float32).exp(), np.float64), [x], eps=1e-2, rtol=1e-3)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float32, 1e-4)])
def test_torch_parity(torch, rng, dtype, rtol):
    a, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((4,))
    pos = np.abs(rng.standard_normal((2, 3, 4))) + 0.5
    for name, fn, _, tfn in BINARY:
        torch_parity(torch, fn, lambda x, y, f=tfn: f(torch, x, y), [a, pos if name == "div" else b], dtype, rtol)
    for name, fn, _, tfn, positive in UNARY:
        torch_parity(torch, fn, lambda x, f=tfn: f(torch, x), [pos if positive else a], dtype, rtol)
    torch_parity(torch, lambda x: F.sum(x, (0, 2)), lambda x: x.sum((0, 2)), [a], dtype, rtol)
    torch_parity(torch, lambda x: F.mean(x, -1, True), lambda x: x.mean(-1, keepdim=True), [a], dtype, rtol)
    torch_parity(torch, lambda x: F.max(x, 1), lambda x: x.amax(1), [a], dtype, rtol)
    w, bias = rng.standard_normal((4, 5)), rng.standard_normal(5)
    torch_parity(torch, F.matmul, torch.matmul, [a, w], dtype, rtol)
    torch_parity(torch, F.linear, lambda x, w_, b_: torch.nn.functional.linear(x, w_.T, b_), [a, w, bias], dtype, rtol)
    torch_parity(torch, lambda x: F.transpose(x, (1, 2, 0))[:, [0, 0, 3]],
                 lambda x: x.permute(1, 2, 0)[:, [0, 0, 3]], [a], dtype, rtol)


def test_float32_stays_float32(rng):
    x = tv.Tensor(rng.standard_normal((2, 3, 4)).astype(np.float32), requires_grad=True)
    w = tv.Tensor(rng.standard_normal((4, 5)).astype(np.float32), requires_grad=True)
    y = (F.linear(x, w) * 0.5 + 1.0).exp().sqrt().tanh() / 3.0
    y = F.pow(y, 2.0).mean()
    assert y.dtype == np.float32
    y.backward()
    assert x.grad.dtype == np.float32 and w.grad.dtype == np.float32


def test_shape_errors_name_both_shapes(rng):
    a, b = tv.Tensor(np.zeros((2, 3), np.float32)), tv.Tensor(np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(4, 5\)"):
        F.matmul(a, b)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(4, 5\)"):
        F.linear(a, b)
    with pytest.raises(TypeError, match="floating-point"):
        F.linear(np.zeros((2, 4), np.int64), b)


def test_linear_mixed_dtypes_are_rejected():
    """A float32 input with a float64 weight is an error naming both, not a silent float64 output
    whose backward then fails."""
    with pytest.raises(TypeError, match="one floating dtype"):
        F.linear(np.ones((2, 3), np.float32), np.ones((3, 2)))
