"""cross_entropy (integer labels, probabilities, label smoothing) and mse: references, gradients,
PyTorch parity, huge logits, dtypes and the errors bad targets raise."""
import numpy as np
import pytest

import tinyvit as tv
import tinyvit.functional as F
from tinyvit.backend import to_numpy
from tinyvit.ops import loss as loss_ops

from helpers import assert_close, const, param, torch_parity

# (logits shape, label shape): 1-D logits take a single label of shape ()
LABEL_CASES = [((4, 5), (4,)), ((1, 3), (1,)), ((7,), ()), ((2, 3, 4), (2, 3)), ((3, 1), (3,)), ((5, 2), (5,))]


def random_labels(rng, shape, k):
    return rng.integers(0, k, size=shape)


def random_probabilities(rng, shape):
    p = rng.random(shape) + 0.05
    return p / p.sum(axis=-1, keepdims=True)


def cross_entropy_reference(logits, target, eps=0.0):
    """Written out in float64: log-sum-exp per row, the smoothed target, the mean over rows."""
    logits = np.asarray(logits, dtype=np.float64)
    k = logits.shape[-1]
    z = logits.reshape(-1, k)
    m = z.max(axis=1, keepdims=True)
    logp = z - m - np.log(np.exp(z - m).sum(axis=1, keepdims=True))
    target = np.asarray(target)
    if target.dtype.kind == "f":
        t = target.reshape(-1, k).astype(np.float64)
    else:
        t = np.eye(k)[target.reshape(-1)]
    t = (1 - eps) * t + eps / k
    return -(t * logp).sum(axis=1).mean()


# ---------------------------------------------------------------- cross_entropy: gradients


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("logits_shape,label_shape", LABEL_CASES)
def test_cross_entropy_labels_gradcheck(xp, rng, logits_shape, label_shape, eps):
    logits = param(xp, rng, *logits_shape, scale=2.0)
    labels = xp.asarray(random_labels(rng, label_shape, logits_shape[-1]))
    tv.gradcheck(lambda z: F.cross_entropy(z, labels, label_smoothing=eps), [logits])


@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("shape", [(4, 5), (1, 3), (6,), (2, 3, 4), (3, 1)])
def test_cross_entropy_probabilities_gradcheck_logits_and_target(xp, rng, shape, eps):
    logits = param(xp, rng, *shape, scale=2.0)
    target = tv.Tensor(xp.asarray(random_probabilities(rng, shape)), requires_grad=True)
    tv.gradcheck(lambda z, t: F.cross_entropy(z, t, label_smoothing=eps), [logits, target])


def test_cross_entropy_constant_probabilities_get_no_gradient(xp, rng):
    logits = param(xp, rng, 3, 4)
    target = const(xp, random_probabilities(rng, (3, 4)))
    tv.gradcheck(lambda z: F.cross_entropy(z, target), [logits])
    assert target.grad is None


# ---------------------------------------------------------------- cross_entropy: forward


@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("logits_shape,label_shape", LABEL_CASES)
def test_cross_entropy_labels_match_reference(xp, rng, logits_shape, label_shape, eps):
    logits = rng.standard_normal(logits_shape) * 3
    labels = random_labels(rng, label_shape, logits_shape[-1])
    loss = F.cross_entropy(xp.asarray(logits), xp.asarray(labels), label_smoothing=eps)
    assert loss.shape == ()
    assert_close(loss, cross_entropy_reference(logits, labels, eps), rtol=1e-12, what="loss")


@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_cross_entropy_probabilities_match_reference(xp, rng, eps):
    logits, target = rng.standard_normal((5, 7)) * 3, random_probabilities(rng, (5, 7))
    loss = F.cross_entropy(xp.asarray(logits), xp.asarray(target), label_smoothing=eps)
    assert_close(loss, cross_entropy_reference(logits, target, eps), rtol=1e-12, what="loss")


def test_one_hot_probabilities_equal_labels(xp, rng):
    logits, labels = rng.standard_normal((6, 4)), random_labels(rng, (6,), 4)
    a = F.cross_entropy(xp.asarray(logits), xp.asarray(labels), label_smoothing=0.1)
    b = F.cross_entropy(xp.asarray(logits), xp.asarray(np.eye(4)[labels]), label_smoothing=0.1)
    assert_close(a, to_numpy(b.data), rtol=1e-14, what="labels vs one-hot")


def test_labels_as_list_tensor_and_unsigned(rng):
    logits = rng.standard_normal((3, 4))
    want = cross_entropy_reference(logits, np.array([0, 3, 1]))
    for labels in ([0, 3, 1], tv.Tensor(np.array([0, 3, 1])), np.array([0, 3, 1], dtype=np.uint8)):
        assert_close(F.cross_entropy(logits, labels), want, rtol=1e-14, what=f"labels {type(labels).__name__}")


# ---------------------------------------------------------------- cross_entropy: PyTorch parity

PARITY = [(np.float64, 1e-6), (np.float32, 1e-4)]


@pytest.mark.parametrize("dtype,rtol", PARITY)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cross_entropy_labels_torch_parity(torch, rng, dtype, rtol, eps):
    logits, labels = rng.standard_normal((8, 10)) * 3, random_labels(rng, (8,), 10)
    torch_parity(torch, lambda z: F.cross_entropy(z, labels, label_smoothing=eps),
                 lambda z: torch.nn.functional.cross_entropy(z, torch.tensor(labels), label_smoothing=eps),
                 [logits], dtype, rtol)


@pytest.mark.parametrize("dtype,rtol", PARITY)
def test_cross_entropy_3d_labels_torch_parity(torch, rng, dtype, rtol):
    logits, labels = rng.standard_normal((2, 5, 6)) * 3, random_labels(rng, (2, 5), 6)
    torch_parity(torch, lambda z: F.cross_entropy(z, labels, label_smoothing=0.05),
                 lambda z: torch.nn.functional.cross_entropy(z.reshape(-1, 6), torch.tensor(labels).reshape(-1),
                                                             label_smoothing=0.05),
                 [logits], dtype, rtol)


@pytest.mark.parametrize("dtype,rtol", PARITY)
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_cross_entropy_probabilities_torch_parity(torch, rng, dtype, rtol, eps):
    """Soft targets, both logits and target differentiable (as in distillation)."""
    logits, target = rng.standard_normal((6, 9)) * 3, random_probabilities(rng, (6, 9))
    torch_parity(torch, lambda z, t: F.cross_entropy(z, t, label_smoothing=eps),
                 lambda z, t: torch.nn.functional.cross_entropy(z, t, label_smoothing=eps),
                 [logits, target], dtype, rtol)


# ---------------------------------------------------------------- cross_entropy: numerics and dtypes


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["labels", "probabilities"])
def test_cross_entropy_huge_logits_stay_finite(xp, rng, dtype, kind):
    logits64 = rng.standard_normal((6, 5)) * 1e4
    target = random_labels(rng, (6,), 5) if kind == "labels" else random_probabilities(rng, (6, 5))
    logits = tv.Tensor(xp.asarray(logits64, dtype=dtype), requires_grad=True)
    loss = F.cross_entropy(logits, xp.asarray(target), label_smoothing=0.1)
    loss.backward()
    assert np.isfinite(loss.item()) and np.isfinite(to_numpy(logits.grad)).all()
    want = cross_entropy_reference(logits64.astype(dtype), target, 0.1)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    # the gradient of a mean over rows: each row of (softmax - t) / n sums to zero
    np.testing.assert_allclose(to_numpy(logits.grad).sum(axis=1), 0.0, atol=1e-6)


@pytest.mark.parametrize("kind", ["labels", "probabilities"])
def test_cross_entropy_float32_in_float32_out(xp, rng, kind):
    logits = tv.Tensor(xp.asarray(rng.standard_normal((4, 3)), dtype=np.float32), requires_grad=True)
    # float64 probabilities (a raw array) are converted to the logits' dtype, not the other way round
    target = xp.asarray(random_labels(rng, (4,), 3) if kind == "labels" else random_probabilities(rng, (4, 3)))
    loss = F.cross_entropy(logits, target, label_smoothing=0.1)
    loss.backward()
    assert loss.dtype == np.float32 and logits.grad.dtype == np.float32


def test_cross_entropy_no_grad_records_nothing(rng, monkeypatch):
    """Under no_grad the loss of logits that want a gradient records no graph: it has no creator, its
    Function was told that no input wants a gradient and holds no saved arrays once forward is done,
    and backward through the loss is refused, leaving the logits without a gradient."""
    made = []
    forward = loss_ops.CrossEntropy.forward

    def spy(self, *args, **kwargs):
        made.append(self)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(loss_ops.CrossEntropy, "forward", spy)
    logits = tv.Tensor(rng.standard_normal((2, 3)), requires_grad=True)
    with tv.no_grad():
        loss = F.cross_entropy(logits, np.array([0, 2]))
    (fn,) = made
    assert loss.is_leaf and not loss.requires_grad
    assert fn.needs_input_grad == (False, False, False) and fn.saved == ()
    with pytest.raises(RuntimeError, match="does not require a gradient"):
        loss.backward()
    assert logits.grad is None


# ---------------------------------------------------------------- cross_entropy: bad input


def test_cross_entropy_bad_targets():
    logits = np.zeros((4, 5))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\) for logits of shape \(4, 5\), "
                                         r"got values from 0 to 5"):
        F.cross_entropy(logits, np.array([0, 1, 5, 2]))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\).*got values from -1 to 3"):
        F.cross_entropy(logits, np.array([0, -1, 3, 2]))
    with pytest.raises(ValueError, match=r"target of shape \(3,\) does not fit logits of shape \(4, 5\): "
                                         r"expected integer labels of shape \(4,\) or probabilities of shape \(4, 5\)"):
        F.cross_entropy(logits, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"target of shape \(4, 1\) does not fit"):
        F.cross_entropy(logits, np.zeros((4, 1), dtype=np.int64))
    with pytest.raises(TypeError, match=r"has the shape of class labels .* but dtype float64; "
                                        r"labels must be integers"):
        F.cross_entropy(logits, np.array([0.0, 1.0, 2.0, 3.0]))
    with pytest.raises(TypeError, match=r"holds probabilities and must be floating point, got dtype int64"):
        F.cross_entropy(logits, np.zeros((4, 5), dtype=np.int64))
    with pytest.raises(TypeError, match=r"class labels must be integers, got dtype bool"):
        F.cross_entropy(logits, np.zeros(4, dtype=bool))
    with pytest.raises(TypeError, match=r"probabilities are float32 but logits are float64"):
        F.cross_entropy(logits, tv.Tensor(np.full((4, 5), 0.2, dtype=np.float32), requires_grad=True))
    with pytest.raises(TypeError, match=r"logits must be a floating-point array, got dtype int64"):
        F.cross_entropy(np.zeros((4, 5), dtype=np.int64), np.zeros(4, dtype=np.int64))


def test_cross_entropy_bad_shapes_and_smoothing():
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\], got 1.5"):
        F.cross_entropy(np.zeros((2, 3)), np.array([0, 1]), label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"logits must have shape \(..., K\) with K >= 1 classes, got \(2, 0\)"):
        F.cross_entropy(np.zeros((2, 0)), np.array([0, 0]))
    with pytest.raises(ValueError, match=r"K >= 1 classes, got \(\)"):
        F.cross_entropy(np.array(1.0), np.array(0))
    with pytest.raises(ValueError, match=r"logits of shape \(0, 3\) hold no positions"):
        F.cross_entropy(np.zeros((0, 3)), np.zeros(0, dtype=np.int64))


# ---------------------------------------------------------------- mse


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 1, 5), (1,)])
def test_mse_gradcheck_pred_and_target(xp, rng, shape):
    pred, target = param(xp, rng, *shape), param(xp, rng, *shape)
    tv.gradcheck(F.mse, [pred, target])


def test_mse_constant_target_gradcheck(xp, rng):
    pred = param(xp, rng, 4, 3)
    target = xp.asarray(rng.standard_normal((4, 3)))
    tv.gradcheck(lambda p: F.mse(p, target), [pred])


def test_mse_matches_reference(xp, rng):
    p, t = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 4, 5))
    loss = F.mse(xp.asarray(p), xp.asarray(t))
    assert loss.shape == ()
    assert_close(loss, ((p - t) ** 2).mean(), rtol=1e-13, what="mse")


@pytest.mark.parametrize("dtype,rtol", PARITY)
def test_mse_torch_parity(torch, rng, dtype, rtol):
    p, t = rng.standard_normal((5, 6)), rng.standard_normal((5, 6))
    torch_parity(torch, F.mse, torch.nn.functional.mse_loss, [p, t], dtype, rtol)


def test_mse_float32_with_float64_or_integer_target(xp, rng):
    pred = tv.Tensor(xp.asarray(rng.standard_normal((4, 2)), dtype=np.float32), requires_grad=True)
    for target in (xp.asarray(rng.standard_normal((4, 2))), xp.ones((4, 2), dtype=np.int64)):
        pred.grad = None
        loss = F.mse(pred, target)
        loss.backward()
        assert loss.dtype == np.float32 and pred.grad.dtype == np.float32


def test_mse_bad_input():
    with pytest.raises(ValueError, match=r"target of shape \(3,\) does not match pred of shape \(3, 1\)"):
        F.mse(np.zeros((3, 1)), np.zeros(3))
    with pytest.raises(TypeError, match=r"pred must be a floating-point array, got dtype int64"):
        F.mse(np.zeros(3, dtype=np.int64), np.zeros(3))
    with pytest.raises(TypeError, match=r"target is float32 but pred is float64"):
        F.mse(np.zeros(3), tv.Tensor(np.zeros(3, dtype=np.float32), requires_grad=True))
    with pytest.raises(ValueError, match=r"pred of shape \(0, 2\) is empty"):
        F.mse(np.zeros((0, 2)), np.zeros((0, 2)))
