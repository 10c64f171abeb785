"""kernels/cpu/linear.py (Linear, PatchEmbed, weight_gradient) against ops/basic.py's Linear and
ops/patch.py's PatchEmbed: outputs and every gradient, float64 and float32, many small blocks, 1 and 2
threads (the shared helpers and the meta-test are in test_kernels_cpu.py).

float32 tolerance: rtol 1e-5 and atol 1e-5 times the array's largest magnitude. The kernels compute
the same products as the reference, but into 64-byte-aligned outputs (which can change how BLAS
blocks a GEMM) and with the bias gradient as the BLAS product ones @ g instead of NumPy's pairwise
sum; both round differently by a few float32 ulps (measured: at most 2e-7 of |reference| + scale).
"""
import numpy as np
import pytest

from tinyvit.kernels.cpu.linear import weight_gradient
from tinyvit.ops import basic, patch

from kernel_checks import F64, assert_kernel_equals_reference, cpu_kernel

TOL = {np.float64: (F64["rtol"], F64["atol"]), np.float32: (1e-5, 1e-5)}

# (x shape, in, out): weight_gradient's two orders (in < out: (g^T x)^T; in >= out: x^T g), an odd
# number of rows, one row, rows of more than a block (40 > 64 / 2)
LINEAR_CASES = [((7, 5, 12), 12, 20), ((9, 40), 40, 6), ((1, 1, 3), 3, 3), ((3, 70), 70, 70)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("x_shape,n_in,n_out", LINEAR_CASES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("wants", [(1, 1, 1), (0, 1, 1), (1, 0, 0)], ids=["all", "weights", "x"])
def test_linear_equals_reference(small_blocks, dtype, x_shape, n_in, n_out, bias, wants):
    """The "linear" kernel: y = x W + b and dL/dx, dL/dW, dL/db equal the reference's under a random
    upstream gradient, with every input wanting a gradient, only the weights (x is data), or only x."""
    kernel = cpu_kernel("linear")
    rng = np.random.default_rng(sum(x_shape) + n_out)
    arrays = [rng.standard_normal(x_shape), rng.standard_normal((n_in, n_out)),
              rng.standard_normal(n_out) if bias else None]
    upstream = [rng.standard_normal(x_shape[:-1] + (n_out,))]
    assert_kernel_equals_reference(kernel.apply, basic.Linear.apply, arrays, upstream, dtype, TOL[dtype],
                                   wants_grad=wants, names=["x", "w", "b"])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_linear_with_two_arguments_equals_reference(small_blocks, dtype):
    """The "linear" kernel called as Linear.apply(x, w), no bias argument at all (as the encoder calls it)."""
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((5, 3, 16)), rng.standard_normal((16, 24))]
    assert_kernel_equals_reference(cpu_kernel("linear").apply, basic.Linear.apply, arrays,
                                   [rng.standard_normal((5, 3, 24))], dtype, TOL[dtype])


# (images shape, patch size, D): in = C P^2 > D, in < D, one patch per image
PATCH_CASES = [((5, 3, 8, 8), 4, 16), ((3, 2, 6, 6), 3, 24), ((1, 1, 2, 2), 2, 3)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape,p,d", PATCH_CASES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("wants", [(1, 1, 1), (0, 1, 1), (1, 0, 0)], ids=["all", "weights", "images"])
def test_patch_embed_equals_reference(small_blocks, dtype, shape, p, d, bias, wants):
    """The "patch_embed" kernel (Eq. 1's x_p E + b): tokens and the gradients of the images, E and b
    equal the reference's; the kernel keeps the patches only when E wants a gradient, so images-only
    and weights-only gradients are checked too."""
    kernel = cpu_kernel("patch_embed")
    rng = np.random.default_rng(shape[0] + d)
    c = shape[1]
    arrays = [rng.standard_normal(shape), rng.standard_normal((c * p * p, d)), rng.standard_normal(d) if bias else None]
    n = (shape[2] // p) * (shape[3] // p)
    assert_kernel_equals_reference(lambda i, w, b: kernel.apply(i, w, b, p), lambda i, w, b: patch.PatchEmbed.apply(i, w, b, p),
                                   arrays, [rng.standard_normal((shape[0], n, d))], dtype, TOL[dtype],
                                   wants_grad=wants, names=["images", "w", "b"])


@pytest.mark.parametrize("rows,n_in,n_out", [(37, 5, 11), (37, 11, 5), (4, 6, 6)])
def test_weight_gradient_is_x_transpose_g(rows, n_in, n_out):
    """weight_gradient(x, g) = x^T g, C-contiguous, whichever order it multiplies in."""
    rng = np.random.default_rng(rows + n_in)
    x, g = rng.standard_normal((rows, n_in)), rng.standard_normal((rows, n_out))
    got = weight_gradient(x, g)
    assert got.shape == (n_in, n_out) and got.flags.c_contiguous
    np.testing.assert_allclose(got, x.T @ g, rtol=1e-13, atol=1e-13)
