"""IDX reading/writing and the Fashion-MNIST loader, on generated files (and Debian's real ones if installed)."""
import gzip
import os

import numpy as np
import pytest

from tinyvit.data import (DataFileMissing, DataFormatError, DatasetUnavailable, load_dataset, load_fashion_mnist,
                          prepare_fashion_mnist, read_idx, write_idx)
from tinyvit.data.fashion_mnist import CLASSES, SYSTEM_DIR

NAMES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


def write_fashion_folder(folder, rng, n_train=9, n_test=4, gz=True):
    os.makedirs(folder, exist_ok=True)
    arrays = {NAMES[0]: rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
              NAMES[1]: rng.integers(0, 10, n_train).astype(np.uint8),
              NAMES[2]: rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
              NAMES[3]: rng.integers(0, 10, n_test).astype(np.uint8)}
    for name, array in arrays.items():
        write_idx(os.path.join(folder, name + (".gz" if gz else "")), array)
    return arrays


@pytest.mark.parametrize("dtype, shape", [(np.uint8, (5, 28, 28)), (np.uint8, (7,)), (np.int8, (3, 4)),
                                          (np.int16, (2, 3)), (np.int32, (4, 2, 3)), (np.float32, (6,)),
                                          (np.float64, (2, 2))])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path, dtype, shape, suffix):
    array = (np.random.default_rng(0).standard_normal(shape) * 100).astype(dtype)
    path = tmp_path / f"f{suffix}"
    write_idx(path, array)
    back = read_idx(path)
    assert back.dtype == dtype and back.shape == shape
    np.testing.assert_array_equal(back, array)


def test_idx_header_layout(tmp_path):
    """Big-endian, as LeCun's format says: magic 0x00000803 then the three sizes."""
    write_idx(tmp_path / "f", np.zeros((2, 3, 4), np.uint8))
    raw = (tmp_path / "f").read_bytes()
    assert raw[:16] == bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4]) and len(raw) == 16 + 24
    write_idx(tmp_path / "g", np.array([1], np.int32))
    assert (tmp_path / "g").read_bytes()[-4:] == b"\x00\x00\x00\x01"


def _bad(tmp_path, data, match):
    path = tmp_path / "bad"
    path.write_bytes(data)
    with pytest.raises(DataFormatError, match=match) as err:
        read_idx(path)
    assert str(path) in str(err.value)


def test_idx_errors(tmp_path):
    write_idx(tmp_path / "good", np.arange(24, dtype=np.uint8).reshape(2, 3, 4))
    good = (tmp_path / "good").read_bytes()
    _bad(tmp_path, b"\x01\x00" + good[2:], "bad magic number")
    _bad(tmp_path, good[:2] + b"\x07" + good[3:], "unknown IDX dtype code 0x07")
    _bad(tmp_path, good[:-1], "truncated or corrupt")
    _bad(tmp_path, good + b"\x00", "more data than its header declares")
    _bad(tmp_path, good[:9], "cut short")
    _bad(tmp_path, good[:2], "too short")
    _bad(tmp_path, gzip.compress(good)[:-10], "gzip")
    with pytest.raises(DataFileMissing, match="nothing-here"):
        read_idx(tmp_path / "nothing-here")


@pytest.mark.parametrize("layout", ["subfolder", "flat", "raw"])
def test_load_generated_fashion_mnist(tmp_path, layout):
    folder = tmp_path / "fashion-mnist" if layout == "subfolder" else tmp_path
    arrays = write_fashion_folder(folder, np.random.default_rng(1), gz=layout != "raw")
    ds = load_dataset("fashion-mnist", root=tmp_path, download=False)
    assert ds.train_images.shape == (9, 1, 28, 28) and ds.train_images.dtype == np.uint8
    assert ds.test_images.shape == (4, 1, 28, 28)
    assert ds.train_labels.dtype == np.int64 and ds.test_labels.shape == (4,)
    np.testing.assert_array_equal(ds.train_images[:, 0], arrays[NAMES[0]])
    np.testing.assert_array_equal(ds.test_labels, arrays[NAMES[3]])
    assert ds.classes == CLASSES and ds.classes[9] == "Ankle boot"
    assert ds.channels == 1 and ds.image_size == 28 and ds.mean == (0.2860,) and ds.std == (0.3530,)


def test_inconsistent_files(tmp_path):
    rng = np.random.default_rng(2)
    write_fashion_folder(tmp_path, rng)
    write_idx(tmp_path / (NAMES[1] + ".gz"), np.zeros(8, np.uint8))          # 8 labels, 9 images
    with pytest.raises(DataFormatError, match="train-labels"):
        load_fashion_mnist(tmp_path, download=False)
    write_idx(tmp_path / (NAMES[1] + ".gz"), np.full(9, 10, np.uint8))      # label 10 of 10 classes
    with pytest.raises(DataFormatError, match="label 10"):
        load_fashion_mnist(tmp_path, download=False)


def test_missing_without_download_says_what_to_do(tmp_path):
    with pytest.raises(DatasetUnavailable) as err:
        load_fashion_mnist(tmp_path, download=False)
    msg = str(err.value)
    for needed in ("train-images-idx3-ubyte.gz", "fashion-mnist.s3", "dataset-fashion-mnist", "--data-dir",
                   str(tmp_path)):
        assert needed in msg


def test_prepare_copies_and_validates(tmp_path):
    source = tmp_path / "src"
    arrays = write_fashion_folder(source, np.random.default_rng(3))
    with pytest.raises(DataFormatError, match="MD5"):                    # generated, not the official files
        prepare_fashion_mnist(tmp_path / "root", source=source)
    folder = prepare_fashion_mnist(tmp_path / "root", source=source, check_md5=False)
    assert folder == tmp_path / "root" / "fashion-mnist"
    assert sorted(os.listdir(folder)) == sorted(n + ".gz" for n in NAMES)     # no temporary files
    ds = load_fashion_mnist(tmp_path / "root", download=False)
    np.testing.assert_array_equal(ds.train_images[:, 0], arrays[NAMES[0]])
    (source / (NAMES[2] + ".gz")).write_bytes(b"\x00\x00\x08\x03junk")
    with pytest.raises(DataFormatError, match="t10k-images"):
        prepare_fashion_mnist(tmp_path / "root2", source=source, check_md5=False)


@pytest.mark.skipif(not SYSTEM_DIR.is_dir(), reason=f"{SYSTEM_DIR} not present (apt-get install dataset-fashion-mnist)")
def test_real_fashion_mnist_files():
    ds = load_fashion_mnist(SYSTEM_DIR, download=False)
    assert ds.train_images.shape == (60000, 1, 28, 28) and ds.test_images.shape == (10000, 1, 28, 28)
    assert ds.train_images.dtype == np.uint8 and ds.train_labels.dtype == np.int64
    np.testing.assert_array_equal(np.bincount(ds.train_labels), np.full(10, 6000))
    np.testing.assert_array_equal(np.bincount(ds.test_labels), np.full(10, 1000))
    # the published normalisation constants are those of these pixels
    assert ds.train_images.mean() / 255 == pytest.approx(ds.mean[0], abs=1e-3)
    assert ds.train_images.std() / 255 == pytest.approx(ds.std[0], abs=1e-3)
