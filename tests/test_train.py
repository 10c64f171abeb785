"""`tinyvit train | finetune | eval | predict` end to end, through the real entry point
``tinyvit.cli.main``, with tiny ViTs on small synthetic datasets (a few seconds each on a CPU).

What a run must leave behind (metrics, curves, checkpoints), that it learns, that a run stopped
(after an epoch, by Ctrl-C in the middle of a step or during evaluation) and resumed ends with
bitwise the same weights and optimizer state as one that never stopped, that a diverging run keeps
its last good checkpoint, and that every mistake a user can make gets one clear line and the
documented exit status (2: usage, 1: data/file/value problems, 130: interrupted).
"""
import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, one_line

import tinyvit as tv
import tinyvit.evaluation
import tinyvit.data
import tinyvit.training.components
import tinyvit.training.loop
from tinyvit import io, optim
from tinyvit.cli import main, read_toml
from tinyvit.data import Augment, DataLoader, load_dataset
from tinyvit.training import prepare_finetune
from tinyvit.training import Classification, TrainConfig, train

REPO = Path(__file__).resolve().parent.parent

# A ViT small enough to train in seconds: D=32, 2 blocks, 2 heads, patch 4.
TINY = ["--model", "vit-cifar/4", "--model-arg", "dim=32", "--model-arg", "depth=2",
        "--model-arg", "num_heads=2", "--model-arg", "mlp_dim=64"]
# The main run's data: 6 classes (so top-5 is a real cut), 16x16 RGB.
DATA = dict(train_size=256, test_size=120, image_size=16, channels=3, num_classes=6)
DATA_ARGS = [arg for key, value in DATA.items() for arg in ("--dataset-arg", f"{key}={value}")]   # for eval


@pytest.fixture(scope="module", autouse=True)
def _no_progress_bars():
    """tqdm bars would fill the captured stderr the tests read."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tinyvit.training.loop, "_progress_bar", lambda *args: None)
        yield


def toml(path: Path, top: str = "", model: dict | None = None, dataset: dict | None = None) -> str:
    """Write a --config file: top-level lines, then [model] and [dataset] tables."""
    lines = [top]
    for table, values in (("model", model), ("dataset", dataset)):
        if values:
            lines.append(f"[{table}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def checkpoint_state(path):
    """(arrays: model weights and optimizer moments, the training state saved with them)."""
    arrays, meta = io.load_arrays(path)
    return arrays, json.loads(meta["training"])


def metrics(run: Path) -> list:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def assert_same_run(a: Path, b: Path):
    """Two runs ended with bitwise the same weights, optimizer moments and step counts, schedule,
    data order and random state."""
    arrays_a, state_a = checkpoint_state(a / "latest.safetensors")
    arrays_b, state_b = checkpoint_state(b / "latest.safetensors")
    assert sorted(arrays_a) == sorted(arrays_b)
    assert any(k.startswith("extra/optimizer.") for k in arrays_a), "no optimizer state in the checkpoint"
    for name in arrays_a:
        assert arrays_a[name].dtype == arrays_b[name].dtype, name
        assert np.array_equal(arrays_a[name], arrays_b[name]), f"{name} differs"
    for key in ("optimizer", "scheduler", "loader", "rng"):
        assert state_a[key] == state_b[key], f"{key} state differs"
    assert state_a["progress"]["epoch"] == state_b["progress"]["epoch"]
    rows_a, rows_b = metrics(a), metrics(b)
    assert [r["epoch"] for r in rows_a] == [r["epoch"] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b):
        assert ra["test_acc"] == rb["test_acc"] and ra["test_loss"] == rb["test_loss"]
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-5)   # summed in two parts
        assert ra["train_acc"] == pytest.approx(rb["train_acc"], rel=1e-6)


# ---------------------------------------------------------------- a trained run, shared by several tests


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def data_toml(workdir):
    return toml(workdir / "data.toml", dataset=DATA)


@pytest.fixture(scope="module")
def trained(workdir, data_toml):
    """`tinyvit train` on the synthetic set: 2 epochs of 8 steps."""
    out = workdir / "run"
    code = main(["train", "--dataset", "synthetic", "--config", data_toml, *TINY, "--epochs", "2",
                 "--batch-size", "32", "--lr", "3e-3", "--out", str(out)])
    assert code == 0
    return out


def test_train_learns_and_writes_its_outputs(trained):
    rows = metrics(trained)
    assert [r["epoch"] for r in rows] == [1, 2]
    for r in rows:
        assert {"epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr", "seconds"} <= set(r)
        assert all(math.isfinite(r[k]) for k in ("train_loss", "test_loss", "lr", "seconds"))
        assert 0 <= r["train_acc"] <= 1 and 0 <= r["test_acc"] <= 1 and r["seconds"] > 0
    assert rows[-1]["test_acc"] > 3 / DATA["num_classes"], rows        # far above chance
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert rows[-1]["lr"] < rows[0]["lr"]                              # cosine decay after warmup

    png = (trained / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    from PIL import Image
    with Image.open(trained / "curves.png") as img:
        assert img.format == "PNG" and min(img.size) > 100

    latest = io.load(trained / "latest.safetensors")
    best = io.load(trained / "best.safetensors")
    assert latest.config.num_classes == best.config.num_classes == DATA["num_classes"]
    assert (latest.config.image_size, latest.config.dim, latest.config.depth) == (16, 32, 2)
    _, state = checkpoint_state(trained / "latest.safetensors")
    assert state["progress"]["epoch"] == 2
    assert state["progress"]["best_acc"] == max(r["test_acc"] for r in rows)
    config = json.loads((trained / "config.json").read_text())
    assert config["dataset_args"] == DATA and config["model_args"]["dim"] == 32


def test_existing_run_needs_resume(trained, data_toml, capsys):
    before = (trained / "latest.safetensors").read_bytes()
    code, _, err = cli(capsys, "train", "--dataset", "synthetic", "--config", data_toml, *TINY,
                       "--epochs", "2", "--out", trained)
    assert code == 1
    line = one_line(err)
    assert str(trained) in line and "--resume" in line and "--out" in line
    assert (trained / "latest.safetensors").read_bytes() == before


def test_resume_without_checkpoint(tmp_path, data_toml, capsys):
    code, _, err = cli(capsys, "train", "--dataset", "synthetic", "--config", data_toml, *TINY,
                       "--out", tmp_path / "new", "--resume")
    assert code == 1
    line = one_line(err)
    assert "--resume" in line and "latest.safetensors" in line


# ---------------------------------------------------------------- resume: bitwise the same as never stopping

# Every source of randomness on: crop, flip, RandAugment, Mixup/CutMix, erasing, dropout, drop-path.
AUG_DATA = dict(train_size=128, test_size=40, image_size=16, channels=3, num_classes=4)
AUG_TOP = """
epochs = 2
batch-size = 32
lr = 2e-3
warmup-epochs = 1
crop-padding = 2
flip = true
randaug = "2,5"
mixup = 0.8
cutmix = 1.0
erasing = 0.25
label-smoothing = 0.1
drop-path = 0.1
ema = 0.9
"""
AUG_MODEL = dict(dim=32, depth=2, num_heads=2, mlp_dim=64, dropout=0.1, attn_dropout=0.1)
# (TOML cannot hold both `model = "..."` and a [model] table, nor `dataset = "..."` and a [dataset]
# table: the names go on the command line.)


@pytest.fixture(scope="module")
def aug(workdir):
    """The flags of the augmented run: its --config file and --model."""
    return ["--config", toml(workdir / "aug.toml", AUG_TOP, model=AUG_MODEL, dataset=AUG_DATA),
            "--dataset", "synthetic", "--model", "vit-cifar/4"]


@pytest.fixture(scope="module")
def straight(workdir, aug):
    """The reference: 2 epochs (4 steps each) that never stopped."""
    out = workdir / "straight"
    assert main(["train", *aug, "--out", str(out)]) == 0
    return out


def test_stopped_after_an_epoch_and_resumed_equals_straight_run(straight, aug, tmp_path, capsys):
    out = tmp_path / "stopped"
    cfg = TrainConfig.from_dict({**read_toml(aug[1]), "dataset": aug[3], "model": aug[5], "out": str(out)})
    result = train(cfg, stop_after_epoch=1, progress=False, log=lambda *a, **k: None)
    assert result["epoch"] == 1 and len(metrics(out)) == 1
    code, stdout, _ = cli(capsys, "train", *aug, "--out", out, "--resume")
    assert code == 0 and "resumed" in stdout
    assert_same_run(straight, out)


def test_ema_run_keeps_the_average_as_best_and_the_trained_weights_to_resume(straight):
    """With --ema, latest.safetensors holds the trained weights (and the average beside them, as
    extra/ema.*), best.safetensors and the test accuracy are the average's, and the last epoch also
    reports the trained weights' accuracy."""
    arrays, state = checkpoint_state(straight / "latest.safetensors")
    model, _, _ = io.load_checkpoint(straight / "latest.safetensors")
    ema = {name[len("extra/ema."):]: a for name, a in arrays.items() if name.startswith("extra/ema.")}
    weights = {name: p.numpy() for name, p in model.named_parameters()}
    assert sorted(ema) == sorted(weights) and state["ema_step"] == 8         # 2 epochs x 4 steps
    assert all(not np.array_equal(ema[n], weights[n]) for n in weights if "norm" not in n)
    rows = metrics(straight)
    assert "test_acc_without_ema" in rows[-1] and "test_acc_without_ema" not in rows[0]
    best_epoch = max(range(len(rows)), key=lambda i: (rows[i]["test_acc"], -rows[i]["test_loss"])) + 1
    assert best_epoch == len(rows)           # (this run improves every epoch): best = the last average
    best = tv.load(straight / "best.safetensors")
    for name, p in best.named_parameters():
        assert np.array_equal(p.numpy(), ema[name]), name
    with tv.no_grad():                       # and the accuracy logged is the average's
        acc = tinyvit.evaluation.evaluate(best, _test_loader(straight))["acc"]
    assert acc == rows[-1]["test_acc"]


def _test_loader(run):
    cfg = TrainConfig.from_dict(json.loads((run / "config.json").read_text()))
    dataset = tinyvit.training.load_data(cfg.dataset, cfg.data_dir, cfg.dataset_args)
    return DataLoader(dataset.test_images, dataset.test_labels, cfg.eval_batch_size,
                      transform=tinyvit.training.components.make_transforms(cfg, dataset)[1])


def _interrupt_after(monkeypatch, cls, name, calls):
    """Make cls.name raise KeyboardInterrupt at its call number ``calls`` (1-based), as Ctrl-C would."""
    original, count = getattr(cls, name), [0]

    def wrapper(self, *args, **kwargs):
        count[0] += 1
        if count[0] == calls:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)
    monkeypatch.setattr(cls, name, wrapper)


@pytest.mark.parametrize("where, calls", [("step", 3), ("evaluate", 1)],
                         ids=["mid-epoch-1-forward", "during-evaluation"])
def test_ctrl_c_saves_and_resume_finishes_the_same_run(straight, aug, tmp_path, capsys, monkeypatch,
                                                       where, calls):
    out = tmp_path / "interrupted"
    with monkeypatch.context() as mp:
        _interrupt_after(mp, Classification, where, calls)
        code, stdout, _ = cli(capsys, "train", *aug, "--out", out)
    assert code == 130
    assert "interrupted" in stdout and "--resume" in stdout
    _, state = checkpoint_state(out / "latest.safetensors")
    assert state["progress"]["epoch"] == 0
    if where == "step":          # two steps done, the third was interrupted before its update
        assert state["loader"]["position"] == 2 and state["scheduler"]["step"] == 2

    code, stdout, err = cli(capsys, "train", *aug, "--out", out, "--resume")
    assert code == 0, stdout + err
    assert_same_run(straight, out)


def test_ctrl_c_during_the_update_lands_after_it(straight, aug, tmp_path, capsys, monkeypatch):
    """A real SIGINT arriving while the optimizer writes the weights: the update is completed (never
    half applied) before the run stops, and the resumed run is still the straight one."""
    out, count, original = tmp_path / "sigint", [0], optim.AdamW.step

    def step(self):
        count[0] += 1
        if count[0] == 6:                                  # epoch 2, second step
            os.kill(os.getpid(), signal.SIGINT)            # delivered before the update starts
        original(self)
    with monkeypatch.context() as mp:
        mp.setattr(optim.AdamW, "step", step)
        code, _, _ = cli(capsys, "train", *aug, "--out", out)
    assert code == 130
    _, state = checkpoint_state(out / "latest.safetensors")
    assert state["progress"]["epoch"] == 1 and state["scheduler"]["step"] == 6
    assert cli(capsys, "train", *aug, "--out", out, "--resume")[0] == 0
    assert_same_run(straight, out)


# ---------------------------------------------------------------- a diverging run


@pytest.mark.parametrize("nan_at_step", [6, 2], ids=["epoch-2", "epoch-1"])
def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(aug, tmp_path, capsys, monkeypatch,
                                                              nan_at_step):
    out, count, original = tmp_path / "nan", [0], Classification.step

    def step(self, model, x, y):
        count[0] += 1
        loss, correct = original(self, model, x, y)
        return (loss * float("nan") if count[0] >= nan_at_step else loss), correct
    monkeypatch.setattr(Classification, "step", step)
    code, _, err = cli(capsys, "train", *aug, "--out", out)
    assert code == 1
    line = one_line(err)
    assert "nan" in line.lower() and "--lr" in line
    latest = out / "latest.safetensors"
    if nan_at_step > 4:                                    # epoch 1 (4 steps) ended well
        assert str(latest) in line and "last good checkpoint" in line
        arrays, state = checkpoint_state(latest)
        assert state["progress"]["epoch"] == 1
        assert all(np.isfinite(a).all() for a in arrays.values())
        assert [r["epoch"] for r in metrics(out)] == [1]
    else:                                                  # nothing good to keep: say so
        assert not latest.exists()
        assert "no checkpoint was saved" in line.lower()


# ---------------------------------------------------------------- eval and predict


def test_eval_prints_report_and_writes_json(trained, tmp_path, capsys):
    report = tmp_path / "eval.json"
    code, out, _ = cli(capsys, "eval", trained / "best.safetensors", "--dataset", "synthetic", *DATA_ARGS,
                       "--json", report)
    assert code == 0
    assert "accuracy" in out and "per-class accuracy" in out and "confusion matrix" in out
    assert all(f"class_{k}" in out for k in range(DATA["num_classes"]))
    result = json.loads(report.read_text())
    matrix = np.array(result["confusion"])
    assert matrix.shape == (6, 6) and matrix.sum() == DATA["test_size"]
    assert result["accuracy"] == pytest.approx(np.trace(matrix) / matrix.sum())
    # best.safetensors is the epoch with the best test accuracy, measured the same way
    assert result["accuracy"] == max(r["test_acc"] for r in metrics(trained))
    assert f"({np.trace(matrix)}/{DATA['test_size']})" in out
    per_class = np.diag(matrix) / matrix.sum(axis=1)
    assert result["per_class_accuracy"] == pytest.approx(per_class.tolist())

    code, out, _ = cli(capsys, "eval", trained / "best.safetensors", "--dataset", "synthetic", *DATA_ARGS,
                       "--limit", "50", "--json", report)
    assert code == 0 and np.array(json.loads(report.read_text())["confusion"]).sum() == 50


def test_eval_model_dataset_mismatch(tmp_path, capsys):
    grey = tv.models.create("vit-mnist/4", image_size=16, dim=16, depth=1, num_heads=2, mlp_dim=32,
                            num_classes=6)
    tv.save(grey, tmp_path / "grey.safetensors")
    code, _, err = cli(capsys, "eval", tmp_path / "grey.safetensors", "--dataset", "synthetic", *DATA_ARGS)
    assert code == 1
    line = one_line(err)
    assert "1x16x16" in line and "3x16x16" in line
    code, _, err = cli(capsys, "eval", tmp_path / "grey.safetensors", "--dataset", "synthetic",
                       "--dataset-arg", "test_size")
    assert code == 2 and "KEY=VALUE" in one_line(err)


def _save_png(array_chw: np.ndarray, path: Path):
    from PIL import Image
    Image.fromarray(np.ascontiguousarray(array_chw.transpose(1, 2, 0))).save(path)


def test_predict_top5(trained, tmp_path, capsys):
    from PIL import Image
    ds = load_dataset("synthetic", **DATA)
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"img{i}.png")
        _save_png(ds.test_images[i], paths[-1])
    paths.append(tmp_path / "other.jpg")                               # another size, greyscale, JPEG
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 40), dtype=np.uint8)).save(paths[-1])

    ckpt = trained / "best.safetensors"
    code, out, _ = cli(capsys, "predict", ckpt, *paths)
    assert code == 0
    blocks = out.strip().split("\n")
    assert len(blocks) == 3 * 6
    model = io.load(ckpt)
    x, _ = Augment(ds.mean, ds.std)(ds.test_images[:2], ds.test_labels[:2])     # as in evaluation
    with tv.no_grad():
        expected = tv.functional.softmax(model(x), axis=-1).numpy()
    for i, path in enumerate(paths):
        header, *top = blocks[6 * i:6 * i + 6]
        assert header.split("  (")[0] == str(path) and header.endswith(")")     # then how it was prepared
        probs = [float(line.split("%")[0]) / 100 for line in top]
        names = [line.split("%")[1].strip() for line in top]
        assert len(top) == 5 and probs == sorted(probs, reverse=True)
        assert sum(probs) <= 1 + 5e-5 and min(probs) >= 0
        assert all(name.startswith("class_") for name in names) and len(set(names)) == 5
        if i < 2:       # a dataset image gives what the model gives it in evaluation
            assert names[0] == f"class_{expected[i].argmax()}"
            assert probs[0] == pytest.approx(expected[i].max(), abs=1e-4)


def test_predict_bad_files(trained, tmp_path, capsys):
    ckpt = trained / "best.safetensors"
    missing = tmp_path / "missing.png"
    code, out, err = cli(capsys, "predict", ckpt, missing)
    assert code == 1 and out == "" and str(missing) in one_line(err)
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    code, _, err = cli(capsys, "predict", ckpt, text)
    assert code == 1 and str(text) in one_line(err) and "not an image" in err
    code, _, err = cli(capsys, "predict", ckpt, text, "--topk", "0")
    assert code == 2 and "--topk" in one_line(err)


# ---------------------------------------------------------------- fine-tuning


def test_prepare_finetune_zero_head_and_interpolated_posemb(trained):
    old = io.load(trained / "best.safetensors")
    new = prepare_finetune(trained / "best.safetensors", num_classes=4, image_size=24)
    assert new.config.num_classes == 4 and new.config.image_size == 24
    assert new.head.weight.shape == (32, 4)
    assert not np.any(new.head.weight.data) and not np.any(new.head.bias.data)
    assert new.pos_embed.shape == (1, 1 + 6 * 6, 32) and old.pos_embed.shape == (1, 1 + 4 * 4, 32)
    np.testing.assert_array_equal(new.pos_embed.data[:, 0], old.pos_embed.data[:, 0])   # class token's
    for name, value in old.state_dict().items():
        if not name.startswith(("head.", "pos_embed")):
            np.testing.assert_array_equal(new.state_dict()[name], value, err_msg=name)


def test_finetune_new_classes_larger_images_with_ctrl_c_and_resume(trained, tmp_path, capsys, monkeypatch):
    ft_data = dict(train_size=160, test_size=60, image_size=16, channels=3, num_classes=4)
    config = toml(tmp_path / "ft.toml", dataset=ft_data)
    out = tmp_path / "ft"
    argv = ["finetune", trained / "best.safetensors", "--dataset", "synthetic", "--config", config,
            "--image-size", "24", "--epochs", "2", "--batch-size", "32", "--drop-path", "0.05", "--out", out]
    with monkeypatch.context() as mp:
        _interrupt_after(mp, Classification, "step", 7)     # epoch 2 of 2 (5 steps each)
        code, stdout, _ = cli(capsys, *argv)
    assert code == 130
    assert "resizing synthetic images from 16 to 24" in stdout
    code, stdout, err = cli(capsys, *argv, "--resume")
    assert code == 0, err

    settings = json.loads((out / "config.json").read_text())
    assert (settings["optimizer"], settings["momentum"], settings["grad_clip"], settings["weight_decay"]) == \
        ("sgd", 0.9, 1.0, 0.0)
    model = io.load(out / "latest.safetensors")
    assert (model.config.num_classes, model.config.image_size, model.config.drop_path) == (4, 24, 0.05)
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert rows[-1]["test_acc"] > 2 / ft_data["num_classes"], rows


# ---------------------------------------------------------------- choosing the model


@pytest.mark.parametrize("size, channels, preset", [(28, 1, "vit-mnist/7"), (32, 3, "vit-cifar/4")])
def test_default_preset_fits_the_images(tmp_path, capsys, size, channels, preset):
    data = dict(train_size=16, test_size=8, image_size=size, channels=channels, num_classes=10)
    config = toml(tmp_path / "d.toml", dataset=data)
    code, _, err = cli(capsys, "train", "--dataset", "synthetic", "--config", config, "--epochs", "1",
                       "--batch-size", "16", "--out", tmp_path / "run")
    assert code == 0, err
    got = io.load(tmp_path / "run" / "latest.safetensors").config
    want = tv.models.config_for(preset, image_size=size, in_channels=channels, num_classes=10)
    assert (got.dim, got.depth, got.num_heads, got.mlp_dim, got.patch_size) == \
        (want.dim, want.depth, want.num_heads, want.mlp_dim, want.patch_size)
    assert (got.image_size, got.in_channels) == (size, channels)


# ---------------------------------------------------------------- mistakes get one clear line


SMALL = dict(train_size=8, test_size=4, image_size=16, channels=3, num_classes=2)


@pytest.mark.parametrize("args, config, status, words", [
    (["--epochs", "-1"], None, 2, ["--epochs", ">= 1", "-1"]),
    (["--lr", "-0.1"], None, 2, ["--lr", ">= 0"]),
    (["--randaug", "two"], None, 2, ["--randaug", "N,M", "two"]),
    (["--randaug", "2,11"], None, 2, ["--randaug", "2,11"]),
    (["--model-arg", "dim"], None, 2, ["--model-arg", "KEY=VALUE", "dim"]),
    (["--model-arg", "width=64"], None, 2, ["width", "dim"]),
    (["--model", "vit-tiny/4"], None, 2, ["vit-tiny/4", "vit-cifar/4", "vit-b/16"]),
    (["--config", "missing.toml"], None, 2, ["--config", "missing.toml"]),
    ([], "batch-size = 'ten'", 2, ["--batch-size", "batch_size", "whole number", "ten"]),
    ([], "epoch = 3", 2, ["unknown", "epoch"]),
    ([], "[optim]\nlr = 1", 2, ["unknown tables", "optim"]),
    ([], "epochs = 3 x", 2, ["--config", "not valid TOML"]),
    ([], "[dataset]\ntrainsize = 8", 1, ["[dataset]", "trainsize"]),
    ([], "[dataset]\ntrain_size = 'many'", 1, ["[dataset]", "train_size"]),
], ids=["negative-epochs", "negative-lr", "randaug-word", "randaug-magnitude", "model-arg-no-equals",
        "model-arg-unknown", "unknown-model", "missing-config", "toml-wrong-type", "toml-unknown-key",
        "toml-unknown-table", "toml-syntax", "toml-unknown-dataset-key", "toml-dataset-wrong-type"])
def test_bad_train_settings_give_one_clear_line(tmp_path, capsys, args, config, status, words):
    if config is not None:                                  # the mistake is in the --config file
        (tmp_path / "bad.toml").write_text(config + "\n")
        args = [*args, "--config", tmp_path / "bad.toml"]
    elif "--config" in args:
        args = [tmp_path / a if a.endswith(".toml") else a for a in args]
    else:
        args = [*args, "--config", toml(tmp_path / "d.toml", dataset=SMALL)]
    code, out, err = cli(capsys, "train", "--dataset", "synthetic", *TINY, "--epochs", "1", *args,
                         "--out", tmp_path / "run")
    assert code == status, err
    line = one_line(err)
    assert line.startswith("tinyvit train: ")
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    assert not (tmp_path / "run").exists()                 # nothing started


def test_unknown_optimizer_is_a_usage_error(tmp_path, capsys):
    """argparse's own errors: exit 2, the problem on the last line after the usage."""
    code, _, err = cli(capsys, "train", "--optimizer", "lion", "--out", tmp_path / "run")
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert "--optimizer" in last and "lion" in last and "adamw" in last
    code, _, err = cli(capsys, "train", "--epochs", "ten")
    assert code == 2 and "--epochs" in err.strip().splitlines()[-1]


def test_finetune_bad_settings_are_usage_errors(trained, tmp_path, capsys):
    code, _, err = cli(capsys, "finetune", trained / "best.safetensors", "--dataset", "synthetic",
                       "--epochs", "0", "--out", tmp_path / "ft")
    assert code == 2 and "--epochs" in one_line(err)
    code, _, err = cli(capsys, "finetune", tmp_path / "nothing.safetensors", "--dataset", "synthetic",
                       "--config", toml(tmp_path / "d.toml", dataset=SMALL), "--out", tmp_path / "ft")
    assert code == 1 and "nothing.safetensors" in one_line(err)
    code, _, err = cli(capsys, "finetune", trained / "best.safetensors", "--dataset", "synthetic",
                       "--model", "vit-cifar/4", "--out", tmp_path / "ft")
    assert code == 2 and "--model" in one_line(err) and "CHECKPOINT" in err
    code, _, err = cli(capsys, "finetune", trained / "best.safetensors", "--dataset", "synthetic",
                       "--config", toml(tmp_path / "d.toml", dataset=SMALL), "--model-arg", "depht=3",
                       "--out", tmp_path / "ft")
    assert code == 1 and "depht" in one_line(err)
    assert not (tmp_path / "ft").exists()


# ---------------------------------------------------------------- CIFAR without its data


def _refused_url() -> str:
    """A URL on 127.0.0.1 whose port nothing listens on (connection refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/cifar-10-python.tar.gz"


def test_cifar_missing_and_not_downloadable_says_what_to_do(tmp_path, capsys):
    empty = tmp_path / "data"
    empty.mkdir()
    url = _refused_url()
    config = toml(tmp_path / "mirror.toml", dataset={"url": url})
    code, _, err = cli(capsys, "train", "--dataset", "cifar10", "--data-dir", empty, "--config", config,
                       "--out", tmp_path / "run")
    assert code == 1
    assert err.startswith("tinyvit train: CIFAR-10 is not in")
    for what in (url, str(empty), "--data-dir", "cifar-10-python.tar.gz", "cifar-10-batches-py",
                 "download_cifar.py"):
        assert what in err, f"{what!r} missing from:\n{err}"
    assert list(empty.iterdir()) == []                     # no half-downloaded file left behind
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", ["download_cifar.py", "prepare_fashion_mnist.py", "fashion_mnist_folder.py"])
def test_data_scripts_help(script):
    done = subprocess.run([sys.executable, str(REPO / "data_scripts" / script), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--root" in done.stdout
