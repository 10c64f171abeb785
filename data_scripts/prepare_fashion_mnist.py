"""Put validated Fashion-MNIST IDX files into ROOT/fashion-mnist: copied from a folder, or downloaded.

    python data_scripts/prepare_fashion_mnist.py --source /usr/share/datasets/fashion-mnist --root ~/data
    python data_scripts/prepare_fashion_mnist.py --root ~/data          # download (official URLs, MD5)

Each file is checked as IDX (magic number, dtype, dimensions, length) and, unless --no-md5-check,
against the MD5 of the official content. Afterwards train with ``--data-dir ~/data``.
(Debian and Ubuntu ship the files: apt-get install dataset-fashion-mnist.)
"""
import argparse
import sys

from tinyvit.data import DataError, load_dataset, prepare_fashion_mnist


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=None, help="folder holding the four IDX files (.gz or not)")
    parser.add_argument("--root", required=True, help="data folder; the files go to ROOT/fashion-mnist")
    parser.add_argument("--no-md5-check", action="store_true", help="accept files that differ from the official ones")
    args = parser.parse_args(argv)
    try:
        folder = prepare_fashion_mnist(args.root, source=args.source, check_md5=not args.no_md5_check)
        ds = load_dataset("fashion-mnist", root=args.root, download=False)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{folder}: {ds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
