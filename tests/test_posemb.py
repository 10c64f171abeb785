"""Position embeddings: the fixed 2D sin-cos table, and resizing learned ones to a new patch grid
(paper section 3.2) against PyTorch's interpolate: bilinear with corners aligned (the official code's
scipy.ndimage.zoom, order 1) and antialiased bicubic (timm's resample_abs_pos_embed)."""
import numpy as np
import pytest

import tinyvit as tv
from tinyvit.models import ViT, ViTConfig, resize_pos_embed, sincos_2d


def table(rng, grid, prefix=1, dim=6, dtype=np.float64):
    gh, gw = (grid, grid) if isinstance(grid, int) else grid
    return rng.standard_normal((1, prefix + gh * gw, dim)).astype(dtype)


def torch_resize(torch, pos, old, new, prefix, mode):
    """The reference: the grid as a (1, D, gh, gw) image through F.interpolate."""
    d = pos.shape[-1]
    grid = torch.tensor(pos[0, prefix:]).reshape(old[0], old[1], d).permute(2, 0, 1)[None]
    kwargs = dict(align_corners=True) if mode == "bilinear" else dict(align_corners=False, antialias=True)
    out = torch.nn.functional.interpolate(grid, size=tuple(new), mode=mode, **kwargs)
    return out[0].permute(1, 2, 0).reshape(1, new[0] * new[1], d).numpy()


# ---------------------------------------------------------------- resize_pos_embed


@pytest.mark.parametrize("prefix", [0, 1])
def test_resize_same_grid_is_identity(rng, prefix):
    pos = table(rng, 4, prefix)
    for method in ("bilinear", "bicubic"):
        out = resize_pos_embed(pos, 4, (4, 4), method=method, num_prefix_tokens=prefix)
        np.testing.assert_array_equal(out, pos)


GRIDS = [((4, 4), (7, 7)), ((6, 6), (3, 3)), ((5, 5), (8, 5)), ((3, 5), (6, 2)), ((2, 2), (14, 14)),
         ((7, 7), (2, 2)), ((1, 1), (3, 3)), ((4, 4), (1, 1))]


@pytest.mark.parametrize("method", ["bilinear", "bicubic"])
@pytest.mark.parametrize("old,new", GRIDS, ids=[f"{a[0]}x{a[1]}-{b[0]}x{b[1]}" for a, b in GRIDS])
def test_resize_matches_torch_interpolate(torch, rng, method, old, new):
    pos = table(rng, old, prefix=1)
    out = resize_pos_embed(pos, old, new, method=method)
    assert out.shape == (1, 1 + new[0] * new[1], pos.shape[-1]) and out.dtype == pos.dtype
    np.testing.assert_array_equal(out[:, :1], pos[:, :1])            # the class token is kept
    np.testing.assert_allclose(out[:, 1:], torch_resize(torch, pos, old, new, 1, method), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["bilinear", "bicubic"])
def test_resize_without_prefix_and_in_float32(torch, rng, method):
    pos = table(rng, (4, 4), prefix=0, dtype=np.float32)
    out = resize_pos_embed(pos, 4, 6, method=method, num_prefix_tokens=0)
    assert out.shape == (1, 36, 6) and out.dtype == np.float32
    np.testing.assert_allclose(out, torch_resize(torch, pos, (4, 4), (6, 6), 0, method), rtol=1e-5, atol=1e-6)


def test_bilinear_keeps_the_corners_and_a_linear_ramp(rng):
    """Corner-aligned: the four corner embeddings stay, and a linear function of (row, col) is
    resized exactly (bilinear interpolation reproduces it)."""
    gh, gw, d = 3, 4, 2
    rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    ramp = np.stack([rows / (gh - 1), cols / (gw - 1)], axis=-1).reshape(1, gh * gw, d)
    out = resize_pos_embed(ramp, (gh, gw), (5, 7), num_prefix_tokens=0).reshape(5, 7, d)
    r2, c2 = np.meshgrid(np.arange(5), np.arange(7), indexing="ij")
    np.testing.assert_allclose(out, np.stack([r2 / 4, c2 / 6], axis=-1), atol=1e-12)


def test_resize_errors(rng):
    pos = table(rng, 4)
    with pytest.raises(ValueError, match="4x4|3x3"):
        resize_pos_embed(pos, 3, 5)                         # 17 tokens are not 1 + 3x3
    with pytest.raises(ValueError, match="method"):
        resize_pos_embed(pos, 4, 5, method="nearest")


@pytest.mark.parametrize("method", ["bilinear", "bicubic"])
def test_model_at_new_resolution_loads_resized_weights(method):
    """Fine-tuning at a higher resolution (section 3.2): keep the patch size, resize E_pos."""
    base = dict(patch_size=4, in_channels=3, num_classes=5, dim=8, depth=1, num_heads=2, mlp_dim=16)
    tv.manual_seed(0)
    small = ViT(ViTConfig(image_size=8, **base))              # 2x2 grid
    big = ViT(ViTConfig(image_size=16, **base))               # 4x4 grid
    state = {k: v.copy() for k, v in small.state_dict().items()}
    with pytest.raises(ValueError, match="pos_embed"):
        big.load_state_dict(state)
    state["pos_embed"] = resize_pos_embed(state["pos_embed"], 2, 4, method=method)
    big.load_state_dict(state)
    np.testing.assert_array_equal(big.pos_embed.data, state["pos_embed"])
    np.testing.assert_array_equal(big.blocks[0].attn.qkv.weight.data, small.blocks[0].attn.qkv.weight.data)
    x = tv.Tensor(np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32))
    y = big(x)
    assert y.shape == (2, 5) and np.isfinite(y.data).all()


# ---------------------------------------------------------------- sincos_2d


def test_sincos_2d_shape_range_and_first_rows():
    gh, gw, d = 3, 5, 16
    t = sincos_2d(gh, gw, d)
    q = d // 4
    assert t.shape == (gh * gw, d)
    assert np.all(np.abs(t) <= 1.0)
    # patch (0, 0): sin 0 = 0 and cos 0 = 1 in each half: [0..0, 1..1, 0..0, 1..1]
    np.testing.assert_array_equal(t[0], np.concatenate([np.zeros(q), np.ones(q), np.zeros(q), np.ones(q)]))
    # row-major: entry 1 is (y=0, x=1). The first half encodes x (big_vision's order), the second y.
    omega = 1.0 / 10000 ** (np.arange(q) / q)
    np.testing.assert_allclose(t[1], np.concatenate([np.sin(omega), np.cos(omega), np.zeros(q), np.ones(q)]),
                               atol=1e-15)
    np.testing.assert_allclose(t[gw], np.concatenate([np.zeros(q), np.ones(q), np.sin(omega), np.cos(omega)]),
                               atol=1e-15)
    # every patch gets its own embedding
    dist = np.linalg.norm(t[:, None] - t[None], axis=-1)
    assert (dist + np.eye(gh * gw) > 1e-3).all()


def test_sincos_2d_matches_the_torch_reference(torch):
    from tinyvit.bench.torch_vit import sincos_2d_torch
    np.testing.assert_allclose(sincos_2d(4, 6, 32), sincos_2d_torch(4, 6, 32).numpy(), atol=1e-12)


def test_sincos_2d_needs_dim_divisible_by_4():
    with pytest.raises(ValueError, match="divisible by 4"):
        sincos_2d(2, 2, 6)
