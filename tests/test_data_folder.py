"""Your own images (tinyvit/data/folder.py, images.py): a folder of class folders, or train/ and
val/ folders, for `train`, `finetune`, `eval`, `fewshot` and `predict`, through the command as a user
runs it; the class names kept in the checkpoint; images read at the model's shape (short side, centre
crop); every bad folder one line. The folders are small PNGs and JPEGs the tests write."""
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, one_line

import tinyvit.training.loop
from tinyvit import io
from tinyvit.data import DataError, load_dataset, prepare
from tinyvit.io.arrays import read_header

LESSON = Path(__file__).resolve().parents[1] / "lessons" / "models" / "fashion-mnist-vit-mnist-7.safetensors"
# A ViT of a few thousand parameters: a run takes a second.
TINY = ["--model-arg", "dim=8", "--model-arg", "depth=1", "--model-arg", "num_heads=2", "--model-arg", "mlp_dim=16"]


@pytest.fixture(scope="module", autouse=True)
def _no_progress_bars():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tinyvit.training.loop, "_progress_bar", lambda *args: None)
        yield


def write_folder(root, per_class=None, colour=True, seed=0, sizes=(30, 60)):
    """root/<class>/<i>.png|jpg: class k's images of brightness 40 + 60 k plus noise, random sizes and
    aspects, alternately PNG and JPEG; grey ("L") or colour ("RGB"). Returns root."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    for k, (name, n) in enumerate((per_class or {"boot": 6, "sandal": 6, "shirt": 6}).items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            h, w = rng.integers(*sizes, size=2)
            shape = (h, w, 3) if colour else (h, w)
            pixels = np.clip(rng.normal(40 + 60 * k, 20, shape), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.{'png' if i % 2 else 'jpg'}")
    return root


# ---------------------------------------------------------------- the dataset


def test_one_folder_gets_a_seeded_stratified_held_out_split(tmp_path):
    root = write_folder(tmp_path / "shoes", {"boot": 10, "sandal": 5, "shirt": 2})
    ds = load_dataset(str(root))
    assert ds.name == "shoes" and ds.classes == ["boot", "sandal", "shirt"]        # sorted folder names
    assert ds.train_images.shape[1:] == (3, 32, 32) and ds.train_images.dtype == np.uint8   # colour: 32 px
    assert np.bincount(ds.test_labels).tolist() == [2, 1, 1]                     # 20% of each, at least one
    assert np.bincount(ds.train_labels).tolist() == [8, 4, 1]
    again = load_dataset(str(root))
    assert np.array_equal(again.test_images, ds.test_images)                     # the same seed, the same split
    other = load_dataset(str(root), seed=1)
    assert not np.array_equal(other.test_images, ds.test_images)
    assert ds.mean == pytest.approx(tuple(ds.train_images.reshape(-1, 3, 32 * 32).transpose(1, 0, 2)
                                          .reshape(3, -1).mean(1) / 255))
    assert ds.info["checkpoint"] == {"folder": str(root.resolve()), "val_fraction": 0.2, "seed": 0}


def test_train_and_val_folders_are_the_splits(tmp_path):
    write_folder(tmp_path / "d" / "train", {"a": 3, "b": 3})
    write_folder(tmp_path / "d" / "val", {"a": 2}, seed=1)                      # val may lack a class
    ds = load_dataset(str(tmp_path / "d"))
    assert ds.classes == ["a", "b"] and len(ds.train_labels) == 6 and ds.test_labels.tolist() == [0, 0]


def test_grey_images_give_a_grey_dataset_at_28_and_the_model_decides_otherwise(tmp_path):
    root = write_folder(tmp_path / "g", colour=False)
    assert load_dataset(str(root)).train_images.shape[1:] == (1, 28, 28)
    assert load_dataset(str(root), channels=3, image_size=16).train_images.shape[1:] == (3, 16, 16)


def test_images_keep_their_aspect_short_side_then_centre_crop():
    """A 60x20 image whose middle third is white: the centre crop keeps that third, all white;
    squash keeps all three thirds, pad adds the border colour above and below."""
    from PIL import Image
    pixels = np.zeros((20, 60), np.uint8)
    pixels[:, 20:40] = 255
    img = Image.fromarray(pixels)
    crop, prep = prepare(img, 1, 10)
    assert crop.shape == (1, 10, 10) and crop.min() > 230 and prep.cut == pytest.approx(2 / 3)   # bicubic rings
    assert "cut 67% of the width" in prep.describe()
    squash, _ = prepare(img, 1, 12, "squash")
    assert squash[0, :, 0].max() < 40 and squash[0, :, 6].min() > 215
    pad, _ = prepare(img, 1, 12, "pad")
    assert pad[0, 0].max() == 0 and pad[0, 6, 6] == 255                            # black border rows


@pytest.mark.parametrize("make, words", [
    (lambda root: None, ["imgs", "folder"]),
    (lambda root: (root.mkdir(), (root / "x.png").write_bytes(b"")), ["no class folders"]),
    (lambda root: write_folder(root, {"only": 3}), ["one class folder (only)", "two or more"]),
    (lambda root: (write_folder(root, {"a": 3, "b": 3}), (root / "c").mkdir()), ["c holds no images", "remove"]),
    (lambda root: (write_folder(root, {"a": 3, "b": 3}), (root / "b" / "9.png").write_text("notes")),
     ["9.png is not an image Pillow can read"]),
    (lambda root: write_folder(root, {"a": 1, "b": 1}), ["too few images to hold out"]),
    (lambda root: (write_folder(root / "train", {"a": 2, "b": 2}), write_folder(root / "val", {"z": 1})),
     ["class folders ['z']", "train"]),
], ids=["missing", "no-class-folders", "one-class", "empty-class", "unreadable-file", "too-few", "val-extra-class"])
def test_a_bad_folder_is_one_line_in_every_command(tmp_path, capsys, make, words):
    root = tmp_path / "imgs"
    make(root)
    with pytest.raises((DataError, ValueError)):
        load_dataset(str(root))
    for argv in (["train", "--dataset", root, "--epochs", "1", *TINY, "--out", tmp_path / "run"],
                 ["finetune", LESSON, "--dataset", root, "--epochs", "1", "--out", tmp_path / "ft"],
                 ["eval", LESSON, "--dataset", root], ["fewshot", LESSON, "--dataset", root, "--shots", "1"]):
        code, out, err = cli(capsys, *argv)
        line = one_line(err)
        assert code in (1, 2), err
        for word in words:
            assert word in line, (argv[0], line)
    assert not (tmp_path / "run").exists() and not (tmp_path / "ft").exists()


# ---------------------------------------------------------------- the commands


def test_train_eval_predict_on_a_folder(tmp_path, capsys, monkeypatch):
    """train --dataset DIR names its run after the folder and the preset; eval takes the folder and its
    held-out split from the checkpoint; predict names the folder's classes."""
    monkeypatch.chdir(tmp_path)
    root = write_folder(tmp_path / "shoes")
    code, out, err = cli(capsys, "train", "--dataset", "shoes", "--epochs", "2", "--batch-size", "4", *TINY)
    assert code == 0, err
    run = tmp_path / "runs" / "shoes-vit-cifar-4"
    assert f"writing to {Path('runs') / 'shoes-vit-cifar-4'}" in out and "20% of each class held out" in out
    info = json.loads(read_header(run / "best.safetensors")[1]["dataset"])
    assert info["classes"] == ["boot", "sandal", "shirt"] and info["folder"] == str(root.resolve())
    code, out, err = cli(capsys, "eval", run / "best.safetensors")
    assert code == 0 and "shoes held-out (3 images) (the checkpoint's dataset" in out, err
    code, out, err = cli(capsys, "predict", run / "best.safetensors", root / "boot" / "0.jpg", "--topk", "3")
    assert code == 0 and sorted(line.split()[-1] for line in out.splitlines()[1:]) == ["boot", "sandal", "shirt"]


def test_finetune_the_lesson_model_on_a_colour_folder(tmp_path, capsys, monkeypatch):
    """The README's example: the shipped grey 28x28 model fine-tuned on colour photos of any size,
    which are read grey at 28 px; a 1-epoch run decays its learning rate and says its warmup is cut."""
    monkeypatch.chdir(tmp_path)
    write_folder(tmp_path / "shoes", {"boot": 8, "sandal": 8})
    code, out, err = cli(capsys, "finetune", LESSON, "--dataset", "shoes", "--epochs", "1", "--batch-size", "4")
    assert code == 0, err
    run = tmp_path / "runs" / "finetune-vit-mnist-7-shoes"
    assert "training vit-mnist/7" in out and "warmup" in out and "shortened" in out
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["lr"] < 0.01 / 100 and max(row["lr"] for row in steps) <= 0.01
    model = io.load(run / "best.safetensors")
    assert (model.config.in_channels, model.config.image_size, model.config.num_classes) == (1, 28, 2)
    code, out, err = cli(capsys, "fewshot", run / "best.safetensors", "--shots", "1", "--seeds", "2")
    assert code == 0 and "few-shot linear accuracy on shoes" in out, err
