"""The hybrid R+ViT of section 3.1 (tinyvit/models/hybrid.py): a float64 gradient check of every
parameter, parity with an independent PyTorch hybrid (tests/torch_hybrid.py) in float64 and float32,
the paper's sequence lengths and parameter counts, named variants, timm and official-.npz weights,
save/load, fine-tuning, and a short training run that learns."""
import dataclasses
import json

import numpy as np
import pytest

import tinyvit as tv
from tinyvit import io
from tinyvit.backend import default_dtype
from tinyvit.models import config_for, count_parameters, create, known_names, model_class, resnet
from tinyvit.models.hybrid import HybridConfig, HybridViT

from helpers import assert_close

# 8x8 images, light root (stride 1) + 2 stages (stride 2): a 4x4 feature map of 64 channels, 16 tokens
TINY = dict(image_size=8, in_channels=3, num_classes=3, dim=8, depth=1, num_heads=2, mlp_dim=12,
            resnet_layers=(1, 1), resnet_width_factor=1 / 8, resnet_root="light", resnet_groups=4)
# 16x16 images, the ImageNet root (7x7/2 conv, 3x3/2 max-pool) + 2 stages: a 2x2 map, every 'SAME'
# padding asymmetric (root conv (2, 3), max-pool (0, 1), stage-2 3x3/2 (0, 1))
BIT = dict(TINY, image_size=16, resnet_root="bit", resnet_layers=(1, 2), dim=12, num_heads=3, depth=2)


def build(dtype=np.float64, seed=0, **overrides):
    """A HybridViT with every parameter random (the paper's zero head and zero GN3 scales would make
    most gradients zero and hide misplaced terms)."""
    tv.manual_seed(seed)
    with default_dtype(dtype):
        model = HybridViT(HybridConfig(**{**TINY, **overrides}))
    rng = np.random.default_rng(seed + 100)
    for name, p in model.named_parameters():
        values = rng.standard_normal(p.shape) * 0.4
        if ".norm" in name or name.startswith("norm"):
            values = (1.0 if name.endswith("weight") else 0.0) + 0.5 * values
        p.data[...] = values
    return model


def images(cfg, batch=2, seed=1, dtype=np.float64, requires_grad=False):
    x = np.random.default_rng(seed).standard_normal((batch, cfg.in_channels, cfg.image_size, cfg.image_size))
    return tv.Tensor(x.astype(dtype), requires_grad=requires_grad)


def logits(model, x):
    with tv.no_grad():
        return model(tv.Tensor(x)).numpy()


# ====================================================================== 1. gradient check


@pytest.mark.parametrize("case", [{}, dict(resnet_root="bit", resnet_layers=(1,), image_size=16, patch_size=2,
                                           pool="gap")], ids=["light-root", "bit-root-patch2-gap"])
def test_gradcheck_every_parameter_and_the_images(case):
    """Every tensor of at most 8 elements element by element, the others along 2 random directions
    each (a forward pass costs ~10 ms of Python, so a full check of 9k weights would take minutes)."""
    model = build(**case)
    x = images(model.config, requires_grad=True)
    params = list(model.parameters())
    tv.gradcheck(lambda x, *ps: model(x), [x] + params, mode="auto", max_full=8, directions=2)
    for name, t in [("images", x)] + list(model.named_parameters()):
        assert t.grad is not None and np.abs(t.grad).max() > 0, f"{name} got no gradient"


def test_same_logits_and_gradients_on_the_device(xp):
    """NumPy against CuPy: every op of the hybrid (SAME padding, pooling, norms) on the GPU."""
    if xp is np:
        pytest.skip("compares the GPU run with the host run")
    model = build(**BIT)
    x = images(model.config, requires_grad=True)
    y = model(x)
    y.backward(np.ones(y.shape))
    host = {n: p.grad.copy() for n, p in model.named_parameters()}
    model.zero_grad()
    model.to(device="cuda")
    xd = tv.Tensor(xp.asarray(x.numpy()), requires_grad=True)
    yd = model(xd)
    yd.backward(xp.ones(yd.shape))
    assert_close(yd, y.numpy(), 1e-9, 1e-12, what="logits")
    assert_close(xd.grad, x.grad, 1e-9, 1e-12, what="gradient of the images")
    for name, p in model.named_parameters():
        assert_close(p.grad, host[name], 1e-9, 1e-11, what=f"gradient of {name}")


# ====================================================================== 2. PyTorch parity


def to_torch_state(model, torch):
    """Our parameters in torch_hybrid.TorchHybrid's (timm's) names and layouts: conv kernels are
    (out, in, kh, kw) in both, Linear weights transpose, E folds into a (D, C', P, P) conv."""
    cfg = model.config
    out = {}
    for name, p in model.named_parameters():
        a = p.numpy()
        if name == "patch_embed.proj.weight":
            a = a.T.reshape(cfg.dim, cfg.feature_channels, cfg.patch_size, cfg.patch_size)
        elif a.ndim == 2:
            a = a.T
        out[name] = torch.tensor(np.ascontiguousarray(a))
    return out


def from_torch_grad(name, g, cfg):
    g = g.detach().numpy()
    if name == "patch_embed.proj.weight":
        return g.reshape(cfg.dim, -1).T
    return g.T if g.ndim == 2 else g


@pytest.mark.parametrize("dtype,rtol,atol", [(np.float64, 1e-6, 1e-10), (np.float32, 1e-4, 1e-5)],
                         ids=["float64", "float32"])
@pytest.mark.parametrize("case", [TINY, dict(BIT, patch_size=2, image_size=32)], ids=["light-root", "bit-root-patch2"])
def test_matches_an_independent_pytorch_hybrid(torch, case, dtype, rtol, atol):
    from torch_hybrid import TorchHybrid

    model = build(dtype=dtype, seed=3, **case)
    cfg = model.config
    ref = TorchHybrid(**dataclasses.asdict(cfg)).to(torch.float64 if dtype == np.float64 else torch.float32)
    ref_params = dict(ref.named_parameters())
    state = to_torch_state(model, torch)
    assert set(state) == set(ref_params), f"parameter names differ: {set(state) ^ set(ref_params)}"
    ref.load_state_dict(state, strict=True)

    x_np = np.random.default_rng(4).standard_normal((2, cfg.in_channels, cfg.image_size, cfg.image_size))
    x = tv.Tensor(x_np.astype(dtype), requires_grad=True)
    xt = torch.tensor(x_np.astype(dtype), requires_grad=True)
    y, yt = model(x), ref(xt)
    assert y.dtype == dtype
    assert_close(y, yt, rtol, atol, what="logits")

    g = np.random.default_rng(5).standard_normal(y.shape).astype(dtype)       # random upstream
    y.backward(g)
    yt.backward(torch.tensor(g))
    assert_close(x.grad, xt.grad, rtol, atol * max(1.0, float(xt.grad.abs().max())), what="gradient of the images")
    for name, p in model.named_parameters():
        expected = from_torch_grad(name, ref_params[name].grad, cfg)
        assert p.grad.dtype == dtype, f"{name}: gradient dtype {p.grad.dtype}"
        assert_close(p.grad, expected, rtol, atol * max(1.0, float(np.abs(expected).max())),
                     what=f"gradient of {name}")


# ====================================================================== 3. the paper's models


@pytest.mark.parametrize("name,layers,grid,dim,channels", [
    ("r50+vit-b/16", (3, 4, 9), 14, 768, 1024),      # section 4.1 (ii): stage 4 moved into stage 3
    ("r50+vit-b/32", (3, 4, 6, 3), 7, 768, 2048),    # (i): the stage-4 output of the full R50
    ("r50+vit-l/16", (3, 4, 9), 14, 1024, 1024),
    ("r26+vit-s/32", (2, 2, 2, 2), 7, 384, 2048),
    ("r50x2+vit-b/16", (3, 4, 9), 14, 768, 2048),
    ("r14+vit-cifar/4", (1, 1, 2), 8, 192, 256),      # light root (stride 1), stage 4 in stage 3
    ("r14+vit-cifar/16", (1, 1, 1, 1), 2, 192, 512),  # stride 8, then 2x2 patches on the feature map
])
def test_named_hybrids_have_the_papers_sequence_lengths(name, layers, grid, dim, channels):
    cfg = config_for(name)
    assert isinstance(cfg, HybridConfig)
    assert (cfg.resnet_layers, cfg.grid_size, cfg.dim, cfg.feature_channels) == (layers, grid, dim, channels)
    assert cfg.num_patches == grid * grid
    assert cfg.effective_patch_size == int(name.rsplit("/", 1)[1])
    assert cfg.patch_size == (2 if name.endswith("/16") and "cifar" in name else 1)


def test_r50_vit_b16_parameter_count(torch):
    """98.66M parameters, counted from the config: the (3, 4, 9) ResNet's count equals the torch
    reference's (built on the CPU, 11.9M), the Transformer part is ViT-B's count on 196 tokens of 1024
    channels, and the total (checked once against the whole torch reference, which takes 2 s to
    build) matches timm's model card for vit_base_r50_s16_384 (99.0M) minus its longer position table."""
    from torch_hybrid import TorchResNet

    cfg = config_for("r50+vit-b/16")
    backbone = TorchResNet(cfg.resnet_layers, 1, 3, "bit", 32)
    assert resnet.count_parameters((3, 4, 9)) == sum(p.numel() for p in backbone.parameters()) == 11_894_848
    vit = cfg.transformer_config()
    assert (vit.image_size, vit.patch_size, vit.in_channels, vit.num_patches) == (14, 1, 1024, 196)
    assert count_parameters(cfg) == 11_894_848 + count_parameters(vit) == 98_659_112
    assert round((count_parameters(cfg) + (577 - 197) * 768) / 1e6, 1) == 99.0     # 384 px: 577 tokens


@pytest.mark.parametrize("name", ["r14+vit-cifar/4", "r14+vit-mnist/4"])
def test_small_presets_count_and_shape(name):
    model = create(name)
    cfg = model.config
    assert count_parameters(cfg) == model.num_parameters()
    expected = (32, "light", 8) if "cifar" in name else (28, "light", 7)
    assert (cfg.image_size, cfg.resnet_root, cfg.grid_size) == expected
    assert cfg.resnet_layers == (1, 1, 2)
    with tv.no_grad():
        out = model(tv.Tensor(np.zeros((2, cfg.in_channels, cfg.image_size, cfg.image_size), np.float32)))
    assert out.shape == (2, 10) and out.dtype == np.float32


def test_hybrids_are_listed_and_created_by_name(capsys):
    names = known_names()
    for name in ("r50+vit-b/16", "r26+vit-s/32", "r14+vit-cifar/4", "r14+vit-mnist/4"):
        assert name in names
    model = create("r14+vit-cifar/4", num_classes=5, dim=32, depth=1, num_heads=2, mlp_dim=64)
    assert type(model) is HybridViT and model.arch == "hybrid" and model_class("hybrid") is HybridViT
    assert model.config.num_classes == 5 and model.config.dim == 32
    from tinyvit.cli import main
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("r50+vit-b/16"))
    assert "196" in line and "98.66M" in line and "ResNet(3,4,9)" in line


def test_initialisation_follows_the_official_code():
    model = create("r14+vit-cifar/4", dim=32, depth=1, num_heads=2, mlp_dim=64)
    zero = {n: p for n, p in model.named_parameters() if n.endswith("norm3.weight")}
    assert len(zero) == 4 and all(np.all(p.data == 0) for p in zero.values())       # gn3 scale_init=zeros
    np.testing.assert_array_equal(model.head.weight.data, 0.0)                      # zero head
    np.testing.assert_array_equal(model.cls_token.data, 0.0)
    e = model.patch_embed.proj.weight.data                                          # LeCun normal (256, 32)
    assert e.shape == (256, 32) and abs(e.std() * np.sqrt(256) - 1) < 0.1


# ====================================================================== 4. config and errors


def test_config_round_trips_through_json_lists_and_strings():
    cfg = HybridConfig(**TINY)
    back = HybridConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(cfg))))  # tuple -> list -> tuple
    assert back == cfg and back.resnet_layers == (1, 1)
    assert dataclasses.replace(cfg, resnet_layers="2,1").resnet_layers == (2, 1)   # --model-arg resnet_layers=2,1
    with pytest.raises(ValueError, match="unknown HybridConfig fields"):
        HybridConfig.from_dict({**dataclasses.asdict(cfg), "width": 3})


@pytest.mark.parametrize("bad,words", [
    (dict(image_size=9), r"image_size 9 is not divisible by the pixels per token 2 \(ResNet stride 2"),
    (dict(resnet_layers=(1, 0)), "resnet_layers must be positive"),
    (dict(resnet_layers="a,b"), "resnet_layers"),
    (dict(resnet_root="deep"), "resnet_root"),
    (dict(resnet_groups=3), r"widths \[8, 8, 16\].*resnet_groups=3"),
    (dict(resnet_width_factor=0), "resnet_width_factor"),
    (dict(dim=9), "num_heads"),                                   # ViTConfig's own checks still run
    (dict(patch_size=0), "patch_size"),
    (dict(image_size="224"), "image_size must be a whole number >= 1, got '224'"),   # once a TypeError
    (dict(num_heads=0), "num_heads must be a whole number >= 1"),
])
def test_invalid_config_names_the_problem(bad, words):
    with pytest.raises(ValueError, match=words):
        HybridConfig(**{**TINY, **bad})


def test_unknown_or_impossible_names():
    with pytest.raises(ValueError, match="unknown ResNet 'r99'"):
        config_for("r99+vit-b/16")
    with pytest.raises(ValueError, match="multiple of 16"):
        config_for("r50+vit-b/8")
    with pytest.raises(ValueError, match="unknown hybrid model"):
        config_for("r50+deit-b/16")


def test_wrong_images_name_the_shapes():
    model = build()
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\) with H and W multiples of 2.*\(2, 1, 8, 8\)"):
        model(tv.Tensor(np.zeros((2, 1, 8, 8))))
    with pytest.raises(ValueError, match="resize_pos_embed"):                     # another size: ViT's message
        model(tv.Tensor(np.zeros((2, 3, 12, 12))))


# ====================================================================== 5. checkpoints and weights


def test_save_load_is_bitwise_and_reproduces_the_logits(tmp_path):
    model = build(dtype=np.float32, **BIT)
    tv.save(model, tmp_path / "h.safetensors")
    loaded = tv.load(tmp_path / "h.safetensors")
    assert type(loaded) is HybridViT and loaded.config == model.config and not loaded.training
    for (n, a), (m, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n == m and a.dtype == b.dtype == np.float32
        np.testing.assert_array_equal(a, b, err_msg=n)
    x = images(model.config, dtype=np.float32).numpy()
    np.testing.assert_array_equal(logits(model.eval(), x), logits(loaded, x))
    again = io.load_pretrained(tmp_path / "h.safetensors")                       # our file via load_pretrained
    np.testing.assert_array_equal(logits(again, x), logits(loaded, x))


def test_timm_names_round_trip_and_load(tmp_path, torch):
    """A state dict in timm's names and torch layouts (from the torch reference) loads through
    load_pretrained into a hybrid whose config is inferred and whose logits are the reference's."""
    import safetensors.numpy
    from torch_hybrid import TorchHybrid

    cfg = HybridConfig(**{**BIT, "resnet_groups": 32, "resnet_width_factor": 1 / 2})   # widths 32, 32, 64
    torch.manual_seed(0)
    ref = TorchHybrid(**dataclasses.asdict(cfg)).double().eval()
    for name, p in ref.named_parameters():
        torch.nn.init.normal_(p, 1.0 if ".norm" in name and name.endswith("weight") else 0.0, 0.3)
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    assert {"patch_embed.backbone.stem.conv.weight", "patch_embed.backbone.stages.1.blocks.0.downsample.conv.weight",
            "patch_embed.backbone.stages.0.blocks.0.norm3.bias", "patch_embed.proj.weight"} <= set(sd)
    safetensors.numpy.save_file(sd, str(tmp_path / "timm.safetensors"))

    assert io.config_from_timm_state_dict(sd, num_heads=3, pool="token") == cfg
    model = io.load_pretrained(tmp_path / "timm.safetensors", num_heads=3, pool="token")
    assert type(model) is HybridViT and model.config == cfg
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16))
    np.testing.assert_allclose(logits(model, x), ref(torch.tensor(x)).detach().numpy(), rtol=1e-10, atol=1e-10)
    back = io.to_timm_state_dict(model)
    assert set(back) == set(sd)
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k], err_msg=k)
    np.testing.assert_array_equal(io.to_timm_state_dict(model.state_dict())["patch_embed.proj.weight"],
                                  sd["patch_embed.proj.weight"])        # C' read from the backbone


def official_hybrid_from_ours(model, prefix=""):
    """Reference, independent of tinyvit.io: our hybrid's ResNet in the official Flax names and HWIO
    kernels (vit_jax/models_vit.py conv_root/gn_root, block{s}/unit{u} counted from 1,
    models_resnet.py conv1-3/gn1-3/conv_proj/gn_proj), and the ViT part via test_io's converter."""
    from test_io import official_from_ours

    cfg = model.config
    s = {k: v.copy() for k, v in model.state_dict().items()}
    vit_part = {k: v for k, v in s.items() if not k.startswith("patch_embed.backbone.")}
    out = official_from_ours(vit_part, cfg.transformer_config())           # E: (1, 1, C', D)
    hwio = lambda k: s[k].transpose(2, 3, 1, 0)                                   # (out, in, kh, kw) -> HWIO
    pre = "patch_embed.backbone."
    out["conv_root/kernel"] = hwio(pre + "stem.conv.weight")
    out["gn_root/scale"], out["gn_root/bias"] = s[pre + "stem.norm.weight"], s[pre + "stem.norm.bias"]
    for st, units in enumerate(cfg.resnet_layers):
        for u in range(units):
            ours, theirs = f"{pre}stages.{st}.blocks.{u}.", f"block{st + 1}/unit{u + 1}/"
            for k in (1, 2, 3):
                out[theirs + f"conv{k}/kernel"] = hwio(ours + f"conv{k}.weight")
                out[theirs + f"gn{k}/scale"] = s[ours + f"norm{k}.weight"]
                out[theirs + f"gn{k}/bias"] = s[ours + f"norm{k}.bias"]
            if ours + "downsample.conv.weight" in s:
                out[theirs + "conv_proj/kernel"] = hwio(ours + "downsample.conv.weight")
                out[theirs + "gn_proj/scale"] = s[ours + "downsample.norm.weight"]
                out[theirs + "gn_proj/bias"] = s[ours + "downsample.norm.bias"]
    return {prefix + k: v for k, v in out.items()}


@pytest.mark.parametrize("prefix", ["", "opt/target/"])
def test_official_npz_names_load_into_the_hybrid(tmp_path, prefix):
    model = build(**{**BIT, "gelu_approximate": "tanh", "resnet_groups": 32, "resnet_width_factor": 1 / 2}).eval()
    official = official_hybrid_from_ours(model, prefix)
    assert {prefix + n for n in ("conv_root/kernel", "gn_root/scale", "block1/unit1/conv_proj/kernel",
                                 "block2/unit2/gn3/bias", "embedding/kernel")} <= set(official)
    assert official[prefix + "embedding/kernel"].shape == (1, 1, 256, 12)   # the 1x1 projection, HWIO
    path = tmp_path / "R+ViT-tiny.npz"
    np.savez(path, **official)

    state = io.from_official_npz(path)
    assert set(state) == set(model.state_dict())
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)
    assert io.config_from_official_npz(path) == model.config
    loaded = io.load_pretrained(path)
    x = images(model.config).numpy()
    assert type(loaded) is HybridViT
    np.testing.assert_array_equal(logits(loaded, x), logits(model, x))
    with pytest.raises(ValueError, match="block2/unit1/gn4/scale"):             # a name we have no place for
        io.from_official_npz({**official, prefix + "block2/unit1/gn4/scale": np.ones(64)})
    del official[prefix + "block2/unit1/gn_proj/bias"]
    missing = r"missing keys: patch_embed\.backbone\.stages\.1\.blocks\.0\.downsample\.norm\.bias"
    with pytest.raises(ValueError, match=missing):
        io.load_pretrained(official)


# ====================================================================== 6. fine-tuning and training


def test_finetune_new_head_and_resolution(tmp_path):
    """prepare_finetune: a zero head for the new classes, the backbone and encoder kept, the position
    embeddings interpolated from the 2x2 grid (16 px) to 4x4 (32 px)."""
    from tinyvit.models import resize_pos_embed
    from tinyvit.training import prepare_finetune

    model = build(dtype=np.float32, **BIT)
    tv.save(model, tmp_path / "pre.safetensors")
    tuned = prepare_finetune(tmp_path / "pre.safetensors", num_classes=7, image_size=32)
    assert type(tuned) is HybridViT and tuned.config.grid_size == 4 and tuned.config.num_classes == 7
    np.testing.assert_array_equal(tuned.head.weight.data, 0.0)
    want = resize_pos_embed(model.pos_embed.data, 2, 4, "bilinear", num_prefix_tokens=1)
    np.testing.assert_allclose(tuned.pos_embed.data, want, rtol=1e-6)
    old = model.state_dict()
    for k, v in tuned.state_dict().items():
        if k.startswith("patch_embed.") or k.startswith("blocks."):
            np.testing.assert_array_equal(v, old[k], err_msg=k)
    with tv.no_grad():
        assert tuned(tv.Tensor(np.zeros((1, 3, 32, 32), np.float32))).shape == (1, 7)


def test_trains_on_synthetic_data_far_above_chance(tmp_path):
    from tinyvit.training import TrainConfig, train

    # The grey 28 px preset shrunk to 8 px images, one block of width 32 and two ResNet stages
    # (a 4x4 map, 16 tokens); resnet_layers arrives as a list, as from a TOML [model] table.
    cfg = TrainConfig(dataset="synthetic", model="r14+vit-mnist/4", epochs=2, batch_size=16, lr=3e-3,
                      warmup_epochs=0.5, out=str(tmp_path / "run"), seed=0,
                      model_args=dict(dim=32, depth=1, num_heads=2, mlp_dim=64, resnet_layers=[1, 1]),
                      dataset_args=dict(train_size=128, test_size=100, image_size=8, channels=1, num_classes=4))
    result = train(cfg, progress=False, log=lambda *a: None)
    assert result["test_acc"] > 0.75, result                          # chance is 0.25
    best = tv.load(tmp_path / "run" / "best.safetensors")
    assert type(best) is HybridViT and best.config.resnet_layers == (1, 1) and best.config.grid_size == 4
