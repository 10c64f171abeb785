"""DataLoader: every sample once per epoch, seeded and resumable order, drop_last, device placement."""
import numpy as np
import pytest

from tinyvit.backend import to_numpy
from tinyvit.data import Augment, DataLoader, to_float


def _data(n=23, c=1, s=4):
    images = (np.arange(n * c * s * s) % 251).astype(np.uint8).reshape(n, c, s, s)
    return images, np.arange(n, dtype=np.int64)          # label i == index i, to track samples


def _device(xp):
    return "cpu" if xp is np else "cuda"


def test_every_sample_exactly_once_per_epoch(xp):
    images, labels = _data()
    loader = DataLoader(images, labels, batch_size=5, shuffle=True, seed=0, device=_device(xp))
    assert len(loader) == 5
    epochs = []
    for _ in range(3):
        batches = list(loader)
        assert [len(y) for _, y in batches] == [5, 5, 5, 5, 3]
        seen = np.concatenate([to_numpy(y) for _, y in batches])
        np.testing.assert_array_equal(np.sort(seen), labels)
        for x, y in batches:                              # images travel with their labels
            np.testing.assert_allclose(to_numpy(x), images[to_numpy(y)] / 255.0, rtol=1e-6)
        epochs.append(seen)
    assert not np.array_equal(epochs[0], epochs[1])       # a new order each epoch
    assert loader.epoch == 3


def test_batches_are_on_the_device_as_float(xp):
    images, labels = _data()
    x, y = next(iter(DataLoader(images, labels, 4, device=_device(xp))))
    assert type(x).__module__.split(".")[0] == xp.__name__ and type(y).__module__.split(".")[0] == xp.__name__
    assert x.dtype == np.float32 and x.shape == (4, 1, 4, 4) and y.dtype == np.int64
    np.testing.assert_array_equal(to_numpy(y), [0, 1, 2, 3])        # no shuffle: in order
    assert float(x.max()) <= 1.0


def test_seeded_order_is_reproducible():
    images, labels = _data()
    orders = [[to_numpy(y).tolist() for _, y in DataLoader(images, labels, 6, shuffle=True, seed=s)] for s in (7, 7, 8)]
    assert orders[0] == orders[1] and orders[0] != orders[2]


def test_drop_last():
    images, labels = _data(n=10)
    loader = DataLoader(images, labels, 4, shuffle=True, drop_last=True)
    assert len(loader) == 2
    batches = list(loader)
    assert [len(y) for _, y in batches] == [4, 4]
    assert len(DataLoader(images, labels, 4)) == 3 and [len(y) for _, y in DataLoader(images, labels, 4)] == [4, 4, 2]
    assert len(DataLoader(images, labels, 5, drop_last=True)) == 2


def _run(loader, batches):
    out = []
    it = iter(loader)
    for _ in range(batches):
        x, y = next(it)
        out.append((to_numpy(x), to_numpy(y)))
    return out


@pytest.mark.parametrize("with_augment", [False, True])
def test_state_save_and_restore_mid_epoch(with_augment):
    images, labels = _data(n=20, c=3, s=8)
    make = lambda: DataLoader(images, labels, 3, shuffle=True, seed=1, drop_last=True,      # noqa: E731
                              transform=Augment((0.5,) * 3, (0.25,) * 3, 20, crop_padding=2, flip=True,
                                                mixup_alpha=0.5, seed=5) if with_augment else None)
    a = make()
    list(a)                                  # one full epoch (6 batches)
    _run(a, 2)                               # two batches into the second epoch
    state = a.state_dict()
    expected = _run(a, 4) + _run(a, 6)       # rest of epoch 2, then epoch 3
    b = make()
    b.load_state_dict(state)
    assert (b.epoch, b.position) == (1, 2)
    got = _run(b, 4) + _run(b, 6)
    for (xe, ye), (xg, yg) in zip(expected, got):
        np.testing.assert_array_equal(xe, xg)
        np.testing.assert_array_equal(ye, yg)


def test_break_then_iterate_continues_the_epoch():
    images, labels = _data(n=12)
    loader = DataLoader(images, labels, 4, shuffle=True, seed=2)
    first = _run(loader, 1)
    rest = [to_numpy(y) for _, y in loader]
    seen = np.concatenate([first[0][1]] + rest)
    np.testing.assert_array_equal(np.sort(seen), labels)
    assert loader.epoch == 1 and loader.position == 0


def test_to_float_and_errors():
    x = np.array([[[[0, 255]]]], np.uint8)
    np.testing.assert_array_equal(to_float(x), [[[[0.0, 1.0]]]])
    assert to_float(x, np.float64).dtype == np.float64
    with pytest.raises(ValueError, match="labels"):
        DataLoader(x, np.zeros(2), 1)
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(x, np.zeros(1), 0)
