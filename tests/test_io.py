"""tinyvit.io: safetensors checkpoints (atomic, strict, clear errors) and foreign weights (timm, the
official .npz), checked against independent references: PyTorch's conv2d and a timm-style forward,
and a NumPy forward written in the official Flax code's own layouts (NHWC, HWIO, (D, H, dh))."""
import dataclasses
import json
import os
import pickle

import numpy as np
import pytest

import tinyvit as tv
from tinyvit import io
from tinyvit.models import ViT, ViTConfig, resize_pos_embed

TINY = dict(image_size=8, patch_size=4, in_channels=3, num_classes=5, dim=8, depth=2, num_heads=2, mlp_dim=16)


def make_model(seed=0, dtype=np.float32, **overrides):
    """A tiny ViT whose every weight is random (the real init zeroes the head, which would hide bugs)."""
    model = ViT(ViTConfig(**{**TINY, **overrides}))
    rng = np.random.default_rng(seed)
    for p in model.parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.5
    return model.to(dtype=dtype).eval()


def make_images(cfg, n=2, seed=1, dtype=np.float32):
    shape = (n, cfg.in_channels, cfg.image_size, cfg.image_size)
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def logits(model, images):
    with tv.no_grad():
        return model(tv.Tensor(images)).numpy()


def host_state(model):
    return {k: tv.backend.to_numpy(v).copy() for k, v in model.state_dict().items()}


def assert_same_state(actual, expected):
    assert list(actual) == list(expected) or set(actual) == set(expected), \
        f"keys differ: {set(actual) ^ set(expected)}"
    for name in expected:
        a, e = tv.backend.to_numpy(actual[name]), tv.backend.to_numpy(expected[name])
        assert a.dtype == e.dtype, f"{name}: dtype {a.dtype} != {e.dtype}"
        assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
        np.testing.assert_array_equal(a, e, err_msg=name)


# ============================================================== save / load


@pytest.mark.parametrize("variant", [{}, dict(pool="gap", representation_size=6), dict(posemb="learned-2d")])
def test_save_load_is_bitwise_equal_and_logits_match(tmp_path, variant):
    model = make_model(**variant)
    path = tmp_path / "model.safetensors"
    io.save(model, path)
    loaded = io.load(path)
    assert isinstance(loaded, ViT) and loaded.config == model.config
    assert not loaded.training
    assert_same_state(loaded.state_dict(), model.state_dict())
    x = make_images(model.config)
    np.testing.assert_array_equal(logits(loaded, x), logits(model, x))


def test_load_keeps_the_checkpoint_dtype_unless_told(tmp_path):
    model = make_model(dtype=np.float64)
    io.save(model, tmp_path / "m.safetensors")
    loaded = io.load(tmp_path / "m.safetensors")
    assert {p.dtype for p in loaded.parameters()} == {np.dtype(np.float64)}
    assert_same_state(loaded.state_dict(), model.state_dict())
    as32 = io.load(tmp_path / "m.safetensors", dtype=np.float32)
    assert {p.dtype for p in as32.parameters()} == {np.dtype(np.float32)}
    np.testing.assert_array_equal(as32.pos_embed.data, model.pos_embed.data.astype(np.float32))


def test_saved_file_has_the_metadata(tmp_path):
    model = make_model()
    io.save(model, tmp_path / "m.safetensors")
    arrays, meta = io.load_arrays(tmp_path / "m.safetensors")
    assert meta["format"] == "tinyvit"
    assert meta["arch"] == "vit"
    assert json.loads(meta["config"]) == dataclasses.asdict(model.config)
    assert meta["tinyvit_version"] == tv.__version__
    assert set(arrays) == set(model.state_dict())


def test_extra_arrays_and_metadata_round_trip(tmp_path):
    model = make_model()
    extra = {"adam.step": np.array(7), "adam.m.head.weight": np.arange(40.0).reshape(8, 5)}
    io.save(model, tmp_path / "ckpt.safetensors", arrays=extra, metadata={"epoch": "3"})
    loaded, arrays, meta = io.load_checkpoint(tmp_path / "ckpt.safetensors")
    assert_same_state(arrays, extra)
    assert meta == {"epoch": "3"}
    assert_same_state(loaded.state_dict(), model.state_dict())
    assert_same_state(io.read_state_dict(tmp_path / "ckpt.safetensors"), model.state_dict())
    io.load(tmp_path / "ckpt.safetensors")  # the extras do not disturb a strict model load


def test_save_rejects_reserved_or_non_string_metadata(tmp_path):
    model = make_model()
    with pytest.raises(ValueError, match="reserved"):
        io.save(model, tmp_path / "m.safetensors", metadata={"arch": "mine"})
    with pytest.raises(TypeError, match="str to str"):
        io.save(model, tmp_path / "m.safetensors", metadata={"epoch": 3})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_save_leaves_the_previous_file_and_no_temp_file(tmp_path, monkeypatch, error):
    import safetensors.numpy
    old = make_model(seed=0)
    path = tmp_path / "model.safetensors"
    io.save(old, path)
    before = path.read_bytes()
    calls = []

    def crash_halfway(tmp, arrays, metadata):
        calls.append(tmp)
        data = safetensors.numpy.save(arrays, metadata=metadata)
        with open(tmp, "wb") as f:
            f.write(data[: len(data) // 2])
        raise error

    monkeypatch.setattr(io.arrays, "_write_safetensors", crash_halfway)  # where save_arrays looks it up
    with pytest.raises(type(error)):
        io.save(make_model(seed=1), path)
    assert calls and os.path.dirname(calls[0]) == str(tmp_path) and calls[0] != str(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.safetensors"]
    monkeypatch.undo()
    assert_same_state(io.load(path).state_dict(), old.state_dict())


def test_save_over_an_existing_file_replaces_it(tmp_path):
    path = tmp_path / "model.safetensors"
    io.save(make_model(seed=0), path)
    new = make_model(seed=1)
    io.save(new, path)
    assert_same_state(io.load(path).state_dict(), new.state_dict())
    assert os.listdir(tmp_path) == ["model.safetensors"]


@pytest.mark.parametrize("keep", [0, 4, 20, 0.5, -1])
def test_truncated_file_is_a_clear_error(tmp_path, keep):
    io.save(make_model(), tmp_path / "good.safetensors")
    data = (tmp_path / "good.safetensors").read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(data[:cut])
    with pytest.raises(ValueError, match="truncated or corrupted") as info:
        io.load(bad)
    assert str(bad) in str(info.value)


@pytest.mark.parametrize("content", [b"hello, I am not a checkpoint" * 10,
                                     np.random.default_rng(0).bytes(1000)])
def test_garbage_file_is_a_clear_error(tmp_path, content):
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match="truncated or corrupted") as info:
        io.load(bad)
    assert str(bad) in str(info.value)


def test_missing_file_error_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors"):
        io.load(tmp_path / "nowhere.safetensors")
    with pytest.raises(FileNotFoundError, match="nowhere.npz"):
        io.load_pretrained(tmp_path / "nowhere.npz")


def test_load_points_npz_and_pickles_elsewhere(tmp_path):
    np.savez(tmp_path / "official.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="load_pretrained"):
        io.load(tmp_path / "official.npz")
    (tmp_path / "model.pth").write_bytes(pickle.dumps({"w": 1}, protocol=4))
    with pytest.raises(ValueError, match="never loaded"):
        io.load(tmp_path / "model.pth")


def test_save_into_a_missing_directory_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        io.save(make_model(), tmp_path / "no" / "such" / "m.safetensors")


def test_safetensors_file_without_tinyvit_metadata_is_refused(tmp_path):
    io.save_arrays(tmp_path / "other.safetensors", {"w": np.zeros(3, np.float32)}, {"format": "pt"})
    with pytest.raises(ValueError, match="not a tinyvit checkpoint"):
        io.load(tmp_path / "other.safetensors")


def test_unknown_arch_or_config_is_a_clear_error(tmp_path):
    model = make_model()
    meta = {"format": "tinyvit", "arch": "convnext", "config": json.dumps(dataclasses.asdict(model.config))}
    io.save_arrays(tmp_path / "a.safetensors", model.state_dict(), meta)
    with pytest.raises(ValueError, match="convnext"):
        io.load(tmp_path / "a.safetensors")
    meta = {"format": "tinyvit", "arch": "vit", "config": json.dumps({**TINY, "wings": 2})}
    io.save_arrays(tmp_path / "b.safetensors", model.state_dict(), meta)
    with pytest.raises(ValueError, match="wings"):
        io.load(tmp_path / "b.safetensors")


def test_checkpoint_of_another_config_lists_mismatched_tensors(tmp_path):
    io.save(make_model(), tmp_path / "d8.safetensors")
    wider = make_model(seed=3, dim=12)
    before = host_state(wider)
    with pytest.raises(ValueError) as info:
        wider.load_state_dict(io.read_state_dict(tmp_path / "d8.safetensors"))
    message = str(info.value)
    assert "blocks.0.attn.qkv.weight" in message and "(8, 24)" in message and "(12, 36)" in message
    assert_same_state(wider.state_dict(), before)   # nothing was loaded


def test_save_and_load_on_a_device(tmp_path, xp):
    device = "cpu" if xp is np else "cuda"
    model = make_model().to(device=device)
    io.save(model, tmp_path / "m.safetensors")
    loaded = io.load(tmp_path / "m.safetensors", device=device)
    assert {tv.backend.device_of(p.data) for p in loaded.parameters()} == {tv.backend.device_of(model.pos_embed.data)}
    assert_same_state(loaded.state_dict(), model.state_dict())


# ============================================================== timm / PyTorch


@pytest.mark.parametrize("variant", [{}, dict(pool="gap", representation_size=6), dict(qkv_bias=False)])
def test_timm_round_trip_is_identity(variant):
    model = make_model(**variant)
    d, k = model.config.dim, model.config.num_classes
    timm = io.to_timm_state_dict(model)
    assert timm["patch_embed.proj.weight"].shape == (d, 3, 4, 4)     # torch layouts
    assert timm["blocks.0.attn.qkv.weight"].shape == (3 * d, d)
    assert timm["blocks.1.mlp.fc1.weight"].shape == (16, d)
    assert timm["head.weight"].shape == (k, model.config.representation_size or d)
    back = io.from_timm_state_dict(timm)
    assert_same_state(back, host_state(model))
    assert_same_state(io.to_timm_state_dict(back, in_channels=3), timm)
    cfg = io.config_from_timm_state_dict(timm, num_heads=2, pool=model.config.pool)   # neither is in the file
    assert cfg == model.config
    with pytest.raises(ValueError, match="does not store how the model pools"):
        io.config_from_timm_state_dict(timm, num_heads=2)


def test_to_timm_refuses_what_timm_does_not_have():
    with pytest.raises(ValueError, match="pos_embed_row"):
        io.to_timm_state_dict(make_model(posemb="learned-2d"))


def test_from_timm_reports_unknown_tensors():
    timm = io.to_timm_state_dict(make_model())
    timm["fc_norm.weight"] = np.ones(8, np.float32)
    timm["blocks.0.ls1.gamma"] = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="fc_norm.weight") as info:
        io.from_timm_state_dict(timm)
    assert "fc_norm.weight" in str(info.value) and "blocks.0.ls1.gamma" in str(info.value)
    with pytest.warns(UserWarning, match="fc_norm.weight"):
        state = io.from_timm_state_dict(timm, strict=False)
    assert "fc_norm.weight" not in state and "blocks.0.norm1.weight" in state


def test_timm_no_embed_class_gets_a_zero_class_position():
    timm = io.to_timm_state_dict(make_model())
    timm["pos_embed"] = timm["pos_embed"][:, 1:]               # DeiT-III: patches only
    state = io.from_timm_state_dict(timm)
    assert state["pos_embed"].shape == (1, 5, 8)
    np.testing.assert_array_equal(state["pos_embed"][:, 0], 0)
    np.testing.assert_array_equal(state["pos_embed"][:, 1:], timm["pos_embed"])


def _timm_state_dict(torch, cfg, seed=0):
    """Random weights with timm's names and PyTorch's layouts ((out, in) Linear, (D, C, P, P) conv)."""
    g = torch.Generator().manual_seed(seed)
    d, m, c, p, k = cfg.dim, cfg.mlp_dim, cfg.in_channels, cfg.patch_size, cfg.num_classes
    shapes = {"patch_embed.proj.weight": (d, c, p, p), "patch_embed.proj.bias": (d,), "cls_token": (1, 1, d),
              "pos_embed": (1, cfg.num_patches + 1, d), "norm.weight": (d,), "norm.bias": (d,),
              "head.weight": (k, d), "head.bias": (k,)}
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        shapes.update({b + "norm1.weight": (d,), b + "norm1.bias": (d,), b + "attn.qkv.weight": (3 * d, d),
                       b + "attn.qkv.bias": (3 * d,), b + "attn.proj.weight": (d, d), b + "attn.proj.bias": (d,),
                       b + "norm2.weight": (d,), b + "norm2.bias": (d,), b + "mlp.fc1.weight": (m, d),
                       b + "mlp.fc1.bias": (m,), b + "mlp.fc2.weight": (d, m), b + "mlp.fc2.bias": (d,)})
    return {name: torch.randn(shape, generator=g, dtype=torch.float64) * 0.5 for name, shape in shapes.items()}


def _timm_forward(torch, sd, images, cfg):
    """timm's VisionTransformer.forward (class token, pre-norm blocks, exact GELU), written with torch."""
    F = torch.nn.functional
    b, d, h = images.shape[0], cfg.dim, cfg.num_heads
    x = F.conv2d(images, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=cfg.patch_size)
    x = x.flatten(2).transpose(1, 2)                                        # (B, N, D)
    x = torch.cat([sd["cls_token"].expand(b, -1, -1), x], dim=1) + sd["pos_embed"]
    n = x.shape[1]
    for i in range(cfg.depth):
        p = f"blocks.{i}."
        y = F.layer_norm(x, (d,), sd[p + "norm1.weight"], sd[p + "norm1.bias"], eps=1e-6)
        qkv = F.linear(y, sd[p + "attn.qkv.weight"], sd[p + "attn.qkv.bias"])
        q, k, v = qkv.reshape(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)     # as timm's Attention
        a = torch.softmax(q @ k.transpose(-2, -1) / (d // h) ** 0.5, dim=-1) @ v
        x = x + F.linear(a.transpose(1, 2).reshape(b, n, d), sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"])
        y = F.layer_norm(x, (d,), sd[p + "norm2.weight"], sd[p + "norm2.bias"], eps=1e-6)
        y = F.linear(F.gelu(F.linear(y, sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"])),
                     sd[p + "mlp.fc2.weight"], sd[p + "mlp.fc2.bias"])
        x = x + y
    x = F.layer_norm(x, (d,), sd["norm.weight"], sd["norm.bias"], eps=1e-6)
    return F.linear(x[:, 0], sd["head.weight"], sd["head.bias"])


def test_timm_torch_layouts_convert_correctly(torch):
    cfg = ViTConfig(**TINY)
    sd = _timm_state_dict(torch, cfg)
    ours = io.from_timm_state_dict(sd)
    assert all(isinstance(v, np.ndarray) for v in ours.values())
    images = make_images(cfg, dtype=np.float64)

    # The patch embedding equals PyTorch's strided conv2d on the same images.
    conv = torch.nn.functional.conv2d(torch.from_numpy(images), sd["patch_embed.proj.weight"],
                                      sd["patch_embed.proj.bias"], stride=cfg.patch_size)
    expected = conv.flatten(2).transpose(1, 2).numpy()
    got = tv.functional.patch_embed(images, ours["patch_embed.proj.weight"], ours["patch_embed.proj.bias"], 4)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)

    # Every Linear: x W_ours + b equals torch's x W^T + b.
    x = np.random.default_rng(2).standard_normal((3, cfg.dim))
    for name in ("blocks.0.attn.qkv", "blocks.1.attn.proj", "blocks.0.mlp.fc1", "head"):
        want = torch.nn.functional.linear(torch.from_numpy(x), sd[name + ".weight"], sd[name + ".bias"]).numpy()
        np.testing.assert_allclose(x @ ours[name + ".weight"] + ours[name + ".bias"], want, rtol=1e-12, err_msg=name)

    # The whole model: our ViT on the converted weights equals a timm-style forward in torch.
    model = io.load_pretrained(sd, num_heads=2, pool="token")
    assert model.config == cfg and model.pos_embed.dtype == np.float64
    want = _timm_forward(torch, sd, torch.from_numpy(images), cfg).numpy()
    np.testing.assert_allclose(logits(model, images), want, rtol=1e-10, atol=1e-10)


def test_load_pretrained_reads_a_timm_safetensors_file(tmp_path):
    import safetensors.numpy
    model = make_model()
    path = tmp_path / "timm_vit.safetensors"
    safetensors.numpy.save_file(io.to_timm_state_dict(model), str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="num_heads"):
        io.load_pretrained(path)                    # width 8 is no standard width: heads are unknown
    loaded = io.load_pretrained(path, num_heads=2, pool="token")
    assert loaded.config == model.config
    x = make_images(model.config)
    np.testing.assert_array_equal(logits(loaded, x), logits(model, x))


def test_pickles_are_refused_with_a_recipe(tmp_path):
    path = tmp_path / "vit.pth"
    path.write_bytes(pickle.dumps({"patch_embed.proj.weight": [1.0]}, protocol=4))
    with pytest.raises(ValueError, match="never unpickles") as info:
        io.load_pretrained(path)
    assert "safetensors.torch.save_file" in str(info.value)


# ============================================================== the official .npz


def official_from_ours(state, cfg, prefix=""):
    """Reference, written independently of tinyvit.io: our state dict -> the official Flax names and
    layouts (vit_jax/models_vit.py): HWIO conv kernel, (D, H, dh) q/k/v kernels, (H, dh, D) out kernel."""
    d, h, p, c = cfg.dim, cfg.num_heads, cfg.patch_size, cfg.in_channels
    dh = d // h
    s = {k: tv.backend.to_numpy(v) for k, v in state.items()}
    out = {"embedding/kernel": s["patch_embed.proj.weight"].reshape(c, p, p, d).transpose(1, 2, 0, 3),
           "embedding/bias": s["patch_embed.proj.bias"],
           "Transformer/posembed_input/pos_embedding": s["pos_embed"],
           "Transformer/encoder_norm/scale": s["norm.weight"], "Transformer/encoder_norm/bias": s["norm.bias"],
           "head/kernel": s["head.weight"], "head/bias": s["head.bias"]}
    if "cls_token" in s:
        out["cls"] = s["cls_token"]
    if "pre_logits.fc.weight" in s:
        out["pre_logits/kernel"], out["pre_logits/bias"] = s["pre_logits.fc.weight"], s["pre_logits.fc.bias"]
    for i in range(cfg.depth):
        b, t = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
        mha = t + "MultiHeadDotProductAttention_1/"
        w, bias = s[b + "attn.qkv.weight"], s[b + "attn.qkv.bias"]
        for j, name in enumerate(("query", "key", "value")):
            out[mha + name + "/kernel"] = w[:, j * d:(j + 1) * d].reshape(d, h, dh)
            out[mha + name + "/bias"] = bias[j * d:(j + 1) * d].reshape(h, dh)
        out[mha + "out/kernel"] = s[b + "attn.proj.weight"].reshape(h, dh, d)
        out[mha + "out/bias"] = s[b + "attn.proj.bias"]
        for ours, theirs in (("norm1", "LayerNorm_0"), ("norm2", "LayerNorm_2")):
            out[t + theirs + "/scale"], out[t + theirs + "/bias"] = s[b + ours + ".weight"], s[b + ours + ".bias"]
        for ours, theirs in (("fc1", "Dense_0"), ("fc2", "Dense_1")):
            out[t + f"MlpBlock_3/{theirs}/kernel"] = s[b + f"mlp.{ours}.weight"]
            out[t + f"MlpBlock_3/{theirs}/bias"] = s[b + f"mlp.{ours}.bias"]
    return {prefix + k: v for k, v in out.items()}


def flax_forward(w, images_nhwc, cfg):
    """The official model's forward in NumPy, on the official arrays and NHWC images, with the Flax
    layer semantics (nn.Conv HWIO, DenseGeneral heads, LayerNorm eps 1e-6, nn.gelu = tanh form)."""
    def ln(x, name):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-6) * w[name + "/scale"] + w[name + "/bias"]

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    n_img, hh, ww, _ = images_nhwc.shape
    p = w["embedding/kernel"].shape[0]
    patches = images_nhwc.reshape(n_img, hh // p, p, ww // p, p, -1).transpose(0, 1, 3, 2, 4, 5)
    x = np.einsum("bghijc,ijcd->bghd", patches, w["embedding/kernel"]) + w["embedding/bias"]
    x = x.reshape(n_img, -1, x.shape[-1])
    if "cls" in w:
        x = np.concatenate([np.repeat(w["cls"], n_img, axis=0), x], axis=1)
    x = x + w["Transformer/posembed_input/pos_embedding"]
    for i in range(cfg.depth):
        t = f"Transformer/encoderblock_{i}/"
        mha = t + "MultiHeadDotProductAttention_1/"
        y = ln(x, t + "LayerNorm_0")
        q, k, v = (np.einsum("bnd,dhk->bnhk", y, w[mha + f"{s}/kernel"]) + w[mha + f"{s}/bias"]
                   for s in ("query", "key", "value"))
        logit = np.einsum("bqhk,bshk->bhqs", q / np.sqrt(q.shape[-1]), k)
        attn = np.exp(logit - logit.max(-1, keepdims=True))
        attn /= attn.sum(-1, keepdims=True)
        o = np.einsum("bhqs,bshk->bqhk", attn, v)
        x = x + np.einsum("bqhk,hkd->bqd", o, w[mha + "out/kernel"]) + w[mha + "out/bias"]
        y = ln(x, t + "LayerNorm_2")
        y = gelu(y @ w[t + "MlpBlock_3/Dense_0/kernel"] + w[t + "MlpBlock_3/Dense_0/bias"])
        x = x + y @ w[t + "MlpBlock_3/Dense_1/kernel"] + w[t + "MlpBlock_3/Dense_1/bias"]
    x = ln(x, "Transformer/encoder_norm")
    x = x[:, 0] if "cls" in w else x.mean(axis=1)
    if "pre_logits/kernel" in w:
        x = np.tanh(x @ w["pre_logits/kernel"] + w["pre_logits/bias"])
    return x @ w["head/kernel"] + w["head/bias"]


OFFICIAL_VARIANTS = [
    pytest.param({}, "", id="token"),
    pytest.param(dict(pool="gap", representation_size=6), "", id="gap-prelogits"),
    pytest.param({}, "opt/target/", id="opt-target-prefix"),
]


@pytest.mark.parametrize("variant, prefix", OFFICIAL_VARIANTS)
def test_official_npz_reproduces_the_model(tmp_path, variant, prefix):
    model = make_model(dtype=np.float64, gelu_approximate="tanh", **variant)
    cfg = model.config
    path = tmp_path / "ViT-tiny.npz"
    np.savez(path, **official_from_ours(model.state_dict(), cfg, prefix))

    assert_same_state(io.from_official_npz(path), host_state(model))
    assert io.config_from_official_npz(path) == cfg

    loaded = io.load_pretrained(path)
    assert loaded.config == cfg and not loaded.training
    x = make_images(cfg, dtype=np.float64)
    ours = logits(loaded, x)
    np.testing.assert_array_equal(ours, logits(model, x))
    official = official_from_ours(model.state_dict(), cfg)
    np.testing.assert_allclose(ours, flax_forward(official, x.transpose(0, 2, 3, 1), cfg), rtol=1e-10, atol=1e-10)


def test_official_npz_from_a_mapping_and_unknown_names():
    model = make_model(gelu_approximate="tanh")
    official = official_from_ours(model.state_dict(), model.config)
    assert_same_state(io.from_official_npz(official), host_state(model))
    official["Transformer/encoderblock_0/LayerScale/scale"] = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="LayerScale"):
        io.from_official_npz(official)
    del official["Transformer/encoderblock_1/MultiHeadDotProductAttention_1/value/kernel"]
    with pytest.raises(ValueError, match="encoderblock_1/MultiHeadDotProductAttention_1/value/kernel"):
        io.from_official_npz(official, strict=False)


def test_npz_with_pickled_objects_is_never_unpickled(tmp_path):
    path = tmp_path / "evil.npz"
    np.savez(path, **{"embedding/kernel": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(ValueError, match="pickle"):
        io.from_official_npz(path)


# ============================================================== load_pretrained: fine-tuning adaptations


def test_load_pretrained_new_head_and_resolution(tmp_path):
    model = make_model(gelu_approximate="tanh")
    path = tmp_path / "vit.npz"
    np.savez(path, **official_from_ours(model.state_dict(), model.config))
    tuned = io.load_pretrained(path, num_classes=10, image_size=16)
    assert tuned.config == dataclasses.replace(model.config, num_classes=10, image_size=16)
    np.testing.assert_array_equal(tuned.head.weight.data, 0)           # a fresh zero head, (D, 10)
    assert tuned.head.weight.shape == (8, 10)
    want_pos = resize_pos_embed(model.pos_embed.data, 2, 4, "bilinear", num_prefix_tokens=1)
    np.testing.assert_array_equal(tuned.pos_embed.data, want_pos)
    kept = {k: v for k, v in host_state(model).items() if not k.startswith(("head.", "pos_embed"))}
    assert_same_state({k: tuned.state_dict()[k] for k in kept}, kept)
    assert logits(tuned, make_images(tuned.config)).shape == (2, 10)


def test_load_pretrained_drops_the_pre_logits_when_asked(tmp_path):
    model = make_model(representation_size=6)
    io.save(model, tmp_path / "m.safetensors")
    tuned = io.load_pretrained(tmp_path / "m.safetensors", representation_size=None, num_classes=3)
    assert "pre_logits.fc.weight" not in tuned.state_dict()
    assert tuned.head.weight.shape == (8, 3)
    same = io.load_pretrained(tmp_path / "m.safetensors")
    assert_same_state(same.state_dict(), model.state_dict())


def test_load_pretrained_resizes_learned_2d_tables(tmp_path):
    model = make_model(posemb="learned-2d")
    io.save(model, tmp_path / "m.safetensors")
    bigger = io.load_pretrained(tmp_path / "m.safetensors", image_size=12)     # grid 2 -> 3
    for name in ("pos_embed_row", "pos_embed_col"):
        table = getattr(model, name).data
        want = resize_pos_embed(table[None], (2, 1), (3, 1), "bilinear", num_prefix_tokens=0)[0]
        assert getattr(bigger, name).shape == (3, 4)
        np.testing.assert_array_equal(getattr(bigger, name).data, want)
    np.testing.assert_array_equal(bigger.pos_embed_row.data[0], model.pos_embed_row.data[0])  # end points kept
    assert logits(bigger, make_images(bigger.config)).shape == (2, 5)
