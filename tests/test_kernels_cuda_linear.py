"""kernels/cuda/linear.py (Linear, PatchEmbed: one 2-D cuBLAS GEMM per product, pure CuPy) against
ops/basic.py's Linear and ops/patch.py's PatchEmbed: the output and every gradient, float64 and
float32, with and without a bias, every input wanting a gradient or only some.

Each test runs on three backends (the ``xp`` fixture): NumPy (the Function itself: its array code is
backend-neutral), the CuPy stand-in (CuPy's names, signatures and refusals computed by NumPy, so a
NumPy-only call fails in CI; through F.linear and the switchboard with use_kernels("all")), and a GPU
(marked gpu: `pytest -m gpu`, the same path as the stand-in; `python -m tinyvit.kernels.cuda.record`
records OPS in kernels/cuda/passed.json when they pass there).

float32 tolerance: rtol 1e-5 and atol 1e-5 times the array's largest magnitude (one GEMM over all
rows sums in another order than the reference's batched matmul and its sum over the batch).
"""
import numpy as np
import pytest

import cupy_standin
import tinyvit.functional as F
from tinyvit import kernels
from tinyvit.kernels import kernel_for, use_kernels
from tinyvit.kernels.cuda import linear as k_linear
from tinyvit.ops import basic, patch

from cuda_checks import assert_equal_results, forward_backward_on
from kernel_checks import F64

OPS = ["linear", "patch_embed"]          # the ops these tests cover (python -m tinyvit.kernels.cuda.record)

TOL = {np.float64: (F64["rtol"], F64["atol"]), np.float32: (1e-5, 1e-5)}
WANTS = {"all": (1, 1, 1), "weights": (0, 1, 1), "input": (1, 0, 0)}

# (x shape, D_in, D_out): tokens (B, N, D), rows (R, D), one token, more outputs than inputs
LINEAR_CASES = [((3, 5, 12), 12, 20), ((9, 40), 40, 6), ((1, 1, 3), 3, 3), ((2, 3, 4, 8), 8, 24)]
# (images shape, patch size, D): C P^2 > D, C P^2 < D, one patch per image
PATCH_CASES = [((5, 3, 8, 8), 4, 16), ((3, 2, 6, 6), 3, 24), ((1, 1, 2, 2), 2, 3)]


def through_the_switchboard(xp, name, monkeypatch):
    """How users reach the kernel: on CuPy (or the stand-in) arrays, F.linear / F.patch_embed with
    use_kernels("all") must pick kernels/cuda/linear.py (asserted); on NumPy, the Function itself
    (the switchboard gives NumPy arrays the CPU kernel)."""
    function = {"linear": k_linear.Linear, "patch_embed": k_linear.PatchEmbed}[name]
    if xp is np:
        return function.apply if name == "linear" else (lambda i, w, b, p: function.apply(i, w, b, p))
    if xp is cupy_standin.modules()[0]:                 # the stand-in empties the CUDA table: restore this op
        monkeypatch.setitem(kernels.CUDA_KERNELS, name, f"linear:{function.__name__}")

    def call(*args):
        with use_kernels("all"):
            assert kernel_for(name, *args[:3]) is function
            return F.linear(*args) if name == "linear" else F.patch_embed(*args)
    return call


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("x_shape,n_in,n_out", LINEAR_CASES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("wants", list(WANTS))
def test_linear_equals_reference(xp, monkeypatch, dtype, x_shape, n_in, n_out, bias, wants):
    """The "linear" kernel: y = x W + b and dL/dx, dL/dW, dL/db equal the reference's."""
    rng = np.random.default_rng(sum(x_shape) + n_out)
    arrays = [rng.standard_normal(x_shape), rng.standard_normal((n_in, n_out)),
              rng.standard_normal(n_out) if bias else None]
    upstream = [rng.standard_normal(x_shape[:-1] + (n_out,))]
    kernel = through_the_switchboard(xp, "linear", monkeypatch)
    got = forward_backward_on(xp, kernel, arrays, upstream, dtype, WANTS[wants])
    want = forward_backward_on(xp, basic.Linear.apply, arrays, upstream, dtype, WANTS[wants])
    assert_equal_results(got, want, TOL[dtype], ["x", "w", "b"])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_linear_takes_a_broadcast_upstream_gradient(xp, monkeypatch, dtype):
    """loss = sum(y): dL/dy arrives as a read-only broadcast of ones, which becomes rows by a copy."""
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((4, 6, 10)), rng.standard_normal((10, 7)), rng.standard_normal(7)]
    got = forward_backward_on(xp, through_the_switchboard(xp, "linear", monkeypatch), arrays, ["sum"], dtype)
    want = forward_backward_on(xp, basic.Linear.apply, arrays, ["sum"], dtype)
    assert_equal_results(got, want, TOL[dtype], ["x", "w", "b"])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape,p,d", PATCH_CASES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("wants", list(WANTS))
def test_patch_embed_equals_reference(xp, monkeypatch, dtype, shape, p, d, bias, wants):
    """The "patch_embed" kernel (Eq. 1's x_p E + b): tokens and the gradients of the images, E and b
    equal the reference's; the patches are kept only when E wants a gradient, so images-only and
    weights-only gradients are checked too."""
    rng = np.random.default_rng(shape[0] + d)
    c = shape[1]
    arrays = [rng.standard_normal(shape), rng.standard_normal((c * p * p, d)), rng.standard_normal(d) if bias else None]
    n = (shape[2] // p) * (shape[3] // p)
    kernel = through_the_switchboard(xp, "patch_embed", monkeypatch)
    upstream = [rng.standard_normal((shape[0], n, d))]
    got = forward_backward_on(xp, lambda i, w, b: kernel(i, w, b, p), arrays, upstream, dtype, WANTS[wants])
    want = forward_backward_on(xp, lambda i, w, b: patch.PatchEmbed.apply(i, w, b, p), arrays, upstream, dtype,
                               WANTS[wants])
    assert_equal_results(got, want, TOL[dtype], ["images", "w", "b"])


@pytest.mark.skipif(not cupy_standin.available(), reason="the CuPy stand-in takes its names from the cupy package, "
                    "which is not installed (pip install 'tinyvit[cuda-compile]'; no GPU needed)")
def test_every_product_is_one_2d_gemm(monkeypatch):
    """On CuPy arrays (the stand-in here) forward and backward of both kernels multiply only 2-D
    matrices: the leading axes are folded into rows, never a batched matmul over them."""
    xp = cupy_standin.install(monkeypatch)
    shapes = []
    array_type = type(xp.zeros(1))
    matmul = array_type.__matmul__

    def spy(a, b):
        shapes.append((a.shape, b.shape))
        return matmul(a, b)

    monkeypatch.setattr(array_type, "__matmul__", spy)
    rng = np.random.default_rng(4)
    through = {name: through_the_switchboard(xp, name, monkeypatch) for name in OPS}
    forward_backward_on(xp, through["linear"], [rng.standard_normal((4, 9, 12)), rng.standard_normal((12, 5)),
                                                rng.standard_normal(5)], [rng.standard_normal((4, 9, 5))], np.float32)
    assert shapes == [((36, 12), (12, 5)), ((36, 5), (5, 12)), ((12, 36), (36, 5))], shapes
    shapes.clear()
    forward_backward_on(xp, lambda i, w, b: through["patch_embed"](i, w, b, 2),
                        [rng.standard_normal((3, 2, 4, 4)), rng.standard_normal((8, 6)), rng.standard_normal(6)],
                        [rng.standard_normal((3, 4, 6))], np.float32)
    assert shapes == [((12, 8), (8, 6)), ((12, 6), (6, 8)), ((8, 12), (12, 6))], shapes
