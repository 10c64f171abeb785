"""Foreign weights that once loaded wrongly or not at all (issue 23): the published R+ViT .npz files'
(1, 1, 1, C) GroupNorm shapes, the current vit_jax code's Linen names, timm state dicts that do not
say their heads or pooling, timm's stem-only hybrids, timm's antialiased bicubic resize of position
embeddings, and bfloat16 safetensors files. Each is checked against an independent reference:
PyTorch (conv2d, group_norm, interpolate, bfloat16) or the model the weights were made from."""
import dataclasses
import json
from collections import OrderedDict

import numpy as np
import pytest

from tinyvit import io
from tinyvit.models import ViTConfig, resize_pos_embed
from tinyvit.models.hybrid import HybridConfig, HybridViT

from test_hybrid import BIT, build, official_hybrid_from_ours
from test_io import _timm_forward, _timm_state_dict, flax_forward, logits, make_images, make_model, official_from_ours


# ============================================================== the official .npz


def _older_flax_groupnorms(official: dict) -> dict:
    """The published hybrid files' form: every GroupNorm scale and bias (C,) -> (1, 1, 1, C)."""
    gn = ("gn_root/", "/gn1/", "/gn2/", "/gn3/", "/gn_proj/")
    return {k: v.reshape(1, 1, 1, -1) if any(g in k for g in gn) else v for k, v in official.items()}


@pytest.mark.parametrize("layers", [(1, 2), ()], ids=["two-stages", "stem-only"])
def test_official_hybrid_with_older_flax_groupnorm_shapes_loads(tmp_path, layers):
    """R50+ViT-B/16 and R+Ti/16 (stem only) as published: GroupNorm scales and biases (1, 1, 1, C)."""
    model = build(**{**BIT, "resnet_layers": layers, "gelu_approximate": "tanh", "resnet_groups": 32,
                     "resnet_width_factor": 1 / 2}).eval()
    official = _older_flax_groupnorms(official_hybrid_from_ours(model))
    assert official["gn_root/scale"].shape == (1, 1, 1, 32)
    np.savez(tmp_path / "R+ViT.npz", **official)

    loaded = io.load_pretrained(tmp_path / "R+ViT.npz")
    assert type(loaded) is HybridViT and loaded.config == model.config
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[name], value, err_msg=name)
    x = make_images(model.config, dtype=np.float64)
    np.testing.assert_array_equal(logits(loaded, x), logits(model, x))


def test_official_norm_of_another_shape_is_refused():
    model = build(**{**BIT, "gelu_approximate": "tanh", "resnet_groups": 32, "resnet_width_factor": 1 / 2})
    official = official_hybrid_from_ours(model)
    official["gn_root/scale"] = official["gn_root/scale"].reshape(2, -1)
    with pytest.raises(ValueError, match=r"gn_root/scale has shape \(2, 16\).*\(1, 1, 1, C\)"):
        io.load_pretrained(official)


_LINEN = {"MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0", "LayerNorm_2": "LayerNorm_1",
          "MlpBlock_3": "MlpBlock_0"}


def _linen_names(official: dict) -> dict:
    """The names the current vit_jax/models_vit.py (Flax Linen) gives the encoder blocks' children."""
    out = {}
    for name, value in official.items():
        for old, new in _LINEN.items():
            name = name.replace(f"/{old}/", f"/{new}/")
        out[name] = value
    return out


def test_official_npz_with_linen_names_loads(tmp_path):
    model = make_model(dtype=np.float64, gelu_approximate="tanh")
    published = official_from_ours(model.state_dict(), model.config)
    linen = _linen_names(published)
    assert "Transformer/encoderblock_1/MlpBlock_0/Dense_1/kernel" in linen
    assert "Transformer/encoderblock_0/LayerNorm_2/scale" not in linen
    np.savez(tmp_path / "linen.npz", **linen)

    assert io.config_from_official_npz(tmp_path / "linen.npz") == model.config     # heads from the query kernel
    loaded = io.load_pretrained(tmp_path / "linen.npz")
    x = make_images(model.config, dtype=np.float64)
    np.testing.assert_array_equal(logits(loaded, x), logits(model, x))
    np.testing.assert_allclose(logits(loaded, x), flax_forward(published, x.transpose(0, 2, 3, 1), model.config),
                               rtol=1e-10, atol=1e-10)

    mixed = {**linen, "Transformer/encoderblock_1/LayerNorm_2/scale": linen["Transformer/encoderblock_1/LayerNorm_1/scale"]}
    with pytest.raises(ValueError, match="mixes Flax Linen names"):
        io.load_pretrained(mixed)


# ============================================================== timm: what a state dict does not say


def test_timm_width_off_the_standard_sizes_needs_num_heads(torch):
    """Width 128 once loaded with 128 // 64 = 2 heads: a 4-head model then gave wrong logits."""
    cfg = ViTConfig(image_size=8, patch_size=4, num_classes=5, dim=128, depth=2, num_heads=4, mlp_dim=16)
    sd = _timm_state_dict(torch, cfg)
    with pytest.raises(ValueError, match="num_heads="):
        io.load_pretrained(sd, pool="token")
    model = io.load_pretrained(sd, num_heads=4, pool="token")
    x = make_images(cfg, dtype=np.float64)
    want = _timm_forward(torch, sd, torch.from_numpy(x), cfg).numpy()
    np.testing.assert_allclose(logits(model, x), want, rtol=1e-10, atol=1e-10)


def test_timm_pooling_is_said_by_the_caller_or_the_model_name(torch):
    """A class token does not say the head reads it: timm's global_pool='avg' keeps it too."""
    cfg = ViTConfig(image_size=32, patch_size=16, num_classes=5, dim=192, depth=1, num_heads=3, mlp_dim=64)
    sd = _timm_state_dict(torch, cfg)
    with pytest.raises(ValueError, match="pool='token'.*timm_name="):
        io.load_pretrained(sd)                                  # 192 wide: 3 heads, but the pooling?
    with pytest.raises(ValueError, match="global_pool='avg' with a class token"):
        io.load_pretrained(sd, pool="gap")
    x = make_images(cfg, dtype=np.float64)
    want = _timm_forward(torch, sd, torch.from_numpy(x), cfg).numpy()
    for kwargs in ({"pool": "token"}, {"timm_name": "vit_tiny_patch16_224.augreg_in21k"},
                   {"timm_name": "deit_tiny_patch16_224"}):
        model = io.load_pretrained(sd, **kwargs)
        assert model.config == cfg, kwargs
        np.testing.assert_allclose(logits(model, x), want, rtol=1e-10, atol=1e-10, err_msg=str(kwargs))

    with pytest.raises(ValueError, match="384 wide but the weights are 192 wide"):
        io.load_pretrained(sd, timm_name="vit_small_patch16_224")
    with pytest.raises(ValueError, match="not a standard timm ViT name"):
        io.load_pretrained(sd, timm_name="vit_medium_patch16_gap_256")


def test_timm_without_class_token_needs_pool_gap():
    model = make_model(pool="gap")
    sd = io.to_timm_state_dict(model)
    with pytest.raises(ValueError, match="pool="):
        io.load_pretrained(sd, num_heads=2)
    with pytest.raises(ValueError, match="no cls_token"):
        io.load_pretrained(sd, num_heads=2, pool="token")
    loaded = io.load_pretrained(sd, num_heads=2, pool="gap")
    x = make_images(model.config)
    np.testing.assert_array_equal(logits(loaded, x), logits(model, x))


def test_timm_name_is_refused_for_other_sources(tmp_path):
    model = make_model(gelu_approximate="tanh")
    with pytest.raises(ValueError, match="timm_name= is for timm state dicts"):
        io.load_pretrained(official_from_ours(model.state_dict(), model.config), timm_name="vit_tiny_patch16_224")
    io.save(model, tmp_path / "ours.safetensors")
    with pytest.raises(ValueError, match="timm_name= is for timm state dicts"):
        io.load_pretrained(tmp_path / "ours.safetensors", timm_name="vit_tiny_patch16_224")


def test_timm_resize_bicubic_is_timms_resample(torch):
    """load_pretrained(..., image_size=, resize_method="bicubic") gives the position embeddings timm's
    resample_abs_pos_embed gives: F.interpolate(bicubic, antialias=True) of the grid, class token kept."""
    model = make_model(dtype=np.float64, image_size=16)                     # a 4x4 grid
    sd = io.to_timm_state_dict(model)
    for size, grid in ((8, 2), (28, 7)):
        tuned = io.load_pretrained(sd, num_heads=2, pool="token", image_size=size, resize_method="bicubic")
        table = torch.from_numpy(sd["pos_embed"][0, 1:]).reshape(1, 4, 4, -1).permute(0, 3, 1, 2)
        want = torch.nn.functional.interpolate(table, size=(grid, grid), mode="bicubic", antialias=True,
                                               align_corners=False)
        want = want.permute(0, 2, 3, 1).reshape(1, grid * grid, -1).numpy()
        np.testing.assert_array_equal(tuned.pos_embed.data[:, :1], sd["pos_embed"][:, :1])
        np.testing.assert_allclose(tuned.pos_embed.data[:, 1:], want, rtol=1e-12, atol=1e-13)


# ============================================================== timm's stem-only hybrids


def _timm_stem_only_hybrid(torch, cfg):
    """timm's vit_tiny_r_s16_p8_224 in miniature: HybridEmbed whose backbone is create_resnetv2_stem(
    stem_type='same', preact=False) alone, a Sequential of conv (StdConv2dSame 7x7/2), norm (GroupNormAct:
    GroupNorm + ReLU) and pool (MaxPool2dSame 3x3/2, -inf padding), so named backbone.conv/norm."""
    from torch_hybrid import StdConv2dSame, TorchHybrid, pad_same

    class GroupNormAct(torch.nn.GroupNorm):
        def forward(self, x):
            return torch.relu(super().forward(x))

    class MaxPool2dSame(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.max_pool2d(pad_same(x, 3, 2, value=float("-inf")), 3, 2)

    width = int(64 * cfg.resnet_width_factor)
    # GroupNorm's epsilon is flax's 1e-6, which tinyvit's ResNet keeps for timm's weights too
    # (models/resnet.py GN_EPS; timm's GroupNormAct has 1e-5).
    stem = torch.nn.Sequential(OrderedDict(conv=StdConv2dSame(cfg.in_channels, width, 7, 2),
                                           norm=GroupNormAct(cfg.resnet_groups, width, eps=1e-6),
                                           pool=MaxPool2dSame()))
    ref = TorchHybrid(**dataclasses.asdict(cfg))
    ref.patch_embed.backbone = stem
    ref = ref.double().eval()
    torch.manual_seed(0)
    for name, p in ref.named_parameters():
        torch.nn.init.normal_(p, 1.0 if ".norm" in name and name.endswith("weight") else 0.0, 0.3)
    return ref, {k: v.detach().numpy() for k, v in ref.state_dict().items()}


def test_timm_stem_only_hybrid_loads_and_matches_torch(torch):
    cfg = HybridConfig(image_size=64, patch_size=8, num_classes=5, dim=192, depth=1, num_heads=3, mlp_dim=64,
                       resnet_layers=(), resnet_width_factor=1, resnet_root="bit", resnet_groups=32)
    ref, sd = _timm_stem_only_hybrid(torch, cfg)
    assert {"patch_embed.backbone.conv.weight", "patch_embed.backbone.norm.weight",
            "patch_embed.backbone.norm.bias"} <= set(sd) and not any(".stem." in k for k in sd)
    assert sd["patch_embed.proj.weight"].shape == (192, 64, 8, 8)

    model = io.load_pretrained(sd, timm_name="vit_tiny_r_s16_p8_224")
    assert type(model) is HybridViT and model.config == cfg and model.config.grid_size == 2
    x = np.random.default_rng(0).standard_normal((2, 3, 64, 64))
    want = ref(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(logits(model, x), want, rtol=1e-10, atol=1e-10)

    back = io.to_timm_state_dict(model)                        # and back to timm's names
    assert set(back) == set(sd)
    for name in sd:
        np.testing.assert_array_equal(back[name], sd[name], err_msg=name)


# ============================================================== resizing as timm


@pytest.mark.parametrize("old,new", [(14, 7), (14, 24), (7, 5), (7, 12), ((5, 3), (2, 9)), (4, 1), (1, 3)])
def test_bicubic_resize_is_torchs_antialiased_bicubic(torch, old, new):
    old = (old, old) if isinstance(old, int) else old
    new = (new, new) if isinstance(new, int) else new
    pos = np.random.default_rng(0).standard_normal((1, 1 + old[0] * old[1], 5))
    grid = torch.from_numpy(pos[0, 1:]).reshape(1, *old, 5).permute(0, 3, 1, 2)
    # timm interpolates in float32; there torch's own rounding (its weights are float32) is ~2e-6
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        want = torch.nn.functional.interpolate(grid.to(torch.float64 if dtype == np.float64 else torch.float32),
                                               size=new, mode="bicubic", align_corners=False, antialias=True)
        want = want.permute(0, 2, 3, 1).reshape(1, -1, 5).double().numpy()
        got = resize_pos_embed(pos.astype(dtype), old, new, method="bicubic")
        assert got.dtype == dtype and got.shape == (1, 1 + new[0] * new[1], 5)
        np.testing.assert_allclose(got[:, 1:], want, rtol=tol, atol=tol, err_msg=str(dtype))


# ============================================================== bfloat16 safetensors


def _write_safetensors_by_hand(path, tensors: dict, metadata: dict):
    """The format, with no library: u64 little-endian header length, the JSON header, the raw bytes.
    tensors: {name: (dtype name, shape, bytes)}."""
    header, data = {"__metadata__": metadata}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_bfloat16_safetensors_read_as_float32(tmp_path, torch):
    values = torch.tensor([[1.0, -2.5, 3.140625, 1e-3], [65504.0, -1e30, 0.0, 7.5e-39]]).to(torch.bfloat16)
    raw = values.view(torch.int16).numpy().astype("<i2").tobytes()
    half = np.array([0.5, -1.25], np.float16)
    _write_safetensors_by_hand(tmp_path / "bf16.safetensors",
                               {"w": ("BF16", values.shape, raw), "h": ("F16", half.shape, half.tobytes())},
                               {"format": "pt"})
    arrays, metadata = io.load_arrays(tmp_path / "bf16.safetensors")
    assert metadata == {"format": "pt"}
    assert arrays["w"].dtype == np.float32 and arrays["w"].shape == (2, 4)
    np.testing.assert_array_equal(arrays["w"], values.float().numpy())           # torch's bf16 -> f32, exactly
    assert arrays["h"].dtype == np.float16
    np.testing.assert_array_equal(arrays["h"], half)


def test_bfloat16_timm_file_loads(tmp_path, torch):
    import safetensors.torch
    cfg = ViTConfig(image_size=8, patch_size=4, num_classes=5, dim=8, depth=2, num_heads=2, mlp_dim=16)
    sd = {k: v.to(torch.bfloat16) for k, v in _timm_state_dict(torch, cfg).items()}
    safetensors.torch.save_file(sd, str(tmp_path / "vit_bf16.safetensors"), metadata={"format": "pt"})
    model = io.load_pretrained(tmp_path / "vit_bf16.safetensors", num_heads=2, pool="token")
    assert model.pos_embed.dtype == np.float32
    exact = io.load_pretrained({k: v.float() for k, v in sd.items()}, num_heads=2, pool="token")
    for name, value in exact.state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[name], value, err_msg=name)
