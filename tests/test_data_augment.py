"""Batch augmentation: exact semantics of each op, shapes/dtypes, soft targets, reproducibility, devices."""
import numpy as np
import pytest

from tinyvit.backend import to_numpy
from tinyvit.data import (Augment, RandAugment, cutmix, horizontal_flip, mixup, normalize, random_crop,
                          random_erasing, to_float)
from tinyvit.data import randaugment as ra


def _images(xp, b=8, c=3, h=10, w=12, seed=0, dtype=np.float64):
    """Distinct random images in [0, 1] (no image equals its own mirror)."""
    return xp.asarray(np.random.default_rng(seed).random((b, c, h, w)), dtype=dtype)


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_normalize(xp):
    x = _images(xp)
    out = normalize(x, (0.1, 0.2, 0.3), (0.5, 0.25, 2.0))
    ref = (to_numpy(x) - np.array([0.1, 0.2, 0.3])[:, None, None]) / np.array([0.5, 0.25, 2.0])[:, None, None]
    np.testing.assert_allclose(to_numpy(out), ref, rtol=1e-12)
    assert out.dtype == x.dtype


def test_crop_with_zero_padding_is_identity(xp):
    x = _images(xp)
    assert random_crop(x, _rng(), padding=0) is x


@pytest.mark.parametrize("mode", ["reflect", "zero"])
def test_random_crop_is_a_window_of_the_padded_image(xp, mode):
    x = _images(xp, b=16)
    out = to_numpy(random_crop(x, _rng(1), padding=3, mode=mode))
    assert out.shape == x.shape and out.dtype == x.dtype
    padded = np.pad(to_numpy(x), ((0, 0), (0, 0), (3, 3), (3, 3)), mode="reflect" if mode == "reflect" else "constant")
    offsets = []
    for i in range(len(out)):
        hits = [(dy, dx) for dy in range(7) for dx in range(7)
                if np.array_equal(out[i], padded[i, :, dy:dy + 10, dx:dx + 12])]
        assert len(hits) == 1, f"image {i}: not a single window of the padded image"
        offsets.append(hits[0])
    assert len(set(offsets)) > 4                          # offsets really vary per image
    np.testing.assert_array_equal(out, to_numpy(random_crop(x, _rng(1), padding=3, mode=mode)))


def test_flip_is_exactly_a_flip_of_selected_images(xp):
    x = _images(xp, b=64)
    out, xs = to_numpy(horizontal_flip(x, _rng(2))), to_numpy(x)
    flipped = []
    for i in range(64):
        if np.array_equal(out[i], xs[i, :, :, ::-1]):
            flipped.append(i)
        else:
            np.testing.assert_array_equal(out[i], xs[i])
    assert 10 < len(flipped) < 54                          # about half
    np.testing.assert_array_equal(out, to_numpy(horizontal_flip(x, _rng(2))))
    np.testing.assert_array_equal(to_numpy(horizontal_flip(x, _rng(), p=1.0)), xs[..., ::-1])
    np.testing.assert_array_equal(to_numpy(horizontal_flip(x, _rng(), p=0.0)), xs)


def _partner(mixed, x, lam):
    """Index j with mixed == lam x_i + (1 - lam) x_j, per image i."""
    rest = (mixed - lam * x) / (1 - lam)                                  # (B, ...) should equal x[perm]
    dist = ((rest[:, None] - x[None]) ** 2).reshape(len(x), len(x), -1).sum(-1)
    return dist.argmin(1), dist.min(1)


def test_mixup_targets_equal_the_mixing_weights(xp):
    x, labels = _images(xp, b=10), xp.asarray(np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4]))
    out, y, lam = mixup(x, labels, _rng(3), alpha=0.4, num_classes=5)
    out, y, xs = to_numpy(out), to_numpy(y), to_numpy(x)
    assert out.shape == xs.shape and y.shape == (10, 5) and 0 < lam < 1
    np.testing.assert_allclose(y.sum(1), 1.0)
    j, err = _partner(out, xs, lam)
    assert err.max() < 1e-20 and sorted(j) == list(range(10))              # a permutation of the batch
    onehot = np.eye(5)[to_numpy(labels)]
    np.testing.assert_allclose(y, lam * onehot + (1 - lam) * onehot[j], atol=1e-12)
    out2, y2, lam2 = mixup(x, labels, _rng(3), alpha=0.4, num_classes=5)
    assert lam2 == lam and np.array_equal(to_numpy(out2), out)


def test_mixup_accepts_soft_targets(xp):
    x = _images(xp, b=4)
    soft = xp.asarray(np.full((4, 3), 1 / 3))
    _, y, _ = mixup(x, soft, _rng(), alpha=1.0)
    np.testing.assert_allclose(to_numpy(y), 1 / 3)
    with pytest.raises(ValueError, match="num_classes"):
        mixup(x, xp.asarray(np.arange(4)), _rng(), alpha=1.0)


def test_cutmix_pastes_one_box_and_weights_targets_by_area(xp):
    x, labels = _images(xp, b=6, h=16, w=16), xp.asarray(np.arange(6))
    for seed in range(5):
        out, y, lam = cutmix(x, labels, _rng(seed), alpha=1.0, num_classes=6)
        out, y, xs = to_numpy(out), to_numpy(y), to_numpy(x)
        np.testing.assert_allclose(y.sum(1), 1.0)
        changed = (out != xs).any(axis=(0, 1))                             # (H, W) where the box is
        rows, cols = np.flatnonzero(changed.any(1)), np.flatnonzero(changed.any(0))
        if rows.size:                                                      # the changed pixels form a box
            box = np.zeros_like(changed)
            box[rows.min():rows.max() + 1, cols.min():cols.max() + 1] = True
            np.testing.assert_array_equal(changed, box)
            assert lam == pytest.approx(1 - box.sum() / 256)
        for i in range(6):                                                 # inside: another image's pixels
            j = [k for k in range(6) if np.array_equal(out[i][:, changed], xs[k][:, changed])]
            assert j, "pasted pixels come from no image of the batch"
            expected = np.zeros(6)
            expected[i] += lam
            expected[j[0]] += 1 - lam
            np.testing.assert_allclose(y[i], expected, atol=1e-12)


def test_random_erasing(xp):
    x = _images(xp, b=12, h=16, w=16) + 1.0                                # values in [1, 2]
    assert np.array_equal(to_numpy(random_erasing(x, _rng(), p=0.0)), to_numpy(x))
    out = to_numpy(random_erasing(x, _rng(4), p=1.0, value=0.0))
    assert out.shape == x.shape and out.dtype == x.dtype
    for i in range(12):
        erased = out[i] == 0
        assert erased.any() and (erased == erased[0]).all()                # same box in all channels
        rows, cols = np.flatnonzero(erased[0].any(1)), np.flatnonzero(erased[0].any(0))
        assert erased[0].sum() == rows.size * cols.size                     # a filled rectangle
        assert 0.02 * 256 * 0.5 <= erased[0].sum() <= 256
    noisy = to_numpy(random_erasing(x, _rng(4), p=1.0))                    # "pixel": N(0, 1) noise
    assert ((noisy != to_numpy(x)) == (out == 0)).all()


# ----------------------------------------------------------------------------- RandAugment ops

@pytest.mark.parametrize("name", ["brightness", "color", "contrast", "sharpness", "solarize", "posterize",
                                  "rotate", "shear_x", "shear_y", "translate_x", "translate_y", "identity"])
def test_magnitude_zero_is_identity(xp, name):
    x = xp.asarray(np.round(np.random.default_rng(0).random((4, 3, 9, 9)) * 255) / 255, dtype=np.float32)
    np.testing.assert_allclose(to_numpy(ra.OPS[name](x, 0.0, _rng())), to_numpy(x), atol=1e-6)


def test_ops_known_values(xp):
    x = xp.asarray(np.round(np.random.default_rng(0).random((4, 3, 20, 20)) * 255) / 255, dtype=np.float32)
    xs = to_numpy(x)
    np.testing.assert_allclose(to_numpy(ra.invert(x, 0, _rng())), 1 - xs)
    np.testing.assert_allclose(to_numpy(ra.solarize(x, 10, _rng())), 1 - xs)       # threshold 0: all
    poster = to_numpy(ra.posterize(x, 10, _rng())) * 255                              # 4 bits kept
    np.testing.assert_allclose(poster, np.round(poster / 16) * 16, atol=1e-3)
    auto = to_numpy(ra.autocontrast(x * 0.5 + 0.2, 0, _rng()))
    np.testing.assert_allclose(auto.min(axis=(2, 3)), 0, atol=1e-6)
    np.testing.assert_allclose(auto.max(axis=(2, 3)), 1, atol=1e-6)
    eq = to_numpy(ra.equalize(x * 0.3, 0, _rng()))
    assert eq.max() == pytest.approx(1.0) and eq.min() == pytest.approx(0.0)
    order = np.argsort((xs * 0.3)[0, 0].ravel(), kind="stable")
    assert np.all(np.diff(eq[0, 0].ravel()[order]) >= -1e-6)                         # monotone per channel
    shifted = to_numpy(ra.translate_x(x, 10, _rng(5)))                                # 0.45 * 20 = 9 pixels
    for i in range(4):
        right = np.array_equal(shifted[i, :, :, 9:], xs[i, :, :, :11]) and np.all(shifted[i, :, :, :9] == 0.5)
        left = np.array_equal(shifted[i, :, :, :11], xs[i, :, :, 9:]) and np.all(shifted[i, :, :, 11:] == 0.5)
        assert right or left


def test_randaugment_shapes_range_and_reproducibility(xp):
    x = _images(xp, b=32, dtype=np.float32)
    aug = RandAugment(num_ops=2, magnitude=9)
    out = aug(x, _rng(6))
    assert out.shape == x.shape and out.dtype == np.float32
    assert float(out.min()) >= 0 and float(out.max()) <= 1
    np.testing.assert_array_equal(to_numpy(out), to_numpy(aug(x, _rng(6))))
    assert not np.array_equal(to_numpy(out), to_numpy(aug(x, _rng(7))))
    np.testing.assert_array_equal(to_numpy(x), to_numpy(_images(xp, b=32, dtype=np.float32)))   # input untouched
    with pytest.raises(ValueError, match="unknown"):
        RandAugment(ops=["warp"])


# ----------------------------------------------------------------------------- the pipeline

def _batch(xp, b=16, c=3, s=8, seed=0):
    rng = np.random.default_rng(seed)
    return (xp.asarray(rng.integers(0, 256, (b, c, s, s), dtype=np.uint8)),
            xp.asarray(rng.integers(0, 10, b).astype(np.int64)))


FULL = dict(crop_padding=2, flip=True, randaug_n=2, randaug_m=9, mixup_alpha=0.8, cutmix_alpha=1.0,
            erasing_p=0.5)


def test_eval_transform_is_to_float_and_normalize(xp):
    images, labels = _batch(xp)
    aug = Augment((0.5, 0.4, 0.3), (0.2, 0.2, 0.2))
    assert not aug.is_random and not aug.soft_targets
    x, y = aug(images, labels)
    np.testing.assert_allclose(to_numpy(x), to_numpy(normalize(to_float(images), (0.5, 0.4, 0.3), (0.2,) * 3)))
    assert x.dtype == np.float32 and y is labels


@pytest.mark.parametrize("options", [dict(crop_padding=4, flip=True), dict(randaug_n=2), dict(erasing_p=1.0), FULL])
def test_pipeline_shapes_dtypes_and_reproducibility(xp, options):
    images, labels = _batch(xp)
    aug = Augment((0.5,) * 3, (0.25,) * 3, num_classes=10, seed=3, **options)
    x, y = aug(images, labels)
    assert x.shape == (16, 3, 8, 8) and x.dtype == np.float32
    if aug.soft_targets:
        assert y.shape == (16, 10) and y.dtype == np.float32
        np.testing.assert_allclose(to_numpy(y).sum(1), 1.0, rtol=1e-6)
    else:
        assert y.shape == (16,) and y.dtype == np.int64
    x2, y2 = Augment((0.5,) * 3, (0.25,) * 3, num_classes=10, seed=3, **options)(images, labels)
    np.testing.assert_array_equal(to_numpy(x), to_numpy(x2))
    np.testing.assert_array_equal(to_numpy(y), to_numpy(y2))
    x3, _ = Augment((0.5,) * 3, (0.25,) * 3, num_classes=10, seed=4, **options)(images, labels)
    assert not np.array_equal(to_numpy(x), to_numpy(x3))


def test_pipeline_state_dict_restores_the_stream():
    images, labels = _batch(np)
    a = Augment((0.5,) * 3, (0.25,) * 3, num_classes=10, seed=1, **FULL)
    a(images, labels)
    state = a.state_dict()
    expected = a(images, labels)
    b = Augment((0.5,) * 3, (0.25,) * 3, num_classes=10, seed=99, **FULL)
    b.load_state_dict(state)
    got = b(images, labels)
    np.testing.assert_array_equal(expected[0], got[0])
    np.testing.assert_array_equal(expected[1], got[1])


def test_pipeline_same_on_every_device(xp):
    """The random draws are made on the host, so CPU and GPU give the same batch for a seed; only the
    noise that random erasing fills its boxes with is drawn by the device (tested below)."""
    images, labels = _batch(np)
    options = {**FULL, "erasing_p": 0.0}
    ref = Augment((0.5,) * 3, (0.25,) * 3, num_classes=10, seed=2, **options)(images, labels)
    got = Augment((0.5,) * 3, (0.25,) * 3, num_classes=10, seed=2, **options)(xp.asarray(images), xp.asarray(labels))
    np.testing.assert_allclose(to_numpy(got[0]), ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(to_numpy(got[1]), ref[1], rtol=1e-6)


def test_erasing_boxes_same_on_every_device_noise_drawn_there(xp):
    x = _images(np, b=12, h=16, w=16) + 1.0
    ref = random_erasing(x, _rng(4), p=0.7)
    got = to_numpy(random_erasing(xp.asarray(x), _rng(4), p=0.7))
    np.testing.assert_array_equal(got != x, ref != x)                      # the same boxes
    noise = got[got != x]
    assert abs(noise.mean()) < 0.2 and 0.8 < noise.std() < 1.2            # filled with N(0, 1) noise
    np.testing.assert_array_equal(to_numpy(random_erasing(xp.asarray(x), _rng(4), p=0.7)), got)  # same seed


def test_soft_targets_need_num_classes():
    with pytest.raises(ValueError, match="num_classes"):
        Augment((0.5,), (0.5,), mixup_alpha=0.2)
