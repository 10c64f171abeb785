"""patch_embed (Eq. 1's x_p E): gradient checks, a loop reference, conv2d parity, errors."""
import numpy as np
import pytest

import tinyvit as tv
import tinyvit.functional as F

from helpers import assert_close, const, torch_parity


def ref_patch_embed(images, w, b, p):
    """Patch by patch, row-major over the grid, each flattened in (C, P, P) order, then x_p E + b."""
    bsz, c, hh, ww = images.shape
    rows = []
    for i in range(hh // p):
        for j in range(ww // p):
            patch = images[:, :, i * p:(i + 1) * p, j * p:(j + 1) * p]     # (B, C, P, P)
            rows.append(patch.reshape(bsz, c * p * p) @ w + (0 if b is None else b))
    return np.stack(rows, axis=1)                                          # (B, N, D)


# (B, C, H, W, P, D): square and non-square, one patch per image (N = 1), P = 1, D = 1, batch 1
CASES = [(2, 3, 4, 6, 2, 5), (1, 1, 3, 3, 3, 4), (1, 2, 2, 2, 1, 3), (2, 1, 4, 2, 2, 1), (3, 2, 6, 3, 3, 2)]


def make(rng, bsz, c, hh, ww, p, d):
    return [rng.standard_normal((bsz, c, hh, ww)), rng.standard_normal((c * p * p, d)), rng.standard_normal(d)]


@pytest.mark.parametrize("bsz,c,hh,ww,p,d", CASES)
def test_gradcheck_every_input(xp, rng, bsz, c, hh, ww, p, d):
    inputs = [tv.Tensor(xp.asarray(a), requires_grad=True) for a in make(rng, bsz, c, hh, ww, p, d)]
    tv.gradcheck(lambda x, w, b: F.patch_embed(x, w, b, p), inputs)


@pytest.mark.parametrize("wanted", [(True, False, False), (False, True, True), (False, True, False), (False, False, True)])
def test_gradcheck_subsets(xp, rng, wanted):
    """Images usually need no gradient: the op must skip that work and still get w and b right."""
    inputs = [tv.Tensor(xp.asarray(a), requires_grad=r) for a, r in zip(make(rng, 2, 3, 4, 4, 2, 3), wanted)]
    tv.gradcheck(lambda x, w, b: F.patch_embed(x, w, b, 2), inputs)
    for t, r in zip(inputs, wanted):
        assert (t.grad is not None) == r


def test_gradcheck_without_bias(xp, rng):
    x, w, _ = [tv.Tensor(xp.asarray(a), requires_grad=True) for a in make(rng, 2, 2, 4, 4, 2, 3)]
    tv.gradcheck(lambda x, w: F.patch_embed(x, w, None, 2), [x, w])


@pytest.mark.parametrize("bsz,c,hh,ww,p,d", CASES)
def test_forward_matches_loop_reference(xp, rng, bsz, c, hh, ww, p, d):
    images, w, b = make(rng, bsz, c, hh, ww, p, d)
    y = F.patch_embed(xp.asarray(images), xp.asarray(w), xp.asarray(b), p)
    assert y.shape == (bsz, (hh // p) * (ww // p), d)
    assert_close(y, ref_patch_embed(images, w, b, p), rtol=1e-12, atol=1e-12)
    assert_close(F.patch_embed(xp.asarray(images), xp.asarray(w), None, p), ref_patch_embed(images, w, None, p),
                 rtol=1e-12, atol=1e-12)


def test_patch_order_is_row_major_and_channel_major():
    """Token 1 is the patch right of token 0; inside a patch, all of channel 0 comes first."""
    images = np.arange(2 * 4 * 6, dtype=np.float64).reshape(1, 2, 4, 6)      # C=2, H=4, W=6, P=2
    tokens = F.patch_embed(images, np.eye(8), None, 2).numpy()[0]            # identity E: the raw patches
    assert tokens.shape == (6, 8)
    np.testing.assert_array_equal(tokens[0], [0, 1, 6, 7, 24, 25, 30, 31])
    np.testing.assert_array_equal(tokens[1], [2, 3, 8, 9, 26, 27, 32, 33])
    np.testing.assert_array_equal(tokens[3], [12, 13, 18, 19, 36, 37, 42, 43])


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float32, 1e-4)])
@pytest.mark.parametrize("bsz,c,hh,ww,p,d", [(2, 3, 8, 12, 4, 6), (1, 1, 5, 5, 5, 3)])
def test_torch_conv2d_parity(torch, rng, dtype, rtol, bsz, c, hh, ww, p, d):
    """Our w is the conv kernel (D, C, P, P) reshaped to (D, C*P*P) and transposed."""
    def conv(x, w, b):
        kernel = w.T.reshape(d, c, p, p)
        return torch.nn.functional.conv2d(x, kernel, b, stride=p).flatten(2).transpose(1, 2)

    torch_parity(torch, lambda x, w, b: F.patch_embed(x, w, b, p), conv, make(rng, bsz, c, hh, ww, p, d), dtype, rtol)


def test_weight_layout_from_a_conv_kernel(torch, rng):
    """Going the other way: a torch conv kernel (D, C, P, P) becomes E by kernel.reshape(D, -1).T."""
    images, kernel, b = rng.standard_normal((2, 3, 6, 6)), rng.standard_normal((5, 3, 3, 3)), rng.standard_normal(5)
    expected = torch.nn.functional.conv2d(torch.tensor(images), torch.tensor(kernel), torch.tensor(b), stride=3)
    ours = F.patch_embed(images, kernel.reshape(5, -1).T, b, 3)
    assert_close(ours, expected.flatten(2).transpose(1, 2), rtol=1e-12, atol=1e-12)


def test_float32_in_float32_out(xp, rng):
    inputs = [tv.Tensor(xp.asarray(a, dtype=np.float32), requires_grad=True) for a in make(rng, 2, 3, 4, 4, 2, 5)]
    y = F.patch_embed(*inputs, 2)
    assert y.dtype == np.float32
    (y * const(xp, rng.standard_normal(y.shape), np.float32)).sum().backward()
    for t in inputs:
        assert t.grad is not None and t.grad.dtype == np.float32


def test_errors():
    f = np.float32
    images, w, b = np.zeros((2, 3, 8, 8), f), np.zeros((48, 5), f), np.zeros(5, f)
    with pytest.raises(ValueError, match=r"image size 7x8 \(H x W\) is not divisible by the patch size 4"):
        F.patch_embed(np.zeros((2, 3, 7, 8), f), w, b, 4)
    with pytest.raises(ValueError, match=r"C=3 channels and patch size P=4, but w has shape \(47, 5\) \(47 rows\)"):
        F.patch_embed(images, np.zeros((47, 5), f), b, 4)
    with pytest.raises(ValueError, match=r"C=1 channels and patch size P=4.*\(48 rows\)"):
        F.patch_embed(np.zeros((2, 1, 8, 8), f), w, b, 4)           # grayscale images, RGB embedding
    with pytest.raises(ValueError, match=r"\(B, C, H, W\), got shape \(3, 8, 8\)"):
        F.patch_embed(images[0], w, b, 4)
    with pytest.raises(TypeError, match="images must be a floating-point array, got dtype uint8"):
        F.patch_embed(images.astype(np.uint8), w, b, 4)
    with pytest.raises(ValueError, match=r"b must have shape \(5,\)"):
        F.patch_embed(images, w, np.zeros(4, f), 4)
    with pytest.raises(ValueError, match="patch_size must be a positive integer"):
        F.patch_embed(images, w, b, 0)
    with pytest.raises(TypeError, match="one floating dtype"):
        F.patch_embed(images.astype(np.float64), w, b, 4)
