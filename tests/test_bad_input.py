"""Bad input a user can give (issue 23): each is one line on stderr that names the problem and the
fix, a non-zero exit status, no traceback and nothing half-written.

Crafted checkpoints (a config describing a huge model beside tiny arrays, arrays that do not fit,
NaN weights, a zero std, dataset info or JSON that is incomplete or corrupt), model sizes that
cannot build a model, flags argparse accepts but training must not (NaN, inf, a negative gradient
clip, a limit of 0), 16-bit, truncated and oversized images, a directory, pipe or device where a
file belongs, a full disk, float64 and float16 checkpoints, a test loss that turns NaN, and a resume
with settings that would make it another run or a damaged training state. The last section runs
them all again, as a table, against a finished run and checks that not one file of it changed.
Tiny models on tiny synthetic data: seconds in all.
"""
import errno
import json
import os
import subprocess
import sys
import time
import tracemalloc
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, one_line

import tinyvit as tv
import tinyvit.training.loop
from tinyvit import io
from tinyvit.cli import main
from tinyvit.io.config import state_shapes
from tinyvit.models import config_for, hybrid, masked
from tinyvit.models.vit import ViT, ViTConfig
from tinyvit.training import Classification

# A ViT of a few thousand parameters on 8x8 RGB images of 2 classes: a run takes well under a second.
TINY = ["--model", "vit-cifar/4", "--model-arg", "dim=8", "--model-arg", "depth=1",
        "--model-arg", "num_heads=2", "--model-arg", "mlp_dim=16"]
DATA = {"train_size": 16, "test_size": 8, "image_size": 8, "channels": 3, "num_classes": 2}


@pytest.fixture(scope="module", autouse=True)
def _no_progress_bars():
    """tqdm bars would fill the captured stderr the tests read."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tinyvit.training.loop, "_progress_bar", lambda *args: None)
        yield


def snapshot(folder) -> dict:
    """{path: (bytes, mtime, mode)} of every file under ``folder``, hidden ones included: equal
    snapshots mean nothing was written, created, removed or touched."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_mode)
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture
def data_toml(tmp_path):
    path = tmp_path / "data.toml"
    path.write_text("[dataset]\n" + "".join(f"{k} = {v}\n" for k, v in DATA.items()))
    return path


def train_args(data_toml, out, *extra):
    return ["train", "--dataset", "synthetic", "--config", data_toml, *TINY, "--epochs", "1",
            "--batch-size", "8", "--out", out, *extra]


def tiny_vit(**overrides) -> ViT:
    sizes = {"image_size": 8, "patch_size": 4, "dim": 8, "depth": 1, "num_heads": 2, "mlp_dim": 16, "num_classes": 2}
    return ViT(ViTConfig(**{**sizes, **overrides}))


def png(path, array):
    from PIL import Image
    Image.fromarray(array).save(path)
    return path


# ---------------------------------------------------------------- crafted checkpoints


def craft(path, config: dict, state: dict, arch: str = "vit"):
    """A file that says it is a tinyvit checkpoint of ``config`` but holds the arrays ``state``."""
    io.save_arrays(path, state, {"format": "tinyvit", "arch": arch, "config": json.dumps(config),
                                 "tinyvit_version": tv.__version__})
    return path


def test_a_huge_config_beside_tiny_arrays_is_refused_without_allocating(tmp_path, capsys):
    """The issue's 52 KB file that took 4.5 GB: its config says depth 10000 and width 65536."""
    small = tiny_vit()
    huge = {**asdict(small.config), "depth": 10_000, "dim": 65_536, "num_heads": 1024, "mlp_dim": 262_144}
    path = craft(tmp_path / "crafted.safetensors", huge, small.state_dict())
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as info:
            tv.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20, f"{peak / 2**20:.0f} MiB allocated to refuse a crafted file"
    message = str(info.value)
    assert str(path) in message and "patch_embed.proj.weight" in message and "65536" in message
    assert "tinyvit.save" in message

    image = png(tmp_path / "img.png", np.zeros((8, 8, 3), np.uint8))
    code, out, err = cli(capsys, "predict", path, image)
    assert code == 1 and out == ""
    assert "do not fit the model its config describes" in one_line(err)


def test_load_pretrained_refuses_a_crafted_file_before_building_its_model(tmp_path):
    """load_pretrained reads our own files by another path than load: the same check guards it."""
    small = tiny_vit()
    huge = {**asdict(small.config), "depth": 10_000, "dim": 65_536, "num_heads": 1024, "mlp_dim": 262_144}
    path = craft(tmp_path / "crafted.safetensors", huge, small.state_dict())
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="do not fit the model its config describes"):
            io.load_pretrained(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20, f"{peak / 2**20:.0f} MiB allocated to refuse a crafted file"
    ok = craft(tmp_path / "ok.safetensors", asdict(small.config), small.state_dict())
    assert io.load_pretrained(ok).config == small.config                   # a file that fits still loads


def test_a_config_with_absurdly_many_blocks_costs_only_the_file(tmp_path):
    """Every array of block 0 fits, but the config asks for a billion blocks: refused at block 1,
    not after listing a billion blocks' names."""
    small = tiny_vit()
    path = craft(tmp_path / "deep.safetensors", {**asdict(small.config), "depth": 10 ** 9}, small.state_dict())
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"blocks\.1\.norm1\.weight is missing"):
        tv.load(path)
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("change, words", [
    (lambda s: s.pop("norm.bias"), ["norm.bias is missing"]),
    (lambda s: s.update({"blocks.0.mlp.fc1.weight": np.zeros((8, 15), np.float32)}),
     ["blocks.0.mlp.fc1.weight is (8, 15) in the file but (8, 16) in its config"]),
    (lambda s: s.update({"adapter.weight": np.zeros(3, np.float32)}), ["adapter.weight is not part of that model"]),
    (lambda s: s.update({"norm.weight": np.zeros(8, np.int64)}), ["norm.weight is I64, not floating point"]),
], ids=["missing", "wrong-shape", "unexpected", "integer"])
def test_arrays_that_do_not_fit_the_config_are_named(tmp_path, change, words):
    model = tiny_vit()
    state = dict(model.state_dict())
    change(state)
    path = craft(tmp_path / "bad.safetensors", asdict(model.config), state)
    with pytest.raises(ValueError) as info:
        io.load_checkpoint(path)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("change", [{"patch_size": 0}, {"depth": "12"}, {"resnet_layers": [3, 4]}, {"pool": 3}],
                         ids=["zero-patch", "depth-text", "unknown-field", "pool-number"])
def test_a_damaged_config_is_one_clear_error(tmp_path, change):
    model = tiny_vit()
    path = craft(tmp_path / "bad.safetensors", {**asdict(model.config), **change}, model.state_dict())
    with pytest.raises(ValueError, match="cannot rebuild the model"):
        io.load(path)


def test_a_header_that_claims_more_bytes_than_the_file_holds(tmp_path):
    """safetensors refuses a header whose arrays do not fill the file exactly: the sizes read from a
    header before loading are sizes the file really has."""
    path = tmp_path / "m.safetensors"
    tv.save(tiny_vit(), path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["norm.weight"]["shape"] = [1 << 40]
    header["norm.weight"]["data_offsets"][1] = header["norm.weight"]["data_offsets"][0] + (4 << 40)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        io.load(path)


def test_a_config_that_is_not_json_names_the_file(tmp_path, capsys):
    path = tmp_path / "m.safetensors"
    io.save_arrays(path, tiny_vit().state_dict(), {"format": "tinyvit", "arch": "vit", "config": "{depth: 1"})
    code, out, err = cli(capsys, "predict", path, png(tmp_path / "img.png", np.zeros((8, 8, 3), np.uint8)))
    line = one_line(err)
    assert code == 1 and str(path) in line and "not JSON" in line and "tinyvit.save" in line


@pytest.mark.parametrize("info, words", [
    ({"name": "synthetic", "classes": ["a", "b"], "std": [1.0] * 3}, ["has no mean"]),
    ({"name": "synthetic", "mean": [0.5] * 3, "std": [1.0] * 3}, ["has no classes"]),
    ({"name": "synthetic", "classes": ["a", "b"]}, ["has no mean or std"]),
    ('{"name": "synthetic", "classes": ["a", "b"', ["not valid JSON"]),
], ids=["no-mean", "no-classes", "no-mean-or-std", "not-json"])
def test_incomplete_dataset_info_says_what_is_missing_and_how_to_mend_it(tmp_path, capsys, info, words):
    path = tmp_path / "m.safetensors"
    tv.save(tiny_vit(), path, metadata={"dataset": info if isinstance(info, str) else json.dumps(info)})
    code, out, err = cli(capsys, "predict", path, png(tmp_path / "img.png", np.zeros((8, 8, 3), np.uint8)))
    assert code == 1 and out == ""
    line = one_line(err)
    for word in [str(path), *words, "tinyvit.save(model, path, metadata={'dataset'"]:
        assert word in line, f"{word!r} not in {line!r}"


@pytest.mark.parametrize("arch, config", [
    ("vit", ViTConfig(image_size=16, patch_size=4, dim=8, depth=2, num_heads=2, mlp_dim=12, num_classes=3)),
    ("vit", ViTConfig(image_size=16, patch_size=4, dim=8, depth=1, num_heads=2, mlp_dim=12, num_classes=0,
                      pool="gap", posemb="learned-2d", qkv_bias=False, representation_size=5)),
    ("vit", ViTConfig(image_size=16, patch_size=4, dim=8, depth=1, num_heads=2, mlp_dim=12, num_classes=4,
                      posemb="sincos-2d", representation_size=5)),
    ("hybrid", config_for("r14+vit-cifar/4", dim=8, depth=1, num_heads=2, mlp_dim=8)),
    ("hybrid", hybrid.HybridConfig(image_size=32, resnet_layers=(1, 2), resnet_width_factor=0.25, resnet_groups=4,
                                   dim=8, depth=1, num_heads=2, mlp_dim=8, num_classes=2)),
    ("masked-vit", masked.MaskedConfig(image_size=16, patch_size=4, dim=8, depth=2, num_heads=2, mlp_dim=12,
                                       target="downsized3bit")),
    ("masked-vit", masked.MaskedConfig(image_size=16, patch_size=4, dim=8, depth=1, num_heads=2, mlp_dim=12,
                                       target="pixels-l2", pool="gap")),
], ids=["vit", "vit-gap-2d-no-head", "vit-sincos-prelogits", "hybrid-light", "hybrid-bit", "masked-downsized",
        "masked-pixels-gap"])
def test_state_shapes_are_the_built_models(arch, config):
    """The shapes the loader checks a file against are exactly those of the model it then builds."""
    model = tv.models.model_class(arch)(config)
    assert dict(state_shapes(config)) == {name: tuple(a.shape) for name, a in model.state_dict().items()}


# ---------------------------------------------------------------- numbers argparse accepts and training must not


@pytest.mark.parametrize("flag, value, words", [
    ("--grad-clip", "-1", ["--grad-clip", "> 0", "-1"]),
    ("--lr", "nan", ["--lr", "finite", "nan"]),
    ("--lr", "inf", ["--lr", "finite", "inf"]),
    ("--weight-decay", "nan", ["--weight-decay", "finite"]),
    ("--min-lr=-inf", None, ["--min-lr", "finite"]),                 # argparse reads "-inf" as a flag
    ("--warmup-epochs", "nan", ["--warmup-epochs", "finite"]),
    ("--momentum", "nan", ["--momentum", "finite"]),
    ("--momentum", "1.5", ["--momentum", "[0, 1)"]),
    ("--grad-clip", "nan", ["--grad-clip", "finite"]),
    ("--label-smoothing", "nan", ["--label-smoothing", "finite"]),
    ("--mixup", "inf", ["--mixup", "finite"]),
    ("--cutmix", "nan", ["--cutmix", "finite"]),
    ("--erasing", "nan", ["--erasing", "finite"]),
    ("--drop-path", "nan", ["--drop-path", "finite"]),
    ("--ema", "1", ["--ema", "[0, 1)"]),
    ("--ema", "nan", ["--ema", "finite"]),
    ("--train-limit", "0", ["--train-limit", ">= 1", "0"]),
    ("--train-limit", "-5", ["--train-limit", ">= 1", "-5"]),
    ("--test-limit", "0", ["--test-limit", ">= 1"]),
])
def test_bad_numbers_are_refused_before_training(tmp_path, capsys, data_toml, flag, value, words):
    given = [flag] if value is None else [flag, value]
    code, _, err = cli(capsys, *train_args(data_toml, tmp_path / "run", *given))
    assert code == 2, err
    line = one_line(err)
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    assert not (tmp_path / "run").exists()


def test_nan_in_a_config_file_is_refused(tmp_path, capsys, data_toml):
    """TOML has nan and inf too."""
    config = tmp_path / "run.toml"
    config.write_text("lr = nan\n" + data_toml.read_text())
    code, _, err = cli(capsys, "train", "--dataset", "synthetic", "--config", config, *TINY,
                       "--out", tmp_path / "run")
    assert code == 2 and "--lr must be a finite number" in one_line(err)


@pytest.mark.parametrize("argv, words", [
    (["eval", "CKPT", "--dataset", "synthetic", "--limit", "0"], ["--limit", ">= 1"]),
    (["eval", "CKPT", "--dataset", "synthetic", "--limit", "-3"], ["--limit", "-3"]),
    (["eval", "CKPT", "--dataset", "synthetic", "--batch-size", "0"], ["--batch-size", ">= 1"]),
    (["fewshot", "CKPT", "--dataset", "synthetic", "--l2", "nan"], ["--l2", "finite", "nan"]),
    (["fewshot", "CKPT", "--dataset", "synthetic", "--l2", "1,inf"], ["--l2", "finite"]),
    (["fewshot", "CKPT", "--dataset", "synthetic", "--test-limit", "0"], ["--test-limit", ">= 1"]),
], ids=["eval-limit-0", "eval-limit-negative", "eval-batch-0", "fewshot-l2-nan", "fewshot-l2-inf",
        "fewshot-test-limit-0"])
def test_bad_numbers_of_eval_and_fewshot(tmp_path, capsys, argv, words):
    path = tmp_path / "m.safetensors"
    tv.save(tiny_vit(), path)
    code, out, err = cli(capsys, *[path if a == "CKPT" else a for a in argv])
    assert code == 2 and out == ""
    line = one_line(err)
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"


@pytest.mark.parametrize("setting, words", [
    ("patch_size=0", ["patch_size must be a whole number >= 1, got 0"]),
    ("num_heads=0", ["num_heads must be a whole number >= 1, got 0"]),
    ("mlp_dim=0", ["mlp_dim must be a whole number >= 1, got 0"]),
    ("dim=0", ["dim must be a whole number >= 1, got 0"]),
    ("depth=-2", ["depth must be a whole number >= 1, got -2"]),
    ("depth=abc", ["depth must be a whole number >= 1, got 'abc'"]),
    ("dim=7", ["dim 7 is not divisible by num_heads 2"]),
    ("patch_size=3", ["image_size 8 is not divisible by patch_size 3"]),
    ("dropout=high", ["dropout must be in [0, 1), got 'high'"]),
])
def test_model_sizes_that_build_no_model_are_named(tmp_path, capsys, data_toml, setting, words):
    """Once a division by zero, a "cannot reshape" or a comparison of text with a number."""
    code, _, err = cli(capsys, *train_args(data_toml, tmp_path / "run", "--model-arg", setting))
    assert code == 1
    line = one_line(err)
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    assert not (tmp_path / "run").exists()


def test_fewshot_library_refuses_a_nan_penalty():
    from tinyvit.evaluation import fit_least_squares
    with pytest.raises(ValueError, match="finite"):
        fit_least_squares(np.eye(4), np.array([0, 1, 0, 1]), num_classes=2, l2=float("nan"))


# ---------------------------------------------------------------- images


def test_16_bit_greyscale_is_scaled_not_clipped(tmp_path):
    """Pillow opens a 16-bit PNG as mode I;16 and its convert("L") clips every value above 255 to white."""
    from PIL import Image

    from tinyvit.evaluation import read_image
    values = (np.arange(64, dtype=np.uint16) * 1040).reshape(8, 8)           # 0 .. 65520
    path = png(tmp_path / "deep.png", values)
    assert Image.open(path).mode.startswith("I")
    grey = read_image(path, channels=1, size=8)
    assert grey.shape == (1, 8, 8)
    np.testing.assert_allclose(grey[0], values / 65535, atol=1 / 255)       # 8-bit rounding, no clipping
    rgb = read_image(path, channels=3, size=8)
    np.testing.assert_allclose(rgb, np.broadcast_to(grey, (3, 8, 8)))


def test_floating_point_images_are_refused(tmp_path):
    from PIL import Image

    from tinyvit.evaluation import read_image
    path = tmp_path / "float.tiff"
    Image.fromarray(np.full((8, 8), 0.5, np.float32)).save(path)
    with pytest.raises(ValueError, match="floating-point pixels"):
        read_image(path, channels=3, size=8)


def test_an_image_too_large_to_decode_safely_is_refused(tmp_path, capsys, monkeypatch):
    """A small file can decode to gigabytes: Pillow warns above Image.MAX_IMAGE_PIXELS (and went on
    decoding) and refuses above twice that. Both are one line, in predict and inspect."""
    from PIL import Image
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40)       # 8x8 = 64 pixels: a warning; 16x16: an error
    path = tmp_path / "m.safetensors"
    tv.save(tiny_vit(), path)
    for side in (8, 16):
        image = png(tmp_path / f"big{side}.png", np.zeros((side, side, 3), np.uint8))
        for argv in (["predict", path, image], ["inspect", path, "--images", image, "--out", tmp_path / "maps"]):
            code, out, err = cli(capsys, *argv)
            assert code == 1 and out == ""
            line = one_line(err)
            assert str(image) in line and "too large to decode safely" in line
    assert not list((tmp_path / "maps").glob("*"))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_as_checkpoint_is_refused_not_waited_on(tmp_path):
    """Opening a named pipe to read waits for a writer: once, predict hung there for ever (holding
    the GIL, so it runs in a process of its own here, which a timeout can end)."""
    pipe = tmp_path / "model.safetensors"
    os.mkfifo(pipe)
    image = png(tmp_path / "img.png", np.zeros((8, 8, 3), np.uint8))
    done = subprocess.run([sys.executable, "-m", "tinyvit", "predict", str(pipe), str(image)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert done.returncode == 1 and done.stdout == "" and "is not a regular file" in one_line(done.stderr)


# ---------------------------------------------------------------- a full disk


def disk_full(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def safetensors_disk_full(tensors, filename, metadata=None):
    """How safetensors reports a full disk: its Rust I/O error as text."""
    import safetensors
    raise safetensors.SafetensorError(f"Error while serializing: I/O error: No space left on device (os error 28) "
                                      f'at path "{filename}"')


@pytest.mark.parametrize("target, writer", [("tinyvit.io.arrays._write_safetensors", disk_full),
                                            ("safetensors.numpy.save_file", safetensors_disk_full)],
                         ids=["os-error", "safetensors-error"])
def test_a_full_disk_is_named_and_keeps_the_previous_file(tmp_path, monkeypatch, target, writer):
    path = tmp_path / "m.safetensors"
    tv.save(tiny_vit(), path)
    before = path.read_bytes()
    monkeypatch.setattr(target, writer)
    with pytest.raises(OSError, match="is full") as info:
        tv.save(tiny_vit(num_classes=3), path)
    assert str(tmp_path) in str(info.value) and "free some space" in str(info.value)
    assert path.read_bytes() == before
    assert io.arrays.leftover_temporary_files(tmp_path) == []


def test_a_full_disk_stops_training_with_the_last_checkpoint_whole(tmp_path, capsys, data_toml, monkeypatch):
    out = tmp_path / "run"
    write = io.arrays._write_safetensors

    def full_after_the_first_epoch(path, arrays, metadata):
        if (out / "latest.safetensors").exists():
            disk_full()
        write(path, arrays, metadata)
    monkeypatch.setattr(io.arrays, "_write_safetensors", full_after_the_first_epoch)
    code, _, err = cli(capsys, *train_args(data_toml, out, "--epochs", "2"))
    assert code == 1
    line = one_line(err)
    assert "is full" in line and str(out) in line
    assert json.loads(io.load_arrays(out / "latest.safetensors")[1]["training"])["progress"]["epoch"] == 1
    assert io.arrays.leftover_temporary_files(out) == []


# ---------------------------------------------------------------- float64 and float16 checkpoints


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_a_float64_or_float16_checkpoint_works_in_every_command(tmp_path, capsys, data_toml, dtype):
    """Their models run in float32, as the images fed to them are (once a dtype clash in eval and
    finetune)."""
    path = tmp_path / "m.safetensors"
    tv.save(tiny_vit().to(dtype=dtype), path)
    data = [f"--dataset-arg={k}={v}" for k, v in DATA.items()]
    for argv in (["predict", path, png(tmp_path / "img.png", np.zeros((8, 8, 3), np.uint8))],
                 ["eval", path, "--dataset", "synthetic", *data],
                 ["fewshot", path, "--dataset", "synthetic", *data, "--shots", "2", "--seeds", "1"],
                 ["finetune", path, "--dataset", "synthetic", "--config", data_toml, "--epochs", "1",
                  "--batch-size", "8", "--out", tmp_path / "tuned"]):
        code, _, err = cli(capsys, *argv)
        assert code == 0, err
    tuned, _ = io.load_arrays(tmp_path / "tuned" / "latest.safetensors")
    assert {a.dtype for a in tuned.values() if a.dtype.kind == "f"} == {np.dtype(np.float32)}


# ---------------------------------------------------------------- NaN test loss, NaN weights, a zero std


def nan_at_epoch(monkeypatch, epoch: int):
    """Make the test loss NaN from ``epoch`` on, with a perfect accuracy (which once made it "best")."""
    calls, original = [0], Classification.evaluate

    def evaluate(self, model, loader):
        calls[0] += 1
        result = original(self, model, loader)
        return {**result, "loss": float("nan"), "acc": 1.0} if calls[0] >= epoch else result
    monkeypatch.setattr(Classification, "evaluate", evaluate)


def test_a_nan_test_loss_stops_and_keeps_the_last_good_checkpoints(tmp_path, capsys, data_toml, monkeypatch):
    out = tmp_path / "run"
    nan_at_epoch(monkeypatch, 2)
    code, _, err = cli(capsys, *train_args(data_toml, out, "--epochs", "3"))
    assert code == 1
    line = one_line(err)
    assert "test loss became nan after epoch 2" in line and "last good checkpoint" in line and "--lr" in line
    for name in ("latest", "best"):
        arrays, _ = io.load_arrays(out / f"{name}.safetensors")
        assert all(np.isfinite(a).all() for a in arrays.values())
    assert json.loads(io.load_arrays(out / "latest.safetensors")[1]["training"])["progress"]["epoch"] == 1
    assert io.load_arrays(out / "best.safetensors")[1]["epoch"] == "1"
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1]


def test_a_nan_test_loss_in_the_first_epoch_saves_nothing(tmp_path, capsys, data_toml, monkeypatch):
    out = tmp_path / "run"
    nan_at_epoch(monkeypatch, 1)
    code, _, err = cli(capsys, *train_args(data_toml, out))
    assert code == 1 and "no checkpoint was saved" in one_line(err).lower()
    assert not (out / "latest.safetensors").exists() and not (out / "best.safetensors").exists()


def test_nan_weights_are_refused_by_eval_and_predict(tmp_path, capsys):
    model = tiny_vit()
    model.blocks[0].attn.qkv.weight.data[0, 0] = np.nan
    path = tmp_path / "nan.safetensors"
    tv.save(model, path)
    image = png(tmp_path / "img.png", np.zeros((8, 8, 3), np.uint8))
    for argv in (["predict", path, image], ["eval", path, "--dataset", "synthetic",
                                            *[f"--dataset-arg={k}={v}" for k, v in DATA.items()]]):
        code, out, err = cli(capsys, *argv)
        assert code == 1 and out == ""
        line = one_line(err)
        assert "blocks.0.attn.qkv.weight" in line and "NaN" in line and "earlier checkpoint" in line


@pytest.mark.parametrize("std", [[0.0, 1.0, 1.0], [float("nan"), 1.0, 1.0], [1.0, 1.0]], ids=["zero", "nan", "short"])
def test_a_bad_normalisation_in_the_checkpoint_is_refused(tmp_path, capsys, std):
    path = tmp_path / "m.safetensors"
    info = {"name": "synthetic", "classes": ["a", "b"], "mean": [0.5, 0.5, 0.5], "std": std}
    tv.save(tiny_vit(), path, metadata={"dataset": json.dumps(info)})
    image = png(tmp_path / "img.png", np.zeros((8, 8, 3), np.uint8))
    code, out, err = cli(capsys, "predict", path, image)
    assert code == 1 and out == ""
    assert "positive standard deviations" in one_line(err)


# ---------------------------------------------------------------- resume


@pytest.fixture
def stopped_run(tmp_path, data_toml, capsys):
    """A one-epoch run, to be resumed."""
    out = tmp_path / "run"
    assert cli(capsys, *train_args(data_toml, out))[0] == 0
    return out


@pytest.mark.parametrize("extra, words", [
    (["--batch-size", "4"], ["--batch-size 4", "(the run's: 8)"]),
    (["--optimizer", "sgd"], ["--optimizer 'sgd'", "'adamw'"]),
    (["--model-arg", "depth=2"], ["--model-arg/[model]", "'depth': 2"]),
    (["--seed", "3", "--mixup", "0.2"], ["--seed 3", "--mixup 0.2"]),
    (["--epochs", "2"], ["--epochs 2"]),
], ids=["batch-size", "optimizer", "model", "seed-and-mixup", "epochs"])
def test_resume_refuses_settings_that_change_the_run(stopped_run, data_toml, capsys, extra, words):
    before = (stopped_run / "latest.safetensors").read_bytes()
    code, _, err = cli(capsys, *train_args(data_toml, stopped_run, "--resume", *extra))
    assert code == 1
    line = one_line(err)
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    assert "--out DIR" in line and "config.json" in line
    assert (stopped_run / "latest.safetensors").read_bytes() == before


def test_resume_refuses_another_dataset(stopped_run, data_toml, capsys, tmp_path):
    other = tmp_path / "other.toml"
    other.write_text(data_toml.read_text().replace("num_classes = 2", "num_classes = 3"))
    code, _, err = cli(capsys, "train", "--dataset", "synthetic", "--config", other, *TINY, "--epochs", "1",
                       "--batch-size", "8", "--out", stopped_run, "--resume")
    assert code == 1 and "[dataset]" in one_line(err) and "'num_classes': 3" in err


def test_resume_may_lower_the_lr_and_says_so(stopped_run, data_toml, capsys):
    """The way out of a diverged run (its message says: --resume and a lower --lr) stays open."""
    code, out, err = cli(capsys, *train_args(data_toml, stopped_run, "--resume", "--lr", "1e-4",
                                             "--grad-clip", "1"))
    assert code == 0, err
    assert "resuming with --lr 0.0001 (the run had 0.001)" in out
    assert "resuming with --grad-clip 1.0 (the run had None)" in out


def test_resume_from_a_plain_model_file(tmp_path, data_toml, capsys):
    out = tmp_path / "run"
    out.mkdir()
    tv.save(tiny_vit(), out / "latest.safetensors")
    code, _, err = cli(capsys, *train_args(data_toml, out, "--resume"))
    assert code == 1 and "no training state" in one_line(err) and "finetune" in err


def test_resume_names_a_damaged_training_state(stopped_run, data_toml, capsys):
    latest = stopped_run / "latest.safetensors"
    arrays, metadata = io.load_arrays(latest)
    io.save_arrays(latest, arrays, {**metadata, "training": '{"config": {"lr"'})
    code, _, err = cli(capsys, *train_args(data_toml, stopped_run, "--resume"))
    line = one_line(err)
    assert code == 1 and f"the training state in {latest} is damaged" in line and "--out DIR" in line


def test_resume_names_a_torn_line_of_the_metrics_log(stopped_run, data_toml, capsys):
    with open(stopped_run / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 2, "train_lo')
    code, _, err = cli(capsys, *train_args(data_toml, stopped_run, "--resume"))
    line = one_line(err)
    assert code == 1 and f"{stopped_run / 'metrics.jsonl'}, line 2: not valid JSON" in line


# ---------------------------------------------------------------- all of it again: a finished run stays as it was


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A folder with a finished one-epoch run (run/), the --config files of its data and of other
    data, an image, a text file and crafted checkpoints: everything the table below points at."""
    root = tmp_path_factory.mktemp("finished")
    (root / "data.toml").write_text("[dataset]\n" + "".join(f"{k} = {v}\n" for k, v in DATA.items()))
    (root / "other.toml").write_text((root / "data.toml").read_text().replace("num_classes = 2", "num_classes = 3"))
    assert main([str(a) for a in train_args(root / "data.toml", root / "run")]) == 0
    png(root / "img.png", np.zeros((8, 8, 3), np.uint8))
    (root / "notes.png").write_text("not an image")
    whole = png(root / "big.png", np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)).read_bytes()
    (root / "truncated.png").write_bytes(whole[:len(whole) * 3 // 4])
    small = tiny_vit()
    craft(root / "huge.safetensors", {**asdict(small.config), "depth": 10_000, "dim": 65_536, "num_heads": 1024,
                                      "mlp_dim": 262_144}, small.state_dict())
    small.blocks[0].attn.qkv.weight.data[0, 0] = np.nan
    tv.save(small, root / "nan.safetensors")
    info = {"name": "synthetic", "classes": ["a", "b"], "mean": [0.5] * 3, "std": [0.0, 1.0, 1.0]}
    tv.save(tiny_vit(), root / "zero-std.safetensors", metadata={"dataset": json.dumps(info)})
    return root


TRAIN_RUN = ["train", "--dataset", "synthetic", "--config", "data.toml", *TINY, "--epochs", "1", "--batch-size", "8",
             "--out", "run"]
DATA_ARGS = [f"--dataset-arg={k}={v}" for k, v in DATA.items()]


@pytest.mark.parametrize("argv, status, words", [
    ([*TRAIN_RUN, "--resume", "--lr", "nan"], 2, ["--lr", "finite"]),
    ([*TRAIN_RUN, "--resume", "--grad-clip", "-1"], 2, ["--grad-clip", "> 0"]),
    ([*TRAIN_RUN, "--resume", "--train-limit", "0"], 2, ["--train-limit", ">= 1"]),
    ([*TRAIN_RUN, "--resume", "--epochs", "-1"], 2, ["--epochs", ">= 1"]),
    ([*TRAIN_RUN, "--resume", "--randaug", "two"], 2, ["--randaug", "N,M"]),
    ([*TRAIN_RUN, "--resume", "--model-arg", "width=64"], 2, ["width", "dim"]),
    ([*TRAIN_RUN, "--resume", "--time-budget", "3x"], 2, ["--time-budget", "'3x'"]),
    ([*TRAIN_RUN, "--resume", "--time-budget", "10m"], 2, ["--epochs or --time-budget, not both"]),
    (TRAIN_RUN, 1, ["already holds a run", "--resume", "--out DIR"]),
    ([*TRAIN_RUN, "--resume", "--batch-size", "4"], 1, ["--batch-size 4", "(the run's: 8)", "--out DIR"]),
    ([*TRAIN_RUN, "--resume", "--config", "other.toml"], 1, ["[dataset]", "'num_classes': 3"]),
    (["finetune", "run/best.safetensors", "--dataset", "synthetic", "--epochs", "0", "--out", "run"], 2,
     ["--epochs", ">= 1"]),
    (["eval", "run/best.safetensors", "--dataset", "synthetic", *DATA_ARGS, "--limit", "0"], 2, ["--limit", ">= 1"]),
    (["eval", "run/best.safetensors", "--dataset", "synthetic", "--dataset-arg=num_classes=3",
      "--dataset-arg=image_size=8", "--json", "run/eval.json"], 1, ["classes"]),
    (["predict", "run/best.safetensors", "img.png", "--topk", "0"], 2, ["--topk"]),
    (["predict", "run/best.safetensors", "missing.png"], 1, ["missing.png"]),
    (["predict", "run/best.safetensors", "notes.png"], 1, ["notes.png", "not an image"]),
    (["predict", "huge.safetensors", "img.png"], 1, ["do not fit the model its config describes"]),
    (["predict", "nan.safetensors", "img.png"], 1, ["blocks.0.attn.qkv.weight", "NaN"]),
    (["predict", "zero-std.safetensors", "img.png"], 1, ["positive standard deviations"]),
    (["fewshot", "run/best.safetensors", "--dataset", "synthetic", "--l2", "nan"], 2, ["--l2", "finite"]),
    (["predict", "run", "img.png"], 1, ["run is a directory"]),
    (["eval", "run", "--dataset", "synthetic", *DATA_ARGS], 1, ["run is a directory"]),
    (["predict", "run/best.safetensors", "run"], 1, ["image file run is a directory"]),
    ([*TRAIN_RUN, "--resume", "--config", "run"], 2, ["--config: run is a directory"]),
    (["predict", "/dev/zero", "img.png"], 1, ["/dev/zero is not a regular file"]),
    (["predict", "/dev/null", "img.png"], 1, ["/dev/null is not a regular file"]),
    (["predict", "run/best.safetensors", "truncated.png"], 1, ["truncated.png is truncated or damaged"]),
    (["inspect", "run/best.safetensors", "--images", "truncated.png", "--out", "run"], 1,
     ["truncated.png is truncated or damaged"]),
    ([*TRAIN_RUN[:-1], "new", "--model-arg", "mlp_dim=0"], 1, ["mlp_dim must be a whole number >= 1"]),
], ids=["lr-nan", "grad-clip-negative", "train-limit-0", "epochs-negative", "randaug-word", "model-arg-unknown",
        "time-budget-3x", "time-budget-and-epochs", "run-exists", "resume-other-batch-size", "resume-other-dataset",
        "finetune-epochs-0", "eval-limit-0", "eval-other-classes", "predict-topk-0", "predict-missing-image",
        "predict-not-an-image", "predict-crafted-huge", "predict-nan-weights", "predict-zero-std", "fewshot-l2-nan",
        "predict-checkpoint-directory", "eval-checkpoint-directory", "predict-image-directory", "config-directory",
        "predict-dev-zero", "predict-dev-null", "predict-truncated-image", "inspect-truncated-image",
        "model-arg-mlp-dim-0"])
def test_bad_input_changes_no_file(finished, capsys, monkeypatch, argv, status, words):
    """Each mistake against a finished run and its checkpoints: the documented exit status, the
    problem named in one line (after argparse's usage, for the errors argparse reports itself), no
    traceback, and every file under the folder byte for byte, mtime and mode as it was."""
    monkeypatch.chdir(finished)
    before = snapshot(finished)
    code, _, err = cli(capsys, *argv)
    assert code == status, err
    lines = err.strip().splitlines()
    line = lines[-1] if lines[0].startswith("usage:") else one_line(err)
    assert "Traceback" not in err and line.startswith(f"tinyvit {argv[0]}: ")
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    assert snapshot(finished) == before
