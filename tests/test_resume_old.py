"""Old and damaged run folders (issue 32, item 3).

A run folder written by an older tinyvit resumes (tests/fixtures/old_runs: f9de1fb of 2026-11-22,
whose training state has no plan, and 0422621, main before the package layout), continuing the
schedule it started with. A hand-edited or damaged training state is refused in one line that
names the field and what to do, before anything is loaded or written: every field is checked for
its type and range before use. JSON nested 100,000 deep in a checkpoint's metadata is one line
too (it was a RecursionError), in train --resume and predict.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, one_line

import tinyvit as tv
import tinyvit.training.loop
from tinyvit import io, optim

FIXTURES = Path(__file__).parent / "fixtures" / "old_runs"
TINY = ["--model", "vit-cifar/4", "--model-arg", "dim=8", "--model-arg", "depth=1",
        "--model-arg", "num_heads=2", "--model-arg", "mlp_dim=16"]
DATA = "[dataset]\ntrain_size = 32\ntest_size = 8\nimage_size = 8\nchannels = 3\nnum_classes = 2\n"


@pytest.fixture(scope="module", autouse=True)
def _no_progress_bars():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tinyvit.training.loop, "_progress_bar", lambda *args: None)
        yield


def resume(capsys, tmp_path, out, *extra):
    """The command the old runs were started with, plus --resume."""
    config = tmp_path / "data.toml"
    config.write_text(DATA)
    return cli(capsys, "train", "--resume", "--out", out, "--dataset", "synthetic", "--config", config, *TINY,
               "--epochs", "3", "--batch-size", "8", "--lr", "1e-3", *extra)


def snapshot(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- folders of older versions


@pytest.mark.parametrize("name, epoch_done", [("f9de1fb-epoch1", 1), ("f9de1fb-midepoch2", 1),
                                              ("0422621-midepoch2", 1)])
def test_a_run_folder_of_an_older_version_resumes(tmp_path, capsys, name, epoch_done):
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    code, stdout, err = resume(capsys, tmp_path, out)
    assert code == 0, err
    assert f"resumed {out} at epoch {epoch_done}" in stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2, 3]
    state = json.loads(io.load_arrays(out / "latest.safetensors")[1]["training"])
    assert state["progress"]["epoch"] == 3 and state["scheduler"]["step"] == 12
    arrays, _ = io.load_arrays(out / "latest.safetensors")
    assert all(np.isfinite(a).all() for a in arrays.values())


@pytest.mark.parametrize("name", ["f9de1fb-epoch1", "f9de1fb-midepoch2"])
def test_an_older_run_keeps_the_schedule_it_started_with(tmp_path, capsys, name):
    """Before the time budget, a run's schedule was epochs x steps with int(warmup_epochs x steps)
    of warmup, never shortened: 12 steps, 4 of warmup here. The resumed steps follow it."""
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    code, stdout, err = resume(capsys, tmp_path, out)
    assert code == 0, err
    assert "older tinyvit" in stdout and "12 steps" in stdout and "4 of warmup" in stdout
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [row["step"] for row in steps] == [8, 12]
    for row in steps:
        assert row["lr"] == pytest.approx(optim.warmup_cosine(row["step"], 12, 4, 1e-3, 1e-6))


# ---------------------------------------------------------------- damaged training states


@pytest.fixture(scope="module")
def stopped_once(tmp_path_factory):
    """A run stopped after epoch 1 of 3, its state written by today's tinyvit (the old run resumed
    to its end, then its state set back to the end of epoch 1)."""
    from tinyvit.cli import main
    root = tmp_path_factory.mktemp("stopped")
    out = root / "run"
    shutil.copytree(FIXTURES / "0422621-midepoch2", out)
    (root / "data.toml").write_text(DATA)
    argv = ["train", "--resume", "--out", str(out), "--dataset", "synthetic", "--config", str(root / "data.toml"),
            *TINY, "--epochs", "3", "--batch-size", "8", "--lr", "1e-3"]
    assert main(argv) == 0
    arrays, metadata = io.load_arrays(out / "latest.safetensors")
    state = json.loads(metadata["training"])
    state["progress"].update(epoch=1, partial=None, trained=None)
    state["scheduler"]["step"], state["loader"]["epoch"], state["loader"]["position"] = 4, 1, 0
    io.save_arrays(out / "latest.safetensors", arrays, {**metadata, "training": json.dumps(state)})
    shutil.copytree(out, root / "copy")
    assert main(argv) == 0                                                 # a state that fits resumes
    return root / "copy"


@pytest.fixture
def stopped(stopped_once, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped_once, out)
    return out


def edit(out, change):
    latest = out / "latest.safetensors"
    arrays, metadata = io.load_arrays(latest)
    state = json.loads(metadata["training"])
    change(state)
    io.save_arrays(latest, arrays, {**metadata, "training": json.dumps(state)})


def setter(path: str, value):
    def change(state):
        *parents, last = path.split(".")
        node = state
        for key in parents:
            node = node[key]
        if value is KeyError:
            del node[last]
        else:
            node[last] = value
    return change


@pytest.mark.parametrize("path, value, words", [
    ("progress.epoch", "1", ["progress.epoch", "'1'", "whole number"]),
    ("progress.epoch", -3, ["progress.epoch", "-3"]),
    ("progress.epoch", 9, ["progress.epoch", "9", "epochs"]),
    ("progress.epoch", KeyError, ["progress.epoch", "missing"]),
    ("progress.best_acc", "high", ["progress.best_acc", "'high'"]),
    ("progress.partial", 5, ["progress.partial", "5"]),
    ("progress.partial", {"loss": 1.0, "correct": 1.0, "seen": -1, "seconds": 0.0}, ["progress.partial.seen", "-1"]),
    ("progress.trained", {"epoch": 2}, ["progress.trained.train_loss", "missing"]),
    ("progress.plan.total_steps", 0, ["progress.plan.total_steps", "0"]),
    ("progress.plan", {"total_steps": 12}, ["progress.plan.warmup_steps", "missing"]),
    ("progress", [], ["progress", "[]"]),
    ("scheduler", [], ["scheduler", "[]"]),
    ("scheduler.step", 10 ** 9, ["scheduler.step", "1000000000", "12"]),
    ("loader.position", 10 ** 9, ["loader.position", "1000000000", "4"]),
    ("loader.epoch", "one", ["loader.epoch", "'one'"]),
    ("loader.rng", {"bit_generator": "PCG64"}, ["loader.rng", "random"]),
    ("rng", "x", ["rng", "'x'"]),
    ("optimizer", None, ["optimizer", "None"]),
    ("optimizer.param_groups", {}, ["optimizer.param_groups", "{}"]),
    ("optimizer.scalars", {"x": {"step": 1}}, ["optimizer.scalars", "'x'"]),
    ("optimizer.scalars", {"0": {"step": "two"}}, ["optimizer.scalars.0.step", "'two'"]),
])
def test_a_damaged_training_state_is_one_line_naming_the_field(stopped, tmp_path, capsys, path, value, words):
    edit(stopped, setter(path, value))
    before = snapshot(stopped)
    code, _, err = resume(capsys, tmp_path, stopped)
    assert code == 1
    line = one_line(err)
    assert f"the training state in {stopped / 'latest.safetensors'} is damaged" in line
    for word in [*words, "--out DIR"]:
        assert word in line, f"{word!r} not in {line!r}"
    assert snapshot(stopped) == before


def test_a_state_whose_optimizer_does_not_fit_its_model(stopped, tmp_path, capsys):
    """Types and ranges right, but a parameter group too few: the optimizer's own check, one line."""
    edit(stopped, lambda state: state["optimizer"]["param_groups"].pop())
    code, _, err = resume(capsys, tmp_path, stopped)
    line = one_line(err)
    assert code == 1 and "is damaged" in line and "parameter groups" in line and "--out DIR" in line


# ---------------------------------------------------------------- JSON nested 100,000 deep


DEEP = "[" * 100_000 + "]" * 100_000


def test_deep_json_in_the_training_state(stopped, tmp_path, capsys):
    latest = stopped / "latest.safetensors"
    arrays, metadata = io.load_arrays(latest)
    io.save_arrays(latest, arrays, {**metadata, "training": DEEP})
    code, _, err = resume(capsys, tmp_path, stopped)
    line = one_line(err)
    assert code == 1 and str(latest) in line and "nested" in line and "--out DIR" in line


@pytest.mark.parametrize("key", ["dataset", "config", "training"])
def test_deep_json_in_a_checkpoint_read_by_predict(tmp_path, capsys, key):
    from PIL import Image
    model = tv.models.ViT(tv.models.ViTConfig(image_size=8, patch_size=4, dim=8, depth=1, num_heads=2, mlp_dim=16,
                                              num_classes=2))
    path = tmp_path / "m.safetensors"
    tv.save(model, path)
    arrays, metadata = io.load_arrays(path)
    io.save_arrays(path, arrays, {**metadata, key: DEEP})
    image = tmp_path / "img.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(image)
    code, out, err = cli(capsys, "predict", path, image)
    line = one_line(err)
    assert code == 1 and out == "" and str(path) in line and f"'{key}'" in line and "nested" in line
