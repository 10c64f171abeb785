"""Any {name: array} to and from one .safetensors file: the bottom layer of tinyvit.io.

    save_arrays(path, arrays, metadata)     written atomically (temporary file, fsync, rename)
    write_bytes_atomically(path, data)      any other file the same way (config.json, curves.png)
    append_text(path, text)                 a line onto a log (metrics.jsonl), never through a link
    leftover_temporary_files(directory)     what a killed write left there (its owner removes them)
    load_arrays(path) -> (arrays, metadata)
    read_header(path) -> ({name: (dtype, shape)}, metadata)    no array read (checks before loading)

No write follows a symbolic link: files are created with O_CREAT | O_EXCL | O_NOFOLLOW and put in
place by a rename, which replaces a link and never what it points to, and an append refuses a
link (a run writes nothing outside its folder, whatever links someone left in it).

Also the small file helpers the other modules share: ``check_file`` (clear errors for a missing
path, a directory, a pipe or device, or an unreadable file), ``parse_json`` (metadata JSON of a
bounded depth), ``_sniff`` (a file's kind from its first bytes) and ``_contiguous``.
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
import uuid
import zipfile
from collections.abc import Mapping

import numpy as np

from .. import backend


def _safetensors():
    """The safetensors package, imported on first use (it is an optional dependency)."""
    try:
        import safetensors
        import safetensors.numpy
    except ImportError as exc:  # pragma: no cover - the test environment has it
        raise ImportError("checkpoints need the safetensors package: pip install safetensors "
                          "(or pip install 'tinyvit[test]')") from exc
    return safetensors


def _contiguous(array) -> np.ndarray:
    """A C-contiguous array (np.ascontiguousarray would turn a 0-d array into 1-d)."""
    return np.asarray(array, order="C")


def _host_array(value) -> np.ndarray:
    """A C-contiguous NumPy array from a NumPy/CuPy array or a Tensor (safetensors needs host bytes)."""
    from ..autograd import Tensor
    value = value.data if isinstance(value, Tensor) else value
    return _contiguous(backend.to_numpy(value))


def _write_safetensors(path: str, arrays: dict, metadata: dict) -> None:
    """Write ``arrays`` and ``metadata`` to ``path`` in the safetensors format (the one writer
    ``save_arrays`` uses; tests replace it to simulate a crash halfway through). safetensors reports
    a failed write (a full disk, ...) as text, "... No space left on device (os error 28) ...": it
    becomes the OSError it was, errno included."""
    st = _safetensors()
    try:
        st.numpy.save_file(arrays, path, metadata=metadata)
    except st.SafetensorError as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from exc


def _fsync_directory(directory: str) -> None:
    """Make a rename inside ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_arrays(path, arrays: Mapping, metadata: Mapping | None = None) -> None:
    """Write ``{name: array}`` and string ``metadata`` to a .safetensors file, atomically.

    Arrays may be NumPy or CuPy arrays or Tensors; they are copied to the host. The file is first
    written to a temporary file in the same directory, flushed and fsynced, and only then renamed
    onto ``path`` (``os.replace`` is atomic), so ``path`` always holds either the old file or the
    complete new one, never a torn mix. On any error the temporary file is removed; a full disk is
    an OSError that says so and names the folder.
    """
    path = os.fspath(path)
    host = {}
    for name, value in arrays.items():
        if not isinstance(name, str):
            raise TypeError(f"save_arrays: array names must be strings, got {name!r}")
        host[name] = _host_array(value)
    metadata = dict(metadata or {})
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"save_arrays: metadata must map str to str, got {key!r}: {value!r} "
                            "(encode other values with json.dumps)")

    def write(tmp):
        _write_safetensors(tmp, host, metadata)
        os.chmod(tmp, mode)                  # safetensors renames its own 0600 temporary file onto ours
        with open(tmp, "rb+") as f:          # the bytes are on disk before the rename makes them visible
            os.fsync(f.fileno())

    fd, tmp, mode = _claim_temporary(path)
    os.close(fd)
    _put_in_place(path, tmp, write)


def write_bytes_atomically(path, data: bytes) -> None:
    """Replace ``path`` by a file holding ``data``, atomically (as ``save_arrays``): readers see the
    old file or the new one, and a link at ``path`` is replaced, never written through."""
    def write(tmp):
        with os.fdopen(fd, "wb") as f:               # the temporary file, as created
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    fd, tmp, _ = _claim_temporary(path)
    _put_in_place(os.fspath(path), tmp, write)


def append_text(path, text: str) -> None:
    """Append ``text`` to ``path``, creating it (mode 0o666 & ~umask) if it is not there. A symbolic
    link at ``path`` is refused (OSError ELOOP naming it): an append cannot replace it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o666)
    except OSError as exc:
        raise _link_error(path, exc) from None
    with os.fdopen(fd, "a") as f:
        f.write(text)


# O_NOFOLLOW: opening a path whose last part is a symbolic link fails (ELOOP) instead of opening
# what it points to; O_CLOEXEC keeps the descriptor from processes started meanwhile. (Windows has
# neither, nor symbolic links an ordinary user can make.)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _link_error(path, exc: OSError) -> OSError:
    """``exc``, or for the ELOOP of O_NOFOLLOW an error that says a link was refused and why."""
    if exc.errno != errno.ELOOP or not os.path.islink(path):
        return exc
    return OSError(errno.ELOOP, f"{path} is a symbolic link (to {os.readlink(path)}); tinyvit writes only "
                                "files of its own there and never through a link: remove the link")


def _claim_temporary(path) -> tuple:
    """(open descriptor, name, mode) of a new, empty temporary file beside ``path``, named as
    TEMPORARY_NAME says (so a killed write's is found and removed), created O_EXCL | O_NOFOLLOW:
    never a file or link already there. Its mode is 0o666 & ~umask, what open() gives every file."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot save {path}: the directory {directory} does not exist")
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666)
    return fd, tmp, os.fstat(fd).st_mode & 0o777


def _put_in_place(path: str, tmp: str, write) -> None:
    """``write(tmp)``, then rename ``tmp`` onto ``path`` (atomic; a link there is replaced, not
    followed) and make the rename durable. On any error the temporary file is removed; a full disk
    is an OSError that says so and names the folder."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as exc:             # KeyboardInterrupt too: never leave the temporary file
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(f"cannot save {path}: the disk holding {directory} is full (or your quota there is "
                          "used up); free some space or save elsewhere (any file already at that path is "
                          "unchanged)") from exc
        raise
    _fsync_directory(directory)


# The temporary files of a save_arrays killed mid-write (its ``except`` never ran, so they stayed):
# its own ".NAME.<12 hex digits>.tmp", and the ".tmp<6 letters or digits>" that safetensors (Rust's
# tempfile crate) writes before renaming it onto ours.
TEMPORARY_NAME = re.compile(r"\..+\.[0-9a-f]{12}\.tmp|\.tmp[A-Za-z0-9]{6}")


def leftover_temporary_files(directory) -> list[str]:
    """The paths of the temporary files killed writes left in ``directory`` (sorted). Only the
    folder's owner may remove them (a write in progress has the same names): the training loop does, at
    the start of a run, holding the run folder's lock."""
    return sorted(entry.path for entry in os.scandir(directory)
                  if TEMPORARY_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False))


# Metadata JSON may nest this deep (ours nests 5 levels). Python's parser recurses once per level, so
# 100,000 levels are a RecursionError; deeper than this is refused before parsing.
MAX_JSON_DEPTH = 64
_JSON_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')        # a string (skipped), or a bracket


def check_json_depth(text: str, what: str) -> None:
    """Raise ValueError naming ``what`` when ``text`` nests JSON arrays or objects more than
    MAX_JSON_DEPTH levels deep (brackets inside strings do not count)."""
    depth = 0
    for match in _JSON_NESTING.finditer(text):
        bracket = match.group()
        if bracket in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"{what} is JSON nested more than {MAX_JSON_DEPTH} levels deep, which no file tinyvit "
                                 "writes has: the file is damaged or crafted")
        elif bracket in "]}":
            depth -= 1


def parse_json(text: str, what: str):
    """``json.loads(text)`` for metadata: a ValueError naming ``what`` for text that is not JSON or is
    nested too deep (check_json_depth)."""
    check_json_depth(text, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON ({exc}): the file is damaged or was edited") from None


def check_file(path: str, what: str = "file") -> None:
    """Clear errors for a path that cannot be read as a file: missing, a directory, not a regular
    file (reading a named pipe waits for a writer forever, /dev/zero never ends), or unreadable
    (which safetensors would report as missing)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"{what} not found: {path}") from None
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"{what} {path} is a directory, not a file; give the path of a file in it")
    if not stat.S_ISREG(mode):
        raise ValueError(f"{what} {path} is not a regular file (a named pipe, socket or device); give the path "
                         "of a file on disk")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"cannot read {path}: permission denied; make it readable (chmod +r) or "
                              "ask its owner for a copy")



def _sniff(path: str) -> str:
    """'safetensors', 'npz', 'pickle' or 'unknown', from the file's first bytes (not its name)."""
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:2] == b"PK":                                      # a zip: .npz, or torch.save's zip pickle
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except zipfile.BadZipFile:
            return "unknown"
        if names and all(n.endswith(".npy") for n in names):
            return "npz"
        return "pickle" if any(n.endswith(".pkl") for n in names) else "unknown"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):   # a pickle, protocol 2-5
        return "pickle"
    if len(head) == 9 and head[8:9] == b"{":                   # safetensors: u64 header length, then JSON
        return "safetensors"
    return "unknown"


def load_arrays(path) -> tuple[dict, dict]:
    """Read a .safetensors file: ({name: numpy array}, {metadata key: str}). BF16 arrays (NumPy
    has no bfloat16) come back as float32 of the same values; every other dtype as stored.

    Raises FileNotFoundError naming a missing file, and ValueError("... is truncated or corrupted")
    for a file whose header or length is not valid safetensors."""
    path = os.fspath(path)
    check_file(path)
    st = _safetensors()
    try:
        with st.safe_open(path, framework="numpy") as f:        # checks the header against the file
            metadata = dict(f.metadata() or {})
            names = list(f.keys())
            bf16 = _read_bfloat16(path, [n for n in names if f.get_slice(n).get_dtype() == "BF16"])
            arrays = {name: bf16[name] if name in bf16 else f.get_tensor(name) for name in names}
    except st.SafetensorError as exc:
        raise _not_safetensors(path, exc) from exc
    return arrays, metadata


def _read_bfloat16(path: str, names) -> dict:
    """{name: float32 array} for the BF16 arrays ``names`` of a safetensors file safe_open has checked.
    A bfloat16 is the high half of the float32 of the same value, so its 16 bits shifted into the
    high half of a uint32 and viewed as float32 are that value, exactly."""
    if not names:
        return {}
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")            # the format: u64 header length, JSON, raw data
        header = json.loads(f.read(size))
        out = {}
        for name in names:
            start, end = header[name]["data_offsets"]
            f.seek(8 + size + start)
            bits = np.frombuffer(f.read(end - start), dtype="<u2").reshape(header[name]["shape"])
            out[name] = (bits.astype(np.uint32) << 16).view(np.float32)
    return out


def read_header(path) -> tuple[dict, dict]:
    """A .safetensors file's header alone, no array read: ({name: (dtype, shape)}, {metadata key: str}),
    dtype as the file spells it ("F32", "BF16", "I64", ...).

    safetensors checks the header when it opens the file: every array's bytes must lie inside the
    file and the arrays must fill it exactly, so the sizes read here are sizes the file really holds
    (a header that claims more is refused as truncated or corrupted, as ``load_arrays`` does)."""
    path = os.fspath(path)
    check_file(path)
    st = _safetensors()
    try:
        with st.safe_open(path, framework="numpy") as f:
            metadata = dict(f.metadata() or {})
            slices = {name: f.get_slice(name) for name in f.keys()}
            specs = {name: (s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}
    except st.SafetensorError as exc:
        raise _not_safetensors(path, exc) from exc
    return specs, metadata


def _not_safetensors(path: str, exc: Exception) -> ValueError:
    """The error for a file safetensors cannot open, naming what it is instead when we can tell."""
    kind = _sniff(path)
    if kind in ("npz", "pickle"):
        return ValueError(f"{path} is a {kind} file, not safetensors; official .npz weights load with "
                          "tinyvit.io.load_pretrained, and pickles are never loaded")
    return ValueError(f"{path} is not a valid safetensors file: it is truncated or corrupted ({exc})")
