"""The `tinyvit` command. The only place that parses command-line arguments."""
from __future__ import annotations

import argparse
import sys

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tinyvit",
        description="The Vision Transformer (Dosovitskiy et al., 2020) from scratch on NumPy/CuPy.")
    parser.add_argument("--version", action="version", version=f"tinyvit {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
