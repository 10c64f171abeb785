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
import importlib
import json
import shutil
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


def test_a_diverging_run_is_one_line_without_numpy_warnings(tmp_path, capsys, data_toml):
    code, _, err = cli(capsys, *train_args(data_toml, tmp_path / "run", "--lr", "1e308"))
    line = one_line(err)                                     # no "RuntimeWarning: overflow" lines before it
    assert code == 1 and "the loss became nan" in line and "lower --lr" in line


# ---------------------------------------------------------------- the table (items 7 and 8)


def gpu_usable() -> bool:
    """Whether CuPy reaches a GPU here (asked of CuPy itself: tinyvit's backend is left as it is)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def snapshot(root) -> dict:
    """{path: (bytes, mtime, mode)} of every file under ``root``, links and hidden files included
    (a link's target read through it): equal snapshots mean nothing was written, made or removed."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = ("link", str(p.readlink()))
        elif p.is_file():
            out[str(p.relative_to(root))] = (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_mode)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One folder holding everything the table points at: a finished run (run/), --config files, a
    file outside any run, a run folder with a link to it, a damaged run, crafted checkpoints, and
    data folders that are bombs (a CIFAR pickle of nested lists, a Fashion-MNIST gzip bomb)."""
    from test_data_bombs import fashion_folder, gzip_bomb, nested
    from test_data_cifar import cifar_batch, py2_pickle, write_cifar10_folder

    from tinyvit.cli import main
    root = tmp_path_factory.mktemp("world")
    (root / "data.toml").write_text(DATA)
    assert main(["train", "--dataset", "synthetic", "--config", str(root / "data.toml"), *TINY, "--epochs", "1",
                 "--batch-size", "8", "--out", str(root / "run")]) == 0
    for name, text in {"ten.toml": 'lr = "high"\n', "model-args.toml": "model_args = 3\n",
                       "internal.toml": "from_recipe = []\n", "seed.toml": "seed = -1\n",
                       "no-test.toml": DATA.replace("test_size = 8", "test_size = 0")}.items():
        (root / name).write_text(text + (DATA if "[dataset]" not in text else ""))
    (root / "outside.txt").write_text("not the run's\n")
    shutil.copytree(root / "run", root / "linked")
    (root / "linked" / "metrics.jsonl").unlink()
    (root / "linked" / "metrics.jsonl").symlink_to(root / "outside.txt")
    shutil.copytree(root / "run", root / "damaged")
    arrays, metadata = io.load_arrays(root / "damaged" / "latest.safetensors")
    state = json.loads(metadata["training"])
    state["progress"]["epoch"] = "1"
    io.save_arrays(root / "damaged" / "latest.safetensors", arrays, {**metadata, "training": json.dumps(state)})
    tv.save(tiny_vit(), root / "deep.safetensors", metadata={"dataset": "[" * 100_000 + "]" * 100_000})
    from PIL import Image
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(root / "img.png")
    write_cifar10_folder(root / "cifar-bomb" / "cifar-10-batches-py", np.random.default_rng(0), n=4)
    batch, _, _ = cifar_batch(np.random.default_rng(1), 4)
    batch[b"labels"] = nested(10, 10)
    (root / "cifar-bomb" / "cifar-10-batches-py" / "data_batch_1").write_bytes(py2_pickle(batch))
    (root / "gzip-bomb").mkdir()
    gzip_bomb(fashion_folder(root / "gzip-bomb") / "train-images-idx3-ubyte.gz", (5_000_000, 28, 28), 4 << 30)
    return root


RUN = ["train", "--dataset", "synthetic", "--config", "data.toml", *TINY, "--epochs", "1", "--batch-size", "8"]
NEW = [*RUN, "--out", "new"]
CUDA = pytest.mark.skipif(gpu_usable(), reason="a usable GPU here: --device cuda would run")


def cupy_importable() -> bool:
    try:
        importlib.import_module("cupy")
        return True
    except Exception:
        return False


# What the line names: with CuPy but no GPU, the device that cannot be used; without CuPy, the package.
NO_CUDA = "'cuda'" if cupy_importable() else "needs CuPy"


@pytest.mark.parametrize("argv, status, words, capped", [
    # budgets, seeds and sizes: the flag, its limit
    ([*NEW, "--time-budget", "1e308"], 2, ["--time-budget", "at most 30 days (43200 minutes)"], False),
    ([*NEW, "--time-budget", "1e30"], 2, ["--time-budget", "at most 30 days"], False),
    ([*NEW, "--seed", "-1"], 2, ["--seed must be a whole number >= 0, got -1"], False),
    ([*NEW, "--epochs", "1000000000000"], 2, ["--epochs must be at most 100000"], False),
    ([*NEW, "--warmup-epochs", "1e308"], 2, ["--warmup-epochs must be at most 100000"], False),
    ([*NEW, "--crop-padding", "-1"], 2, ["--crop-padding must be >= 0"], False),
    ([*NEW, "--crop-padding", "100000"], 1, ["--crop-padding 100000", "give at most 8"], True),
    ([*NEW, "--randaug", "100000,9"], 2, ["--randaug", "0 <= N <= 15"], False),
    ([*NEW, "--min-lr", "1", "--lr", "0.1"], 2, ["--min-lr 1.0 is above --lr 0.1"], False),
    ([*NEW, "--model-arg", "depth=100000000"], 1, ["6e+10 parameters", "memory", "--model-arg"], True),
    ([*NEW, "--model-arg", "image_size=1000000000"], 1, ["parameters", "memory", "--model-arg"], True),
    ([*NEW, "--model-arg", "qkv_bias=maybe"], 1, ["qkv_bias must be true or false"], False),
    (["finetune", "run/best.safetensors", "--dataset", "synthetic", "--config", "data.toml", "--epochs", "1",
      "--out", "new", "--image-size", "0"], 2, ["--image-size must be >= 1"], False),
    (["finetune", "run/best.safetensors", "--dataset", "synthetic", "--config", "data.toml", "--epochs", "1",
      "--out", "new", "--image-size", "100000"], 1, ["parameters", "memory"], True),
    (["pretrain", "--dataset", "synthetic", "--config", "data.toml", *TINY, "--epochs", "1", "--out", "new",
      "--mask-rate", "2"], 2, ["--mask-rate must be in (0, 1], got 2.0"], False),
    (["fewshot", "run/best.safetensors", "--dataset", "synthetic", "--seed", "-1"], 2, ["--seed", ">= 0"], False),
    (["fewshot", "run/best.safetensors", "--dataset", "synthetic", "--seeds", "100000000000"], 2,
     ["--seeds must be at most 1000"], True),
    # --config files and where a run goes
    ([*NEW[:4], "ten.toml", *NEW[5:]], 2, ["--lr", "`lr = ...` in a --config file", "a number", "'high'"], False),
    ([*NEW[:4], "model-args.toml", *NEW[5:]], 2, ["model_args", "[model] table"], False),
    ([*NEW[:4], "internal.toml", *NEW[5:]], 2, ["from_recipe", "not a setting"], False),
    ([*NEW[:4], "seed.toml", *NEW[5:]], 2, ["--seed must be a whole number >= 0"], False),
    ([*NEW[:4], "no-test.toml", *NEW[5:]], 1, ["test_size must be a whole number >= 1, got 0", "[dataset]"], False),
    ([*NEW, "--config", "/dev/zero"], 2, ["/dev/zero is not a regular file"], False),
    ([*RUN, "--out", "data.toml"], 1, ["--out data.toml is a file, not a folder"], False),
    ([*RUN, "--out", "data.toml/run"], 1, ["--out: cannot make the run folder", "Not a directory"], False),
    # --device cuda where no GPU can be used, in every command that takes it
    pytest.param([*NEW, "--device", "cuda"], 1, [NO_CUDA, "--device cpu"], False, marks=CUDA),
    pytest.param([*NEW, "--device", "CUDA:3"], 1, ["cuda", "--device cpu"], False, marks=CUDA),
    pytest.param(["eval", "run/best.safetensors", "--dataset", "synthetic", "--device", "cuda"], 1,
                 [NO_CUDA, "--device cpu"], False, marks=CUDA),
    pytest.param(["predict", "run/best.safetensors", "img.png", "--device", "cuda"], 1, [NO_CUDA, "--device cpu"],
                 False, marks=CUDA),
    pytest.param(["fewshot", "run/best.safetensors", "--dataset", "synthetic", "--device", "cuda"], 1,
                 [NO_CUDA, "--device cpu"], False, marks=CUDA),
    pytest.param(["inspect", "run/best.safetensors", "--device", "cuda", "--out", "maps"], 1,
                 [NO_CUDA, "--device cpu"], False, marks=CUDA),
    pytest.param(["finetune", "run/best.safetensors", "--dataset", "synthetic", "--config", "data.toml",
                  "--out", "new", "--device", "cuda"], 1, [NO_CUDA, "--device cpu"], False, marks=CUDA),
    # run folders: links, damage, another checkpoint, crafted metadata
    ([*RUN, "--out", "linked", "--resume"], 1, ["metrics.jsonl is a symbolic link", "--out DIR"], False),
    ([*RUN, "--out", "linked"], 1, ["metrics.jsonl is a symbolic link"], False),
    ([*RUN, "--out", "damaged", "--resume"], 1, ["progress.epoch is '1', not a whole number", "--out DIR"], False),
    (["finetune", "img.png", "--dataset", "synthetic", "--config", "data.toml", "--epochs", "1", "--out", "run",
      "--resume"], 1, ["trained from scratch", "tinyvit train --resume"], False),
    (["predict", "deep.safetensors", "img.png"], 1, ["'dataset' metadata", "nested more than 64"], False),
    # small files that ask for gigabytes
    (["train", "--dataset", "cifar10", "--data-dir", "cifar-bomb", *TINY, "--epochs", "1", "--out", "new"], 1,
     ["data_batch_1", "'labels' holds a list", "download"], True),
    (["train", "--dataset", "fashion-mnist", "--data-dir", "gzip-bomb", *TINY, "--epochs", "1", "--out", "new"], 1,
     ["train-images-idx3-ubyte.gz", "declares shape (5000000, 28, 28)"], True),
], ids=["budget-1e308", "budget-1e30", "seed-negative", "epochs-1e12", "warmup-1e308", "crop-negative", "crop-huge",
        "randaug-huge", "min-lr-above-lr", "depth-1e8", "image-size-1e9", "qkv-bias-maybe", "finetune-image-size-0",
        "finetune-image-size-huge", "mask-rate-2", "fewshot-seed-negative", "fewshot-seeds-huge", "toml-lr-text",
        "toml-model-args", "toml-internal", "toml-seed-negative", "toml-empty-test-split", "config-dev-zero",
        "out-is-a-file", "out-under-a-file", "device-cuda", "device-cuda-3", "eval-cuda", "predict-cuda",
        "fewshot-cuda", "inspect-cuda", "finetune-cuda", "link-resume", "link-new", "damaged-state",
        "finetune-resume-scratch-run", "deep-json", "cifar-nested-lists", "gzip-bomb"])
def test_hostile_input_is_one_line_and_changes_no_file(world, capsys, monkeypatch, argv, status, words, capped):
    """Each case: the exit status, one line naming the flag or file and the fix (after argparse's usage
    for what argparse reports itself), no traceback, and every file under the folder that holds the
    run, its configs, checkpoints, data and a file outside any run, as it was (bytes, mtime, mode).
    The cases marked ``capped`` run in a process of their own under a 1 GiB address-space limit,
    which they must stay far below."""
    monkeypatch.chdir(world)
    before = snapshot(world)
    if capped:
        from test_data_bombs import PEAK_MIB, capped as run_capped, cli_code
        code, _, err, peak, seconds = run_capped(cli_code(*argv), world)
        assert 0 < peak < PEAK_MIB and seconds < 60, f"{peak} MiB, {seconds:.0f} s"
    else:
        code, _, err = cli(capsys, *argv)
    assert code == status, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    line = lines[-1] if lines[0].startswith("usage:") else one_line(err)
    assert line.startswith(f"tinyvit {argv[0]}: ")
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    assert snapshot(world) == before
