"""CIFAR-10/100 readers on small batches written in the real on-disk format, and the safe unpickler.

The real files are Python-2 pickles (protocol 2): strings are BINSTRING opcodes and arrays name
``numpy.core.multiarray._reconstruct``. :class:`Py2Pickler` writes exactly that, so these tests read
what the official archives contain, only with fewer images.
"""
import dataclasses
import io
import os
import pickle
import pickletools
import struct
import tarfile
import tempfile

import numpy as np
import pytest

from tinyvit.data import (DataFormatError, DatasetUnavailable, UnsafePickleError, ensure_cifar, load_cifar10,
                          load_cifar100, load_dataset, read_cifar_batch)
from tinyvit.data import cifar as cifar_module

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # NumPy 1.x
    from numpy.core.multiarray import _reconstruct

CIFAR10_NAMES = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]


class Py2Pickler(pickle._Pickler):
    """Writes pickles the way Python 2 wrote the CIFAR files: every string a BINSTRING, NumPy 1 names."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_string(self, obj):
        data = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[bytes] = save_py2_string
    dispatch[str] = save_py2_string

    def save_global(self, obj, name=None):
        if obj is _reconstruct:
            self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
            self.memoize(obj)
        else:
            super().save_global(obj, name)


def py2_pickle(obj) -> bytes:
    buf = io.BytesIO()
    Py2Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def cifar_batch(rng, n, label_key=b"labels", num_classes=10, extra=None):
    """A batch dict like the real ones; returns (dict, images (n,3,32,32), labels)."""
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = [int(v) for v in rng.integers(0, num_classes, n)]
    batch = {b"batch_label": b"training batch 1 of 5", label_key: labels, b"data": data,
             b"filenames": [b"img_%d.png" % i for i in range(n)]}
    batch.update(extra or {})
    return batch, data.reshape(n, 3, 32, 32), np.array(labels)


def write_cifar10_folder(folder, rng, n=6):
    """cifar-10-batches-py with n images per batch. Returns {file: (images, labels)}."""
    os.makedirs(folder, exist_ok=True)
    content = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch, images, labels = cifar_batch(rng, n)
        with open(os.path.join(folder, name), "wb") as f:
            f.write(py2_pickle(batch))
        content[name] = (images, labels)
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        f.write(py2_pickle({b"label_names": CIFAR10_NAMES, b"num_cases_per_batch": n, b"num_vis": 3072}))
    return content


def write_cifar100_folder(folder, rng, n=7):
    os.makedirs(folder, exist_ok=True)
    content = {}
    for name in ("train", "test"):
        fine = rng.integers(0, 100, n)
        batch, images, _ = cifar_batch(rng, n, b"fine_labels", extra={b"coarse_labels": [int(v) // 5 for v in fine]})
        batch[b"fine_labels"] = [int(v) for v in fine]
        with open(os.path.join(folder, name), "wb") as f:
            f.write(py2_pickle(batch))
        content[name] = (images, fine, fine // 5)
    meta = {b"fine_label_names": [b"fine_%d" % i for i in range(100)],
            b"coarse_label_names": [b"coarse_%d" % i for i in range(20)]}
    with open(os.path.join(folder, "meta"), "wb") as f:
        f.write(py2_pickle(meta))
    return content


def make_cifar_archive(path, rng, which="cifar10", n=6):
    """The .tar.gz as published: one top-level folder. Returns the folder's content."""
    folder = "cifar-10-batches-py" if which == "cifar10" else "cifar-100-python"
    writer = write_cifar10_folder if which == "cifar10" else write_cifar100_folder
    with tempfile.TemporaryDirectory() as staging:
        content = writer(os.path.join(staging, folder), rng, n)
        with tarfile.open(path, "w:gz") as tar:
            tar.add(os.path.join(staging, folder), arcname=folder)
    return content


class Evil:
    """Unpickling this would run a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ----------------------------------------------------------------------------- reading batches

def test_writer_produces_the_python2_format(tmp_path):
    batch, _, _ = cifar_batch(np.random.default_rng(0), 3)
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(py2_pickle(batch))]
    assert ("GLOBAL", "numpy.core.multiarray _reconstruct") in ops
    assert not any(name in ("BINUNICODE", "SHORT_BINBYTES", "BINBYTES") for name, _ in ops)


def test_read_batch_round_trip(tmp_path):
    batch, images, labels = cifar_batch(np.random.default_rng(0), 5)
    (tmp_path / "data_batch_1").write_bytes(py2_pickle(batch))
    got = read_cifar_batch(tmp_path / "data_batch_1")
    assert set(got) == {"batch_label", "labels", "data", "filenames"}
    np.testing.assert_array_equal(got["data"], batch[b"data"])
    assert got["labels"] == list(labels)


def test_read_batch_written_by_python3(tmp_path):
    """Protocols 2 (bytes via _codecs.encode) and 4 (NumPy 2 names) are read as well."""
    batch, _, _ = cifar_batch(np.random.default_rng(0), 4)
    for protocol in (2, 4):
        (tmp_path / "b").write_bytes(pickle.dumps(batch, protocol=protocol))
        np.testing.assert_array_equal(read_cifar_batch(tmp_path / "b")["data"], batch[b"data"])


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_malicious_pickle_is_refused(tmp_path, protocol):
    marker = tmp_path / "pwned"
    batch, _, _ = cifar_batch(np.random.default_rng(0), 2)
    batch[b"labels"] = Evil(marker)
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps(batch, protocol=protocol))
    with pytest.raises(UnsafePickleError) as err:
        read_cifar_batch(path)
    assert not marker.exists(), "the payload ran"
    msg = str(err.value)
    assert str(path) in msg and ("posix.system" in msg or "os.system" in msg or "nt.system" in msg)


def test_malicious_batch_inside_dataset_folder_is_refused(tmp_path):
    write_cifar10_folder(tmp_path / "cifar-10-batches-py", np.random.default_rng(0))
    marker = tmp_path / "pwned"
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(
        pickle.dumps({b"data": Evil(marker)}, protocol=2))
    with pytest.raises(UnsafePickleError, match="data_batch_3"):
        load_cifar10(tmp_path, download=False)
    assert not marker.exists()


def test_builtins_eval_is_refused(tmp_path):
    path = tmp_path / "b"
    path.write_bytes(b"cbuiltins\neval\n(V1+1\ntR.")         # protocol 0: eval("1+1")
    with pytest.raises(UnsafePickleError, match="builtins.eval"):
        read_cifar_batch(path)


def test_malformed_batches_name_the_file(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10_folder(folder, rng)
    good = (folder / "test_batch").read_bytes()
    (folder / "test_batch").write_bytes(good[: len(good) // 2])          # truncated
    with pytest.raises(DataFormatError, match="test_batch"):
        load_cifar10(tmp_path, download=False)
    batch, _, _ = cifar_batch(rng, 4)
    batch[b"data"] = batch[b"data"][:, :100]                             # wrong row length
    (folder / "test_batch").write_bytes(py2_pickle(batch))
    with pytest.raises(DataFormatError, match=r"test_batch.*\(N, 3072\)"):
        load_cifar10(tmp_path, download=False)
    batch, _, _ = cifar_batch(rng, 4)
    del batch[b"labels"]
    (folder / "test_batch").write_bytes(py2_pickle(batch))
    with pytest.raises(DataFormatError, match="test_batch.*'labels'"):
        load_cifar10(tmp_path, download=False)
    (folder / "test_batch").write_bytes(py2_pickle([1, 2, 3]))           # not a dict
    with pytest.raises(DataFormatError, match="test_batch"):
        load_cifar10(tmp_path, download=False)


# ----------------------------------------------------------------------------- whole datasets

def test_load_cifar10_from_extracted_folder(tmp_path):
    content = write_cifar10_folder(tmp_path / "cifar-10-batches-py", np.random.default_rng(1), n=6)
    ds = load_cifar10(tmp_path, download=False)
    assert ds.train_images.shape == (30, 3, 32, 32) and ds.train_images.dtype == np.uint8
    assert ds.test_images.shape == (6, 3, 32, 32)
    assert ds.train_labels.dtype == np.int64 and ds.train_labels.shape == (30,)
    order = [f"data_batch_{i}" for i in range(1, 6)]
    np.testing.assert_array_equal(ds.train_images, np.concatenate([content[f][0] for f in order]))
    np.testing.assert_array_equal(ds.train_labels, np.concatenate([content[f][1] for f in order]))
    np.testing.assert_array_equal(ds.test_labels, content["test_batch"][1])
    # the row layout: 1024 red, 1024 green, 1024 blue values, each row-major over 32 x 32
    raw = read_cifar_batch(tmp_path / "cifar-10-batches-py" / "data_batch_1")["data"]
    assert ds.train_images[2, 1, 5, 7] == raw[2, 1024 + 5 * 32 + 7]
    assert ds.classes[0] == "airplane" and len(ds.classes) == 10
    assert ds.channels == 3 and ds.image_size == 32 and ds.num_classes == 10
    assert ds.mean == pytest.approx((0.4914, 0.4822, 0.4465)) and len(ds.std) == 3


def test_root_may_be_the_dataset_folder_itself(tmp_path):
    write_cifar10_folder(tmp_path / "cifar-10-batches-py", np.random.default_rng(1))
    ds = load_dataset("cifar10", root=tmp_path / "cifar-10-batches-py", download=False)
    assert len(ds.train_images) == 30


@pytest.mark.parametrize("label, k", [("fine", 100), ("coarse", 20)])
def test_load_cifar100(tmp_path, label, k):
    content = write_cifar100_folder(tmp_path / "cifar-100-python", np.random.default_rng(2), n=7)
    ds = load_cifar100(tmp_path, download=False, label=label)
    assert ds.train_images.shape == (7, 3, 32, 32) and ds.test_images.shape == (7, 3, 32, 32)
    assert ds.num_classes == k and ds.classes[3] == f"{label}_3"
    np.testing.assert_array_equal(ds.train_images, content["train"][0])
    np.testing.assert_array_equal(ds.test_labels, content["test"][1 if label == "fine" else 2])
    with pytest.raises(ValueError, match="fine"):
        load_cifar100(tmp_path, download=False, label="medium")


def test_local_archive_is_checked_and_extracted(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    archive = tmp_path / "cifar-10-python.tar.gz"
    make_cifar_archive(archive, rng)
    # not the official file: refused, with the MD5s in the message, nothing extracted
    with pytest.raises(DatasetUnavailable, match="MD5"):
        ensure_cifar("cifar10", tmp_path, download=False)
    assert os.listdir(tmp_path) == ["cifar-10-python.tar.gz"]
    # pretend it is the official file
    from tinyvit.data.download import md5sum
    spec = dataclasses.replace(cifar_module.CIFAR["cifar10"], md5=md5sum(archive))
    monkeypatch.setitem(cifar_module.CIFAR, "cifar10", spec)
    folder = ensure_cifar("cifar10", tmp_path, download=False)
    assert folder == tmp_path / "cifar-10-batches-py"
    assert len(load_cifar10(tmp_path, download=False).test_images) == 6
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".")]
    assert leftovers == []


def test_missing_dataset_without_download_explains_what_to_do(tmp_path):
    with pytest.raises(DatasetUnavailable) as err:
        load_cifar10(tmp_path / "nowhere", download=False)
    msg = str(err.value)
    for needed in ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", str(tmp_path / "nowhere"),
                   "cifar-10-batches-py", "cifar-10-python.tar.gz", "--data-dir"):
        assert needed in msg
    assert not (tmp_path / "nowhere").exists()


def test_incomplete_folder_is_not_used(tmp_path):
    write_cifar10_folder(tmp_path / "cifar-10-batches-py", np.random.default_rng(1))
    os.remove(tmp_path / "cifar-10-batches-py" / "data_batch_5")
    with pytest.raises(DatasetUnavailable, match="--data-dir"):
        load_cifar10(tmp_path, download=False)
