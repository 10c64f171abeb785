"""kernels/cuda/loss.py (softmax cross-entropy, CUDA) against ops/loss.py's CrossEntropy on the GPU: the
loss and the gradients of the logits and of a probability target, on the same CuPy arrays, the
reference under use_kernels(False) and the kernel under use_kernels("all") (through F.cross_entropy,
the switchboard), float64 and float32, int64 and int32 labels or probabilities, label smoothing
0, 0.1 and 1, an upstream gradient of 2.5, rows of 1 to 21843 classes (one warp per block up to the
full 512 threads, ragged last passes) and leading axes (..., K).

float64: rtol = atol = 1e-12. float32: rtol 1e-5, atol 1e-6 times the array's largest magnitude:
the kernel sums each row in another order than CuPy and takes the loss as a mean of per-row losses
(the CPU emulation of the kernels measured at most 6e-7 of the largest value).

The GPU tests carry the gpu mark (pytest -m gpu) and skip without a CUDA device; the tests at the
end (no mark) check the launch arithmetic and the compiled kernels' names on the CPU.
"""
import numpy as np
import pytest

import tinyvit as tv
import tinyvit.functional as F
from tinyvit.kernels import cuda as cuda_kernels, kernel_for, use_kernels
from tinyvit.kernels.cuda import loss as k_loss

from conftest import CUDA
from kernel_checks import F64, assert_same

OPS = ["cross_entropy"]
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device with CuPy here (pip install 'tinyvit[gpu]')")

TOL = {np.float64: (F64["rtol"], F64["atol"]), np.float32: (1e-5, 1e-6)}
# (leading shape, K)
SHAPES = [((1,), 1), ((7,), 3), ((5,), 10), ((2, 3), 100), ((33,), 129), ((3,), 1000), ((4,), 1037), ((2,), 21843)]
GY = 2.5


def inputs(rng, lead, k, kind):
    """Logits of spread ~3 and a target: int64 or int32 labels, or rows of probabilities."""
    logits = rng.standard_normal(lead + (k,)) * 3
    if kind.startswith("labels"):
        return logits, rng.integers(0, k, size=lead).astype(np.int32 if kind == "labels32" else np.int64)
    p = rng.random(lead + (k,))
    return logits, p / p.sum(axis=-1, keepdims=True)


def run(logits, target, eps, dtype, target_grad):
    """F.cross_entropy on CuPy Tensors, then backward of GY * loss: host copies of (loss, dlogits, dtarget)."""
    import cupy
    x = tv.Tensor(cupy.asarray(logits, dtype=dtype), requires_grad=True)
    t = cupy.asarray(target, dtype=dtype if target.dtype.kind == "f" else target.dtype)
    t = tv.Tensor(t, requires_grad=target_grad)
    loss = F.cross_entropy(x, t, label_smoothing=eps)
    assert loss.shape == () and loss.dtype == dtype
    (loss * GY).backward()
    return loss.data.get(), x.grad.get(), None if t.grad is None else t.grad.get()


@pytest.mark.gpu
@needs_cuda
def test_the_switchboard_picks_the_cuda_kernel():
    """With use_kernels("all"), CuPy float32 and float64 logits get kernels/cuda/loss.py's Function."""
    import cupy
    for dtype in (cupy.float32, cupy.float64):
        with use_kernels("all"):
            assert kernel_for("cross_entropy", cupy.ones((2, 3), dtype)) is k_loss.CrossEntropy
        with use_kernels(False):
            assert kernel_for("cross_entropy", cupy.ones((2, 3), dtype)) is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("lead,k", SHAPES)
@pytest.mark.parametrize("kind", ["labels", "labels32", "probabilities", "probabilities with gradient"])
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
def test_cross_entropy_equals_reference(dtype, lead, k, kind, eps):
    """The "cross_entropy" kernel: the loss, dL/dlogits and (probabilities that want one) dL/dtarget
    equal the reference's, for labels and probabilities, with and without label smoothing."""
    rng = np.random.default_rng(k + len(lead))
    logits, target = inputs(rng, lead, k, kind)
    target_grad = kind == "probabilities with gradient"
    with use_kernels("all"):
        got = run(logits, target, eps, dtype, target_grad)
    with use_kernels(False):
        want = run(logits, target, eps, dtype, target_grad)
    for what, a, b in zip(("loss", "gradient of the logits", "gradient of the target"), got, want):
        assert_same(a, b, *TOL[dtype], what=f"{what} ({np.dtype(dtype).name}, {kind}, eps={eps})")
    assert (got[2] is not None) == target_grad


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_large_logits_stay_finite(dtype):
    """Logits of +-1000 (exp overflows past 88 in float32, 709 in float64): the max is subtracted
    first, so the loss and gradient are finite and equal the reference's."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, 50)) * 1000
    labels = rng.integers(0, 50, size=6)
    with use_kernels("all"):
        got = run(logits, labels, 0.1, dtype, False)
    with use_kernels(False):
        want = run(logits, labels, 0.1, dtype, False)
    assert np.isfinite(got[0]) and np.isfinite(got[1]).all()
    for a, b in zip(got[:2], want[:2]):
        assert_same(a, b, *TOL[dtype], what="large logits")


@pytest.mark.gpu
@needs_cuda
def test_loss_stays_on_the_device_and_takes_a_device_gradient():
    """The kernel's loss is a 0-d CuPy array (no host copy), and backward reads the upstream
    gradient from device memory: a CuPy gy of 3 gives 3 times the gradient of gy = 1."""
    import cupy
    rng = np.random.default_rng(6)
    logits = cupy.asarray(rng.standard_normal((8, 10)), dtype=cupy.float32)
    labels = cupy.asarray(rng.integers(0, 10, size=8))
    grads = []
    for gy in (1.0, 3.0):
        x = tv.Tensor(logits, requires_grad=True)
        loss = k_loss.CrossEntropy.apply(x, labels, 0.0)
        assert type(loss.data).__module__.startswith("cupy") and loss.data.shape == ()
        loss.backward(cupy.asarray(gy, dtype=cupy.float32))
        grads.append(x.grad.get())
    np.testing.assert_allclose(grads[1], 3 * grads[0], rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- CPU: launch arithmetic, names


def test_launch_config():
    """A block per row; whole warps, about PER_THREAD classes per thread, between 32 and 512 threads."""
    for n, k, threads in [(1, 1, 32), (5, 10, 32), (128, 128, 32), (128, 129, 64), (64, 1000, 256),
                          (3, 21843, 512), (2, 10 ** 6, 512)]:
        assert k_loss.launch_config(n, k) == ((n,), (threads,)), (n, k)
    with pytest.raises(ValueError):
        k_loss.launch_config(2 ** 31, 10)


@pytest.mark.parametrize("arch", cuda_kernels.SM_ARCHS)
def test_every_launched_kernel_is_compiled(arch):
    """cross_entropy_forward and _backward, _f32 and _f64, are kernels of SOURCE's CUBIN."""
    from test_kernels_cuda_compile import _nvrtc, compile_source
    cubin = compile_source(_nvrtc(), k_loss.SOURCE, "loss", arch)
    for name in ("cross_entropy_forward", "cross_entropy_backward"):
        for suffix in ("f32", "f64"):
            assert f"{name}_{suffix}".encode() in cubin, f"{name}_{suffix}"
