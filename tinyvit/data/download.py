"""Downloading and unpacking datasets safely, with nothing but the standard library.

The rules every function here keeps:

1. A download streams into a temporary file in the *destination* folder (same filesystem), is
   checked (length, MD5) and only then renamed into place: a crash never leaves a file that looks done.
2. An archive is unpacked into a temporary folder next to the target and the finished folder is
   renamed into place in one ``os.replace``: a failed or interrupted extraction leaves no half folder.
3. A tar member with an absolute path, a ``..`` component, or that is a link or a device is refused
   before anything is written (the "tar slip" attack).
4. Running again is a no-op once the target folder is complete.

Errors are :class:`~tinyvit.data.errors.DownloadError` and name the URL or file involved.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zlib
from pathlib import Path, PurePosixPath
from typing import Callable, Optional

from .errors import DownloadError

CHUNK = 1 << 20          # read and hash 1 MiB at a time


def default_data_dir() -> Path:
    """Where datasets are cached: ``$TINYVIT_DATA`` if set, else ``~/.cache/tinyvit/data``."""
    env = os.environ.get("TINYVIT_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tinyvit" / "data"


def md5sum(path) -> str:
    """The hex MD5 digest of a file, read in 1 MiB chunks."""
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def apply_umask(path) -> None:
    """Give a file made by ``tempfile`` (mode 0600) the permissions a normal ``open`` would have."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _remove(path) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def fetch(url: str, dest_dir, md5: Optional[str] = None, timeout: float = 60.0,
          progress: bool = False) -> Path:
    """Stream ``url`` into a new temporary file inside ``dest_dir`` and return its path.

    The caller owns the returned file (rename it into place or delete it). On any failure (HTTP
    error, connection error, a body shorter than its Content-Length, an MD5 mismatch) the temporary
    file is removed and a DownloadError naming the URL is raised.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=".tinyvit-download-", suffix=".part")
    done = False
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "tinyvit"})
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(request, timeout=timeout) as resp:
            total = resp.headers.get("Content-Length")
            total = int(total) if total and total.isdigit() else None
            h, received, last_shown = hashlib.md5(usedforsecurity=False), 0, -1
            for chunk in iter(lambda: resp.read(CHUNK), b""):
                out.write(chunk)
                h.update(chunk)
                received += len(chunk)
                if progress and total:
                    pct = 100 * received // total
                    if pct // 5 != last_shown:
                        last_shown = pct // 5
                        print(f"\rdownloading {url}: {received / 1e6:.1f} / {total / 1e6:.1f} MB ({pct}%)",
                              end="", file=sys.stderr, flush=True)
            if progress and total:
                print(file=sys.stderr)
        if total is not None and received != total:
            raise DownloadError(f"download of {url} is truncated: got {received} of {total} bytes")
        if md5 is not None and h.hexdigest() != md5.lower():
            raise DownloadError(f"checksum mismatch for {url}: expected MD5 {md5.lower()}, got "
                                f"{h.hexdigest()} ({received} bytes). The file is corrupt or not the "
                                "official one; nothing was kept")
        apply_umask(tmp)
        done = True
        return Path(tmp)
    except urllib.error.HTTPError as exc:
        raise DownloadError(f"could not download {url}: HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise DownloadError(f"could not download {url}: {reason}") from exc
    finally:
        if not done:
            _remove(tmp)


def download_file(url: str, dest, md5: Optional[str] = None, timeout: float = 60.0,
                  progress: bool = False) -> Path:
    """Download ``url`` to the file ``dest`` (checked against ``md5`` when given) and return ``dest``.

    Skips the download when ``dest`` already exists and matches ``md5`` (or exists, when md5 is None).
    """
    dest = Path(dest)
    if dest.is_file() and (md5 is None or md5sum(dest) == md5.lower()):
        return dest
    tmp = fetch(url, dest.parent, md5=md5, timeout=timeout, progress=progress)
    try:
        os.replace(tmp, dest)
    finally:
        _remove(tmp)
    return dest


def check_tar_member(member: tarfile.TarInfo, archive, folder: Optional[str] = None) -> None:
    """Refuse a tar member that could write outside the extraction folder or is not a plain file.

    Refused: absolute paths (``/etc/passwd``), any ``..`` component, symlinks, hard links, devices,
    and (when ``folder`` is given) anything outside the top-level ``folder``.
    """
    name = member.name
    parts = PurePosixPath(name.replace("\\", "/")).parts
    why = None
    if name.startswith(("/", "\\")) or PurePosixPath(name).is_absolute() or (len(name) > 1 and name[1] == ":"):
        why = "it has an absolute path"
    elif ".." in parts:
        why = "it has a '..' component"
    elif not (member.isfile() or member.isdir()):
        why = "it is not a regular file or folder (link or device)"
    elif folder is not None and (not parts or parts[0] != folder):
        why = f"it is outside the expected top-level folder {folder!r}"
    if why:
        raise DownloadError(f"{archive}: refusing to extract member {name!r}: {why}")


def extract_tar(archive, dest_dir, folder: str,
                is_valid: Optional[Callable[[Path], bool]] = None) -> Path:
    """Unpack the .tar.gz ``archive``, whose single top-level folder is ``folder``, into ``dest_dir``.

    The members are checked (:func:`check_tar_member`) before anything is written, unpacked into a
    temporary folder inside ``dest_dir``, checked with ``is_valid`` and renamed to
    ``dest_dir/folder`` in one step. Returns ``dest_dir/folder``. A truncated or corrupt archive
    raises DownloadError and leaves nothing behind.
    """
    dest_dir, target = Path(dest_dir), Path(dest_dir) / folder
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmpdir = Path(tempfile.mkdtemp(dir=dest_dir, prefix=f".{folder}.extracting-"))
    try:
        try:
            with tarfile.open(archive, "r:gz") as tar:
                members = tar.getmembers()            # reads the whole archive: finds truncation early
                for member in members:
                    check_tar_member(member, archive, folder)
                if hasattr(tarfile, "data_filter"):   # Python >= 3.11.4: a second line of defence
                    tar.extractall(tmpdir, members, filter="data")
                else:
                    tar.extractall(tmpdir, members)
        except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
            raise DownloadError(f"{archive} is truncated or not a valid .tar.gz archive ({exc!r}); "
                                "nothing was extracted") from exc
        unpacked = tmpdir / folder
        if not unpacked.is_dir():
            raise DownloadError(f"{archive} does not contain the folder {folder!r}")
        if is_valid is not None and not is_valid(unpacked):
            raise DownloadError(f"{archive} unpacked to an incomplete {folder!r} (files are missing)")
        try:
            os.replace(unpacked, target)              # atomic; fails if target is a non-empty folder
        except OSError:
            if not (target.is_dir() and (is_valid is None or is_valid(target))):
                raise DownloadError(f"could not move the extracted folder into {target}: it exists "
                                    "and is incomplete; remove it and try again") from None
        return target                                 # (another process may have finished first)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def download(url: str, dest_dir, md5: Optional[str], folder: str,
             is_valid: Optional[Callable[[Path], bool]] = None, timeout: float = 60.0,
             progress: bool = False) -> Path:
    """Make ``dest_dir/folder`` exist by downloading and unpacking the .tar.gz at ``url``.

    A no-op when the folder is already there and ``is_valid`` accepts it. Otherwise the archive is
    streamed to a temporary file in ``dest_dir``, checked against ``md5``, unpacked with
    :func:`extract_tar`, and the temporary file deleted. On failure nothing new is left in
    ``dest_dir`` (no folder, no partial files) and DownloadError is raised.

    >>> download("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "data",
    ...          "c58f30108f718f92721af3b95e74349a", "cifar-10-batches-py")   # doctest: +SKIP
    PosixPath('data/cifar-10-batches-py')
    """
    target = Path(dest_dir) / folder
    if target.is_dir():
        if is_valid is None or is_valid(target):
            return target
        raise DownloadError(f"{target} exists but is incomplete; remove it and run again")
    archive = fetch(url, dest_dir, md5=md5, timeout=timeout, progress=progress)
    try:
        return extract_tar(archive, dest_dir, folder, is_valid)
    finally:
        _remove(archive)
