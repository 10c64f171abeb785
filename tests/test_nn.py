"""Modules: registration and names, state dicts, modes, dtype/device moves, initialisation, gradient
checks of the attention and MLP blocks over every parameter, and a tiny network that learns."""
import copy
import math

import numpy as np
import pytest

import tinyvit as tv
import tinyvit.functional as F
import tinyvit.nn as nn
import tinyvit.optim as optim
from tinyvit import backend
from tinyvit.backend import to_numpy
from tinyvit.gradcheck import gradcheck

# ---------------------------------------------------------------------- a small ViT-shaped model


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiHeadAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.MLP(dim, 2 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Tiny(nn.Module):
    def __init__(self, dim=8, heads=2, depth=2, classes=3):
        super().__init__()
        self.cls_token = nn.Parameter(np.zeros((1, 1, dim), dtype=np.float32))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.drop(self.norm(x)))


BLOCK_NAMES = ["norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
               "attn.proj.bias", "norm2.weight", "norm2.bias", "mlp.fc1.weight", "mlp.fc1.bias",
               "mlp.fc2.weight", "mlp.fc2.bias"]
TINY_NAMES = (["cls_token"] + [f"blocks.{i}.{n}" for i in range(2) for n in BLOCK_NAMES]
              + ["norm.weight", "norm.bias", "head.weight", "head.bias"])


def snapshot(model):
    return {k: to_numpy(v).copy() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- registration and names


def test_named_parameters_names_and_order():
    m = Tiny()
    assert [n for n, _ in m.named_parameters()] == TINY_NAMES
    assert list(m.state_dict()) == TINY_NAMES
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in m.parameters())
    assert m.blocks[1].attn.qkv.weight.shape == (8, 24)
    assert m.num_parameters() == sum(p.size for p in m.parameters())
    names = [n for n, _ in m.named_modules()]
    assert names[:4] == ["", "blocks", "blocks.0", "blocks.0.norm1"] and "blocks.1.mlp.fc2" in names
    assert [n for n, _ in m.named_children()] == ["blocks", "norm", "head", "drop"]


def test_shared_parameter_listed_once():
    a = nn.Linear(4, 4)
    seq = nn.Sequential(a, nn.ReLU(), a)
    assert [n for n, _ in seq.named_parameters()] == ["0.weight", "0.bias"]
    assert seq.num_parameters() == 20
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    assert [n for n, _ in tied.named_parameters()] == ["0.weight", "0.bias", "1.bias"]


def test_registration_rules():
    m = nn.Module()
    m.w = nn.Parameter(np.ones(2))
    m.sub = nn.Linear(2, 2)
    m.register_buffer("running", np.zeros(3))
    m.register_buffer("scratch", np.zeros(1), persistent=False)
    m.plain = 5
    assert [n for n, _ in m.named_parameters()] == ["w", "sub.weight", "sub.bias"]
    assert list(m.state_dict()) == ["w", "running", "sub.weight", "sub.bias"]
    assert m.running.shape == (3,) and m.plain == 5
    m.w = nn.Parameter(np.zeros(5))          # replacing keeps the name
    assert m.w.shape == (5,)
    with pytest.raises(TypeError, match="parameter 'w'"):
        m.w = np.zeros(5)                    # an array is not a Parameter
    m.sub.bias = None
    assert [n for n, _ in m.named_parameters()] == ["w", "sub.weight"]
    del m.sub
    assert [n for n, _ in m.named_parameters()] == ["w"]
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        m.nothing

    class Forgot(nn.Module):
        def __init__(self):
            self.w = nn.Parameter(np.ones(1))

    with pytest.raises(AttributeError, match="super"):
        Forgot()


def test_parameter_is_float_tensor():
    p = nn.Parameter([1.0, 2.0])
    assert isinstance(p, tv.Tensor) and p.requires_grad and p.dtype == np.float32
    with pytest.raises(TypeError, match="floating"):
        nn.Parameter(np.arange(3))
    with pytest.raises(TypeError, match="floating"):
        nn.Parameter([1, 2])


def test_containers():
    layers = [nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)]
    seq = nn.Sequential(*layers)
    assert len(seq) == 3 and list(seq) == layers and seq[-1] is layers[2]
    assert isinstance(seq[:2], nn.Sequential) and list(seq[:2]) == layers[:2]
    x = tv.Tensor(np.ones((4, 2), dtype=np.float32))
    np.testing.assert_allclose(seq(x).data, layers[2](layers[1](layers[0](x))).data)
    ml = nn.ModuleList([nn.Linear(2, 2)])
    ml.append(nn.Linear(2, 3)).extend([nn.Identity()])
    assert len(ml) == 3 and [n for n, _ in ml.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    ml[0] = nn.Linear(2, 5)
    assert [n for n, _ in ml.named_children()] == ["0", "1", "2"] and ml[0].out_features == 5
    with pytest.raises(IndexError):
        ml[3]
    assert nn.Identity()(x) is x
    text = repr(Tiny())
    assert "(blocks): ModuleList(" in text and "(qkv): Linear(in_features=8, out_features=24, bias=True)" in text


def test_deepcopy_gives_an_independent_model():
    m = Tiny()
    twin = copy.deepcopy(m)              # e.g. an EMA copy of the weights
    assert [n for n, _ in twin.named_parameters()] == TINY_NAMES
    twin.head.weight.data[...] = 1.0
    assert not np.any(m.head.weight.data == 1.0)


def test_apply_and_zero_grad():
    m = Tiny()
    seen = []
    m.apply(lambda mod: seen.append(type(mod).__name__))
    assert seen[-1] == "Tiny" and seen.count("Linear") == 9
    for p in m.parameters():
        p.grad = np.ones_like(p.data)
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())


# ---------------------------------------------------------------------- state dicts


def test_state_dict_round_trip():
    tv.manual_seed(0)
    a = Tiny()
    tv.manual_seed(1)
    b = Tiny()
    params_before = list(b.parameters())
    arrays_before = [p.data for p in b.parameters()]
    assert not np.array_equal(a.blocks[0].attn.qkv.weight.data, b.blocks[0].attn.qkv.weight.data)
    missing, unexpected = b.load_state_dict(a.state_dict())
    assert missing == [] and unexpected == []
    for (name, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        np.testing.assert_array_equal(va, vb, err_msg=name)
    # same Parameter objects, same arrays (copied into), and no aliasing with the source
    assert all(p is q for p, q in zip(params_before, b.parameters()))
    assert all(p.data is arr for p, arr in zip(b.parameters(), arrays_before))
    a.head.weight.data[...] = 7.0
    assert not np.any(b.head.weight.data == 7.0)


def test_state_dict_values_are_the_live_arrays():
    m = nn.Linear(2, 3)
    sd = m.state_dict()
    assert sd["weight"] is m.weight.data and sd["bias"] is m.bias.data


def test_load_converts_dtype_and_accepts_tensors():
    m = nn.Linear(2, 3)
    state = {"weight": np.full((2, 3), 0.5), "bias": tv.Tensor(np.arange(3.0))}   # float64 in
    m.load_state_dict(state)
    assert m.weight.dtype == np.float32 and m.bias.dtype == np.float32
    np.testing.assert_array_equal(m.bias.data, [0, 1, 2])


def test_strict_load_lists_every_problem_and_loads_nothing():
    m = Tiny()
    before = snapshot(m)
    state = {k: np.zeros_like(v) for k, v in before.items()}
    del state["norm.bias"]
    state["extra.weight"] = np.zeros(3)
    state["head.weight"] = np.zeros((8, 5))
    with pytest.raises(ValueError) as err:
        m.load_state_dict(state)
    msg = str(err.value)
    assert "missing keys: norm.bias" in msg
    assert "unexpected keys: extra.weight" in msg
    assert "head.weight: checkpoint shape (8, 5) != model shape (8, 3)" in msg
    assert "nothing was loaded" in msg
    after = snapshot(m)
    assert all(np.array_equal(before[k], after[k]) for k in before), "a failed load changed the model"


def test_non_strict_load_reports_and_loads_the_rest():
    m = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    state = {"0.weight": np.ones((2, 2)), "1.weight": np.full(2, 3.0), "junk": np.ones(1)}
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert missing == ["0.bias", "1.bias"] and unexpected == ["junk"]
    np.testing.assert_array_equal(m[1].weight.data, [3.0, 3.0])
    with pytest.raises(ValueError, match=r"0.weight: checkpoint shape \(3, 2\)"):
        m.load_state_dict({"0.weight": np.ones((3, 2))}, strict=False)   # shapes are never skipped


# ---------------------------------------------------------------------- modes and moves


def test_train_eval_recursive():
    m = Tiny()
    assert all(mod.training for mod in m.modules())
    assert m.eval() is m
    assert not any(mod.training for mod in m.modules())
    m.blocks.train()
    assert m.blocks[1].mlp.drop1.training and not m.training
    m.train()
    assert all(mod.training for mod in m.modules())


def test_to_dtype_keeps_parameter_identity():
    m = Tiny()
    params = list(m.parameters())
    opt = optim.SGD(m.parameters(), lr=0.1)
    m.blocks[0].norm1.weight.grad = np.ones(8, dtype=np.float32)
    m.register_buffer("stat", np.zeros(2, dtype=np.float32))
    assert m.to(dtype=np.float64) is m
    assert all(p is q for p, q in zip(params, m.parameters()))
    assert all(p.dtype == np.float64 for p in m.parameters())
    assert m.blocks[0].norm1.weight.grad.dtype == np.float64 and m.stat.dtype == np.float64
    assert opt.param_groups[0]["params"][0] is params[0]
    x = tv.Tensor(np.random.default_rng(0).standard_normal((2, 3, 8)))
    assert m.eval()(x).dtype == np.float64
    assert m.to(device="cpu") is m
    with pytest.raises(TypeError, match="floating"):
        m.to(dtype=np.int32)


def test_requires_grad_freezes():
    m = nn.Linear(3, 3)
    m.requires_grad_(False)
    assert not any(p.requires_grad for p in m.parameters()) and m.num_parameters(trainable_only=True) == 0


# ---------------------------------------------------------------------- initialisation


def test_linear_init_statistics():
    tv.manual_seed(0)
    lin = nn.Linear(300, 500)
    w = lin.weight.data
    bound = math.sqrt(6.0 / (300 + 500))                   # Xavier / Glorot uniform
    assert w.shape == (300, 500) and w.dtype == np.float32
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound
    assert abs(w.std() - bound / math.sqrt(3)) < 0.01 * bound and abs(w.mean()) < 0.01 * bound
    np.testing.assert_array_equal(lin.bias.data, 0.0)


def test_init_uses_the_seed_and_default_dtype():
    tv.manual_seed(3)
    a = nn.Linear(4, 4).weight.data.copy()
    tv.manual_seed(3)
    b = nn.Linear(4, 4).weight.data
    np.testing.assert_array_equal(a, b)
    with backend.default_dtype(np.float64):
        assert nn.Linear(4, 4).weight.dtype == np.float64 and nn.LayerNorm(4).weight.dtype == np.float64


def test_other_init_statistics():
    tv.manual_seed(0)
    attn = nn.MultiHeadAttention(64, 4)
    bound = math.sqrt(6.0 / 128)                          # q, k, v each Xavier over (dim, dim)
    w = attn.qkv.weight.data
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound
    conv = nn.Conv2d(16, 32, 3)
    assert conv.weight.shape == (32, 16, 3, 3)
    assert abs(conv.weight.data.std() - math.sqrt(2.0 / (16 * 9))) < 0.03 * math.sqrt(2.0 / (16 * 9))
    ln, gn = nn.LayerNorm(5), nn.GroupNorm(2, 4)
    assert np.all(ln.weight.data == 1) and np.all(ln.bias.data == 0) and ln.eps == 1e-6
    assert np.all(gn.weight.data == 1) and gn.weight.shape == (4,) and gn.eps == 1e-5
    p = nn.Parameter(np.zeros((200, 200)))
    nn.init.trunc_normal_(p, std=1.0, a=-1.5, b=1.5)
    assert np.abs(p.data).max() <= 1.5 and p.data.std() > 0.7
    nn.init.trunc_normal_(p, std=0.02)
    assert abs(p.data.std() - 0.02) < 0.001


def test_dimension_errors():
    with pytest.raises(ValueError, match="dim=10.*num_heads=3"):
        nn.MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="num_channels=6.*num_groups=4"):
        nn.GroupNorm(4, 6)
    with pytest.raises(ValueError, match="probability"):
        nn.Dropout(1.5)


# ---------------------------------------------------------------------- gradient checks (float64)


def _module_gradcheck(module, x):
    params = list(module.parameters())
    assert params and all(p.dtype == np.float64 for p in params)
    result = gradcheck(lambda x_, *ps: module(x_), [x, *params])
    assert result.ok and result.checked == x.size + sum(p.size for p in params)
    unused = [n for n, p in module.named_parameters() if p.grad is None or not np.any(to_numpy(p.grad))]
    assert not unused, f"parameters that get no gradient: {unused}"


def test_gradcheck_multi_head_attention(xp):
    tv.manual_seed(0)
    with backend.default_dtype(np.float64):
        attn = nn.MultiHeadAttention(8, 2)
    attn.to(device="cuda" if xp is not np else "cpu")
    for p in attn.parameters():   # non-zero biases, so their gradients matter
        p.data[...] += xp.asarray(np.random.default_rng(1).standard_normal(p.shape) * 0.1)
    x = tv.Tensor(xp.asarray(np.random.default_rng(2).standard_normal((2, 5, 8))), requires_grad=True)
    _module_gradcheck(attn, x)
    out, weights = attn(x, return_attention=True)
    assert out.shape == (2, 5, 8) and weights.shape == (2, 2, 5, 5)
    np.testing.assert_allclose(to_numpy(weights.data).sum(-1), 1.0, rtol=1e-12)


def test_gradcheck_mlp_and_layer_norm(xp):
    tv.manual_seed(0)
    mlp = nn.MLP(6, 12, dropout=0.3).to(dtype=np.float64).eval()
    for approximate in ("none", "tanh"):
        mlp.act.approximate = approximate
        x = tv.Tensor(xp.asarray(np.random.default_rng(2).standard_normal((2, 3, 6))), requires_grad=True)
        _module_gradcheck(mlp.to(device="cuda" if xp is not np else "cpu"), x)
    norm = nn.LayerNorm(6).to(dtype=np.float64, device="cuda" if xp is not np else "cpu")
    _module_gradcheck(norm, x)


def test_gradcheck_conv_group_norm():
    tv.manual_seed(0)
    with backend.default_dtype(np.float64):
        net = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.GroupNorm(2, 4))
    x = tv.Tensor(np.random.default_rng(0).standard_normal((2, 2, 5, 5)), requires_grad=True)
    assert net(x).shape == (2, 4, 3, 3)
    _module_gradcheck(net, x)


def test_attention_matches_a_hand_written_version():
    tv.manual_seed(0)
    with backend.default_dtype(np.float64):
        attn = nn.MultiHeadAttention(6, 3)
    x = np.random.default_rng(0).standard_normal((2, 4, 6))
    qkv = x @ attn.qkv.weight.data + attn.qkv.bias.data
    q, k, v = (qkv[..., i * 6:(i + 1) * 6].reshape(2, 4, 3, 2).transpose(0, 2, 1, 3) for i in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(2)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = (a @ v).transpose(0, 2, 1, 3).reshape(2, 4, 6) @ attn.proj.weight.data + attn.proj.bias.data
    np.testing.assert_allclose(attn(tv.Tensor(x)).data, o, rtol=1e-10)


def test_mlp_and_linear_match_hand_written_versions():
    tv.manual_seed(0)
    with backend.default_dtype(np.float64):
        mlp = nn.MLP(4, 8, out_dim=3)
    x = np.random.default_rng(0).standard_normal((2, 5, 4))
    h = x @ mlp.fc1.weight.data + mlp.fc1.bias.data                      # Linear: y = x W + b
    h = h * 0.5 * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0)))      # exact GELU
    expected = h @ mlp.fc2.weight.data + mlp.fc2.bias.data
    np.testing.assert_allclose(mlp(tv.Tensor(x)).data, expected, rtol=1e-9, atol=1e-12)
    assert mlp.fc2.weight.shape == (8, 3) and np.any(mlp.fc1.bias.data != 0)   # biases N(0, 1e-6^2)


# ---------------------------------------------------------------------- dropout and drop-path modes


def test_dropout_only_while_training():
    tv.manual_seed(0)
    x = tv.Tensor(np.ones((64, 32), dtype=np.float32))
    for layer in (nn.Dropout(0.5), nn.DropPath(0.5)):
        layer.eval()
        assert np.array_equal(layer(x).data, x.data)
        layer.train()
        y = layer(x).data
        assert 0.3 < (y == 0).mean() < 0.7 and np.allclose(y[y != 0], 2.0)
    mlp = nn.MLP(32, 64, dropout=0.5)
    attn = nn.MultiHeadAttention(32, 4, attn_dropout=0.5, proj_dropout=0.5)
    t = tv.Tensor(np.random.default_rng(0).standard_normal((2, 8, 32)).astype(np.float32))
    for mod in (mlp, attn):
        assert not np.array_equal(mod(t).data, mod(t).data)     # training: random masks
        if mod is attn:
            mod.attn_dropout = 0.0                              # the output dropout alone
        zeros = (mod(t).data == 0).mean()
        assert 0.35 < zeros < 0.65, f"{type(mod).__name__}: dropout after the last dense layer zeroed {zeros:.2f}"
        mod.eval()
        np.testing.assert_array_equal(mod(t).data, mod(t).data)


# ---------------------------------------------------------------------- learning


def _two_spirals(n, rng):
    t = np.sqrt(rng.uniform(0.05, 1.0, n)) * 3 * np.pi
    label = rng.integers(0, 2, n)
    r = t / (3 * np.pi)
    angle = t + np.pi * label
    x = np.stack([r * np.cos(angle), r * np.sin(angle)], axis=1) + rng.normal(0, 0.01, (n, 2))
    return x.astype(np.float32), label


@pytest.mark.parametrize("act", [nn.GELU, nn.ReLU])
def test_tiny_mlp_learns_two_spirals(act):
    tv.manual_seed(0)
    rng = np.random.default_rng(0)
    x, y = _two_spirals(200, rng)
    net = nn.Sequential(nn.Linear(2, 48), act(), nn.Linear(48, 48), act(), nn.Linear(48, 2))
    opt = optim.Adam(net.parameters(), lr=2e-2)
    xt = tv.Tensor(x)
    for _ in range(200):
        loss = F.cross_entropy(net(xt), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with tv.no_grad():
        acc = (net.eval()(xt).data.argmax(axis=1) == y).mean()
    assert acc >= 0.98, f"accuracy {acc:.3f}, final loss {loss.item():.4f}"
