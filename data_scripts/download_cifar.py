"""Download, verify (MD5) and unpack CIFAR-10 or CIFAR-100 into a data folder, then load it once.

    python data_scripts/download_cifar.py --dataset cifar10 --root ~/data
    python data_scripts/download_cifar.py --dataset cifar100 --root ~/data --url https://mirror/cifar-100-python.tar.gz

Afterwards train with ``--data-dir ~/data``. Safe to re-run: a complete folder is left as it is.
On a machine without internet access, copy cifar-10-python.tar.gz (or the extracted
cifar-10-batches-py folder) into the root folder and run this script to check it.
"""
import argparse
import sys

from tinyvit.data import DataError, ensure_cifar, load_dataset


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["cifar10", "cifar100"], required=True)
    parser.add_argument("--root", required=True, help="data folder that will hold the extracted dataset")
    parser.add_argument("--url", default=None, help="a mirror of the official archive (same MD5)")
    args = parser.parse_args(argv)
    try:
        folder = ensure_cifar(args.dataset, args.root, url=args.url, download=True)
        ds = load_dataset(args.dataset, root=args.root, download=False)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{folder}: {ds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
