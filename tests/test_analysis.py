"""Looking inside a ViT (tinyvit/analysis.py, tinyvit/plots.py, `tinyvit inspect`): the paper's
Figure 6 (attention rollout) and Figure 7 (embedding filters, position-embedding similarity,
attention distance), each against an answer known without the code under test: hand computations,
explicit-loop references, closed forms computed by brute force, and textbook PCA identities."""
import math

import numpy as np
import pytest
from PIL import Image

import tinyvit as tv
from tinyvit.evaluation import analysis, plots
from tinyvit.evaluation.analysis import (attention_distance, attention_rollout, embedding_filters,
                              position_embedding_similarity)
from tinyvit.backend import to_numpy
from tinyvit.cli import main
from tinyvit.models import ViT, ViTConfig


def random_attention(rng, layers, batch, heads, tokens):
    """Softmax-like rows: (layers list of) (B, H, T, T) with positive entries summing to 1."""
    a = rng.gamma(0.5, size=(layers, batch, heads, tokens, tokens))
    return list(a / a.sum(-1, keepdims=True))


def uniform_attention(layers, batch, heads, tokens):
    return [np.full((batch, heads, tokens, tokens), 1.0 / tokens) for _ in range(layers)]


# ====================================================================== 1. attention rollout


def test_identity_attention_rolls_out_to_the_identity(xp):
    att = [xp.broadcast_to(xp.eye(5), (2, 3, 5, 5)) for _ in range(4)]   # grid 2x2 + class token
    rollout, amap = attention_rollout(att)
    assert to_numpy(rollout).shape == (2, 5, 5) and to_numpy(amap).shape == (2, 2, 2)
    np.testing.assert_allclose(to_numpy(rollout), np.broadcast_to(np.eye(5), (2, 5, 5)))
    np.testing.assert_allclose(to_numpy(amap), 0.0)          # the class token only sees itself


def test_two_layers_by_hand():
    # Layer 1: heads [[0,1],[1,0]] and [[1,0],[1,0]] -> mean [[.5,.5],[1,0]] -> + I [[1.5,.5],[1,1]]
    #          -> rows / 2: A1 = [[.75,.25],[.5,.5]]
    # Layer 2: both heads [[0,1],[0,1]] -> + I [[1,1],[0,2]] -> A2 = [[.5,.5],[0,1]]
    # R = A2 A1 = [[.625,.375],[.5,.5]]   (the other order, A1 A2, would give [[.375,.625],[.25,.75]])
    layer1 = np.array([[[[0, 1], [1, 0]], [[1, 0], [1, 0]]]], float)
    layer2 = np.array([[[[0, 1], [0, 1]], [[0, 1], [0, 1]]]], float)
    rollout, amap = attention_rollout([layer1, layer2], grid_size=1)
    np.testing.assert_allclose(rollout, [[[0.625, 0.375], [0.5, 0.5]]])
    np.testing.assert_allclose(amap, [[[0.375]]])            # class token -> the one patch


def reference_rollout(layers, prefix):
    """Attention rollout with explicit loops over images, layers, heads and rows."""
    layers = [np.asarray(a) for a in layers]
    b, h, t, _ = layers[0].shape
    out = np.zeros((b, t, t))
    for i in range(b):
        r = np.eye(t)
        for a in layers:
            fused = sum(a[i, k] for k in range(h)) / h + np.eye(t)
            for row in range(t):
                fused[row] = fused[row] / fused[row].sum()
            r = fused @ r
        out[i] = r
    rows = out[:, 0, prefix:] if prefix else np.stack([out[i].mean(axis=0) for i in range(b)])
    return out, rows


@pytest.mark.parametrize("prefix, grid", [(1, (3, 3)), (0, (3, 3)), (1, (2, 4))], ids=["token", "gap", "2x4"])
def test_rollout_matches_explicit_loops(xp, prefix, grid):
    att = random_attention(np.random.default_rng(0), layers=3, batch=2, heads=3, tokens=prefix + grid[0] * grid[1])
    rollout, amap = attention_rollout([xp.asarray(a) for a in att], grid_size=grid)
    expected, rows = reference_rollout(att, prefix)
    np.testing.assert_allclose(to_numpy(rollout), expected, rtol=1e-12)
    np.testing.assert_allclose(to_numpy(amap), rows.reshape(2, *grid), rtol=1e-12)
    np.testing.assert_allclose(to_numpy(rollout).sum(-1), 1.0)   # still a distribution per row


def test_rollout_accepts_tensors_stacks_and_unbatched_layers():
    att = random_attention(np.random.default_rng(1), layers=2, batch=1, heads=2, tokens=5)
    expected = attention_rollout(att).matrix
    for variant in ([tv.Tensor(a) for a in att], np.stack(att), [a[0] for a in att]):
        np.testing.assert_allclose(attention_rollout(variant).matrix, expected)


@pytest.mark.parametrize("att, kwargs, message", [
    ([np.full((1, 2, 10, 10), 0.1)], dict(grid_size=2), "10 tokens does not match a 2x2"),
    ([np.full((1, 2, 7, 7), 1 / 7)], {}, "square patch grid"),
    ([np.full((1, 2, 5, 5), 0.2), np.full((1, 2, 10, 10), 0.1)], {}, "same shape"),
    ([np.full((1, 2, 5, 4), 0.25)], {}, r"\(B, heads, T, T\)"),
    ([], {}, "no attention"),
])
def test_rollout_rejects_attention_that_does_not_fit(att, kwargs, message):
    with pytest.raises(ValueError, match=message):
        attention_rollout(att, **kwargs)


# ====================================================================== 2. attention distance


def brute_force_mean_distance(gh, gw, patch_size):
    """Mean distance in pixels between patch centres over all ordered pairs (self-pairs included):
    what uniform attention over the patches gives."""
    total, count = 0.0, 0
    for r1 in range(gh):
        for c1 in range(gw):
            for r2 in range(gh):
                for c2 in range(gw):
                    total += math.hypot((r1 - r2) * patch_size, (c1 - c2) * patch_size)
                    count += 1
    return total / count


def test_attention_on_itself_has_distance_zero(xp):
    att = [xp.broadcast_to(xp.eye(17), (2, 3, 17, 17)) for _ in range(2)]   # 4x4 grid + class token
    d = to_numpy(attention_distance(att, grid_size=4, patch_size=16))
    assert d.shape == (2, 3)
    np.testing.assert_allclose(d, 0.0, atol=1e-12)


@pytest.mark.parametrize("grid, prefix, patch", [(4, 1, 16), ((2, 3), 0, 8), (5, 1, 4)])
def test_uniform_attention_gives_the_mean_pairwise_patch_distance(xp, grid, prefix, patch):
    gh, gw = (grid, grid) if isinstance(grid, int) else grid
    att = [xp.asarray(a) for a in uniform_attention(3, 2, 2, prefix + gh * gw)]
    d = to_numpy(attention_distance(att, grid, patch))
    np.testing.assert_allclose(d, np.full((3, 2), brute_force_mean_distance(gh, gw, patch)), rtol=1e-12)


def test_class_token_is_excluded_and_weights_renormalised():
    # Every patch query puts half its weight on the class token and half on the first patch of its
    # own row; the class token's own row looks at the far corner. Without the class token and after
    # renormalising, query (r, c) looks only at (r, 0): distance c * P, mean over c of 0..3 = 1.5 P.
    g, p = 4, 10
    t = 1 + g * g
    a = np.zeros((1, 1, t, t))
    a[0, 0, 0, -1] = 1.0
    for i in range(g * g):
        a[0, 0, 1 + i, 0] = 0.5
        a[0, 0, 1 + i, 1 + (i // g) * g] = 0.5
    np.testing.assert_allclose(attention_distance([a], g, p), [[1.5 * p]], rtol=1e-12)


def test_distance_is_per_layer_and_head():
    g, p, t = 3, 4, 10
    local, spread = np.broadcast_to(np.eye(t), (1, t, t)), np.full((1, t, t), 1.0 / t)
    layer1 = np.stack([local, spread], axis=1)                    # head 1 local, head 2 uniform
    layer2 = np.stack([spread, local], axis=1)
    uniform = brute_force_mean_distance(g, g, p)
    np.testing.assert_allclose(attention_distance([layer1, layer2], g, p), [[0, uniform], [uniform, 0]],
                               atol=1e-12)


def test_distance_rejects_a_grid_that_does_not_fit():
    with pytest.raises(ValueError, match="17 tokens does not match a 3x3"):
        attention_distance(uniform_attention(1, 1, 1, 17), grid_size=3, patch_size=16)


# ====================================================================== 3. position-embedding similarity


def test_orthogonal_embeddings_are_similar_only_to_themselves():
    table = np.concatenate([np.full((1, 6), 5.0), 3.0 * np.eye(6)])[None]   # class token + 2x3 grid
    sim = position_embedding_similarity(table, grid_size=(2, 3))
    assert sim.shape == (2, 3, 2, 3)
    np.testing.assert_allclose(sim.reshape(6, 6), np.eye(6), atol=1e-12)


@pytest.mark.parametrize("posemb, pool", [("learned-1d", "token"), ("learned-2d", "token"),
                                          ("sincos-2d", "token"), ("learned-1d", "gap")])
def test_similarity_of_a_model_is_symmetric_with_ones_on_the_diagonal(posemb, pool):
    tv.manual_seed(0)
    model = ViT(ViTConfig(image_size=12, patch_size=4, dim=16, depth=1, num_heads=2, mlp_dim=16,
                          num_classes=2, posemb=posemb, pool=pool))
    sim = to_numpy(position_embedding_similarity(model))
    assert sim.shape == (3, 3, 3, 3)
    flat = sim.reshape(9, 9)
    np.testing.assert_allclose(np.diag(flat), 1.0, rtol=1e-6)
    np.testing.assert_allclose(flat, flat.T, atol=1e-6)
    assert np.all(np.abs(flat) <= 1 + 1e-6)
    if posemb == "learned-1d":   # the cosine similarity of the patch rows, class token left out
        e = model.pos_embed.data[0, model.config.num_prefix_tokens:].astype(np.float64)
        e = e / np.linalg.norm(e, axis=1, keepdims=True)
        np.testing.assert_allclose(flat, e @ e.T, rtol=1e-5, atol=1e-6)


def test_similarity_needs_position_embeddings():
    model = ViT(ViTConfig(image_size=8, patch_size=4, dim=8, depth=1, num_heads=2, mlp_dim=8, num_classes=2,
                          posemb="none"))
    with pytest.raises(ValueError, match="no position embeddings"):
        position_embedding_similarity(model)
    relative = ViT(ViTConfig(image_size=8, patch_size=4, dim=8, depth=1, num_heads=2, mlp_dim=8, num_classes=2,
                             posemb="relative"))
    with pytest.raises(ValueError, match="relative .*not a table of one per patch"):
        position_embedding_similarity(relative)


# ====================================================================== 4. embedding filters


def test_filter_pca_components_are_orthonormal_and_ordered_by_explained_variance():
    rng = np.random.default_rng(0)
    c, p, d = 3, 4, 64
    w = rng.standard_normal((c * p * p, d)) * np.linspace(3.0, 0.1, c * p * p)[:, None]   # E (CPP, D)
    pca = embedding_filters(w, num_components=20, patch_size=p)
    comps = pca.components.reshape(20, -1)
    assert pca.components.shape == (20, c, p, p)
    np.testing.assert_allclose(comps @ comps.T, np.eye(20), atol=1e-10)                # orthonormal
    assert np.all(np.diff(pca.explained_variance) <= 0)                                 # ordered
    filters = w.T - w.T.mean(axis=0)                                                    # D centred filters
    np.testing.assert_allclose((filters @ comps.T).var(axis=0, ddof=1), pca.explained_variance, rtol=1e-10)
    eigenvalues = np.linalg.eigvalsh(np.cov(w))[::-1]        # covariance of the filters' C*P*P entries
    np.testing.assert_allclose(pca.explained_variance, eigenvalues[:20], rtol=1e-8)
    np.testing.assert_allclose(pca.explained_variance_ratio, eigenvalues[:20] / eigenvalues.sum(), rtol=1e-8)


def test_filter_pca_of_a_model_and_its_limits():
    tv.manual_seed(0)
    model = ViT(ViTConfig(image_size=8, patch_size=4, dim=10, depth=1, num_heads=2, mlp_dim=8, num_classes=2))
    pca = embedding_filters(model, num_components=28)
    assert pca.components.shape == (9, 3, 4, 4)     # 10 filters span at most 9 centred directions
    direct = embedding_filters(model.patch_embed.proj.weight.data, 28, patch_size=4, in_channels=3)
    np.testing.assert_allclose(pca.components, direct.components)
    with pytest.raises(ValueError, match="not"):
        embedding_filters(model.patch_embed.proj.weight, 28, patch_size=5)


# ====================================================================== 5. pictures


def png_size(path):
    with Image.open(path) as img:
        assert img.format == "PNG"
        return img.size


def figure_size(figsize):
    return round(figsize[0] * plots.DPI), round(figsize[1] * plots.DPI)


def test_pictures_have_the_expected_sizes(tmp_path):
    rng = np.random.default_rng(0)
    overlay = plots.rollout_overlay(rng.uniform(size=(3, 16, 16)), rng.uniform(size=(4, 4)))
    assert overlay.size == (3 * 224 + 2 * plots.OVERLAY_GAP, 224)        # 16 px enlarged 14 times
    grey = plots.rollout_overlay(rng.uniform(size=(1, 28, 28)), np.zeros((7, 7)))
    assert grey.size == (3 * 224 + 2 * plots.OVERLAY_GAP, 224) and grey.mode == "RGB"
    tiles = plots.filters_image(rng.standard_normal((28, 3, 4, 4)))        # 4 x 7 tiles of 48 px
    assert tiles.size == (7 * 48 + 8 * plots.TILE_GAP, 4 * 48 + 5 * plots.TILE_GAP)
    plots.plot_position_similarity(rng.uniform(-1, 1, (3, 3, 3, 3)), tmp_path / "sim.png")
    plots.plot_attention_distance(rng.uniform(0, 20, (4, 3)), tmp_path / "dist.png", reference=10.0)
    assert png_size(tmp_path / "sim.png") == figure_size(plots.SIMILARITY_FIGSIZE)
    assert png_size(tmp_path / "dist.png") == figure_size(plots.DISTANCE_FIGSIZE)


def test_overlay_follows_the_map():
    """The rollout map's hot patch is where the middle panel (input x map) stays bright."""
    amap = np.zeros((4, 4))
    amap[1, 2] = 1.0
    strip = np.asarray(plots.rollout_overlay(np.ones((3, 16, 16)), amap, min_size=16), float)
    masked = strip[:, 16 + plots.OVERLAY_GAP:32 + plots.OVERLAY_GAP].mean(axis=2)      # (16, 16)
    row, col = np.unravel_index(masked.argmax(), masked.shape)
    assert (row // 4, col // 4) == (1, 2)
    assert masked[14, 1] == 0                                                           # far away: dark


# ====================================================================== 6. `tinyvit inspect` end to end


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny ViT trained for one epoch on 16x16 synthetic images (4x4 grid of 4-pixel patches)."""
    from tinyvit.training import TrainConfig, train
    out = tmp_path_factory.mktemp("run")
    train(TrainConfig(dataset="synthetic", model="vit-cifar/4", epochs=1, batch_size=32, out=str(out),
                      model_args=dict(dim=32, depth=2, num_heads=2, mlp_dim=64),
                      dataset_args=dict(train_size=64, test_size=32, image_size=16)),
          progress=False, log=lambda *a: None)
    return out / "best.safetensors"


@pytest.fixture
def image_files(tmp_path):
    rng = np.random.default_rng(0)
    a, b = tmp_path / "cat.png", tmp_path / "dog.jpg"
    Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(a)   # not square, not 16 px
    Image.fromarray(rng.integers(0, 256, (20, 20), dtype=np.uint8)).save(b)      # greyscale
    return [a, b]


def test_inspect_command_writes_the_four_figures(checkpoint, image_files, tmp_path, capsys):
    out = tmp_path / "figures"
    assert main(["inspect", str(checkpoint), "--images", *map(str, image_files), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    expected = [out / "attention_rollout_0_cat.png", out / "attention_rollout_1_dog.png",
                out / "attention_distance.png", out / "position_embedding_similarity.png",
                out / "embedding_filters.png"]
    assert printed == [str(p) for p in expected]
    for path in expected[:2]:
        assert png_size(path) == (3 * 224 + 2 * plots.OVERLAY_GAP, 224)
    assert png_size(expected[2]) == figure_size(plots.DISTANCE_FIGSIZE)
    assert png_size(expected[3]) == figure_size(plots.SIMILARITY_FIGSIZE)
    assert png_size(expected[4]) == (7 * 48 + 8 * plots.TILE_GAP, 4 * 48 + 5 * plots.TILE_GAP)  # 28 of 31


def test_inspect_preprocesses_as_predict(checkpoint, image_files, tmp_path, monkeypatch):
    """The maps drawn are the rollout of the model on read_image + the checkpoint's mean/std."""
    from tinyvit.evaluation import load_for_inference, read_image
    drawn = []
    original = plots.rollout_overlay
    monkeypatch.setattr(plots, "rollout_overlay", lambda image, amap: drawn.append(amap) or original(image, amap))
    written = analysis.inspect_checkpoint(checkpoint, image_files, tmp_path / "api", batch_size=1, log=None)
    assert [len(v) for v in written.values()] == [2, 1, 1, 1]
    model, info = load_for_inference(checkpoint)
    x = np.stack([read_image(p, 3, 16) for p in image_files])
    x = (x - np.reshape(info["mean"], (1, 3, 1, 1))) / np.reshape(info["std"], (1, 3, 1, 1))
    expected = attention_rollout(analysis.collect_attentions(model, x.astype(np.float32))).map
    np.testing.assert_allclose(np.stack(drawn), expected, rtol=1e-5, atol=1e-7)


def test_inspect_without_images_or_position_embeddings_says_what_it_skipped(tmp_path, capsys):
    tv.manual_seed(0)
    model = ViT(ViTConfig(image_size=8, patch_size=4, dim=8, depth=1, num_heads=2, mlp_dim=8, num_classes=2,
                          posemb="none", pool="gap"))
    tv.save(model, tmp_path / "m.safetensors")
    assert main(["inspect", str(tmp_path / "m.safetensors"), "--out", str(tmp_path / "o")]) == 0
    out, err = capsys.readouterr()
    assert out.split() == [str(tmp_path / "o" / "embedding_filters.png")]
    assert "no images given" in err and "posemb='none'" in err


def test_inspect_errors_are_one_line(checkpoint, tmp_path, capsys):
    assert main(["inspect", str(checkpoint), "--images", str(tmp_path / "missing.png"),
                 "--out", str(tmp_path / "o")]) == 1
    assert "missing.png" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["inspect", str(checkpoint), "--components", "0"])
    assert exc.value.code == 2
