"""Fashion-MNIST (Xiao, Rasul & Vollgraf, 2017): 70,000 greyscale 28x28 images of 10 kinds of clothing.

It ships as four IDX files, gzipped or not:

    train-images-idx3-ubyte(.gz)  (60000, 28, 28) uint8     train-labels-idx1-ubyte(.gz)  (60000,) uint8
    t10k-images-idx3-ubyte(.gz)   (10000, 28, 28) uint8     t10k-labels-idx1-ubyte(.gz)   (10000,) uint8

The IDX format (LeCun's, from MNIST) is a 4-byte magic number ``0, 0, dtype code, ndim``, then
``ndim`` big-endian uint32 sizes, then the values in C order, big-endian. A file is read as its
header says and no further: the data it declares, at most ``MAX_IDX_BYTES``, so a small gzip file
that inflates to gigabytes (a "gzip bomb") is refused after reading what the header declares.

Where the files are looked for (the first folder holding all four wins): ``root/fashion-mnist``,
``root`` itself; with no root, ``$TINYVIT_DATA/fashion-mnist`` (default ``~/.cache/tinyvit/data``)
and Debian's ``/usr/share/datasets/fashion-mnist`` (``apt-get install dataset-fashion-mnist``).
Otherwise they are downloaded (official URLs, MD5-checked) into ``<root or cache>/fashion-mnist``.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import tempfile
import zlib
from pathlib import Path
from typing import Optional

import numpy as np

from .dataset import FASHION_MNIST_MEAN, FASHION_MNIST_STD, ImageDataset
from .download import apply_umask, default_data_dir, download_file
from .errors import DataFileMissing, DataFormatError, DatasetUnavailable, DownloadError

CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
BASE_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")      # Debian's dataset-fashion-mnist package
FOLDER = "fashion-mnist"

# name -> (MD5 of the official .gz, MD5 of the decompressed IDX file). The first is what the
# download checks; the second identifies the content whoever compressed it (Debian re-gzips).
FILES = {
    "train-images-idx3-ubyte": ("8d4fb7e6c68d591d4c3dfef9ec88bf0d", "f4a8712d7a061bf5bd6d2ca38dc4d50a"),
    "train-labels-idx1-ubyte": ("25c81989df183df01b3e8a0aad5dffbe", "9018921c3c673c538a1fc5bad174d6f9"),
    "t10k-images-idx3-ubyte": ("bef4ecab320f06d8554ea6380940ec79", "8181f5470baa50b63fa0f6fddb340f0a"),
    "t10k-labels-idx1-ubyte": ("bb300cfdad3c16e7a12a480ee83cd310", "15d484375f8d13e6eb1aabb0c3f46965"),
}
SPLITS = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}

IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
# The most data an IDX file may declare: the largest Fashion-MNIST file (the training images) holds
# 47 MB; a header that declares more is refused before anything is read.
MAX_IDX_BYTES = 64 << 20


# ----------------------------------------------------------------------------- the IDX format

def _read_bytes(path) -> bytes:
    """The file's bytes (decompressed when it is gzipped, detected by its magic bytes 1f 8b), read as
    far as its IDX header says and no further: a header that declares more than MAX_IDX_BYTES, or
    data that go on past what it declares, is a DataFormatError (the rest is never decompressed)."""
    path = Path(path)
    if not path.is_file():
        raise DataFileMissing(f"IDX file {path} does not exist")
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
    try:
        with (gzip.open(path, "rb") if gzipped else open(path, "rb")) as f:
            head = f.read(4)
            ndim = head[3] if len(head) == 4 else 0
            head += f.read(4 * ndim)
            declared = _declared_bytes(head, path)          # None: no valid header (parse_idx says why)
            body = f.read(min(declared, MAX_IDX_BYTES) if declared is not None else 0)
            if declared is not None and f.read(1):
                shape = tuple(int(d) for d in np.frombuffer(head, ">u4", ndim, 4))
                raise DataFormatError(f"{path}: more data than its header declares (shape {shape}: {declared} bytes); "
                                      "not a Fashion-MNIST file, or damaged: delete it and download it again")
    except (OSError, EOFError, zlib.error) as exc:      # BadGzipFile, truncated stream
        raise DataFormatError(f"{path}: corrupt or truncated gzip data ({exc})") from exc
    return head + body


def _declared_bytes(head: bytes, path):
    """The bytes of data an IDX header declares (None for a header parse_idx will refuse); more than
    MAX_IDX_BYTES is a DataFormatError."""
    if len(head) < 4 or head[:2] != b"\0\0" or head[2] not in IDX_DTYPES or len(head) < 4 + 4 * head[3]:
        return None
    shape = tuple(int(d) for d in np.frombuffer(head, ">u4", head[3], 4))
    declared = int(np.prod(shape, dtype=object)) * np.dtype(IDX_DTYPES[head[2]]).itemsize
    if declared > MAX_IDX_BYTES:
        raise DataFormatError(f"{path}: its header declares shape {shape} of {np.dtype(IDX_DTYPES[head[2]]).name} = "
                              f"{declared} bytes, more than any Fashion-MNIST file holds (at most {MAX_IDX_BYTES}); "
                              "not a Fashion-MNIST file, or damaged: delete it and download it again")
    return declared


def parse_idx(data: bytes, source="<bytes>") -> np.ndarray:
    """Decode IDX bytes into an array (native byte order); every inconsistency is a DataFormatError."""
    if len(data) < 4:
        raise DataFormatError(f"{source}: {len(data)} bytes, too short for an IDX header")
    zero1, zero2, code, ndim = data[:4]
    if zero1 != 0 or zero2 != 0:
        raise DataFormatError(f"{source}: bad magic number 0x{data[:4].hex()} (an IDX file starts "
                              "with two zero bytes); not an IDX file")
    if code not in IDX_DTYPES:
        raise DataFormatError(f"{source}: unknown IDX dtype code 0x{code:02x} "
                              f"(known: {', '.join(f'0x{c:02x}' for c in IDX_DTYPES)})")
    if ndim == 0 or len(data) < 4 + 4 * ndim:
        raise DataFormatError(f"{source}: header of {ndim} dimensions is missing or cut short")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(IDX_DTYPES[code])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    body = len(data) - 4 - 4 * ndim
    if body != expected:
        raise DataFormatError(f"{source}: header says shape {shape} of {dtype.name} = {expected} bytes "
                              f"of data, but the file has {body} (truncated or corrupt)")
    array = np.frombuffer(data, dtype=dtype, offset=4 + 4 * ndim).reshape(shape)
    return array.astype(dtype.newbyteorder("="))             # a writable, native-order copy


def read_idx(path) -> np.ndarray:
    """Read an IDX file (gzipped or not) into a NumPy array, validating header and length."""
    return parse_idx(_read_bytes(path), source=path)


def write_idx(path, array) -> None:
    """Write ``array`` as an IDX file (gzipped when ``path`` ends in .gz). Used by tests and tools."""
    array = np.asarray(array)
    code = {np.dtype(v).newbyteorder("=").str: k for k, v in IDX_DTYPES.items()}.get(array.dtype.str)
    if code is None:
        raise ValueError(f"IDX cannot store dtype {array.dtype}")
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    data = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    Path(path).write_bytes(gzip.compress(data) if str(path).endswith(".gz") else data)


# ----------------------------------------------------------------------------- finding the files

def _find(folder: Path, name: str) -> Optional[Path]:
    for candidate in (folder / f"{name}.gz", folder / name):
        if candidate.is_file():
            return candidate
    return None


def _complete(folder: Path) -> bool:
    return all(_find(folder, name) for name in FILES)


def _candidates(root) -> list:
    if root is not None:
        root = Path(root).expanduser()
        return [root / FOLDER, root]
    return [default_data_dir() / FOLDER, SYSTEM_DIR]


def _instructions(target: Path, base_url: str, reason: str) -> str:
    names = ", ".join(f"{n}.gz" for n in FILES)
    return (f"Fashion-MNIST is not in {target} and {reason}.\n"
            f"To provide it by hand, either download {names} from {base_url} into {target},\n"
            f"  or install Debian's copy (apt-get install dataset-fashion-mnist) and run\n"
            f"  python data_scripts/prepare_fashion_mnist.py --source {SYSTEM_DIR} --root {target.parent};\n"
            f"then run again with --data-dir {target.parent} (or set TINYVIT_DATA={target.parent}).")


def ensure_fashion_mnist(root=None, download: bool = True, base_url: Optional[str] = None,
                         progress: bool = True) -> Path:
    """Return a folder holding the four Fashion-MNIST files, downloading them if needed (see module doc)."""
    for folder in _candidates(root):
        if _complete(folder):
            return folder
    base_url = base_url or BASE_URL
    target = _candidates(root)[0]
    if not download:
        raise DatasetUnavailable(_instructions(target, base_url, "downloading is turned off"))
    try:
        for name, (gz_md5, _) in FILES.items():
            if _find(target, name) is None:
                download_file(base_url.rstrip("/") + f"/{name}.gz", target / f"{name}.gz", md5=gz_md5,
                              progress=progress)
    except (DownloadError, OSError) as exc:
        raise DatasetUnavailable(_instructions(target, base_url, f"could not be fetched: {exc}")) from exc
    return target


def _load_split(folder: Path, split: str):
    images_name, labels_name = SPLITS[split]
    images_path, labels_path = _find(folder, images_name), _find(folder, labels_name)
    if images_path is None or labels_path is None:
        raise DataFileMissing(f"{folder}: missing {images_name}(.gz) or {labels_name}(.gz)")
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3:
        raise DataFormatError(f"{images_path}: expected (N, H, W) uint8 images, got {images.dtype} {images.shape}")
    if labels.dtype != np.uint8 or labels.ndim != 1 or len(labels) != len(images):
        raise DataFormatError(f"{labels_path}: expected ({len(images)},) uint8 labels, "
                              f"got {labels.dtype} {labels.shape}")
    if labels.size and labels.max() >= len(CLASSES):
        raise DataFormatError(f"{labels_path}: label {labels.max()} outside [0, {len(CLASSES)})")
    return images[:, None], labels.astype(np.int64)             # (N, 1, H, W), (N,)


def load_fashion_mnist(root=None, download: bool = True, base_url: Optional[str] = None,
                       progress: bool = True) -> ImageDataset:
    """Fashion-MNIST: 60,000 train + 10,000 test images (1, 28, 28) uint8 in 10 classes."""
    folder = ensure_fashion_mnist(root, download=download, base_url=base_url, progress=progress)
    return ImageDataset("fashion-mnist", *_load_split(folder, "train"), *_load_split(folder, "test"),
                        classes=CLASSES, mean=FASHION_MNIST_MEAN, std=FASHION_MNIST_STD,
                        info={"folder": str(folder)})


def prepare_fashion_mnist(root=None, source=None, download: bool = True, check_md5: bool = True,
                          progress: bool = True) -> Path:
    """Put validated Fashion-MNIST files into ``root/fashion-mnist`` and return that folder.

    With ``source`` (a folder such as /usr/share/datasets/fashion-mnist), each file there is read and
    validated as IDX, compared (when ``check_md5``) with the MD5 of the official decompressed content,
    and, once all four passed, copied atomically. Without it the files are downloaded. Finally both
    splits are loaded once.
    """
    target = (Path(root).expanduser() if root is not None else default_data_dir()) / FOLDER
    if source is None:
        folder = ensure_fashion_mnist(target.parent, download=download, progress=progress)
    else:
        source, folder = Path(source).expanduser(), target
        checked = []                                   # validate all four before copying any
        for name, (_, raw_md5) in FILES.items():
            path = _find(source, name)
            if path is None:
                raise DataFileMissing(f"{source}: no {name}.gz or {name} here")
            content = _read_bytes(path)
            parse_idx(content, source=path)
            got = hashlib.md5(content, usedforsecurity=False).hexdigest()
            if check_md5 and got != raw_md5:
                raise DataFormatError(f"{path}: decompressed MD5 {got} differs from the official "
                                      f"{raw_md5}; not the official Fashion-MNIST file")
            checked.append(path)
        target.mkdir(parents=True, exist_ok=True)
        for path in checked:
            if path.resolve().parent == target.resolve():
                continue
            fd, tmp = tempfile.mkstemp(dir=target, prefix=".tinyvit-copy-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(path.read_bytes())
                apply_umask(tmp)
                os.replace(tmp, target / path.name)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
    for split in SPLITS:
        _load_split(folder, split)
    return folder
