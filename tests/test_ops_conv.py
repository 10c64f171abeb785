"""conv2d and max_pool2d: finite-difference gradient checks (every input), a plain-loop NumPy
reference for the forward, PyTorch parity for forward and every gradient, dtypes and errors."""
import numpy as np
import pytest

import tinyvit as tv
import tinyvit.functional as F
from tinyvit.backend import to_numpy
from tinyvit.gradcheck import gradcheck

from helpers import assert_close, const, param, torch_parity

# (B, C_in, H, W, C_out, kh, kw, stride, padding): every geometry the BiT stem uses, and the corners
CONV_CONFIGS = [
    pytest.param(2, 3, 5, 5, 4, 1, 1, 1, 0, id="1x1-s1"),
    pytest.param(2, 3, 6, 7, 2, 1, 1, 2, 0, id="1x1-s2"),
    pytest.param(1, 2, 7, 9, 3, 3, 3, 1, 1, id="3x3-s1-p1-odd"),
    pytest.param(2, 2, 7, 9, 3, 3, 3, 2, 1, id="3x3-s2-p1"),
    pytest.param(1, 1, 9, 11, 2, 7, 7, 2, 3, id="7x7-s2-p3-cin1"),
    pytest.param(1, 2, 6, 7, 3, 2, 3, (2, 1), (0, 1), id="2x3-mixed-stride-pad"),
    pytest.param(1, 2, 3, 3, 2, 3, 3, 1, 0, id="kernel-fills-input"),
    pytest.param(1, 2, 8, 8, 2, 2, 2, 3, 0, id="stride-skips-pixels"),
]

# (B, C, H, W, kernel, stride, padding)
POOL_CONFIGS = [
    pytest.param(2, 2, 7, 9, 3, 2, 1, id="3-s2-p1-bit-root"),
    pytest.param(2, 3, 6, 8, 2, 2, 0, id="2-s2"),
    pytest.param(1, 2, 7, 9, 2, None, 0, id="2-default-stride-odd"),
    pytest.param(1, 2, 5, 6, 3, 1, 0, id="3-s1-overlap"),
    pytest.param(1, 2, 6, 7, 3, 1, 1, id="3-s1-p1-overlap"),
    pytest.param(2, 1, 6, 7, (2, 3), (1, 2), (1, 1), id="2x3-mixed"),
]


def _pair(v):
    return v if isinstance(v, tuple) else (v, v)


# ---------------------------------------------------------------- plain-loop references


def ref_conv2d(x, w, b, stride, padding):
    """y[:, o, i, j] = b[o] + sum(x_pad[:, :, window(i, j)] * w[o]), one output pixel at a time."""
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    x_pad = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    c_out, _, kh, kw = w.shape
    ho, wo = (x_pad.shape[2] - kh) // sh + 1, (x_pad.shape[3] - kw) // sw + 1
    y = np.zeros((x.shape[0], c_out, ho, wo))
    for o in range(c_out):
        for i in range(ho):
            for j in range(wo):
                window = x_pad[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw]
                y[:, o, i, j] = (window * w[o]).sum(axis=(1, 2, 3)) + (0.0 if b is None else b[o])
    return y


def ref_max_pool2d(x, kernel, stride, padding):
    (kh, kw) = _pair(kernel)
    (sh, sw), (ph, pw) = _pair(kernel if stride is None else stride), _pair(padding)
    x_pad = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf)
    ho, wo = (x_pad.shape[2] - kh) // sh + 1, (x_pad.shape[3] - kw) // sw + 1
    y = np.zeros(x.shape[:2] + (ho, wo))
    for i in range(ho):
        for j in range(wo):
            y[:, :, i, j] = x_pad[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw].max(axis=(2, 3))
    return y


# ---------------------------------------------------------------- conv2d


@pytest.mark.parametrize("B,C,H,W,O,kh,kw,stride,padding", CONV_CONFIGS)
def test_conv2d_gradcheck(xp, rng, B, C, H, W, O, kh, kw, stride, padding):
    x, w, b = param(xp, rng, B, C, H, W), param(xp, rng, O, C, kh, kw), param(xp, rng, O)
    gradcheck(lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=padding), [x, w, b])


def test_conv2d_gradcheck_without_bias(xp, rng):
    x, w = param(xp, rng, 2, 2, 5, 6), param(xp, rng, 3, 2, 3, 3)
    gradcheck(lambda x, w: F.conv2d(x, w, stride=2, padding=1), [x, w])


@pytest.mark.parametrize("B,C,H,W,O,kh,kw,stride,padding", CONV_CONFIGS)
def test_conv2d_forward_matches_loops(xp, rng, B, C, H, W, O, kh, kw, stride, padding):
    x, w, b = rng.standard_normal((B, C, H, W)), rng.standard_normal((O, C, kh, kw)), rng.standard_normal(O)
    y = F.conv2d(xp.asarray(x), xp.asarray(w), xp.asarray(b), stride=stride, padding=padding)
    assert y.data.flags.c_contiguous
    assert_close(y, ref_conv2d(x, w, b, stride, padding), rtol=1e-12, atol=1e-12)
    assert_close(F.conv2d(xp.asarray(x), xp.asarray(w), stride=stride, padding=padding),
                 ref_conv2d(x, w, None, stride, padding), rtol=1e-12, atol=1e-12, what="no bias")


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float32, 1e-4)])
@pytest.mark.parametrize("B,C,H,W,O,kh,kw,stride,padding", CONV_CONFIGS + [
    pytest.param(2, 3, 32, 32, 8, 7, 7, 2, 3, id="bit-stem-32px"),
    pytest.param(2, 16, 9, 9, 8, 3, 3, 2, 1, id="bit-3x3-s2-16ch"),
])
def test_conv2d_torch_parity(torch, rng, dtype, rtol, B, C, H, W, O, kh, kw, stride, padding):
    arrays = [rng.standard_normal((B, C, H, W)), rng.standard_normal((O, C, kh, kw)), rng.standard_normal(O)]
    torch_parity(torch, lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=padding),
                 lambda x, w, b: torch.nn.functional.conv2d(x, w, b, stride=stride, padding=padding),
                 arrays, dtype, rtol)


def test_conv2d_float32_stays_float32(xp, rng):
    x, w, b = (param(xp, rng, *s, dtype=np.float32) for s in [(2, 3, 7, 7), (4, 3, 3, 3), (4,)])
    y = F.conv2d(x, w, b, stride=2, padding=1)
    assert y.dtype == np.float32
    y.backward(xp.asarray(rng.standard_normal(y.shape), dtype=np.float32))
    for t in (x, w, b):
        assert t.grad.dtype == np.float32 and t.grad.shape == t.shape


def test_conv2d_on_images_computes_no_input_gradient(xp, rng):
    """The first conv on images: no dx, so no W kept for it; the weight gradient is still right."""
    x = rng.standard_normal((2, 3, 8, 8))
    w = param(xp, rng, 4, 3, 3, 3)
    y = F.conv2d(const(xp, x), w, stride=2, padding=1)
    cols, w_saved = y._ctx.saved[:2]
    assert cols is not None and w_saved is None
    g = rng.standard_normal(y.shape)
    y.backward(xp.asarray(g))
    # dL/dW[o,c,u,v] = sum_{b,i,j} g[b,o,i,j] x_pad[b,c,2i+u,2j+v], by loops
    x_pad = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    expected = np.zeros((4, 3, 3, 3))
    for u in range(3):
        for v in range(3):
            patch = x_pad[:, :, u:u + 8:2, v:v + 8:2]                   # (B, C, 4, 4)
            expected[:, :, u, v] = np.einsum("boij,bcij->oc", g, patch)
    assert_close(w.grad, expected, rtol=1e-10, atol=1e-12, what="weight gradient")


def test_conv2d_input_only_gradient_keeps_no_cols(xp, rng):
    x = param(xp, rng, 1, 2, 6, 6)
    y = F.conv2d(x, const(xp, rng.standard_normal((3, 2, 3, 3))), padding=1)
    cols, w_saved = y._ctx.saved[:2]
    assert cols is None and w_saved is not None
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_conv2d_accepts_raw_arrays_and_returns_tensor(rng):
    y = F.conv2d(rng.standard_normal((1, 2, 5, 5)), rng.standard_normal((3, 2, 3, 3)))
    assert isinstance(y, tv.Tensor) and y.shape == (1, 3, 3, 3) and not y.requires_grad


def test_conv2d_matches_numpy_on_every_backend(xp, rng):
    """The same numbers (output and all gradients) from CuPy as from NumPy."""
    arrays = [rng.standard_normal(s) for s in [(2, 3, 9, 9), (4, 3, 7, 7), (4,)]]
    g = rng.standard_normal((2, 4, 5, 5))
    results = []
    for mod in (np, xp):
        ts = [tv.Tensor(mod.asarray(a), requires_grad=True) for a in arrays]
        y = F.conv2d(*ts, stride=2, padding=3)
        y.backward(mod.asarray(g))
        results.append([to_numpy(y.data)] + [to_numpy(t.grad) for t in ts])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- max_pool2d


@pytest.mark.parametrize("B,C,H,W,kernel,stride,padding", POOL_CONFIGS)
def test_max_pool2d_gradcheck(xp, rng, B, C, H, W, kernel, stride, padding):
    x = param(xp, rng, B, C, H, W)   # random normal: no ties within eps
    gradcheck(lambda x: F.max_pool2d(x, kernel, stride, padding), [x])


@pytest.mark.parametrize("B,C,H,W,kernel,stride,padding", POOL_CONFIGS)
def test_max_pool2d_forward_matches_loops(xp, rng, B, C, H, W, kernel, stride, padding):
    x = rng.standard_normal((B, C, H, W))
    y = F.max_pool2d(xp.asarray(x), kernel, stride, padding)
    assert_close(y, ref_max_pool2d(x, kernel, stride, padding), rtol=0, atol=0)


def test_max_pool2d_pads_with_minus_infinity(xp, rng):
    x = -5.0 - np.abs(rng.standard_normal((1, 2, 5, 5)))      # all negative: zero padding would win
    y = F.max_pool2d(xp.asarray(x), 3, 2, 1)
    assert float(y.data.max()) < -5.0
    assert_close(y, ref_max_pool2d(x, 3, 2, 1), rtol=0, atol=0)


def test_max_pool2d_ties_go_to_the_first_maximum(xp):
    x = tv.Tensor(xp.ones((1, 1, 4, 4)), requires_grad=True)
    F.max_pool2d(x, 3, 1, 1).sum().backward()
    # every window's first real element (row-major) wins; overlapping wins accumulate
    expected = np.array([[4, 2, 2, 0], [2, 1, 1, 0], [2, 1, 1, 0], [0, 0, 0, 0]], dtype=float)
    assert_close(x.grad, expected[None, None], rtol=0, what="tie-broken gradient")


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float32, 1e-4)])
@pytest.mark.parametrize("B,C,H,W,kernel,stride,padding", POOL_CONFIGS + [
    pytest.param(2, 4, 16, 16, 3, 2, 1, id="bit-root-16px"),
])
def test_max_pool2d_torch_parity(torch, rng, dtype, rtol, B, C, H, W, kernel, stride, padding):
    torch_parity(torch, lambda x: F.max_pool2d(x, kernel, stride, padding),
                 lambda x: torch.nn.functional.max_pool2d(x, kernel, stride, padding),
                 [rng.standard_normal((B, C, H, W))], dtype, rtol)


def test_max_pool2d_torch_parity_with_ties(torch, rng):
    """Small integers make many ties: the gradient must go where PyTorch sends it."""
    x = rng.integers(0, 3, (2, 3, 7, 9)).astype(np.float64)
    torch_parity(torch, lambda x: F.max_pool2d(x, 3, 1, 1),
                 lambda x: torch.nn.functional.max_pool2d(x, 3, 1, 1), [x], np.float64, 1e-12)


def test_max_pool2d_float32_stays_float32(xp, rng):
    x = param(xp, rng, 2, 3, 7, 7, dtype=np.float32)
    y = F.max_pool2d(x, 3, 2, 1)
    assert y.dtype == np.float32 and y.shape == (2, 3, 4, 4)
    y.backward(xp.asarray(rng.standard_normal(y.shape), dtype=np.float32))
    assert x.grad.dtype == np.float32


# ---------------------------------------------------------------- together: a BiT root block


def test_bit_root_gradcheck(xp, rng):
    """conv 7x7/2 pad 3 -> max-pool 3/2 pad 1, the ResNet (BiT) root, differentiated end to end."""
    x, w = param(xp, rng, 1, 2, 10, 10), param(xp, rng, 2, 2, 7, 7)
    gradcheck(lambda x, w: F.max_pool2d(F.conv2d(x, w, stride=2, padding=3), 3, 2, 1), [x, w])


# ---------------------------------------------------------------- errors


def test_conv2d_errors(rng):
    x, w = rng.standard_normal((2, 3, 5, 5)), rng.standard_normal((4, 3, 3, 3))
    with pytest.raises(ValueError, match=r"input must be 4-D .*got shape \(3, 5, 5\)"):
        F.conv2d(x[0], w)
    with pytest.raises(ValueError, match=r"weight must be 4-D"):
        F.conv2d(x, w[0])
    with pytest.raises(ValueError, match=r"\(2, 3, 5, 5\).*\(4, 2, 3, 3\)"):
        F.conv2d(x, w[:, :2])
    with pytest.raises(ValueError, match=r"bias has shape \(3,\), expected \(4,\)"):
        F.conv2d(x, w, rng.standard_normal(3))
    with pytest.raises(ValueError, match="kernel 3x3 is larger than the padded input 2x2"):
        F.conv2d(x[:, :, :2, :2], w)
    F.conv2d(x[:, :, :2, :2], w, padding=1)        # fits once padded
    with pytest.raises(ValueError, match="stride must be positive"):
        F.conv2d(x, w, stride=0)
    with pytest.raises(ValueError, match="stride must be positive"):
        F.conv2d(x, w, stride=(1, -1))
    with pytest.raises(ValueError, match="padding must be non-negative"):
        F.conv2d(x, w, padding=-1)
    with pytest.raises(TypeError, match="stride must be an int or a pair"):
        F.conv2d(x, w, stride=1.5)
    with pytest.raises(TypeError, match="input must be a floating-point array"):
        F.conv2d(x.astype(np.int64), w)
    with pytest.raises(TypeError, match="weight must be a floating-point array"):
        F.conv2d(x, w.astype(np.int32))
    with pytest.raises(TypeError, match=r"input \(float32\), weight \(float64\).*one dtype"):
        F.conv2d(x.astype(np.float32), w)


def test_max_pool2d_errors(rng):
    x = rng.standard_normal((2, 3, 5, 5))
    with pytest.raises(ValueError, match=r"input must be 4-D .*got shape \(3, 5, 5\)"):
        F.max_pool2d(x[0], 2)
    with pytest.raises(ValueError, match="kernel 6x6 is larger than the padded input 5x5"):
        F.max_pool2d(x, 6)
    with pytest.raises(ValueError, match="stride must be positive"):
        F.max_pool2d(x, 2, 0)
    with pytest.raises(ValueError, match="kernel must be positive"):
        F.max_pool2d(x, 0)
    with pytest.raises(ValueError, match="at most half the kernel"):
        F.max_pool2d(x, 3, 2, 2)
    with pytest.raises(TypeError, match="input must be a floating-point array"):
        F.max_pool2d(x.astype(np.uint8), 2)
