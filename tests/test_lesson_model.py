"""The trained models the lessons load (lessons/models/, made by data_scripts/make_lesson_model.py): each
loads, is float16 and small, carries what `tinyvit predict` needs, and the README states the numbers
recorded in the file. Quick: nothing is trained."""
import json
from pathlib import Path

import numpy as np
import pytest

import tinyvit as tv
from tinyvit.evaluation import load_for_inference
from tinyvit.io import load_checkpoint

MODELS = Path(__file__).resolve().parent.parent / "lessons" / "models"
MAX_BYTES = 2 * 1024 * 1024
# file -> (arch, image_size, grid, in_channels, classes, dim, depth, heads): what the lessons rely on
EXPECTED = {
    "fashion-mnist-vit-mnist-7.safetensors": ("vit", 28, 4, 1, 10, 128, 4, 4),      # lesson 10
    "fashion-mnist-vit4-seed0.safetensors": ("vit", 28, 7, 1, 10, 64, 6, 4),        # lesson 11
    "fashion-mnist-vit4-seed1.safetensors": ("vit", 28, 7, 1, 10, 64, 6, 4),
    "fashion-mnist-hybrid4-seed0.safetensors": ("hybrid", 28, 7, 1, 10, 64, 6, 4),
    "fashion-mnist-hybrid4-seed1.safetensors": ("hybrid", 28, 7, 1, 10, 64, 6, 4),
}
PATHS = [MODELS / name for name in EXPECTED]


def test_every_model_file_is_expected():
    present = {path.name for path in MODELS.glob("*.safetensors")}
    assert present == set(EXPECTED), f"lessons/models/ holds {sorted(present)}, the lessons expect {sorted(EXPECTED)}"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_lesson_model_is_small_float16_and_loads(path):
    assert path.is_file(), f"{path} is missing: make it with data_scripts/make_lesson_model.py RUN_FOLDER"
    assert path.stat().st_size < MAX_BYTES, f"{path.name} is {path.stat().st_size:,} bytes; keep it under 2 MB"
    model = tv.load(path)
    dtypes = {str(value.dtype) for value in model.state_dict().values()}
    assert dtypes == {"float16"}, f"{path.name} holds {dtypes}, not float16"
    arch, image, grid, channels, classes, dim, depth, heads = EXPECTED[path.name]
    cfg = model.config
    assert hasattr(cfg, "resnet_layers") == (arch == "hybrid")
    assert (cfg.image_size, cfg.grid_size, cfg.in_channels, cfg.num_classes) == (image, grid, channels, classes)
    assert (cfg.dim, cfg.depth, cfg.num_heads) == (dim, depth, heads)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_lesson_model_has_dataset_info_for_predict(path):
    model, info = load_for_inference(path)               # float32 weights, the checkpoint's normalisation
    assert info["name"] == "fashion-mnist" and len(info["classes"]) == 10
    assert "Ankle boot" in info["classes"] and len(info["mean"]) == len(info["std"]) == 1
    x = (np.random.default_rng(0).random((4, 1, 28, 28), dtype=np.float32) - info["mean"][0]) / info["std"][0]
    with tv.no_grad():
        logits = model(x).numpy()
    assert logits.shape == (4, 10) and np.isfinite(logits).all()


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_lesson_model_readme_states_the_files_numbers(path):
    _, _, meta = load_checkpoint(path)
    prov = json.loads(meta["provenance"])
    readme = (MODELS / "README.md").read_text(encoding="utf-8")
    part = readme.split(f"## `{path.name}`", 1)
    assert len(part) == 2, f"lessons/models/README.md has no section for {path.name}"
    section = part[1].split("\n## ", 1)[0]
    for key in ("best_test_accuracy", "final_test_accuracy", "float16_test_accuracy"):
        stated = f"{100 * prov[key]:.2f}%"
        assert stated in section, f"lessons/models/README.md does not state the {key} {stated} of {path.name}"
    assert abs(prov["float16_test_accuracy"] - prov["best_test_accuracy"]) <= 0.002 + 1e-9
    for key in ("command", "commit", "machine"):
        assert prov[key] in section, f"lessons/models/README.md does not state the {key} {prov[key]!r} of {path.name}"
    assert f"{path.stat().st_size:,} bytes" in section, f"lessons/models/README.md states another size for {path.name}"
    assert f"{prov['wall_minutes']:.1f} minutes" in section


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_lesson_model_accuracy_on_test_images(path):
    """On the first 500 Fashion-MNIST test images (where the data is on this machine), the accuracy is
    near the recorded one: the weights are the trained ones, not damaged by the float16 cast."""
    from tinyvit.data import Augment, DataError, load_dataset
    try:
        ds = load_dataset("fashion-mnist", download=False)
    except DataError:
        pytest.skip("Fashion-MNIST is not on this machine")
    model, _ = load_for_inference(path)
    prov = json.loads(load_checkpoint(path)[2]["provenance"])
    x, y = Augment(ds.mean, ds.std)(ds.test_images[:500], ds.test_labels[:500])
    with tv.no_grad():
        acc = float((model(x).numpy().argmax(-1) == y).mean())
    assert abs(acc - prov["float16_test_accuracy"]) < 0.05, f"accuracy {acc:.3f} on 500 test images"
