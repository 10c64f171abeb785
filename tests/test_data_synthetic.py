"""The synthetic dataset: deterministic per seed, configurable, balanced, and learnable."""
import numpy as np
import pytest

from tinyvit.data import load_dataset, make_synthetic


def test_deterministic_per_seed():
    a = make_synthetic(train_size=60, test_size=20, seed=3)
    b = load_dataset("synthetic", train_size=60, test_size=20, seed=3)
    for field in ("train_images", "train_labels", "test_images", "test_labels"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert a.mean == b.mean and a.std == b.std
    c = make_synthetic(train_size=60, test_size=20, seed=4)
    assert not np.array_equal(a.train_images, c.train_images)


@pytest.mark.parametrize("k, size, channels", [(10, 32, 3), (4, 28, 1), (3, 16, 2)])
def test_shapes_dtypes_and_balance(k, size, channels):
    ds = make_synthetic(num_classes=k, image_size=size, channels=channels, train_size=6 * k, test_size=2 * k)
    assert ds.train_images.shape == (6 * k, channels, size, size) and ds.train_images.dtype == np.uint8
    assert ds.test_images.shape == (2 * k, channels, size, size)
    assert ds.train_labels.dtype == np.int64 and ds.test_labels.dtype == np.int64
    np.testing.assert_array_equal(np.bincount(ds.train_labels, minlength=k), np.full(k, 6))
    assert ds.num_classes == k and ds.channels == channels and ds.image_size == size
    assert len(ds.mean) == channels and all(s > 0 for s in ds.std)
    pixels = ds.train_images.astype(np.float64) / 255
    np.testing.assert_allclose(ds.mean, pixels.mean(axis=(0, 2, 3)))
    assert pixels.std() > 0.05                             # not a blank image


def test_learnable_far_above_chance():
    """Even a linear softmax classifier on raw pixels (a few steps of gradient descent) beats chance
    by far; a ViT, which can read stripe orientation inside patches, does better still."""
    ds = make_synthetic(train_size=1000, test_size=300, image_size=16, seed=0)
    x = ds.train_images.reshape(1000, -1) / 255.0 - 0.5
    xt = ds.test_images.reshape(300, -1) / 255.0 - 0.5
    w = np.zeros((x.shape[1], 10))
    onehot = np.eye(10)[ds.train_labels]
    for _ in range(40):
        logits = x @ w
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        w -= 0.5 * x.T @ (p - onehot) / len(x)
    accuracy = ((xt @ w).argmax(1) == ds.test_labels).mean()
    assert accuracy > 0.4, accuracy                      # chance is 0.1 (about 0.6 here)


def test_bad_arguments():
    with pytest.raises(ValueError):
        make_synthetic(num_classes=1)
