"""What a careless or adversarial user can do, each through the CLI (issue 32, items 4, 7 and 8).

Silent wrong answers made loud or right: an empty test split (once "accuracy 0.00%" and exit 0), a
fine-tune resumed from another checkpoint than it started from (once continued the old run), a
--min-lr above --lr (once a "decay" that raised the rate), a qkv_bias of "maybe", a fine-tune at
--image-size 0 (once "keep the size"); a Ctrl-C never leaves a latest.safetensors whose weights are
not finite, and a diverged run's message names the checkpoint that really is good.

Every one-line error names the flag or file and the fix (absurd budgets and sizes refused with their
limits, --device cuda without a usable GPU); the last section runs a representative set of these
cases as a table and checks one line, the exit status, no traceback, and every file inside and
outside the run folder unchanged. Tiny models on tiny synthetic data.
"""
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, one_line

import tinyvit as tv
import tinyvit.training.loop
from tinyvit import io, optim
from tinyvit.data.fashion_mnist import FILES, write_idx
from tinyvit.models.vit import ViT, ViTConfig

TINY = ["--model", "vit-cifar/4", "--model-arg", "dim=8", "--model-arg", "depth=1",
        "--model-arg", "num_heads=2", "--model-arg", "mlp_dim=16"]
DATA = "[dataset]\ntrain_size = 16\ntest_size = 8\nimage_size = 8\nchannels = 3\nnum_classes = 2\n"


@pytest.fixture(scope="module", autouse=True)
def _no_progress_bars():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tinyvit.training.loop, "_progress_bar", lambda *args: None)
        yield


@pytest.fixture
def data_toml(tmp_path):
    path = tmp_path / "data.toml"
    path.write_text(DATA)
    return path


def train_args(data_toml, out, *extra):
    return ["train", "--dataset", "synthetic", "--config", data_toml, *TINY, "--epochs", "1", "--batch-size", "8",
            "--out", out, *extra]


def tiny_vit(**overrides) -> ViT:
    sizes = dict(image_size=8, patch_size=4, dim=8, depth=1, num_heads=2, mlp_dim=16, num_classes=2)
    return ViT(ViTConfig(**{**sizes, **overrides}))


def finite(path) -> bool:
    return all(np.isfinite(a).all() for a in io.load_arrays(path)[0].values() if a.dtype.kind == "f")


# ---------------------------------------------------------------- silent wrong answers (item 4)


def fashion_without_test_images(root) -> Path:
    folder = root / "fashion-mnist"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in FILES:
        n = 8 if name.startswith("train") else 0
        array = rng.integers(0, 256, (n, 28, 28), np.uint8) if "images" in name else rng.integers(0, 10, n, np.uint8)
        write_idx(folder / f"{name}.gz", array)
    return root


def test_an_empty_test_split_is_refused_by_train_and_eval(tmp_path, capsys):
    data = fashion_without_test_images(tmp_path)
    code, out, err = cli(capsys, "train", "--dataset", "fashion-mnist", "--data-dir", data, "--model", "vit-mnist/7",
                         "--model-arg", "dim=8", "--model-arg", "depth=1", "--model-arg", "num_heads=2",
                         "--model-arg", "mlp_dim=8", "--epochs", "1", "--batch-size", "4", "--out", tmp_path / "run")
    line = one_line(err)
    assert code == 1 and "fashion-mnist has no test images" in line and "accuracy" not in out
    assert not (tmp_path / "run").exists()
    model = ViT(ViTConfig(image_size=28, patch_size=7, in_channels=1, dim=8, depth=1, num_heads=2, mlp_dim=8,
                          num_classes=10))
    tv.save(model, tmp_path / "m.safetensors")
    code, out, err = cli(capsys, "eval", tmp_path / "m.safetensors", "--dataset", "fashion-mnist", "--data-dir", data)
    line = one_line(err)
    assert code == 1 and "fashion-mnist has no test images" in line and out == ""


def test_finetune_resume_refuses_another_checkpoint(tmp_path, capsys, data_toml):
    first, other = tmp_path / "first.safetensors", tmp_path / "other.safetensors"
    tv.save(tiny_vit(), first)
    tv.save(tiny_vit(num_classes=3), other)
    out = tmp_path / "tuned"
    tune = ["finetune", "--dataset", "synthetic", "--config", data_toml, "--epochs", "2", "--batch-size", "8",
            "--out", out]
    code, _, err = cli(capsys, tune[0], first, *tune[1:])
    assert code == 0, err
    latest = (out / "latest.safetensors").read_bytes()
    code, _, err = cli(capsys, tune[0], other, *tune[1:], "--resume")
    line = one_line(err)
    assert code == 1 and str(first.resolve()) in line and str(other.resolve()) in line and "--out DIR" in line
    assert (out / "latest.safetensors").read_bytes() == latest
    code, _, err = cli(capsys, "train", "--dataset", "synthetic", "--config", data_toml, "--epochs", "2",
                       "--batch-size", "8", "--out", out, "--resume")
    assert code == 1 and "tinyvit finetune" in one_line(err)
    code, _, err = cli(capsys, tune[0], first, *tune[1:], "--resume")             # its own checkpoint: resumes
    assert code == 0, err


def test_min_lr_above_lr_is_refused(tmp_path, capsys, data_toml):
    code, _, err = cli(capsys, *train_args(data_toml, tmp_path / "run", "--lr", "0.1", "--min-lr", "1"))
    line = one_line(err)
    assert code == 2 and "--min-lr 1.0" in line and "--lr 0.1" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["maybe", "2", "none"])
def test_qkv_bias_must_be_true_or_false(tmp_path, capsys, data_toml, value):
    code, _, err = cli(capsys, *train_args(data_toml, tmp_path / "run", "--model-arg", f"qkv_bias={value}"))
    line = one_line(err)
    assert code == 1 and "qkv_bias must be true or false" in line
    assert not (tmp_path / "run" / "config.json").exists()


@pytest.mark.parametrize("size", ["0", "-8"])
def test_finetune_image_size_must_be_positive(tmp_path, capsys, data_toml, size):
    tv.save(tiny_vit(), tmp_path / "m.safetensors")
    code, _, err = cli(capsys, "finetune", tmp_path / "m.safetensors", "--dataset", "synthetic", "--config", data_toml,
                       "--epochs", "1", "--out", tmp_path / "tuned", "--image-size", size)
    line = one_line(err)
    assert code == 2 and "--image-size must be >= 1" in line
    assert not (tmp_path / "tuned").exists()


def poison_after(monkeypatch, steps: int):
    """The optimizer's update number ``steps`` leaves NaN weights, and the next is interrupted by a
    Ctrl-C: before the loss check every 20 steps could see them."""
    calls, original = [0], optim.AdamW.step

    def step(self):
        calls[0] += 1
        if calls[0] > steps:
            raise KeyboardInterrupt
        original(self)
        if calls[0] == steps:
            for group in self.param_groups:
                for p in group["params"]:
                    p.data[...] = np.nan
    monkeypatch.setattr(optim.AdamW, "step", step)


def test_ctrl_c_never_saves_weights_that_are_not_finite(tmp_path, capsys, data_toml, monkeypatch):
    out = tmp_path / "run"
    with monkeypatch.context() as mp:                       # epoch 1 (2 steps) saved; step 3 NaN; step 4 Ctrl-C
        poison_after(mp, 3)
        code, stdout, err = cli(capsys, *train_args(data_toml, out, "--epochs", "3"))
    assert code == 130
    assert finite(out / "latest.safetensors")
    state = json.loads(io.load_arrays(out / "latest.safetensors")[1]["training"])
    assert state["progress"]["epoch"] == 1 and state["scheduler"]["step"] == 2
    message = stdout + err
    assert "not finite" in message and f"The last good checkpoint is kept at {out / 'latest.safetensors'}" in message
    assert "saved" not in message.replace("was not saved", "")


def test_a_diverged_resume_of_a_nan_checkpoint_names_the_good_one(tmp_path, capsys, data_toml):
    """A latest.safetensors of NaN weights (as a Ctrl-C once saved them): its resume diverges, and the
    message says that latest is not good, and that best.safetensors is."""
    out = tmp_path / "run"
    assert cli(capsys, *train_args(data_toml, out, "--epochs", "3"))[0] == 0
    latest = out / "latest.safetensors"
    arrays, metadata = io.load_arrays(latest)
    state = json.loads(metadata["training"])
    state["progress"]["epoch"], state["scheduler"]["step"] = 1, 2
    poisoned = {k: np.full_like(v, np.nan) if not k.startswith("extra/") else v for k, v in arrays.items()}
    io.save_arrays(latest, poisoned, {**metadata, "training": json.dumps(state)})
    code, _, err = cli(capsys, *train_args(data_toml, out, "--epochs", "3", "--resume"))
    line = one_line(err)
    assert code == 1 and "last good checkpoint is kept" not in line
    assert f"{latest} holds weights that are not finite" in line and str(out / "best.safetensors") in line
