"""A new user's first hour (issue 31), through the `tinyvit` command as installed: where Python is
started, a GPU that is not there, a dataset that cannot be fetched, the test run's summary, the
habits PyTorch and timm users bring (export to timm, a torch tensor as input), and the flags and
output of a run (--help, --print-config, run folders, progress without a terminal, the summary).
Tiny models on tiny synthetic data: seconds each, except the install check (a wheel build)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, one_line

import tinyvit
import tinyvit.training.loop

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "vit-cifar/4", "--model-arg", "dim=8", "--model-arg", "depth=1",
        "--model-arg", "num_heads=2", "--model-arg", "mlp_dim=16"]
DATA = {"train_size": 16, "test_size": 8, "image_size": 8, "channels": 3, "num_classes": 2}


@pytest.fixture
def data_toml(tmp_path):
    path = tmp_path / "data.toml"
    path.write_text("[dataset]\n" + "".join(f"{k} = {v}\n" for k, v in DATA.items()))
    return path


def train_args(data_toml, *extra):
    return ["train", "--dataset", "synthetic", "--config", data_toml, *TINY, "--epochs", "1", "--batch-size", "8",
            *extra]


# ---------------------------------------------------------------- where Python is started


def test_import_from_the_clones_parent_folder(tmp_path):
    """A folder named tinyvit without an __init__.py in the working directory (the clone, seen from
    its parent: Colab's /content after `git clone`) must not hide the installed package. Python finds
    such a folder as a namespace package; a regular package anywhere on sys.path beats it, which is
    what the editable install's .pth entry (pyproject's package-dir) provides. Run as installed."""
    (tmp_path / "tinyvit" / "lessons").mkdir(parents=True)            # the clone folder's look-alike
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    done = subprocess.run([sys.executable, "-c", "import tinyvit; print(tinyvit.__version__)"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == tinyvit.__version__, done.stderr[-2000:]


def test_the_editable_install_is_a_path_entry_that_beats_the_clone_folder(tmp_path):
    """pyproject.toml makes setuptools' editable wheel a .pth path entry (not an import hook, which
    Python consults after its path search has already settled on the namespace package); with it,
    `import tinyvit` works from the clone's parent folder. Builds the wheel of a copy named tinyvit."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed here (Python >= 3.12 venvs have none; pip fetches it to build)")
    clone = tmp_path / "parent" / "tinyvit"
    clone.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, clone / name)
    shutil.copytree(REPO / "tinyvit", clone / "tinyvit", ignore=shutil.ignore_patterns("__pycache__"))
    script = "from setuptools import build_meta; print(build_meta.build_editable(%r))" % str(tmp_path / "wheel")
    done = subprocess.run([sys.executable, "-c", script], cwd=clone, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with zipfile.ZipFile(next((tmp_path / "wheel").glob("*.whl"))) as wheel:
        names = wheel.namelist()
        assert not [n for n in names if "finder" in n], f"an import hook, not a path entry: {names}"
        pth = next(n for n in names if n.endswith(".pth"))
        site = tmp_path / "site"
        wheel.extract(pth, site)
    assert (site / pth).read_text().strip() == str(clone)
    # Without site-packages (-S, where an installed tinyvit may live), then this .pth, then NumPy's folder.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    numpy_dir = str(Path(np.__file__).parents[1])
    check = (f"import site, sys; site.addsitedir({str(site)!r}); sys.path.append({numpy_dir!r}); "
             "import tinyvit; print(tinyvit.__file__)")
    done = subprocess.run([sys.executable, "-S", "-c", check], cwd=clone.parent, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == str(clone / "tinyvit" / "__init__.py"), done.stderr


# ---------------------------------------------------------------- a GPU that is not there


def test_device_cuda_without_cupy_is_one_line_naming_the_extra(tmp_path, capsys, data_toml, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cupy" else real(name, *a))
    for argv in (train_args(data_toml, "--out", tmp_path / "run", "--device", "cuda"),
                 ["predict", REPO / "lessons/models/fashion-mnist-vit-mnist-7.safetensors", "x.png", "--device", "cuda"]):
        code, out, err = cli(capsys, *argv)
        assert code == 1 and "pip install -e '.[gpu]'" in one_line(err), err
    assert not (tmp_path / "run").exists()


def test_device_cuda_without_a_gpu_is_one_line(tmp_path, capsys, data_toml, monkeypatch):
    from tinyvit import backend

    class NoGPU:
        class cuda:
            class runtime:
                @staticmethod
                def getDeviceCount():
                    raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(backend, "cupy_module", lambda: NoGPU)
    code, out, err = cli(capsys, *train_args(data_toml, "--out", tmp_path / "run", "--device", "cuda:0"))
    assert code == 1 and "no CUDA GPU" in one_line(err) and "--device cpu" in err
    code, out, err = cli(capsys, *train_args(data_toml, "--out", tmp_path / "run", "--device", "gpu"))
    assert code == 2 and "cpu, cuda or cuda:N" in one_line(err)


# ---------------------------------------------------------------- a dataset that cannot be fetched


def test_cifar_unreachable_is_one_line_naming_the_offline_way(tmp_path, capsys, monkeypatch):
    from tinyvit.data import cifar

    def offline(*args, **kwargs):
        raise OSError("[Errno -2] Name or service not known")
    monkeypatch.setattr(cifar, "download_archive", offline)
    code, out, err = cli(capsys, "train", "--data-dir", tmp_path / "data", "--epochs", "1", "--out", tmp_path / "run")
    line = one_line(err)
    assert code == 1 and "--dataset fashion-mnist" in line and "apt-get install dataset-fashion-mnist" in line
    assert "cifar-10-python.tar.gz" in line


# ---------------------------------------------------------------- the test run's summary


def test_the_test_run_ends_with_one_line_per_skip_reason(tmp_path):
    """tests/conftest.py's summary: 30 skips for 2 reasons are 2 lines, with their counts."""
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('i', range(20))\n"
        "def test_a(i):\n    pytest.skip('torch is not installed')\n"
        "@pytest.mark.parametrize('i', range(10))\n"
        "def test_b(i):\n    pytest.skip('no GPU')\n"
        "def test_c():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                           "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert any(line.split() == ["20", "torch", "is", "not", "installed"] for line in lines), done.stdout
    assert any(line.split() == ["10", "no", "GPU"] for line in lines), done.stdout
    assert "1 passed, 30 skipped" in done.stdout and "SKIPPED" not in done.stdout
