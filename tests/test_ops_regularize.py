"""dropout and drop_path: gradients, statistics, identities, reproducibility, dtypes and errors."""
import numpy as np
import pytest

import tinyvit as tv
import tinyvit.functional as F
from tinyvit.backend import to_numpy

from helpers import param


def seeded(op, p, seed=7):
    """op(x, p, training=True) with the same mask on every call, as gradcheck needs."""
    def fn(x):
        tv.manual_seed(seed)
        return op(x, p, True)
    return fn


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("p", [0.25, 0.6])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 1, 5), (1, 3, 1)])
def test_dropout_gradcheck(xp, rng, shape, p):
    tv.gradcheck(seeded(F.dropout, p), [param(xp, rng, *shape)])


@pytest.mark.parametrize("p", [0.25, 0.6])
@pytest.mark.parametrize("shape", [(9,), (6, 5), (5, 1, 3), (4, 2, 3)])
def test_drop_path_gradcheck(xp, rng, shape, p):
    tv.gradcheck(seeded(F.drop_path, p), [param(xp, rng, *shape)])


@pytest.mark.parametrize("op", [F.dropout, F.drop_path])
def test_gradient_is_the_mask(xp, rng, op):
    """dL/dx = gy * keep / (1 - p): zero exactly where the output was zeroed, 1/(1-p) elsewhere."""
    p = 0.4
    x = tv.Tensor(xp.asarray(rng.random((50, 3, 4)) + 0.5), requires_grad=True)   # no zeros in x
    y = seeded(op, p)(x)
    y.backward(xp.ones(x.shape))
    kept = to_numpy(y.data) != 0
    np.testing.assert_allclose(to_numpy(x.grad), kept / (1 - p), rtol=1e-15)
    np.testing.assert_allclose(to_numpy(y.data), to_numpy(x.data) * kept / (1 - p), rtol=1e-15)
    assert 0 < kept.mean() < 1


# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_statistics(xp, p):
    n = 1_000_000
    tv.manual_seed(0)
    y = to_numpy(F.dropout(xp.ones(n, dtype=np.float32), p, True).data)
    zeroed = (y == 0).mean()
    assert abs(zeroed - p) < 5 * np.sqrt(p * (1 - p) / n), f"fraction zeroed {zeroed}, expected {p}"
    assert abs(y.mean() - 1.0) < 5 * np.sqrt(p / (1 - p) / n), f"mean {y.mean()} drifted from 1"
    np.testing.assert_array_equal(np.unique(y), np.array([0.0, 1.0 / (1.0 - p)], dtype=np.float32))


def test_drop_path_zeroes_whole_samples(xp, rng):
    p, b = 0.3, 4000
    tv.manual_seed(1)
    x = xp.asarray(rng.random((b, 3, 5)) + 0.5)
    y = to_numpy(F.drop_path(x, p, True).data)
    dropped = (y == 0).reshape(b, -1)
    assert (dropped.all(axis=1) | ~dropped.any(axis=1)).all(), "a sample was dropped only in part"
    kept = ~dropped.all(axis=1)
    np.testing.assert_allclose(y[kept], to_numpy(x)[kept] / (1 - p), rtol=1e-15)
    assert abs((~kept).mean() - p) < 5 * np.sqrt(p * (1 - p) / b), f"dropped {(~kept).mean()} of samples"


def test_drop_path_on_a_1d_batch(xp):
    tv.manual_seed(2)
    y = to_numpy(F.drop_path(xp.ones(1000), 0.5, True).data)
    assert set(np.unique(y)) == {0.0, 2.0}


# ---------------------------------------------------------------- identity, reproducibility, dtypes


@pytest.mark.parametrize("op", [F.dropout, F.drop_path])
def test_identity_when_not_training_or_p_zero(xp, rng, op):
    x = param(xp, rng, 4, 6)
    for p, training in [(0.5, False), (0.0, True), (0.0, False)]:
        y = op(x, p, training)
        np.testing.assert_array_equal(to_numpy(y.data), to_numpy(x.data))
        x.grad = None
        y.backward(xp.full(x.shape, 3.0))
        np.testing.assert_array_equal(to_numpy(x.grad), 3.0)
    raw = op(xp.ones((2, 3)), 0.5, False)
    assert isinstance(raw, tv.Tensor) and not raw.requires_grad


@pytest.mark.parametrize("op", [F.dropout, F.drop_path])
def test_reproducible_under_manual_seed(xp, op):
    x = xp.ones((64, 8), dtype=np.float32)
    tv.manual_seed(11)
    a = to_numpy(op(x, 0.5, True).data)
    b = to_numpy(op(x, 0.5, True).data)          # the generator moved on: another mask
    tv.manual_seed(11)
    c = to_numpy(op(x, 0.5, True).data)
    np.testing.assert_array_equal(a, c)
    assert not np.array_equal(a, b)


def test_masks_come_from_the_seeded_generator():
    """On NumPy the mask is tinyvit's generator's uniforms compared with p (keep where u >= p)."""
    tv.manual_seed(5)
    y = F.dropout(np.ones((30, 20), dtype=np.float32), 0.3, True).numpy()
    u = np.random.default_rng(5).random((30, 20), dtype=np.float32)
    np.testing.assert_array_equal(y != 0, u >= 0.3)


@pytest.mark.parametrize("op", [F.dropout, F.drop_path])
def test_float32_in_float32_out_on_the_same_device(xp, rng, op):
    x = tv.Tensor(xp.asarray(rng.standard_normal((8, 3, 2)), dtype=np.float32), requires_grad=True)
    y = op(x, 0.5, True)
    y.backward(xp.ones(x.shape, dtype=np.float32))
    assert y.dtype == np.float32 and x.grad.dtype == np.float32
    assert type(y.data) is type(x.data) and type(x.grad) is type(x.data)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("op,name", [(F.dropout, "dropout"), (F.drop_path, "drop_path")])
def test_bad_input_errors(op, name):
    x = np.ones((2, 3))
    for p in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=rf"{name}: p must be in \[0, 1\), got {p}"):
            op(x, p, True)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got 1.0"):
        op(x, 1.0, False)                         # checked in evaluation too: the bug is in the config
    with pytest.raises(TypeError, match=rf"{name}: p must be a number in \[0, 1\), got str"):
        op(x, "0.5", True)
    with pytest.raises(TypeError, match=rf"{name}: x must be a floating-point array, got dtype int64"):
        op(np.ones((2, 3), dtype=np.int64), 0.5, True)


def test_drop_path_needs_a_batch_axis():
    with pytest.raises(ValueError, match=r"drop_path: x must have a batch axis \(B, ...\), got shape \(\)"):
        F.drop_path(np.array(1.0), 0.5, True)
