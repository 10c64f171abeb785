"""CIFAR-10 and CIFAR-100 (Krizhevsky, 2009), read from the official "python version" archives.

On disk (after extracting the .tar.gz):

    cifar-10-batches-py/  data_batch_1 ... data_batch_5, test_batch   (10,000 images each)
                          batches.meta                                 (label_names)
    cifar-100-python/     train (50,000 images), test (10,000)         (fine_labels, coarse_labels)
                          meta                                         (fine_label_names, coarse_label_names)

Each file is a Python-2 pickle of a dict: ``data`` is a (N, 3072) uint8 array whose rows hold the
1024 red, then 1024 green, then 1024 blue pixels of a 32x32 image, row by row, so
``data.reshape(N, 3, 32, 32)`` is already NCHW. Labels are lists of ints.

A pickle can run arbitrary code when loaded, so these files are read with :class:`SafeUnpickler`,
which rebuilds only NumPy arrays of integers and refuses every other class or function by name. A
pickle can also be small and still ask for gigabytes (a few hundred bytes of nested lists whose
labels NumPy reads as 10^10 integers; a megabyte of one-byte opcodes that each build an empty list),
so before anything is built a file is checked against the layout above: its size and number of
opcodes (``MAX_PICKLE_BYTES``, ``MAX_PICKLE_OPCODES``), then one dict of arrays, numbers, names
and flat lists of them (``check_layout``), and labels that are whole numbers of the classes.
"""
from __future__ import annotations

import functools
import io
import pickle
import pickletools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .dataset import CIFAR10_MEAN, CIFAR10_STD, CIFAR100_MEAN, CIFAR100_STD, ImageDataset
from .download import default_data_dir, download as download_archive, extract_tar, md5sum
from .errors import DataFileMissing, DataFormatError, DatasetUnavailable, DownloadError, UnsafePickleError

try:                                                    # NumPy 2 moved numpy.core to numpy._core
    from numpy._core.multiarray import _reconstruct, scalar as _np_scalar
except ImportError:                                     # pragma: no cover - NumPy 1.x
    from numpy.core.multiarray import _reconstruct, scalar as _np_scalar


# The largest CIFAR file is CIFAR-100's train: 155 MB and about 200,000 opcodes (a label, a file
# name and its memo entry per image). Anything much larger is not a CIFAR file; these bounds keep
# what unpickling builds to a few hundred MB whatever the file holds.
MAX_PICKLE_BYTES = 256 << 20
MAX_PICKLE_OPCODES = 1_000_000
NOT_GENUINE = ("the file is not a genuine CIFAR batch (damaged, or made to look like one); delete it and download "
               "the dataset again")


def _integer_dtype(source, name, align=False, copy=False):
    """``numpy.dtype`` for the dtypes a CIFAR batch holds, integers (uint8 pixels, int labels), alone."""
    dtype = np.dtype(name) if isinstance(name, str) and len(name) <= 4 else None
    if dtype is None or dtype.kind not in "ui":
        found = dtype if dtype is not None else repr(name)[:40]
        raise UnsafePickleError(f"{source}: refusing a NumPy array of {found}: a CIFAR batch holds uint8 pixels and "
                                f"integer labels only; {NOT_GENUINE}")
    return dtype


def _latin1_encode(text, encoding="latin1"):
    """``_codecs.encode`` as Python 3 writes bytes in protocol-2 pickles; only latin-1 is allowed."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise UnsafePickleError(f"_codecs.encode called with encoding {encoding!r}; only latin1 is allowed")
    return text.encode("latin1")


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that can rebuild dicts, lists, strings, bytes, numbers and NumPy arrays, nothing else.

    Plain containers and scalars need no lookup at all; the only globals a CIFAR batch names are the
    ones NumPy uses to pickle an array. Anything else (``os.system``, ``builtins.eval``, ...) raises
    UnsafePickleError naming the refused ``module.name``.
    """

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,    # how NumPy 1.x pickles arrays
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,   # how NumPy 2.x pickles arrays
        ("numpy.core.multiarray", "scalar"): _np_scalar,
        ("numpy._core.multiarray", "scalar"): _np_scalar,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): _integer_dtype,
        ("_codecs", "encode"): _latin1_encode,                      # bytes in Python-3 protocol 2
    }

    def __init__(self, file, source="<pickle>"):
        super().__init__(file, encoding="latin1")      # latin1: how NumPy reads Python-2 array data
        self.source = source

    def find_class(self, module, name):
        try:
            found = self.ALLOWED[(module, name)]
            return functools.partial(found, self.source) if found is _integer_dtype else found   # names the file
        except KeyError:
            raise UnsafePickleError(
                f"{self.source}: refusing to unpickle {module}.{name}: a CIFAR batch holds only dicts, "
                "lists, strings, numbers and NumPy arrays. The file is not a genuine CIFAR batch "
                "(possibly malicious); delete it and download the dataset again") from None


def _str(x):
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def read_cifar_batch(path) -> dict:
    """Unpickle one CIFAR file safely; returns its dict with ``str`` keys (``data``, ``labels``, ...)."""
    path = Path(path)
    if not path.is_file():
        raise DataFileMissing(f"CIFAR file {path} does not exist")
    size = path.stat().st_size
    if size > MAX_PICKLE_BYTES:
        raise DataFormatError(f"{path} is {size} bytes, more than any CIFAR file (at most {MAX_PICKLE_BYTES}): "
                              f"{NOT_GENUINE}")
    raw = path.read_bytes()
    try:
        _count_opcodes(raw, path)
        obj = SafeUnpickler(io.BytesIO(raw), source=str(path)).load()
    except (UnsafePickleError, DataFormatError):
        raise
    except Exception as exc:        # UnpicklingError, EOFError (truncated), ValueError, ...
        raise DataFormatError(f"{path} is not a readable CIFAR pickle ({exc!r})") from exc
    return check_layout(obj, path)


def _count_opcodes(raw: bytes, path) -> None:
    """Refuse a pickle of more opcodes than any CIFAR file, before unpickling builds them (one empty
    list per byte would cost 60 bytes each). pickletools reads the opcodes without building anything."""
    for count, _ in enumerate(pickletools.genops(io.BytesIO(raw)), 1):
        if count > MAX_PICKLE_OPCODES:
            raise DataFormatError(f"{path}: the pickle builds more than {MAX_PICKLE_OPCODES} objects, more than any "
                                  f"CIFAR file: {NOT_GENUINE}")


def check_layout(obj, path) -> dict:
    """The unpickled ``obj`` as the CIFAR layout allows it, keys made ``str``: one dict whose values
    are NumPy arrays (integers: SafeUnpickler), numbers, names, or flat lists of whole numbers or names.
    Anything else (a nested list, whose labels NumPy would expand into a huge array; a float label,
    which would be truncated) is a DataFormatError naming the key and the value."""
    if not isinstance(obj, dict):
        raise DataFormatError(f"{path}: expected a pickled dict, found {type(obj).__name__}")
    layout = {}
    for key, value in obj.items():
        if not isinstance(key, (str, bytes)):
            raise DataFormatError(f"{path}: a key {key!r} that is not a name: {NOT_GENUINE}")
        key = _str(key)
        if isinstance(value, list):
            bad = next((item for item in value if type(item) not in (int, str, bytes)), None)
            if bad is not None:
                kind = f"{bad!r} ({type(bad).__name__})" if type(bad) in (float, bool) else f"a {type(bad).__name__}"
                raise DataFormatError(f"{path}: {key!r} holds {kind}, but a CIFAR batch's lists hold only whole "
                                      f"numbers (labels) or names: {NOT_GENUINE}")
        elif type(value) not in (np.ndarray, int, str, bytes):
            raise DataFormatError(f"{path}: {key!r} holds a {type(value).__name__}, which a CIFAR batch never does: "
                                  f"{NOT_GENUINE}")
        layout[key] = value
    return layout


def _images_and_labels(batch: dict, path, label_key: str, num_classes: int):
    """(N, 3072) uint8 rows -> (N, 3, 32, 32) images; the label list (checked by check_layout: flat,
    whole numbers) -> (N,) int64, each in [0, num_classes)."""
    for key in ("data", label_key):
        if key not in batch:
            raise DataFormatError(f"{path}: missing key {key!r} (found {sorted(batch)})")
    data = batch["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise DataFormatError(f"{path}: 'data' must be a (N, 3072) uint8 array, got "
                              f"{getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')}")
    raw = batch[label_key]
    if not (isinstance(raw, np.ndarray) or isinstance(raw, list) and all(type(v) is int for v in raw)):
        raise DataFormatError(f"{path}: {label_key!r} must be a list of whole numbers, got {type(raw).__name__}: "
                              f"{NOT_GENUINE}")
    labels = np.asarray(raw, dtype=np.int64)
    if labels.shape != (data.shape[0],):
        raise DataFormatError(f"{path}: {len(labels)} {label_key!r} for {data.shape[0]} images")
    outside = labels[(labels < 0) | (labels >= num_classes)]
    if outside.size:
        raise DataFormatError(f"{path}: {label_key!r} holds {outside[0]}, outside the classes [0, {num_classes}): "
                              f"{NOT_GENUINE}")
    return data.reshape(-1, 3, 32, 32), labels


@dataclass(frozen=True)
class CifarSpec:
    """Where one CIFAR variant comes from and what its extracted folder must contain."""
    key: str                # "cifar10" or "cifar100"
    title: str
    url: str
    md5: str                # of the .tar.gz, as published on https://www.cs.toronto.edu/~kriz/cifar.html
    folder: str             # the top-level folder inside the archive
    train_files: tuple
    test_files: tuple
    meta_file: str

    @property
    def archive(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def files(self) -> tuple:
        return self.train_files + self.test_files + (self.meta_file,)


CIFAR = {
    "cifar10": CifarSpec("cifar10", "CIFAR-10", "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                         "c58f30108f718f92721af3b95e74349a", "cifar-10-batches-py",
                         tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), "batches.meta"),
    "cifar100": CifarSpec("cifar100", "CIFAR-100", "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
                          "eb9058c3a382ffc7106e4002c42a8d85", "cifar-100-python",
                          ("train",), ("test",), "meta"),
}


def _spec(name: str) -> CifarSpec:
    key = name.lower().replace("-", "").replace("_", "")
    if key not in CIFAR:
        raise ValueError(f"unknown CIFAR dataset {name!r}: expected 'cifar10' or 'cifar100'")
    return CIFAR[key]


def is_complete(folder, name: str) -> bool:
    """True when ``folder`` holds every (non-empty) file of the named CIFAR variant."""
    folder = Path(folder)
    return all((folder / f).is_file() and (folder / f).stat().st_size > 0 for f in _spec(name).files)


def _instructions(spec: CifarSpec, root: Path, url: str, reason: str) -> str:
    """One line: what is missing, the offline way (Fashion-MNIST from a Debian package), how to
    provide the archive by hand."""
    return (f"{spec.title} is not in {root} and {reason}. Offline, train on Fashion-MNIST instead: "
            "--dataset fashion-mnist (its files: apt-get install dataset-fashion-mnist, or any machine's "
            f"download). Or fetch {url} elsewhere and put {spec.archive} (or its extracted {spec.folder}/) "
            f"into {root} or the folder --data-dir names (data_scripts/download_cifar.py --dataset {spec.key} --root DIR downloads and checks it)")


def ensure_cifar(name: str, root=None, url: Optional[str] = None, download: bool = True,
                 progress: bool = True) -> Path:
    """Return the extracted CIFAR folder (e.g. ``root/cifar-10-batches-py``), fetching it if needed.

    Looks, in order, for: a complete ``root/<folder>``; ``root`` itself being that folder; the
    archive (``root/cifar-10-python.tar.gz`` or ``root/cifar-100-python.tar.gz``, checked against
    the official MD5, then extracted);
    finally, when ``download`` is true, downloads ``url`` (default: the official URL; a mirror must
    serve the identical file) into ``root``. ``root`` defaults to :func:`default_data_dir`.
    Raises DatasetUnavailable with step-by-step instructions when none of that works.
    """
    spec = _spec(name)
    root = Path(root).expanduser() if root is not None else default_data_dir()
    url = url or spec.url
    for folder in (root / spec.folder, root):
        if is_complete(folder, name):
            return folder
    valid = lambda p: is_complete(p, name)               # noqa: E731
    try:
        local = root / spec.archive
        if local.is_file():
            got = md5sum(local)
            if got != spec.md5:
                raise DatasetUnavailable(f"{local} has MD5 {got}, but the official {spec.archive} has "
                                         f"{spec.md5}: it is corrupt or incomplete; delete it and run again")
            return extract_tar(local, root, spec.folder, valid)
        if not download:
            raise DatasetUnavailable(_instructions(spec, root, url, "downloading is turned off"))
        return download_archive(url, root, spec.md5, spec.folder, valid, progress=progress)
    except (DownloadError, OSError) as exc:       # no network, HTTP error, bad checksum, read-only root
        raise DatasetUnavailable(_instructions(spec, root, url, f"could not be fetched: {exc}")) from exc


def _class_names(path, key: str) -> list:
    """The class names a meta file lists under ``key``."""
    meta = read_cifar_batch(path)
    if key not in meta:
        raise DataFormatError(f"{path}: missing key {key!r}")
    if not isinstance(meta[key], list) or not meta[key] or not all(isinstance(c, (str, bytes)) for c in meta[key]):
        raise DataFormatError(f"{path}: {key!r} must be a list of names: {NOT_GENUINE}")
    return [_str(c) for c in meta[key]]


def load_cifar10(root=None, download: bool = True, url: Optional[str] = None,
                 progress: bool = True) -> ImageDataset:
    """CIFAR-10: 50,000 train + 10,000 test images (3, 32, 32) uint8 in 10 classes.

    root: the data folder that holds (or will hold) ``cifar-10-batches-py``; see :func:`ensure_cifar`.
    """
    folder = ensure_cifar("cifar10", root, url=url, download=download, progress=progress)
    spec = CIFAR["cifar10"]
    classes = _class_names(folder / spec.meta_file, "label_names")
    splits = {}
    for split, files in (("train", spec.train_files), ("test", spec.test_files)):
        parts = [_images_and_labels(read_cifar_batch(folder / f), folder / f, "labels", len(classes)) for f in files]
        splits[split] = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    return ImageDataset("cifar10", *splits["train"], *splits["test"], classes=classes,
                        mean=CIFAR10_MEAN, std=CIFAR10_STD, info={"folder": str(folder)})


def load_cifar100(root=None, download: bool = True, url: Optional[str] = None, label: str = "fine",
                  progress: bool = True) -> ImageDataset:
    """CIFAR-100: 50,000 train + 10,000 test images (3, 32, 32) uint8.

    label: "fine" (100 classes, the usual benchmark) or "coarse" (20 superclasses).
    """
    if label not in ("fine", "coarse"):
        raise ValueError(f"label must be 'fine' or 'coarse', got {label!r}")
    folder = ensure_cifar("cifar100", root, url=url, download=download, progress=progress)
    spec = CIFAR["cifar100"]
    classes = _class_names(folder / spec.meta_file, f"{label}_label_names")
    train = _images_and_labels(read_cifar_batch(folder / "train"), folder / "train", f"{label}_labels", len(classes))
    test = _images_and_labels(read_cifar_batch(folder / "test"), folder / "test", f"{label}_labels", len(classes))
    return ImageDataset("cifar100" if label == "fine" else "cifar100-coarse", *train, *test, classes=classes,
                        mean=CIFAR100_MEAN, std=CIFAR100_STD, info={"folder": str(folder), "label": label})
