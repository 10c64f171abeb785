"""The trained model the lessons load (lessons/models/, made by data_scripts/make_lesson_model.py): it
loads, is float16 and small, carries what `tinyvit predict` needs, and its README states the numbers
recorded in the file. Quick: nothing is trained."""
import json
from pathlib import Path

import numpy as np
import pytest

import tinyvit as tv
from tinyvit.evaluation import load_for_inference
from tinyvit.io import load_checkpoint

MODELS = Path(__file__).resolve().parent.parent / "lessons" / "models"
PATH = MODELS / "fashion-mnist-vit-mnist-7.safetensors"
MAX_BYTES = 2 * 1024 * 1024


def test_lesson_model_is_small_float16_and_loads():
    assert PATH.is_file(), f"{PATH} is missing: make it with data_scripts/make_lesson_model.py RUN_FOLDER"
    assert PATH.stat().st_size < MAX_BYTES, f"{PATH.name} is {PATH.stat().st_size:,} bytes; keep it under 2 MB"
    model = tv.load(PATH)
    dtypes = {str(value.dtype) for value in model.state_dict().values()}
    assert dtypes == {"float16"}, f"{PATH.name} holds {dtypes}, not float16"
    cfg = model.config
    assert (cfg.image_size, cfg.patch_size, cfg.in_channels, cfg.num_classes) == (28, 7, 1, 10)
    assert (cfg.dim, cfg.depth, cfg.num_heads, cfg.grid_size) == (128, 4, 4, 4)


def test_lesson_model_has_dataset_info_for_predict():
    model, info = load_for_inference(PATH)               # float32 weights, the checkpoint's normalisation
    assert info["name"] == "fashion-mnist" and len(info["classes"]) == 10
    assert "Ankle boot" in info["classes"] and len(info["mean"]) == len(info["std"]) == 1
    x = (np.random.default_rng(0).random((4, 1, 28, 28), dtype=np.float32) - info["mean"][0]) / info["std"][0]
    with tv.no_grad():
        logits = model(x).numpy()
    assert logits.shape == (4, 10) and np.isfinite(logits).all()


def test_lesson_model_readme_states_the_files_numbers():
    _, _, meta = load_checkpoint(PATH)
    prov = json.loads(meta["provenance"])
    readme = (MODELS / "README.md").read_text(encoding="utf-8")
    for key in ("best_test_accuracy", "final_test_accuracy", "float16_test_accuracy"):
        stated = f"{100 * prov[key]:.2f}%"
        assert stated in readme, f"lessons/models/README.md does not state the {key} {stated} of the file"
    assert abs(prov["float16_test_accuracy"] - prov["best_test_accuracy"]) <= 0.002 + 1e-9
    for key in ("command", "commit", "machine"):
        assert prov[key] in readme, f"lessons/models/README.md does not state the {key} {prov[key]!r}"
    assert f"{PATH.stat().st_size:,} bytes" in readme, "lessons/models/README.md states another file size"
    assert f"{prov['wall_minutes']:.1f} minutes" in readme


def test_lesson_model_accuracy_on_test_images():
    """On the first 500 Fashion-MNIST test images (where the data is on this machine), the accuracy is
    near the recorded one: the weights are the trained ones, not damaged by the float16 cast."""
    from tinyvit.data import Augment, DataError, load_dataset
    try:
        ds = load_dataset("fashion-mnist", download=False)
    except DataError:
        pytest.skip("Fashion-MNIST is not on this machine")
    model, _ = load_for_inference(PATH)
    prov = json.loads(load_checkpoint(PATH)[2]["provenance"])
    x, y = Augment(ds.mean, ds.std)(ds.test_images[:500], ds.test_labels[:500])
    with tv.no_grad():
        acc = float((model(x).numpy().argmax(-1) == y).mean())
    assert abs(acc - prov["float16_test_accuracy"]) < 0.05, f"accuracy {acc:.3f} on 500 test images"
