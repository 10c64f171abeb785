"""The engine: accumulation, broadcasting, deep graphs, freed buffers, no_grad, devices, gradcheck itself."""
import numpy as np
import pytest

import tinyvit as tv
from tinyvit import backend
from tinyvit import functional as F
from tinyvit.autograd import Function
from tinyvit.backend import to_numpy
from tinyvit.gradcheck import GradcheckError, gradcheck


def test_tensor_used_twice_gets_the_sum(xp):
    x = tv.Tensor(xp.asarray([1.0, 2.0]), requires_grad=True)
    y = x * x + x          # dy/dx = 2x + 1
    y.sum().backward()
    np.testing.assert_allclose(to_numpy(x.grad), [3.0, 5.0])


def test_gradients_accumulate_across_backward_calls(xp):
    x = tv.Tensor(xp.asarray([1.0, 2.0]), requires_grad=True)
    (x * 3.0).sum().backward()
    (x * 3.0).sum().backward()
    np.testing.assert_allclose(to_numpy(x.grad), [6.0, 6.0])


def test_broadcast_gradient_is_reduced_to_input_shape(xp):
    x = tv.Tensor(xp.ones((2, 3, 4)), requires_grad=True)
    b = tv.Tensor(xp.ones((3, 1)), requires_grad=True)
    (x * b).sum().backward()
    assert b.grad.shape == (3, 1)
    np.testing.assert_allclose(to_numpy(b.grad), np.full((3, 1), 8.0))


def test_leaf_gradients_do_not_alias(xp):
    a = tv.Tensor(xp.zeros(3), requires_grad=True)
    b = tv.Tensor(xp.zeros(3), requires_grad=True)
    (a + b).backward(xp.ones(3))
    a.grad *= 2.0                         # an in-place change of one gradient ...
    np.testing.assert_allclose(to_numpy(b.grad), np.ones(3))  # ... leaves the other alone


def test_deep_graph_does_not_recurse(xp):
    x = tv.Tensor(xp.asarray([1.0]), requires_grad=True)
    y = x
    for _ in range(3000):
        y = y * 1.0 + 0.0
    y.sum().backward()
    np.testing.assert_allclose(to_numpy(x.grad), [1.0])


def test_saved_arrays_are_released_and_second_backward_fails(xp):
    x = tv.Tensor(xp.asarray([1.0, 2.0]), requires_grad=True)
    y = (x.exp() * x).sum()
    y.backward()
    assert y._ctx.saved is None
    with pytest.raises(RuntimeError, match="second time"):
        y.backward()


def test_retain_graph_allows_a_second_backward(xp):
    x = tv.Tensor(xp.asarray([1.0, 2.0]), requires_grad=True)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(to_numpy(x.grad), [4.0, 8.0])


def test_backward_on_non_scalar_needs_a_gradient():
    x = tv.Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(RuntimeError, match="shape"):
        (x * 2.0).backward()
    with pytest.raises(ValueError, match="shape"):
        (x * 2.0).backward(np.ones(4))


def test_no_grad_records_nothing():
    x = tv.Tensor(np.ones(3), requires_grad=True)
    with tv.no_grad():
        y = x * 2.0
    assert not y.requires_grad and y._ctx is None
    with pytest.raises(RuntimeError, match="does not require"):
        y.sum().backward()


def test_detach_cuts_the_graph():
    x = tv.Tensor(np.ones(3), requires_grad=True)
    y = (x * 2.0).detach() * x
    y.sum().backward()
    np.testing.assert_allclose(x.grad, [2.0, 2.0, 2.0])


def test_retain_grad_on_intermediate():
    x = tv.Tensor(np.array([1.0, 2.0]), requires_grad=True)
    h = (x * 3.0).retain_grad()
    (h * h).sum().backward()
    np.testing.assert_allclose(h.grad, [6.0, 12.0])


def test_integer_tensors_cannot_require_grad():
    with pytest.raises(TypeError, match="floating-point"):
        tv.Tensor(np.arange(3), requires_grad=True)


def test_default_dtype_is_float32_and_arrays_keep_theirs():
    assert tv.Tensor([1.0, 2.0]).dtype == np.float32
    assert tv.Tensor(np.zeros(2)).dtype == np.float64
    with backend.default_dtype(np.float64):
        assert tv.Tensor([1.0]).dtype == np.float64


def test_cuda_without_cupy_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(backend, "_cupy", False)
    with pytest.raises(RuntimeError, match=r"tinyvit\[gpu\]"):
        tv.Tensor(np.ones(2)).to("cuda")


def test_mixing_devices_names_both(monkeypatch):
    class FakeGPUArray(np.ndarray):  # an ndarray that reports itself as living on cuda:0
        pass
    fake = np.ones(2).view(FakeGPUArray)
    monkeypatch.setattr(backend, "device_of", lambda a: "cuda:0" if isinstance(a, FakeGPUArray) else "cpu")
    with pytest.raises(RuntimeError, match=r"cpu.*cuda:0"):
        F.add(np.ones(2), fake)


def test_gradcheck_catches_a_wrong_backward():
    class BadSquare(Function):
        def forward(self, x):
            self.save(x)
            return x * x

        def backward(self, gy):
            (x,) = self.saved
            return gy * x          # wrong: should be 2 x gy

    x = tv.Tensor(np.random.default_rng(0).standard_normal(5), requires_grad=True)
    with pytest.raises(GradcheckError, match="relative error"):
        gradcheck(BadSquare.apply, [x])
    result = gradcheck(BadSquare.apply, [x], raise_on_failure=False)
    assert not result.ok and result.max_rel_error > 0.1


def test_gradcheck_random_direction_mode_catches_a_wrong_backward():
    class BadScale(Function):
        def forward(self, x):
            return x * 3.0

        def backward(self, gy):
            return gy * 2.9

    x = tv.Tensor(np.random.default_rng(0).standard_normal((50, 100)), requires_grad=True)
    with pytest.raises(GradcheckError):
        gradcheck(BadScale.apply, [x], mode="random")
    assert gradcheck(lambda t: t * 3.0, [x], mode="random").ok


def test_gradcheck_upstream_is_not_all_ones():
    # softmax-like bug: a backward missing the Jacobian's off-diagonal term passes with ones.
    class BadNormalize(Function):
        def forward(self, x):
            y = x / x.sum(axis=-1, keepdims=True)
            self.save(x.sum(axis=-1, keepdims=True))
            return y

        def backward(self, gy):
            (s,) = self.saved
            return gy / s          # misses -sum(gy * y) / s

    x = tv.Tensor(np.random.default_rng(1).random((3, 4)) + 1.0, requires_grad=True)
    with pytest.raises(GradcheckError):
        gradcheck(BadNormalize.apply, [x])


def test_gradcheck_refuses_float32():
    x = tv.Tensor(np.ones(3, np.float32), requires_grad=True)
    with pytest.raises(ValueError, match="float64"):
        gradcheck(lambda t: t * 2.0, [x])


def test_backward_dtype_change_is_caught():
    class Upcast(Function):
        def forward(self, x):
            return x * 2.0

        def backward(self, gy):
            return gy.astype(np.float64) * 2.0

    x = tv.Tensor(np.ones(3, np.float32), requires_grad=True)
    with pytest.raises(RuntimeError, match="float64 gradient for a float32"):
        Upcast.apply(x).sum().backward()
