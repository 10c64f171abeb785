"""Few-shot linear evaluation (section 4.1): the closed-form regularised least-squares classifier
against a reference solution, on separable and on random features, its invariances (bias not
regularised, standardisation), the per-class sampling, batched feature extraction, and
`tinyvit fewshot` end to end on a supervised ViT checkpoint and on a masked-prediction one."""
import json

import numpy as np
import pytest

import tinyvit as tv
from tinyvit import io
from tinyvit.cli import main
from tinyvit.evaluation.fewshot import (extract_features, fewshot_evaluate, fewshot_linear, fewshot_subsets,
                             fit_least_squares, sample_per_class)
from tinyvit.models import ViT, ViTConfig
from tinyvit.models.masked import MaskedConfig, MaskedPatchViT
from tinyvit.training import MaskedPrediction
from tinyvit.training import TrainConfig, train


def _blobs(k=5, d=32, per_class=40, spread=0.3, seed=0):
    """k well separated Gaussian clusters in d dimensions: (k * per_class, d), labels."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((k, d)) * 3
    labels = np.repeat(np.arange(k), per_class)
    return centres[labels] + spread * rng.standard_normal((len(labels), d)), labels


def test_separable_features_are_classified_perfectly():
    x, y = _blobs(per_class=60)
    idx = sample_per_class(y, 5, np.random.default_rng(0))
    test = np.setdiff1d(np.arange(len(y)), idx)
    assert fewshot_linear(x[idx], y[idx], x[test], y[test]) >= 0.99


def test_device_arrays_and_tensors_as_features_and_labels(xp):
    """Features and labels may be device arrays or Tensors: the same accuracy and scores as NumPy's."""
    x, y = _blobs(k=3, d=8, per_class=10, spread=2.0)
    test = np.arange(0, len(y), 3)
    train = np.setdiff1d(np.arange(len(y)), test)
    host = fewshot_linear(x[train], y[train], x[test], y[test])
    assert fewshot_linear(xp.asarray(x[train]), xp.asarray(y[train]), xp.asarray(x[test]), xp.asarray(y[test])) == host
    assert fewshot_linear(tv.Tensor(xp.asarray(x[train])), y[train], tv.Tensor(xp.asarray(x[test])), y[test]) == host
    scores = fit_least_squares(xp.asarray(x[train]), xp.asarray(y[train]), 3)(xp.asarray(x[test]))
    np.testing.assert_allclose(scores, fit_least_squares(x[train], y[train], 3)(x[test]), rtol=1e-12)


def test_random_features_give_chance():
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((4000, 64)), rng.integers(0, 4, 4000)
    acc = fewshot_linear(x[:200], y[:200], x[200:], y[200:], l2=1.0)
    assert abs(acc - 0.25) < 0.04


@pytest.mark.parametrize("n_train", [12, 80])                               # dual (n < d) and primal (n > d)
@pytest.mark.parametrize("standardize", [False, True])
def test_matches_reference_ridge_with_unregularised_bias(n_train, standardize):
    """Scores equal those of ridge regression with an intercept solved by least squares on the
    augmented system [X 1; sqrt(l2) I 0] [W; b] = [T; 0] (the penalty skips the bias)."""
    rng = np.random.default_rng(2)
    d, k, l2 = 20, 3, 0.7
    x = rng.standard_normal((n_train, d)) * rng.uniform(0.5, 3, d) + rng.standard_normal(d)
    y = np.arange(n_train) % k
    x_test = rng.standard_normal((9, d))
    scores = fit_least_squares(x, y, k, l2=l2, standardize=standardize)(x_test)
    if standardize:
        mu, sd = x.mean(0), x.std(0) + 1e-6
        x, x_test = (x - mu) / sd, (x_test - mu) / sd
    t = 2 * np.eye(k)[y] - 1
    a = np.block([[x, np.ones((n_train, 1))], [np.sqrt(l2) * np.eye(d), np.zeros((d, 1))]])
    wb = np.linalg.lstsq(a, np.vstack([t, np.zeros((d, k))]), rcond=None)[0]
    np.testing.assert_allclose(scores, x_test @ wb[:-1] + wb[-1], rtol=1e-8, atol=1e-8)


def test_invariant_to_shifts_and_scales():
    x, y = _blobs(k=4, d=16, per_class=30, spread=2.0, seed=3)
    idx = sample_per_class(y, 3, np.random.default_rng(0))
    rest = np.setdiff1d(np.arange(len(y)), idx)
    base = fit_least_squares(x[idx], y[idx], 4, l2=1.0)(x[rest]).argmax(1)
    shift = np.random.default_rng(4).standard_normal(16) * 50
    np.testing.assert_allclose(  # the bias is not regularised: shifting every feature changes nothing
        fit_least_squares(x[idx] + shift, y[idx], 4, l2=1.0, standardize=False)(x[rest] + shift),
        fit_least_squares(x[idx], y[idx], 4, l2=1.0, standardize=False)(x[rest]), rtol=1e-9, atol=1e-9)
    scale = np.random.default_rng(5).uniform(0.01, 100, 16)
    assert np.array_equal(fit_least_squares(x[idx] * scale, y[idx], 4, l2=1.0)(x[rest] * scale).argmax(1), base), \
        "standardised features: per-dimension scales change nothing"


def test_sample_per_class():
    labels = np.random.default_rng(0).integers(0, 6, 300)
    idx = sample_per_class(labels, 4, np.random.default_rng(1))
    assert len(idx) == 24 and len(np.unique(idx)) == 24
    assert (np.bincount(labels[idx], minlength=6) == 4).all()
    assert np.array_equal(idx, sample_per_class(labels, 4, np.random.default_rng(1)))
    assert not np.array_equal(idx, sample_per_class(labels, 4, np.random.default_rng(2)))
    with pytest.raises(ValueError, match="5-shot"):
        sample_per_class(np.array([0, 0, 0, 0, 0, 1]), 5, np.random.default_rng(0))
    subsets = fewshot_subsets(labels, shots=(1, 2), seeds=3)
    assert sorted(subsets) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]


def test_fewshot_evaluate_reports_mean_and_spread():
    x, y = _blobs(k=3, d=8, per_class=30, spread=2.5, seed=6)
    res = fewshot_evaluate(x, y, x, y, shots=(1, 5), seeds=4, l2s=(0.1, 10.0))
    assert sorted(res) == [(1, 0.1), (1, 10.0), (5, 0.1), (5, 10.0)]
    for r in res.values():
        assert len(r["accs"]) == 4 and r["mean"] == pytest.approx(np.mean(r["accs"]))
        assert r["std"] == pytest.approx(np.std(r["accs"]))
    assert res[(5, 10.0)]["mean"] > res[(1, 10.0)]["mean"], "more shots, better"


def test_extract_features_in_batches_under_no_grad():
    tv.manual_seed(0)
    cfg = dict(image_size=8, patch_size=4, in_channels=3, dim=8, depth=1, num_heads=2, mlp_dim=16)
    vit = ViT(ViTConfig(**cfg, num_classes=3))
    images = np.random.default_rng(0).integers(0, 256, (7, 3, 8, 8)).astype(np.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    feats = extract_features(vit, images, mean, std, batch_size=3)
    x = ((images / 255.0 - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]).astype(np.float32)
    assert feats.shape == (7, 8) and feats.dtype == np.float32
    np.testing.assert_allclose(feats, vit.forward_features(x).data, rtol=1e-5, atol=1e-6)
    gap = extract_features(vit, images, mean, std, pool="gap")
    tokens = vit.encode(vit.add_position(vit.embed_patches(x))).data
    np.testing.assert_allclose(gap, tokens[:, 1:].mean(axis=1), rtol=1e-5, atol=1e-6)
    # a masked-prediction model: its (uncorrupted) encoder's features
    masked = MaskedPatchViT(MaskedConfig(**cfg))
    np.testing.assert_allclose(extract_features(masked, images, mean, std, pool="token"),
                               masked.to_vit().forward_features(x).data, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pool"):
        extract_features(vit, images, pool="max")


# ====================================================================== `tinyvit fewshot` end to end

DATA = dict(image_size=16, train_size=120, test_size=40)
MODEL = dict(dim=16, depth=1, num_heads=2, mlp_dim=32, patch_size=4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A supervised ViT checkpoint (tinyvit.train) and a masked-prediction one, one short epoch each."""
    root = tmp_path_factory.mktemp("fewshot")
    common = dict(dataset="synthetic", model="vit-cifar/4", dataset_args=DATA, epochs=1, batch_size=20, lr=3e-3)
    quiet = dict(progress=False, log=lambda *a: None)
    train(TrainConfig(**common, model_args=MODEL, out=str(root / "vit")), **quiet)
    train(TrainConfig(**common, model_args=MODEL, optimizer="adam", weight_decay=0.0, out=str(root / "masked")),
          objective=MaskedPrediction(), **quiet)
    return {"vit": root / "vit" / "latest.safetensors", "masked": root / "masked" / "latest.safetensors"}


@pytest.mark.parametrize("kind", ["vit", "masked"])
def test_fewshot_cli_prints_mean_and_spread_per_shot_count(checkpoints, kind, tmp_path, capsys):
    assert isinstance(io.load(checkpoints[kind]), MaskedPatchViT if kind == "masked" else ViT)
    report = tmp_path / "fewshot.json"
    args = ["fewshot", str(checkpoints[kind]), "--dataset", "synthetic", "--shots", "1,2,5", "--seeds", "3",
            "--json", str(report)] + [a for k, v in DATA.items() for a in ("--dataset-arg", f"{k}={v}")]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0] in ("1", "2", "5")]
    assert [r[0] for r in rows] == ["1", "2", "5"]
    for r in rows:                                         # shots, l2, mean%, std, min, max
        assert r[2].endswith("%") and 0 <= float(r[2][:-1]) <= 100 and float(r[3]) >= 0
    results = json.loads(report.read_text())
    assert [r["shots"] for r in results] == [1, 2, 5] and all(len(r["accs"]) == 3 for r in results)
    assert results[-1]["mean"] > 1 / 10, "better than chance on the synthetic classes"


def test_fewshot_cli_errors(checkpoints, capsys):
    assert main(["fewshot", str(checkpoints["vit"]), "--dataset", "synthetic", "--dataset-arg", "image_size=32",
                 "--dataset-arg", "train_size=60", "--dataset-arg", "test_size=20", "--shots", "1"]) == 1
    assert "16x16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fewshot", str(checkpoints["vit"]), "--dataset", "synthetic", "--shots", "one"])


def test_fewshot_cli_random_init_baseline(tmp_path, capsys):
    """--random-init MODEL: the same architecture untrained, seeded, sized for the dataset."""
    data = [a for k, v in DATA.items() for a in ("--dataset-arg", f"{k}={v}")]
    model = [a for k, v in MODEL.items() for a in ("--model-arg", f"{k}={v}")]
    reports = []
    for seed in (0, 0, 1):
        report = tmp_path / f"random{len(reports)}.json"
        assert main(["fewshot", "--random-init", "vit-cifar/4", "--dataset", "synthetic", "--shots", "2",
                     "--seeds", "2", "--seed", str(seed), "--json", str(report)] + data + model) == 0
        reports.append(json.loads(report.read_text())[0]["accs"])
    assert "vit-cifar/4 at random initialisation (seed 0)" in capsys.readouterr().out
    assert reports[0] == reports[1], "the same seed gives the same untrained model and subsets"
    assert reports[0] != reports[2]


def test_fewshot_cli_needs_exactly_one_model(checkpoints, capsys):
    for argv, message in [([], "either a CHECKPOINT or --random-init"),
                          ([str(checkpoints["vit"]), "--random-init", "vit-cifar/4"], "either a CHECKPOINT"),
                          ([str(checkpoints["vit"]), "--model-arg", "dim=8"], "--model-arg goes with --random-init")]:
        with pytest.raises(SystemExit) as exc:
            main(["fewshot", *argv, "--dataset", "synthetic", "--shots", "1"])
        assert exc.value.code == 2 and message in capsys.readouterr().err
