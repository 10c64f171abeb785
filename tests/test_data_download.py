"""The downloader against a local HTTP server on 127.0.0.1: success, every failure, and cleanliness.

After any failure the destination folder must hold nothing new: no target folder, no temporary
download, no half-extracted folder.
"""
import dataclasses
import hashlib
import http.server
import io
import os
import tarfile
import threading

import numpy as np
import pytest

from tinyvit.data import (DatasetUnavailable, DownloadError, default_data_dir, download_file, ensure_cifar,
                          extract_tar, load_cifar10, load_fashion_mnist, write_idx)
from tinyvit.data.download import download
from tinyvit.data import cifar as cifar_module
from tinyvit.data import fashion_mnist as fm_module

from test_data_cifar import make_cifar_archive


class _Handler(http.server.BaseHTTPRequestHandler):
    routes = {}            # path -> int status, or (body bytes, declared Content-Length or None)
    hits = []

    def do_GET(self):
        self.hits.append(self.path)
        route = self.routes.get(self.path, 404)
        if isinstance(route, int):
            self.send_error(route)
            return
        body, declared = route
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body) if declared is None else declared))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    """(base URL, routes dict, hits list) of a server on 127.0.0.1 at a free port."""
    handler = type("Handler", (_Handler,), {"routes": {}, "hits": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler.routes, handler.hits
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def tar_gz(members) -> bytes:
    """Build a .tar.gz in memory from (TarInfo-ish dict) entries: name, data, type, linkname."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for m in members:
            info = tarfile.TarInfo(m["name"])
            info.type = m.get("type", tarfile.REGTYPE)
            info.linkname = m.get("linkname", "")
            data = m.get("data", b"")
            info.size = len(data) if info.type == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if info.type == tarfile.REGTYPE else None)
    return buf.getvalue()


PKG = [{"name": "pkg", "type": tarfile.DIRTYPE}, {"name": "pkg/a.txt", "data": b"alpha"},
       {"name": "pkg/sub", "type": tarfile.DIRTYPE}, {"name": "pkg/sub/b.bin", "data": os.urandom(5000)}]


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def test_download_verifies_and_extracts(server, tmp_path):
    base, routes, hits = server
    archive = tar_gz(PKG)
    routes["/pkg.tar.gz"] = (archive, None)
    out = download(f"{base}/pkg.tar.gz", tmp_path, md5(archive), "pkg")
    assert out == tmp_path / "pkg"
    assert (out / "a.txt").read_bytes() == b"alpha"
    assert (out / "sub" / "b.bin").read_bytes() == PKG[3]["data"]
    assert os.listdir(tmp_path) == ["pkg"]                   # no temporary file or folder left
    # re-running is a no-op: nothing is fetched, even if the server now fails
    routes["/pkg.tar.gz"] = 500
    assert download(f"{base}/pkg.tar.gz", tmp_path, md5(archive), "pkg") == out
    assert hits == ["/pkg.tar.gz"]


def test_wrong_checksum_leaves_nothing(server, tmp_path):
    base, routes, _ = server
    routes["/pkg.tar.gz"] = (tar_gz(PKG), None)
    with pytest.raises(DownloadError, match="checksum mismatch") as err:
        download(f"{base}/pkg.tar.gz", tmp_path, "0" * 32, "pkg")
    assert f"{base}/pkg.tar.gz" in str(err.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("with_md5", [True, False])
def test_truncated_archive_leaves_nothing(server, tmp_path, with_md5):
    base, routes, _ = server
    archive = tar_gz(PKG)
    routes["/pkg.tar.gz"] = (archive[: len(archive) // 2], None)    # a consistent but cut file
    match = "checksum mismatch" if with_md5 else "truncated or not a valid"
    with pytest.raises(DownloadError, match=match):
        download(f"{base}/pkg.tar.gz", tmp_path, md5(archive) if with_md5 else None, "pkg")
    assert os.listdir(tmp_path) == []


def test_body_shorter_than_content_length_leaves_nothing(server, tmp_path):
    base, routes, _ = server
    archive = tar_gz(PKG)
    routes["/pkg.tar.gz"] = (archive[:100], len(archive))            # the connection drops early
    with pytest.raises(DownloadError, match="pkg.tar.gz"):
        download(f"{base}/pkg.tar.gz", tmp_path, None, "pkg")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("status", [404, 500])
def test_http_errors_leave_nothing(server, tmp_path, status):
    base, routes, _ = server
    routes["/pkg.tar.gz"] = status
    with pytest.raises(DownloadError, match=f"HTTP {status}") as err:
        download(f"{base}/pkg.tar.gz", tmp_path, None, "pkg")
    assert f"{base}/pkg.tar.gz" in str(err.value)
    assert os.listdir(tmp_path) == []


def test_connection_refused(tmp_path):
    import socket
    with socket.socket() as s:               # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DownloadError, match=f"127.0.0.1:{port}"):
        download(f"http://127.0.0.1:{port}/x.tar.gz", tmp_path, None, "pkg", timeout=5)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("evil, why", [
    ({"name": "../evil.txt", "data": b"x"}, "'..'"),
    ({"name": "pkg/../../evil.txt", "data": b"x"}, "'..'"),
    ({"name": "/tmp/tinyvit-absolute-evil.txt", "data": b"x"}, "absolute"),
    ({"name": "pkg/link", "type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}, "link"),
    ({"name": "pkg/hard", "type": tarfile.LNKTYPE, "linkname": "pkg/a.txt"}, "link"),
    ({"name": "other/x.txt", "data": b"x"}, "outside"),
])
def test_unsafe_tar_members_are_refused(server, tmp_path, evil, why):
    base, routes, _ = server
    archive = tar_gz(PKG + [evil])
    routes["/pkg.tar.gz"] = (archive, None)
    dest = tmp_path / "dest"
    with pytest.raises(DownloadError, match=f"refusing to extract member.*{why}"):
        download(f"{base}/pkg.tar.gz", dest, md5(archive), "pkg")
    assert os.listdir(dest) == []
    assert not (tmp_path / "evil.txt").exists()
    assert not os.path.exists("/tmp/tinyvit-absolute-evil.txt")


def test_archive_without_the_folder_or_incomplete(tmp_path):
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(tar_gz(PKG))
    dest = tmp_path / "dest"
    with pytest.raises(DownloadError, match="outside the expected top-level folder 'other'"):
        extract_tar(archive, dest, "other")
    with pytest.raises(DownloadError, match="incomplete"):
        extract_tar(archive, dest, "pkg", is_valid=lambda p: (p / "missing.txt").exists())
    assert os.listdir(dest) == []
    assert extract_tar(archive, dest, "pkg", is_valid=lambda p: (p / "a.txt").exists()) == dest / "pkg"


def test_existing_incomplete_target_is_reported_not_overwritten(server, tmp_path):
    base, routes, _ = server
    routes["/pkg.tar.gz"] = (tar_gz(PKG), None)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mine.txt").write_text("user data")
    with pytest.raises(DownloadError, match="exists but is incomplete"):
        download(f"{base}/pkg.tar.gz", tmp_path, None, "pkg", is_valid=lambda p: (p / "a.txt").exists())
    assert (tmp_path / "pkg" / "mine.txt").read_text() == "user data"


def test_download_file(server, tmp_path):
    base, routes, hits = server
    routes["/f.bin"] = (b"payload", None)
    dest = tmp_path / "sub" / "f.bin"
    assert download_file(f"{base}/f.bin", dest, md5(b"payload")) == dest
    assert dest.read_bytes() == b"payload"
    download_file(f"{base}/f.bin", dest, md5(b"payload"))                  # present and valid: skipped
    assert hits == ["/f.bin"]
    with pytest.raises(DownloadError, match="checksum"):
        download_file(f"{base}/f.bin", tmp_path / "g.bin", "0" * 32)
    assert sorted(os.listdir(tmp_path)) == ["sub"] and os.listdir(tmp_path / "sub") == ["f.bin"]


def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYVIT_DATA", str(tmp_path / "d"))
    assert default_data_dir() == tmp_path / "d"
    monkeypatch.delenv("TINYVIT_DATA")
    assert str(default_data_dir()).endswith(os.path.join(".cache", "tinyvit", "data"))


# ----------------------------------------------------------------------------- whole datasets over HTTP

def test_ensure_cifar_over_http(server, tmp_path, monkeypatch):
    base, routes, _ = server
    archive = tmp_path / "served.tar.gz"
    content = make_cifar_archive(archive, np.random.default_rng(0))
    data = archive.read_bytes()
    monkeypatch.setitem(cifar_module.CIFAR, "cifar10",
                        dataclasses.replace(cifar_module.CIFAR["cifar10"], md5=md5(data)))
    routes["/cifar-10-python.tar.gz"] = (data, None)
    root = tmp_path / "root"
    folder = ensure_cifar("cifar10", root, url=f"{base}/cifar-10-python.tar.gz", progress=False)
    assert folder == root / "cifar-10-batches-py" and os.listdir(root) == ["cifar-10-batches-py"]
    ds = load_cifar10(root, download=False)
    np.testing.assert_array_equal(ds.test_images, content["test_batch"][0])


@pytest.mark.parametrize("failure", ["404", "checksum"])
def test_ensure_cifar_failure_says_what_to_do(server, tmp_path, failure):
    base, routes, _ = server
    url = f"{base}/cifar-10-python.tar.gz"
    routes["/cifar-10-python.tar.gz"] = 404 if failure == "404" else (b"not the archive", None)
    root = tmp_path / "root"
    with pytest.raises(DatasetUnavailable) as err:
        ensure_cifar("cifar10", root, url=url, progress=False)
    msg = str(err.value)
    for needed in (url, str(root), "cifar-10-batches-py", "cifar-10-python.tar.gz", "--data-dir"):
        assert needed in msg, f"{needed!r} missing from: {msg}"
    assert not root.exists() or os.listdir(root) == []


def test_fashion_mnist_download_over_http(server, tmp_path, monkeypatch):
    base, routes, _ = server
    rng = np.random.default_rng(0)
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (12, 28, 28), dtype=np.uint8),
              "train-labels-idx1-ubyte": rng.integers(0, 10, 12).astype(np.uint8),
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (5, 28, 28), dtype=np.uint8),
              "t10k-labels-idx1-ubyte": rng.integers(0, 10, 5).astype(np.uint8)}
    files = {}
    for name, array in arrays.items():
        write_idx(tmp_path / f"{name}.gz", array)
        data = (tmp_path / f"{name}.gz").read_bytes()
        os.remove(tmp_path / f"{name}.gz")
        routes[f"/fm/{name}.gz"] = (data, None)
        files[name] = (md5(data), "unused")
    monkeypatch.setattr(fm_module, "FILES", files)
    ds = load_fashion_mnist(tmp_path, base_url=f"{base}/fm/", progress=False)
    assert ds.train_images.shape == (12, 1, 28, 28) and ds.test_labels.shape == (5,)
    np.testing.assert_array_equal(ds.train_images[:, 0], arrays["train-images-idx3-ubyte"])
    assert sorted(os.listdir(tmp_path / "fashion-mnist")) == sorted(f"{n}.gz" for n in arrays)
    # a file missing on the server: a clear error
    routes["/fm/t10k-labels-idx1-ubyte.gz"] = 404
    with pytest.raises(DatasetUnavailable, match="--data-dir"):
        load_fashion_mnist(tmp_path / "other", base_url=f"{base}/fm/", progress=False)
