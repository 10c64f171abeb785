"""The `tinyvit` command: the only place that parses command-line arguments.

One module per group of subcommands (models, train, ...); each has ``register(sub)`` that adds its
parsers, and small ``cmd_*`` functions that call the library, so everything is reachable from Python.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
import traceback
from pathlib import Path

from .. import __version__

class UsageError(Exception):
    """A bad flag value or config file: printed as one line, exit status 2."""


def parse_value(text: str):
    """'64' -> 64, '0.1' -> 0.1, 'true' -> True, 'none' -> None, anything else stays a string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def key_values(pairs, flag: str, example: str) -> dict:
    """Repeated KEY=VALUE flags -> {key: parsed value} (dashes in keys become underscores)."""
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise UsageError(f"{flag} needs KEY=VALUE (e.g. {example}), got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.strip().replace("-", "_")] = parse_value(value.strip())
    return out


def add_kernels_flag(p) -> None:
    """--kernels on|off, on every command that runs a model: off runs the reference ops alone
    (tinyvit/ops/), the same numbers more slowly; TINYVIT_KERNELS=0 in the environment does the same."""
    p.add_argument("--kernels", choices=("on", "off", "all"), default=None,
                   help="on: the fast kernels of tinyvit/kernels/ (the default); off: the reference ops only; "
                        "all: also the CUDA kernels not yet recorded as passed on a GPU (for testing them)")


class DeviceUnavailable(ValueError):
    """--device names a GPU this machine cannot use: one line saying why and what to do."""


def check_device(device) -> None:
    """Refuse, in one line, a --device this machine cannot run on: before any data or model is
    loaded, so that a missing CuPy or GPU is not a traceback minutes into a run."""
    name = str(device or "cpu").lower()
    if name == "cpu":
        return
    if not (name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit())):
        raise UsageError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    import importlib.util
    if importlib.util.find_spec("cupy") is None:
        raise DeviceUnavailable(f"--device {device} needs CuPy, which is not installed: in the clone, pip install -e "
                                "'.[gpu]' (CUDA 12 drivers; '.[gpu-cuda13]' for CUDA 13), or use --device cpu")
    from .. import backend
    try:
        count = backend.cupy_module().cuda.runtime.getDeviceCount()
    except Exception as exc:                  # a CUDA driver error: no GPU, or a driver too old for this CuPy
        why = str(getattr(exc, "__cause__", None) or exc).splitlines()[0]
        raise DeviceUnavailable(f"--device {device}: CuPy is installed but reaches no CUDA GPU ({why}); on a "
                                "machine without an NVIDIA GPU use --device cpu, or check `nvidia-smi`") from None
    index = int(name[5:]) if ":" in name else 0
    if index >= count:
        raise DeviceUnavailable(f"--device {device}: this machine has {count} CUDA GPU{'s' if count != 1 else ''}"
                                f"{f' (cuda:0 to cuda:{count - 1})' if count else ''}")


def model_args(pairs) -> dict:
    """--model-arg KEY=VALUE pairs: ViTConfig overrides."""
    return key_values(pairs, "--model-arg", "dim=64")


def read_toml(path) -> dict:
    """A TOML run description: top-level keys are `tinyvit train` flags (dashes or underscores),
    an optional [model] table holds ViTConfig overrides and [dataset] the dataset's options; in a
    table, `name = ...` names the model or dataset.

        epochs = 50
        [model]
        name = "vit-cifar/4"
        depth = 8
        [dataset]
        name = "cifar100"
    """
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise UsageError("--config needs Python >= 3.11 or `pip install tomli`") from None
    from ..training.recipes import INTERNAL_FIELDS
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--config: {path} is a directory; give the path of a .toml file")
    if not path.exists():
        raise UsageError(f"--config: no file at {path}")
    if not path.is_file():                           # /dev/zero never ends, a FIFO waits for a writer
        raise UsageError(f"--config: {path} is not a regular file (a pipe or device); give the path of a .toml file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise UsageError(f"--config: {path} is {path.stat().st_size} bytes, more than a run description needs "
                         f"(at most {MAX_CONFIG_BYTES}); give the path of a .toml file")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"--config {path}: not valid TOML ({exc})") from None
    out = {k.replace("-", "_"): v for k, v in data.items() if not isinstance(v, dict)}
    for key in ("model_args", "dataset_args", *INTERNAL_FIELDS):   # tables, or what a run fills in itself
        if key in out:
            where = {"model_args": "; put model settings in a [model] table",
                     "dataset_args": "; put dataset settings in a [dataset] table"}.get(key, "")
            raise UsageError(f"--config {path}: `{key}` is not a setting of a run description{where}")
    # TOML cannot hold both `model = "..."` and a [model] table: the table's `name` gives the name.
    for table, args in (("model", "model_args"), ("dataset", "dataset_args")):
        if isinstance(data.get(table), dict):
            options = dict(data[table])
            if "name" in options:
                out[table] = options.pop("name")
            out[args] = options
    unknown = [k for k, v in data.items() if isinstance(v, dict) and k not in ("model", "dataset")]
    if unknown:
        raise UsageError(f"--config {path}: unknown tables {unknown} (known: [model], [dataset])")
    return out


# A --config file larger than this is no run description (a few hundred bytes are).
MAX_CONFIG_BYTES = 1 << 20

# One module per group of subcommands, in the order `tinyvit --help` lists them.
COMMAND_GROUPS = ("models", "train", "predict", "pretrain", "inspect", "export", "bench")


class HelpFormatter(argparse.HelpFormatter):
    """--help that states each flag's default: "(default: X)" after the help of a flag that has one,
    unless the help says it already (the training flags say where an unset value comes from)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or action.default in (None, False, argparse.SUPPRESS) or "default" in text
                or isinstance(action, argparse._VersionAction)):
            return text
        return f"{text} (default: {action.default})".strip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tinyvit",
        description="The Vision Transformer (Dosovitskiy et al., 2020) from scratch on NumPy/CuPy.")
    parser.add_argument("--version", action="version", version=f"tinyvit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    import importlib
    for group in COMMAND_GROUPS:
        importlib.import_module(f"{__name__}.{group}").register(sub)
    for command in sub.choices.values():
        command.formatter_class = HelpFormatter
    return parser


def report(message: str) -> None:
    """Print a one-line error to stderr. Under mpirun, a rank other than 0 first waits a moment
    (distributed.OTHER_RANKS_WAIT_SECONDS): a bad flag or a missing dataset fails every rank alike,
    and rank 0, reporting at once, ends the job (mpirun stops the others) before they repeat it;
    a failure of that rank alone is reported after the wait, naming the rank."""
    _after_rank_0()
    print(message, file=sys.stderr, flush=True)


def _after_rank_0() -> None:
    from ..distributed import OTHER_RANKS_WAIT_SECONDS, launched_rank, launched_size
    if launched_size() > 1 and launched_rank() != 0:
        time.sleep(OTHER_RANKS_WAIT_SECONDS)


def _parse(parser, argv):
    """parser.parse_args(argv); on a rank other than 0 (mpirun) its output held back: --help once,
    and a usage error, which rank 0 reports too, printed only after the wait (report)."""
    from ..distributed import launched_rank, launched_size
    if launched_size() <= 1 or launched_rank() == 0:
        return parser.parse_args(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            report(err.getvalue().rstrip())
        raise


def main(argv=None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    if args.command is None:
        parser.print_help()
        return 0
    from .. import distributed
    from ..backend import DeviceUnavailable
    from ..data import DataError
    if getattr(args, "kernels", None) in ("on", "off", "all") and args.command != "bench":   # bench: per path
        from ..kernels import use_kernels
        use_kernels({"on": True, "off": False, "all": "all"}[args.kernels])
    ranks = distributed.rank_prefix()          # "rank R: " in one of several processes (mpirun), else ""
    try:
        if getattr(args, "device", None) is not None:
            check_device(args.device)
        status = args.func(args)
    except UsageError as exc:
        sys.exit(_failed(2, f"tinyvit {args.command}: error: {ranks}{exc}"))      # as parser.exit would
    except BrokenPipeError:
        # The reader went away (`tinyvit models | head`): stop quietly, and point stdout at devnull
        # so that Python's own flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (DataError, OSError, ValueError, DeviceUnavailable,           # OSError: a missing file, a full disk
            distributed.DistributedError) as exc:
        return _failed(1, f"tinyvit {args.command}: {ranks}{exc}")
    except MemoryError as exc:           # NumPy's names the array: "Unable to allocate 1.7 EiB for an array with shape"
        what = str(exc) or "an allocation failed"
        return _failed(1, f"tinyvit {args.command}: {ranks}out of memory: {what}; ask for less (a smaller model or "
                          "image size, a smaller --batch-size or --eval-batch-size, fewer images) or free some memory")
    except Exception as exc:             # a bug: its traceback; among several ranks, then the others stopped
        if not ranks:
            raise
        _after_rank_0()
        traceback.print_exc()
        return _failed(1, f"tinyvit {args.command}: {ranks}{type(exc).__name__}: {exc}")
    if status:                           # stopped by a signal, diverged, ...: the other ranks must stop too
        distributed.abort_if_running(status)
    return status


def _failed(status: int, message: str) -> int:
    """Print the one-line error and return ``status``. In a data-parallel run whose ranks have
    joined (MPI started), end them all first (MPI_Abort): the others may be waiting for this one in
    a collective, and would wait forever."""
    from .. import distributed
    report(message)
    distributed.abort_if_running(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
