"""Small files that ask for gigabytes (issue 32, item 2): each loader checks sizes before it allocates.

Each bomb runs in a process of its own under a 1 GiB address-space limit (resource.setrlimit
RLIMIT_AS), through the command a user would run, and must end in one line that names the file and
what is wrong with it: no MemoryError traceback, a peak far below the limit, within seconds.

    a CIFAR pickle of nested lists     a few hundred bytes whose labels become 10^10 integers
    a gzip bomb in Fashion-MNIST       4 MB that decompress to 4 GB, under an honest header or a short one
    an .npz whose header lies          a few hundred bytes whose header asks for 4 GiB
    an .npz deflate bomb               1 MB that inflates to 1 GiB, its header honest

and whatever else runs out of memory in the CLI (a model too large to build) is one line naming the
allocation that failed.
"""
import gzip
import os
import subprocess
import sys
import textwrap
import time
import zipfile

import numpy as np
import pytest
from helpers import cli, one_line
from test_data_cifar import cifar_batch, py2_pickle, write_cifar10_folder

from tinyvit.data.fashion_mnist import FILES, write_idx

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="peaks are read from Linux's /proc")

LIMIT = 1 << 30                        # bytes of address space the process under test may map
PEAK_MIB = 400                         # what a refusal may cost at most (a tiny run peaks at about 85 MiB)
TINY = ["--model", "vit-cifar/4", "--model-arg", "dim=8", "--model-arg", "depth=1",
        "--model-arg", "num_heads=2", "--model-arg", "mlp_dim=16", "--epochs", "1", "--batch-size", "4"]


def capped(code: str, cwd, timeout: float = 120):
    """(exit status, stdout, stderr, peak resident MiB, seconds) of ``code`` run by a fresh Python
    under the LIMIT. The peak is the process's own, read at exit (atexit also runs after a traceback)
    from /proc (Linux; elsewhere these tests are skipped)."""
    prologue = textwrap.dedent(f"""
        import atexit, os, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({LIMIT}, {LIMIT}))
        def peak():                   # VmHWM: this process's own peak (ru_maxrss may be the parent's at fork)
            with open("/proc/self/status") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
            os.write(int(os.environ["PEAK_FD"]), b"%d" % (kib // 1024))
        atexit.register(peak)
    """)
    read, write = os.pipe()
    env = {**os.environ, "PEAK_FD": str(write), "OPENBLAS_NUM_THREADS": "1", "MPLBACKEND": "Agg", "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                          os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", prologue + textwrap.dedent(code)], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(write,))
    os.close(write)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running after {timeout} s:\n{err[-2000:]}")
    with os.fdopen(read, "rb") as f:
        peak = f.read()
    return proc.returncode, out, err, int(peak or 0), time.perf_counter() - start


def assert_refused(result, *words):
    code, _, err, peak, seconds = result
    assert "Traceback" not in err and "MemoryError" not in err, err[-3000:]
    line = one_line(err)
    assert code == 1, err
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    assert 0 < peak < PEAK_MIB, f"peak {peak} MiB"
    assert seconds < 60
    return line


def cli_code(*argv) -> str:
    return f"from tinyvit.cli import main\nsys.exit(main({[str(a) for a in argv]!r}))\n"


# ---------------------------------------------------------------- CIFAR: a pickle of nested lists


def nested(fanout: int, depth: int):
    """A list of ``fanout`` references to one list of ``fanout`` references ... to [0] * fanout: fanout^depth
    integers as NumPy reads it, a few bytes per level as pickle writes it (every level is one object)."""
    level = [0] * fanout
    for _ in range(depth - 1):
        level = [level] * fanout
    return level


def test_a_cifar_pickle_of_nested_lists_is_refused(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10_folder(folder, np.random.default_rng(0), n=4)
    batch, _, _ = cifar_batch(np.random.default_rng(1), 4)
    batch[b"labels"] = nested(10, 10)                                      # 10^10 labels
    (folder / "data_batch_1").write_bytes(py2_pickle(batch))
    assert (folder / "data_batch_1").stat().st_size < 20_000
    line = assert_refused(capped(cli_code("train", "--dataset", "cifar10", "--data-dir", tmp_path, *TINY), tmp_path),
                          "data_batch_1", "'labels'")
    assert "download" in line                                              # the fix: a genuine copy


@pytest.mark.parametrize("labels, words", [
    ([0.5, 1.0, 2.0, 3.0], ["'labels'", "0.5", "whole numbers"]),          # float labels were truncated
    ([0, 1, 2, 10], ["'labels'", "10", "[0, 10)"]),
    ([0, 1, 2, -1], ["'labels'", "-1", "[0, 10)"]),
    ([0, 1, True, 3], ["'labels'", "True"]),
    ([[0], [1], [2], [3]], ["'labels'"]),
], ids=["float", "too-large", "negative", "bool", "lists"])
def test_cifar_labels_must_be_whole_numbers_of_its_classes(tmp_path, capsys, labels, words):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10_folder(folder, np.random.default_rng(0), n=4)
    batch, _, _ = cifar_batch(np.random.default_rng(1), 4)
    batch[b"labels"] = labels
    (folder / "test_batch").write_bytes(py2_pickle(batch))
    code, _, err = cli(capsys, "train", "--dataset", "cifar10", "--data-dir", tmp_path, *TINY,
                       "--out", tmp_path / "run")
    line = one_line(err)
    assert code == 1 and "test_batch" in line
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("change, words", [
    (lambda b: b.update({b"data": np.zeros((4, 3072), np.float32)}), ["float32", "uint8"]),
    (lambda b: b.update({b"extra": {b"a": 1}}), ["'extra'", "dict"]),
    (lambda b: b.update({b"filenames": [b"a", [b"b"], b"c", b"d"]}), ["'filenames'"]),
], ids=["float-pixels", "nested-dict", "nested-names"])
def test_a_cifar_batch_holds_the_cifar_layout_only(tmp_path, capsys, change, words):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10_folder(folder, np.random.default_rng(0), n=4)
    batch, _, _ = cifar_batch(np.random.default_rng(1), 4)
    change(batch)
    (folder / "data_batch_2").write_bytes(py2_pickle(batch))
    code, _, err = cli(capsys, "train", "--dataset", "cifar10", "--data-dir", tmp_path, *TINY,
                       "--out", tmp_path / "run")
    line = one_line(err)
    assert code == 1 and "data_batch_2" in line
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"


def test_a_pickle_of_many_small_objects_is_refused_before_it_is_built(tmp_path, capsys):
    """Unpickling itself costs up to ~60 bytes of objects per byte of pickle (an empty list is one
    opcode): a pickle is scanned and refused when it holds more objects than any CIFAR batch."""
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10_folder(folder, np.random.default_rng(0), n=4)
    # {'junk': [[], [], ...]}: PROTO 2, EMPTY_DICT, MARK, 'junk', EMPTY_LIST, MARK, ] x 3e6, APPENDS, SETITEMS, STOP
    (folder / "batches.meta").write_bytes(b"\x80\x02}(U\x04junk](" + b"]" * 3_000_000 + b"eu.")
    code, _, err = cli(capsys, "train", "--dataset", "cifar10", "--data-dir", tmp_path, *TINY,
                       "--out", tmp_path / "run")
    line = one_line(err)
    assert code == 1 and "batches.meta" in line and "objects" in line


# ---------------------------------------------------------------- Fashion-MNIST: gzip bombs


def gzip_bomb(path, header_shape, zeros: int):
    """A gzip file of the IDX header for ``header_shape`` (uint8) followed by ``zeros`` zero bytes,
    written as concatenated gzip members of 16 MiB of zeros each (16 KB apiece): fast to make."""
    header = bytes([0, 0, 0x08, len(header_shape)]) + np.asarray(header_shape, ">u4").tobytes()
    chunk = gzip.compress(bytes(1 << 24), compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(header))
        for _ in range(zeros >> 24):
            f.write(chunk)


def fashion_folder(root):
    folder = root / "fashion-mnist"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in FILES:
        n = 6 if name.startswith("train") else 4
        array = rng.integers(0, 256, (n, 28, 28), np.uint8) if "images" in name else rng.integers(0, 10, n, np.uint8)
        write_idx(folder / f"{name}.gz", array)
    return folder


@pytest.mark.parametrize("header, words", [
    ((5_000_000, 28, 28), ["declares", "(5000000, 28, 28)", "3920000000 bytes"]),      # an honest header
    ((6, 28, 28), ["more data than its header", "(6, 28, 28)"]),                      # a short one
], ids=["huge-header", "data-past-the-header"])
def test_a_gzip_bomb_in_a_fashion_mnist_folder_is_refused(tmp_path, header, words):
    folder = fashion_folder(tmp_path)
    gzip_bomb(folder / "train-images-idx3-ubyte.gz", header, 4 << 30)
    assert (folder / "train-images-idx3-ubyte.gz").stat().st_size < 5 << 20
    assert_refused(capped(cli_code("train", "--dataset", "fashion-mnist", "--data-dir", tmp_path, *TINY), tmp_path),
                   "train-images-idx3-ubyte.gz", *words)


def test_a_genuine_size_fashion_mnist_file_still_loads(tmp_path):
    """The cap is far above what Fashion-MNIST holds: a file of its real train size loads."""
    from tinyvit.data.fashion_mnist import read_idx
    path = tmp_path / "train-images-idx3-ubyte.gz"
    write_idx(path, np.zeros((60_000, 28, 28), np.uint8))
    assert read_idx(path).shape == (60_000, 28, 28)


# ---------------------------------------------------------------- .npz: lying headers and deflate bombs


def npy_header(shape, dtype="<f4") -> bytes:
    import io
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def load_pretrained_capped(path, cwd):
    """tinyvit.io.load_pretrained(path) in a memory-capped process; a ValueError is its one line."""
    return capped(f"""
        import tinyvit
        try:
            tinyvit.io.load_pretrained({str(path)!r})
        except ValueError as exc:
            print(f"ValueError: {{exc}}", file=sys.stderr)
            sys.exit(1)
    """, cwd)


def test_an_npz_whose_header_asks_for_gigabytes_is_refused(tmp_path):
    """NumPy allocates what a member's header declares before reading its bytes."""
    path = tmp_path / "lying.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("embedding/kernel.npy", npy_header((1 << 30,)))             # 4 GiB declared, none there
    assert path.stat().st_size < 1000
    assert_refused(load_pretrained_capped(path, tmp_path), "lying.npz", "embedding/kernel.npy", "4294967296 bytes")


def test_an_npz_deflate_bomb_is_refused(tmp_path):
    """1 GiB of zeros deflated to about 1 MB, under an honest header."""
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("embedding/kernel.npy", "w", force_zip64=True) as f:
            f.write(npy_header((1 << 28,)))
            zeros = bytes(1 << 24)
            for _ in range(64):
                f.write(zeros)
    assert path.stat().st_size < 4 << 20
    assert_refused(load_pretrained_capped(path, tmp_path), "bomb.npz", "1073741824 bytes")


# ---------------------------------------------------------------- and whatever else runs out of memory


def test_running_out_of_memory_in_the_cli_is_one_line(tmp_path):
    """A synthetic data set of 10^11 images (its labels alone: 745 GiB)."""
    config = tmp_path / "data.toml"
    config.write_text("[dataset]\ntrain_size = 100000000000\ntest_size = 4\nimage_size = 8\nnum_classes = 2\n")
    line = assert_refused(capped(cli_code("train", "--dataset", "synthetic", "--config", config, *TINY,
                                          "--out", tmp_path / "run"), tmp_path), "out of memory", "745. GiB")
    assert line.startswith("tinyvit train: ")
    assert not (tmp_path / "run" / "latest.safetensors").exists()
