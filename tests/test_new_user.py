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
    import setuptools
    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    if (major, minor) < (70, 1) and importlib.util.find_spec("wheel") is None:
        pytest.skip(f"setuptools {setuptools.__version__} here builds no wheels without the wheel package "
                    "(pip builds the install with a newer one)")
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


# ---------------------------------------------------------------- timm and PyTorch habits


def tiny_vit(**overrides):
    from tinyvit.models.vit import ViT, ViTConfig
    sizes = {"image_size": 8, "patch_size": 4, "dim": 8, "depth": 1, "num_heads": 2, "mlp_dim": 16, "num_classes": 3}
    tinyvit.manual_seed(0)
    return ViT(ViTConfig(**{**sizes, **overrides}))


@pytest.mark.parametrize("pool", ["token", "gap"])
def test_export_to_timm_round_trip(tmp_path, capsys, pool):
    """`tinyvit export` then load_pretrained (the way in for timm weights) gives the same logits."""
    from tinyvit.io import load_arrays, load_pretrained
    model = tiny_vit(pool=pool)
    tinyvit.save(model, tmp_path / "m.safetensors")
    code, out, err = cli(capsys, "export", tmp_path / "m.safetensors", "--to", "timm", "--out", tmp_path / "t.safetensors")
    assert code == 0 and "VisionTransformer(img_size=8, patch_size=4" in out, err
    arrays, metadata = load_arrays(tmp_path / "t.safetensors")
    assert arrays["blocks.0.attn.qkv.weight"].shape == (24, 8) and arrays["patch_embed.proj.weight"].ndim == 4
    assert json.loads(metadata["timm_kwargs"])["global_pool"] == {"token": "token", "gap": "avg"}[pool]
    back = load_pretrained(tmp_path / "t.safetensors", num_heads=2, pool=pool)
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(back(x).numpy(), model(x).numpy(), rtol=1e-6, atol=1e-6)


def _timm():
    try:
        import timm
        from timm.models.vision_transformer import VisionTransformer
    except Exception as exc:               # not installed, or without a torchvision that fits its torch
        pytest.skip(f"timm is not importable ({type(exc).__name__}: {exc}; pip install timm): the round trip above "
                    "checks the export without it")
    return timm, VisionTransformer


@pytest.mark.parametrize("pool", ["token", "gap"])
def test_export_matches_timms_forward(tmp_path, capsys, pool):
    timm, VisionTransformer = _timm()
    import safetensors.torch
    import torch
    from tinyvit.io import load_arrays
    model = tiny_vit(pool=pool)
    tinyvit.save(model, tmp_path / "m.safetensors")
    assert cli(capsys, "export", tmp_path / "m.safetensors", "--out", tmp_path / "t.safetensors")[0] == 0
    theirs = VisionTransformer(**json.loads(load_arrays(tmp_path / "t.safetensors")[1]["timm_kwargs"]))
    theirs.load_state_dict(safetensors.torch.load_file(str(tmp_path / "t.safetensors")))
    theirs.eval()
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    with torch.no_grad():
        expected = theirs(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model(x).numpy(), expected, rtol=1e-5, atol=1e-5)


def test_timm_fc_norm_models_are_refused_naming_the_reason():
    """timm's global_pool='avg' with fc_norm normalises after pooling; our 'gap' before: refused."""
    from tinyvit.io import load_pretrained, to_timm_state_dict
    sd = to_timm_state_dict(tiny_vit(pool="gap"))
    sd = {k.replace("norm.", "fc_norm.") if k.startswith("norm.") else k: v for k, v in sd.items()}
    with pytest.raises(ValueError, match="fc_norm.*normalises every token before averaging"):
        load_pretrained(sd, num_heads=2, pool="gap")
    try:
        timm, VisionTransformer = _timm()
    except pytest.skip.Exception:
        return
    real = VisionTransformer(img_size=8, patch_size=4, embed_dim=8, depth=1, num_heads=2, num_classes=3,
                             global_pool="avg", class_token=False)          # fc_norm, timm's default for avg
    with pytest.raises(ValueError, match="fc_norm"):
        load_pretrained(real.state_dict(), num_heads=2, pool="gap")


def test_advice_on_unknown_tensors_matches_what_each_function_takes():
    from tinyvit.io import from_timm_state_dict, load_pretrained, to_timm_state_dict
    sd = {**to_timm_state_dict(tiny_vit()), "reg_token": np.zeros((1, 4, 8), np.float32)}
    with pytest.raises(ValueError, match="strict=False") as converter:
        from_timm_state_dict(sd)
    with pytest.raises(ValueError) as loader:
        load_pretrained(sd, num_heads=2, pool="token")
    assert "reg_token" in str(loader.value) and "strict" not in str(loader.value)
    assert "reg_token" in str(converter.value)


def test_load_state_dict_with_timm_layouts_points_to_load_pretrained():
    from tinyvit.io import to_timm_state_dict
    model = tiny_vit()
    with pytest.raises(ValueError, match="load_pretrained"):
        model.load_state_dict(to_timm_state_dict(model))


def test_a_torch_tensor_given_to_a_model_says_what_to_pass():
    fake = type("Tensor", (), {"__module__": "torch", "shape": (2, 3, 8, 8), "dtype": None})()   # no torch needed
    for call in (lambda: tiny_vit()(fake), lambda: tinyvit.Tensor(fake)):
        with pytest.raises(TypeError, match=r"torch\.Tensor.*\.numpy\(\)"):
            call()


def test_a_real_torch_tensor_too(torch):
    with pytest.raises(TypeError, match=r"pass x\.numpy\(\)"):
        tiny_vit()(torch.rand(2, 3, 8, 8))


# ---------------------------------------------------------------- flags and output


def test_every_flag_has_help_and_train_flags_say_their_default():
    from tinyvit.cli import build_parser
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, command in commands.items():
        for action in command._actions:
            assert action.help, f"tinyvit {name} {action.option_strings or action.dest} has no help"
    text = commands["train"].format_help()
    for flag in ("--epochs", "--lr", "--min-lr", "--device", "--seed", "--batch-size", "--eval-batch-size"):
        entry = text.split(flag, 2)[-1].split("\n  --")[0]
        assert "default" in entry, (flag, entry)
    assert "(default: 5)" in commands["predict"].format_help()             # --topk, from the formatter


def test_print_config_prints_the_resolved_settings_and_reads_back(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "train", "--dataset", "fashion-mnist", "--lr", "0.003", "--print-config")
    assert code == 0 and not (tmp_path / "runs").exists(), err
    assert "epochs = 60    # the recipe's" in out and "lr = 0.003\n" in out and 'name = "vit-mnist/7"' in out
    assert f"# run folder: {Path('runs') / 'fashion-mnist-vit-mnist-7'}" in out
    (tmp_path / "run.toml").write_text(out)
    code, again, err = cli(capsys, "train", "--config", "run.toml", "--print-config")
    settings = lambda text: [line.split("#")[0].strip() for line in text.splitlines() if "=" in line]   # noqa: E731
    assert code == 0 and settings(again) == settings(out), err


def test_a_second_run_gets_the_next_folder_and_resume_takes_the_latest(tmp_path, capsys, data_toml, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = ["train", "--dataset", "synthetic", "--config", data_toml, *TINY, "--batch-size", "8"]
    for expected in ("synthetic-vit-cifar-4", "synthetic-vit-cifar-4-2"):
        code, out, err = cli(capsys, *base, "--epochs", "1")
        assert code == 0 and f"writing to {Path('runs') / expected}" in out, err
    code, out, err = cli(capsys, *base, "--epochs", "1", "--resume")
    assert code == 0 and f"resumed {Path('runs') / 'synthetic-vit-cifar-4-2'}" in out, err


def test_without_a_terminal_progress_is_a_line_with_the_runs_eta_and_every_run_ends_with_a_summary(
        tmp_path, capsys, data_toml, monkeypatch):
    from tinyvit.training import progress
    monkeypatch.setattr(progress, "PROGRESS_EVERY_SECONDS", 0.0)
    code, out, err = cli(capsys, *train_args(data_toml, "--out", tmp_path / "run", "--epochs", "2"))
    assert code == 0 and "\r" not in out + err, err
    lines = out.splitlines()
    progress_lines = [line for line in lines if " step " in line and "run: step" in line and "epoch 1/2" in line]
    assert progress_lines and "left" in progress_lines[-1]
    done = next(i for i, line in enumerate(lines) if line.startswith("done in "))
    assert "best test accuracy" in lines[done] and "at epoch" in lines[done]
    assert lines[done + 1] == f"files in {tmp_path / 'run'}:" and "best.safetensors" in lines[done + 2]


def test_pretraining_names_its_own_metric_and_its_model(tmp_path, capsys, data_toml, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "pretrain", "--dataset", "synthetic", "--config", data_toml, *TINY, "--epochs", "1",
                         "--batch-size", "8")
    assert code == 0, err
    assert "best masked-patch accuracy" in out and "test accuracy" not in out and "test masked-patch loss" in out
    assert (tmp_path / "runs" / "pretrain-synthetic-vit-cifar-4-mean3bit").is_dir()
    code, out, err = cli(capsys, "predict", tmp_path / "runs/pretrain-synthetic-vit-cifar-4-mean3bit/best.safetensors",
                         REPO / "lessons" / "models" / "README.md")
    assert code == 2 and "pre-trained encoder" in one_line(err) and "tinyvit finetune" in err


def test_curves_say_which_loss_is_smoothed(tmp_path, capsys, data_toml, monkeypatch):
    notes = []
    monkeypatch.setattr(tinyvit.training.loop, "training_curves", lambda *args: notes.append(args[3]))
    code, out, err = cli(capsys, *train_args(data_toml, "--out", tmp_path / "run", "--label-smoothing", "0.1"))
    assert code == 0 and notes == ["label smoothing 0.1"], err
    from tinyvit.evaluation.plots import training_curves
    pytest.importorskip("matplotlib")
    fig = training_curves([{"epoch": 1, "test_loss": 1.0, "test_acc": 0.5}],
                          [{"epoch": 0.5, "train_loss": 1.2, "train_acc": 0.4, "lr": 1e-3}], tmp_path / "c.png",
                          "label smoothing 0.1")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["train (per interval; label smoothing 0.1)", "test (per epoch; plain cross-entropy)"]


def test_eval_takes_the_dataset_from_the_checkpoint_or_says_to_pass_it(tmp_path, capsys):
    tinyvit.save(tiny_vit(), tmp_path / "plain.safetensors")                  # no dataset info
    code, out, err = cli(capsys, "eval", tmp_path / "plain.safetensors")
    assert code == 2 and "pass --dataset" in one_line(err)
    lesson = REPO / "lessons" / "models" / "fashion-mnist-vit-mnist-7.safetensors"
    if not Path("/usr/share/datasets/fashion-mnist").is_dir() and not os.environ.get("TINYVIT_DATA"):
        return                                                                 # nothing to evaluate on offline
    code, out, err = cli(capsys, "eval", lesson, "--limit", "200")
    if code == 1 and "Fashion-MNIST is not in" in err:
        return
    assert code == 0 and "on fashion-mnist test (200 images) (the checkpoint's dataset" in out, err


def test_bench_spells_kernels_and_precision_as_the_other_commands(capsys):
    from tinyvit.cli import build_parser
    parser = build_parser()
    assert parser.parse_args(["bench", "--kernels", "all"]).kernels == "all"
    assert parser.parse_args(["bench", "--kernels", "both"]).kernels == "both"        # the former spelling
    assert parser.parse_args(["bench", "--tf32"]).precision == "tf32"
    assert parser.parse_args(["bench"]).precision == "fp32"


# ---------------------------------------------------------------- predict tells the truth about its input


def test_predict_says_how_each_image_was_prepared_and_what_is_far_from_training(tmp_path, capsys):
    """A product photo (dark object on white, 3:2) given to the Fashion-MNIST model: cropped, which
    is said, and light where Fashion-MNIST is dark, which is said with the fix; --invert --resize pad
    answers both; a tiny image is said to be upscaled."""
    from PIL import Image
    lesson = REPO / "lessons" / "models" / "fashion-mnist-vit-mnist-7.safetensors"
    photo = np.full((400, 600, 3), 250, np.uint8)
    photo[100:300, 150:450] = 30
    Image.fromarray(photo).save(tmp_path / "photo.jpg")
    Image.fromarray(np.zeros((10, 10), np.uint8)).save(tmp_path / "tiny.png")
    code, out, err = cli(capsys, "predict", lesson, tmp_path / "photo.jpg", tmp_path / "tiny.png", "--topk", "1")
    assert code == 0, err
    assert "(600x400 RGB -> grey, short side to 28 px, centre crop (cut 33% of the width))" in out
    assert "note: the centre crop cut 33%" in out and "--resize pad" in out
    assert "mostly light (mean brightness" in out and "--invert flips it" in out
    assert "10x10 is smaller than the model's 28x28 input: upscaled" in out
    code, out, err = cli(capsys, "predict", lesson, tmp_path / "photo.jpg", "--invert", "--resize", "pad")
    assert code == 0 and "padded with its border colour to 28x28, inverted)" in out and "note:" not in out


def test_predict_reads_a_batch_at_a_time(tmp_path, monkeypatch):
    """Memory does not grow with the number of files: they are read --batch-size at a time, and
    results come out as each batch is done."""
    from PIL import Image
    from tinyvit.evaluation import inference
    model = tiny_vit()
    info = {"name": None, "classes": ["a", "b", "c"], "mean": [0.0] * 3, "std": [1.0] * 3}
    paths = []
    for i in range(5):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(paths[-1])
    read = []
    real = inference.read_images
    monkeypatch.setattr(inference, "read_images", lambda batch, *a: read.append(len(batch)) or real(batch, *a))
    results = inference.predict_batches(model, info, paths, topk=2, batch_size=2)
    first = next(results)
    assert read == [2] and first[0] == paths[0] and len(first[3]) == 2
    assert len(list(results)) == 4 and read == [2, 2, 1]


def test_predict_shows_a_bar_for_long_lists_on_a_terminal(monkeypatch):
    from tinyvit.cli import predict
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bar = predict._bar(200, 64)
    assert bar is not None and bar.total == 200
    bar.close()
    assert predict._bar(10, 64) is None


# ---------------------------------------------------------------- README's first look


def test_the_first_look_compares_numbers_that_differ_from_chance():
    """The README's first snippet: the model, its fused step and the reference ops print the same loss,
    and it is not ln 10 (a zero head's): the comparison shows the paths agree on a real computation."""
    text = (REPO / "README.md").read_text()
    snippet = text.split("```python\n", 1)[1].split("```", 1)[0]
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    numbers = [float(v) for v in done.stdout.splitlines()[0].split()]
    assert len(numbers) == 3 and max(numbers) - min(numbers) < 1e-4 * numbers[0]
    assert abs(numbers[0] - np.log(10)) > 0.05
