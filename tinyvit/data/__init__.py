"""Datasets, batching and augmentation. Produces plain NumPy/CuPy arrays; knows nothing of autograd.

    ds = load_dataset("cifar10", root="~/data")          # ImageDataset: uint8 NCHW arrays + metadata
    ds = load_dataset("photos/")                         # your images: photos/<class>/*.jpg (folder.py)
    train_tf = Augment(ds.mean, ds.std, ds.num_classes, crop_padding=4, flip=True, randaug_n=2,
                       mixup_alpha=0.8, cutmix_alpha=1.0, seed=0)
    loader = DataLoader(ds.train_images, ds.train_labels, 128, shuffle=True, seed=0, drop_last=True,
                        device="cuda", transform=train_tf)
    for x, y in loader:        # x: (128, 3, 32, 32) float32 normalised; y: (128, 10) soft targets
        ...
"""
from __future__ import annotations

from .augment import (Augment, cutmix, horizontal_flip, mixup, normalize, one_hot, random_crop,
                      random_erasing)
from .cifar import SafeUnpickler, ensure_cifar, load_cifar10, load_cifar100, read_cifar_batch
from .dataset import ImageDataset
# download.py's download(url, dest_dir, md5, folder) is not re-exported, so that tinyvit.data.download
# stays the module: `from tinyvit.data.download import download`.
from .download import default_data_dir, download_file, extract_tar, md5sum
from .errors import (DataError, DataFileMissing, DataFormatError, DatasetUnavailable, DownloadError,
                     UnsafePickleError)
from .folder import find_layout, is_folder_name, load_image_folder
from .images import IMAGE_EXTENSIONS, RESIZE_MODES, ImageError, Preparation, open_image, prepare
from .fashion_mnist import (ensure_fashion_mnist, load_fashion_mnist, prepare_fashion_mnist, read_idx,
                            write_idx)
from .loader import DataLoader, to_float
from .randaugment import RandAugment
from .synthetic import make_synthetic

DATASETS = ("cifar10", "cifar100", "fashion-mnist", "synthetic")
# Every spelling load_dataset takes for a built-in dataset; any other name is a folder's path.
DATASET_KEYS = ("cifar10", "cifar-10", "cifar100", "cifar-100", "fashion-mnist", "fashionmnist", "fmnist", "synthetic")


def load_dataset(name: str, root=None, download: bool = True, **kw) -> ImageDataset:
    """Load a dataset by name: "cifar10" | "cifar100" | "fashion-mnist" | "synthetic", or any other
    string as the path of a folder of images, one sub-folder per class (:func:`load_image_folder`).

    root: the data folder (default ``$TINYVIT_DATA`` or ``~/.cache/tinyvit/data``); download: fetch
    what is missing. Extra keywords go to the loader: ``url=`` for CIFAR, ``label="coarse"`` for
    CIFAR-100, ``base_url=`` for Fashion-MNIST, the sizes/seed of :func:`make_synthetic`, and
    ``image_size=``, ``channels=``, ``val_fraction=``, ``seed=`` for a folder.
    """
    if is_folder_name(name):
        return load_image_folder(name, **kw)
    key = name.lower().replace("_", "-")
    if key in ("cifar10", "cifar-10"):
        return load_cifar10(root, download=download, **kw)
    if key in ("cifar100", "cifar-100"):
        return load_cifar100(root, download=download, **kw)
    if key in ("fashion-mnist", "fashionmnist", "fmnist"):
        return load_fashion_mnist(root, download=download, **kw)
    if key == "synthetic":
        return make_synthetic(**kw)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


__all__ = [
    "ImageDataset", "load_dataset", "DATASETS",
    "load_cifar10", "load_cifar100", "ensure_cifar", "read_cifar_batch", "SafeUnpickler",
    "load_fashion_mnist", "ensure_fashion_mnist", "prepare_fashion_mnist", "read_idx", "write_idx",
    "make_synthetic", "load_image_folder", "find_layout", "is_folder_name", "DATASET_KEYS",
    "open_image", "prepare", "Preparation", "ImageError", "IMAGE_EXTENSIONS", "RESIZE_MODES",
    "default_data_dir", "download_file", "extract_tar", "md5sum",
    "DataLoader", "to_float",
    "Augment", "RandAugment", "normalize", "random_crop", "horizontal_flip", "random_erasing",
    "mixup", "cutmix", "one_hot",
    "DataError", "DataFileMissing", "DataFormatError", "DatasetUnavailable", "DownloadError",
    "UnsafePickleError",
]
