"""Masked patch prediction (section 4.6, appendix B.1.2): the BERT-style corruption of patch
embeddings, the three targets on hand-built images, the un-normalisation of the data pipeline's
images, a float64 gradient check of the loss for every target and parameter (mask token included),
the loss counting only corrupted patches, labels never read, and `tinyvit pretrain` end to end with
checkpoints, resume and fine-tuning of the pre-trained encoder."""
import json
import math

import numpy as np
import pytest

import tinyvit as tv
from tinyvit import io
from tinyvit.backend import default_dtype
from tinyvit.cli import main
from tinyvit.data import Augment, load_dataset
from tinyvit.models import ViT, from_config
from tinyvit.models.masked import (MaskedConfig, MaskedPatchViT, choose_corruption, corrupt, downsized_3bit,
                                   mean_color_3bit, patch_pixels)
from tinyvit.training import MaskedPrediction
from tinyvit.training import prepare_finetune, train

# image 8, patch 4 (N = 4), C = 3, D = 8, two blocks of two heads
TINY = dict(image_size=8, patch_size=4, in_channels=3, dim=8, depth=2, num_heads=2, mlp_dim=12)


def build(dtype=np.float64, seed=0, **overrides):
    """A MaskedPatchViT of TINY in ``dtype`` with every parameter random (a zero head would hide the
    gradients of everything below it)."""
    tv.manual_seed(seed)
    with default_dtype(dtype):
        model = MaskedPatchViT(MaskedConfig(**{**TINY, **overrides}))
    rng = np.random.default_rng(seed + 100)
    for name, p in model.named_parameters():
        values = rng.standard_normal(p.shape) * 0.4
        if ".norm" in name:
            values = (1.0 if name.endswith("weight") else 0.0) + 0.2 * values
        p.data[...] = values.astype(p.dtype)
    return model


# ====================================================================== 1. corruption


def _corrupt_big(rate=0.5, seed=1):
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((400, 64, 8)).astype(np.float32)
    token = rng.standard_normal(8).astype(np.float32)
    out, kind = corrupt(emb, token, rate, np.random.default_rng(seed))
    return emb, token, out, kind


@pytest.mark.parametrize("rate", [0.5, 0.15])
def test_corrupt_statistics(rate):
    emb, token, out, kind = _corrupt_big(rate)
    assert out.dtype == np.float32 and out.shape == emb.shape and kind.shape == (400, 64)
    chosen = kind > 0
    assert (chosen.sum(axis=1) == round(rate * 64)).all(), "round(rate * N) patches chosen in every image"
    shares = [(kind == k).sum() / chosen.sum() for k in (1, 2, 3)]
    assert shares[0] == pytest.approx(0.8, abs=0.02)
    assert shares[1] == pytest.approx(0.1, abs=0.015) and shares[2] == pytest.approx(0.1, abs=0.015)
    # every position is equally likely to be chosen (no bias towards the first patches)
    per_position = chosen.mean(axis=0)
    assert abs(per_position - rate).max() < 0.12


def test_corrupt_rows():
    emb, token, out, kind = _corrupt_big()
    assert np.array_equal(out[kind == 0], emb[kind == 0]), "untouched rows are bit-identical"
    assert np.array_equal(out[kind == 3], emb[kind == 3]), "chosen-but-kept rows are unchanged"
    assert (out[kind == 1] == token).all(), "kind-1 rows are the mask token"
    # kind 2: exactly some OTHER patch's embedding (random floats: every row of the batch is unique)
    index = {row.tobytes(): i for i, row in enumerate(emb.reshape(-1, 8))}
    assert len(index) == emb.shape[0] * emb.shape[1]
    rows = out[kind == 2]
    found = np.array([index.get(row.tobytes(), -1) for row in rows])
    assert (found >= 0).all(), "each kind-2 row is one patch embedding of the batch"
    own = np.flatnonzero((kind == 2).reshape(-1))
    assert (found != own).all(), "and never the patch's own"
    other_image = found // emb.shape[1] != own // emb.shape[1]
    assert other_image.mean() > 0.9, "drawn from the whole batch, so mostly from other images"


def test_corrupt_is_reproducible_and_random():
    _, _, out1, kind1 = _corrupt_big(seed=5)
    _, _, out2, kind2 = _corrupt_big(seed=5)
    _, _, out3, kind3 = _corrupt_big(seed=6)
    assert np.array_equal(out1, out2) and np.array_equal(kind1, kind2)
    assert not np.array_equal(kind1, kind3)


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5])
def test_corrupt_rejects_bad_rate(rate):
    with pytest.raises(ValueError, match="rate"):
        corrupt(np.zeros((2, 4, 3), np.float32), np.zeros(3, np.float32), rate, np.random.default_rng(0))


def test_rate_one_chooses_everything_and_one_patch_batches_work():
    kind, source = choose_corruption(3, 5, 1.0, np.random.default_rng(0))
    assert (kind > 0).all()
    kind, source = choose_corruption(1, 1, 1.0, np.random.default_rng(0), mask_fraction=0.0, random_fraction=1.0)
    assert kind.tolist() == [[1]] and source.tolist() == [[0]], "no other patch exists: [mask] instead"


# ====================================================================== 2. targets


def _grid_image(colours, patch=4):
    """A 2x2 grid of patches, patch i filled with colours[i] (RGB in [0, 1]): (1, 3, 2P, 2P)."""
    img = np.zeros((1, 3, 2 * patch, 2 * patch))
    for i, c in enumerate(colours):
        r, q = divmod(i, 2)
        img[0, :, r * patch:(r + 1) * patch, q * patch:(q + 1) * patch] = np.asarray(c)[:, None, None]
    return img


def test_mean_color_3bit_known_answers():
    img = _grid_image([(1, 0, 0), (0, 1, 0), (0, 0, 1), (0.5, 0.5, 0.5)])
    assert mean_color_3bit(img, 4).tolist() == [[7 * 64, 7 * 8, 7, 4 * 73]]
    # the MEAN colour: a patch half red, half black has r = 0.5 -> level 4; levels split at k/8
    img = _grid_image([(1, 1, 1), (0, 0, 0), (0.124, 0.125, 0.999), (0.25, 0.75, 0.5)])
    img[0, 0, :, :2] = 0.0                                               # patch 0: left half black
    assert mean_color_3bit(img, 4).tolist() == [[4 * 64 + 7 * 8 + 7, 0, 0 * 64 + 1 * 8 + 7, 2 * 64 + 6 * 8 + 4]]


def test_mean_color_3bit_grey_is_replicated():
    grey = np.full((2, 1, 8, 8), 0.5)
    grey[1] = 1.0
    assert mean_color_3bit(grey, 4).tolist() == [[4 * 73] * 4, [511] * 4]


def test_downsized_3bit_known_answer():
    """One 8x8 patch -> 4x4 small pixels, each the mean of a 2x2 block, in 3-bit colour."""
    img = np.zeros((1, 3, 8, 8))
    img[0, 0, 0:2, 0:2] = 1.0                                            # small pixel (0, 0): red
    img[0, 1, 0:2, 6:8] = 1.0                                            # (0, 3): green
    img[0, 2, 6:8, 0:2] = 1.0                                            # (3, 0): blue
    img[0, :, 6, 6] = 1.0                                                # (3, 3): a quarter white -> 0.25
    expected = np.zeros(16, int)
    expected[0], expected[3], expected[12], expected[15] = 7 * 64, 7 * 8, 7, 2 * 73
    assert downsized_3bit(img, 8).tolist() == [[expected.tolist()]]
    # a 4x4 patch downsized to 4x4 is each pixel's own 3-bit colour
    small = np.random.default_rng(0).random((2, 3, 8, 8))
    per_pixel = downsized_3bit(small, 4)
    assert per_pixel.shape == (2, 4, 16)
    assert per_pixel[0, 0, 5] == mean_color_3bit(small[:1, :, 1:2, 1:2], 1)[0, 0]


def test_downsized_needs_a_divisible_patch():
    with pytest.raises(ValueError, match="divisible by 4"):
        downsized_3bit(np.zeros((1, 3, 12, 12)), 6)
    with pytest.raises(ValueError, match="not divisible by 4"):
        MaskedConfig(**{**TINY, "image_size": 12, "patch_size": 6}, target="downsized3bit")


def test_patch_pixels_follow_the_patch_embedding_order():
    """The pixels-l2 target is exactly the patch embedding's input (C, P, P) flattening."""
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8))
    eye = np.eye(48)
    emb = tv.functional.patch_embed(x, eye, None, 4).data                # identity E: the raw patches
    assert np.array_equal(patch_pixels(x, 4), emb)


def test_targets_are_computed_on_unnormalised_pixels():
    ds = load_dataset("synthetic", train_size=8, test_size=8, image_size=8)
    x, _ = Augment(ds.mean, ds.std)(ds.train_images, ds.train_labels)   # normalised, as training sees
    model = MaskedPatchViT(MaskedConfig(**TINY))
    objective = MaskedPrediction()
    objective.check(model, ds)
    expected = mean_color_3bit(ds.train_images / 255.0, 4)
    assert np.array_equal(objective.targets(model, x), expected)
    assert not np.array_equal(mean_color_3bit(np.clip(x, 0, 1), 4), expected), "normalisation matters here"
    model = MaskedPatchViT(MaskedConfig(**TINY, target="pixels-l2"))
    assert np.allclose(objective.targets(model, x), patch_pixels(x, 4)), "pixels-l2 regresses what the model sees"


def test_objective_needs_the_normalisation():
    with pytest.raises(ValueError, match="mean and std"):
        MaskedPrediction().step(build(np.float32), np.zeros((1, 3, 8, 8), np.float32), None)


# ====================================================================== 3. the model


@pytest.mark.parametrize("target", ["mean3bit", "downsized3bit", "pixels-l2"])
def test_gradcheck_every_parameter(target):
    """The loss of every target, float64, against finite differences for every parameter. Corruption
    is made deterministic by a fixed generator inside the function; rate 1 and a 50/30/20 split
    make sure [mask], swapped and kept patches all occur."""
    model = build(target=target, mask_rate=1.0, mask_fraction=0.5, random_fraction=0.3)
    x = np.random.default_rng(1).standard_normal((3, 3, 8, 8))
    kind, _ = choose_corruption(3, 4, 1.0, np.random.default_rng(7), 0.5, 0.3)
    assert {1, 2, 3} <= set(kind.ravel().tolist())
    rng = np.random.default_rng(2)
    targets = (rng.standard_normal((3, 4, 48)) if target == "pixels-l2"
               else rng.integers(0, 512, (3, 4) + ((16,) if target == "downsized3bit" else ())))
    params = list(model.parameters())
    tv.gradcheck(lambda *ps: model.loss(x, targets, rng=np.random.default_rng(7))[0], params,
                 mode="auto", max_full=24, directions=4)
    for name, p in model.named_parameters():
        assert p.grad is not None and abs(p.grad).max() > 0, f"{name} got no gradient"


def _loss_with_shifted_tokens(model, x, targets, where):
    """The loss when the encoder's output tokens at positions ``where`` ((B, N) bool) are changed."""
    encode = model.vit.encode

    def shifted(tokens, **kw):
        out = encode(tokens, **kw)
        delta = np.zeros(out.shape)
        delta[:, 1:][where] = 5.0                                        # patch tokens after the class token
        return out + delta
    model.vit.encode = shifted
    try:
        return float(model.loss(x, targets, rng=np.random.default_rng(3))[0].item())
    finally:
        model.vit.encode = encode


@pytest.mark.parametrize("target", ["mean3bit", "pixels-l2"])
def test_loss_counts_only_corrupted_patches(target):
    model = build(target=target, image_size=16)                          # N = 16, 8 chosen per image
    x = np.random.default_rng(1).standard_normal((2, 3, 16, 16))
    rng = np.random.default_rng(2)
    targets = rng.standard_normal((2, 16, 48)) if target == "pixels-l2" else rng.integers(0, 512, (2, 16))
    kind, _ = choose_corruption(2, 16, 0.5, np.random.default_rng(3))
    base = float(model.loss(x, targets, rng=np.random.default_rng(3))[0].item())
    assert _loss_with_shifted_tokens(model, x, targets, kind == 0) == base, \
        "changing the predictions of untouched patches changes nothing"
    one_chosen = np.zeros_like(kind, bool)
    one_chosen[np.unravel_index(np.argmax(kind > 0), kind.shape)] = True
    assert _loss_with_shifted_tokens(model, x, targets, one_chosen) != base
    # the same holds for the targets of untouched patches
    other = targets.copy()
    other[kind == 0] = (rng.standard_normal(other[kind == 0].shape) if target == "pixels-l2"
                        else rng.integers(0, 512, other[kind == 0].shape))
    assert float(model.loss(x, other, rng=np.random.default_rng(3))[0].item()) == base


def test_labels_are_never_read():
    model = build(np.float32)
    objective = MaskedPrediction(mean=(0.5,) * 3, std=(0.25,) * 3)
    x = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    losses = []
    for y in (np.array([0, 1, 2, 3]), np.full(4, -12345), None, "garbage"):
        tv.manual_seed(0)                                                # the same corruption each time
        loss, correct = objective.step(model, x, y)
        assert loss.dtype == np.float32
        losses.append(float(loss.item()))
    assert len(set(losses)) == 1


def test_mask_token_and_head_start_as_documented():
    model = MaskedPatchViT(MaskedConfig(**TINY))
    assert model.mask_token.shape == (8,) and model.mask_token.dtype == np.float32
    assert 0 < float(np.std(model.mask_token.data)) < 0.1
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    loss, pred, target = model.loss(x, np.zeros((2, 4), np.int64))
    assert pred.shape == (4, 512) and float(loss.item()) == pytest.approx(math.log(512), rel=1e-5)
    preds, kind = model(x)
    assert preds.shape == (2, 4, 512) and kind.shape == (2, 4)


@pytest.mark.parametrize("bad, word", [(dict(target="rgb"), "target"), (dict(mask_rate=0.0), "mask_rate"),
                                       (dict(mask_rate=1.2), "mask_rate"), (dict(num_classes=10), "num_classes"),
                                       (dict(mask_fraction=0.8, random_fraction=0.3), "random_fraction must be <= 1"),
                                       (dict(in_channels=2), "in_channels"), (dict(mask_rate="half"), "mask_rate"),
                                       (dict(dim=0), "dim must be a whole number >= 1")])
def test_invalid_config(bad, word):
    with pytest.raises(ValueError, match=word):
        MaskedConfig(**{**TINY, **bad})


def test_to_vit_and_checkpoint_round_trip(tmp_path):
    model = build(np.float32)
    vit = model.to_vit()
    assert isinstance(vit, ViT) and set(vit.state_dict()) == set(model.encoder_state_dict())
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    assert np.array_equal(vit.forward_features(x).data, model.forward_features(x).data)
    classifier = model.to_vit(num_classes=5)
    assert classifier(x).shape == (2, 5) and not classifier.head.weight.data.any()
    io.save(model, tmp_path / "m.safetensors")
    again = io.load(tmp_path / "m.safetensors")
    assert type(again) is MaskedPatchViT and again.config == model.config
    assert type(from_config("masked-vit", {**TINY, "target": "pixels-l2"})) is MaskedPatchViT
    for k, v in model.state_dict().items():
        assert np.array_equal(again.state_dict()[k], v)


# ====================================================================== 4. `tinyvit pretrain` end to end


SMALL = ["--dataset", "synthetic", "--model", "vit-cifar/4", "--model-arg", "dim=16", "--model-arg", "depth=1", "--model-arg",
         "num_heads=2", "--model-arg", "mlp_dim=32", "--model-arg", "patch_size=4", "--batch-size", "16",
         "--lr", "3e-3", "--warmup-epochs", "0.2", "--epochs", "2"]


@pytest.fixture(scope="module")
def data_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "small.toml"
    path.write_text("[dataset]\nimage_size = 16\ntrain_size = 96\ntest_size = 32\n")
    return str(path)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, data_config):
    out = tmp_path_factory.mktemp("pretrain") / "run"
    assert main(["pretrain", *SMALL, "--config", data_config, "--out", str(out)]) == 0
    return out


def test_pretrain_writes_metrics_and_checkpoints_and_learns(pretrained):
    rows = [json.loads(line) for line in (pretrained / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]
    assert rows[1]["train_loss"] < rows[0]["train_loss"] < math.log(512), "the zero head starts at log 512"
    assert rows[1]["test_loss"] < math.log(512) - 0.2
    for name in ("latest.safetensors", "best.safetensors", "curves.png", "config.json"):
        assert (pretrained / name).exists(), name
    model = io.load(pretrained / "latest.safetensors")
    assert isinstance(model, MaskedPatchViT) and model.config.target == "mean3bit" and model.config.mask_rate == 0.5
    config = json.loads((pretrained / "config.json").read_text())
    assert config["optimizer"] == "adam" and config["weight_decay"] == 0.0, "appendix B.1.2's Adam"


def test_pretrain_resume_gives_the_same_weights(tmp_path, pretrained, data_config):
    """Stopped after epoch 1 and resumed through the CLI: the same weights as the uninterrupted run."""
    out = tmp_path / "run"
    from tinyvit.cli import build_parser
    from tinyvit.cli.train import _train_config
    from tinyvit.training import PRETRAIN_RECIPE
    args = build_parser().parse_args(["pretrain", *SMALL, "--config", data_config, "--out", str(out)])
    cfg = _train_config(args, recipe=PRETRAIN_RECIPE)
    train(cfg, objective=MaskedPrediction(), progress=False, stop_after_epoch=1, log=lambda *a: None)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert main(["pretrain", *SMALL, "--config", data_config, "--out", str(out), "--resume"]) == 0
    resumed, reference = io.read_state_dict(out / "latest.safetensors"), io.read_state_dict(pretrained / "latest.safetensors")
    for k in reference:
        assert np.array_equal(resumed[k], reference[k]), k


def test_pretrain_other_targets_and_bad_flags(tmp_path, data_config, capsys):
    out = tmp_path / "l2"
    args = ["pretrain", *SMALL, "--config", data_config, "--epochs", "1", "--target", "pixels-l2",
            "--mask-rate", "0.15"]
    assert main([*args, "--out", str(out)]) == 0
    model = io.load(out / "latest.safetensors")
    assert model.config.target == "pixels-l2" and model.config.mask_rate == 0.15
    with pytest.raises(SystemExit) as stopped:                      # a usage error, named as the flag
        main([*args, "--out", str(tmp_path / "bad"), "--mask-rate", "1.5"])
    assert stopped.value.code == 2 and "--mask-rate must be in (0, 1], got 1.5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["pretrain", "--dataset", "synthetic", "--target", "colour"])
    with pytest.raises(SystemExit):
        main(["pretrain", "--dataset", "synthetic", "--mixup", "0.8"])    # no labels to mix


def test_finetune_starts_from_the_pretrained_encoder(pretrained):
    model = prepare_finetune(pretrained / "latest.safetensors", num_classes=10)
    encoder = io.load(pretrained / "latest.safetensors").encoder_state_dict()
    assert isinstance(model, ViT) and model.config.num_classes == 10 and not model.head.weight.data.any()
    for k, v in encoder.items():
        assert np.array_equal(model.state_dict()[k], v), k
