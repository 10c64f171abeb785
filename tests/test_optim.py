"""Optimizers, schedules and gradient clipping: closed forms written out here, and PyTorch as the
independent reference (float64, same gradients, several steps)."""
import math

import numpy as np
import pytest

import tinyvit.nn as nn
import tinyvit.optim as optim
from tinyvit.backend import to_numpy

# ---------------------------------------------------------------------- helpers


def make_params(xp, shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [nn.Parameter(xp.asarray(rng.standard_normal(s))) for s in shapes]


def grad_sequence(shapes, steps, seed=1):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s) for s in shapes] for _ in range(steps)]


def run_ours(opt, params, grads, xp):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = xp.asarray(g)
        opt.step()


def run_torch(torch, opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = torch.tensor(g)
        opt.step()


def assert_same(ours, theirs, rtol=1e-10, atol=1e-12):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(to_numpy(a.data), b.detach().numpy(), rtol=rtol, atol=atol,
                                   err_msg=f"parameter {i}")


SHAPES = [(3, 4), (4,), (2, 3, 2)]

# ---------------------------------------------------------------------- closed forms, one or two steps


def test_sgd_closed_form_momentum_and_weight_decay(xp):
    p0, g1, g2 = np.array([1.0, -2.0, 3.0]), np.array([0.5, 0.1, -1.0]), np.array([-0.2, 0.3, 0.4])
    lr, mu, wd = 0.1, 0.9, 0.01
    p = nn.Parameter(xp.array(p0))  # a copy: the step is in place
    opt = optim.SGD([p], lr=lr, momentum=mu, weight_decay=wd)
    p.grad = xp.asarray(g1)
    opt.step()
    b1 = g1 + wd * p0                          # first step: buffer = (decayed) gradient
    p1 = p0 - lr * b1
    np.testing.assert_allclose(to_numpy(p.data), p1, rtol=1e-14)
    p.grad = xp.asarray(g2)
    opt.step()
    b2 = mu * b1 + (g2 + wd * p1)
    np.testing.assert_allclose(to_numpy(p.data), p1 - lr * b2, rtol=1e-14)


def test_sgd_closed_form_nesterov(xp):
    p0, g1, g2 = np.array([1.0, -2.0]), np.array([0.5, 0.1]), np.array([-0.2, 0.3])
    lr, mu = 0.1, 0.9
    p = nn.Parameter(xp.array(p0))  # a copy: the step is in place
    opt = optim.SGD([p], lr=lr, momentum=mu, nesterov=True)
    for g in (g1, g2):
        p.grad = xp.asarray(g)
        opt.step()
    b1 = g1
    p1 = p0 - lr * (g1 + mu * b1)
    b2 = mu * b1 + g2
    np.testing.assert_allclose(to_numpy(p.data), p1 - lr * (g2 + mu * b2), rtol=1e-14)


def test_adam_closed_form_two_steps(xp):
    p0, g1, g2 = np.array([1.0, -2.0, 0.5]), np.array([0.5, -0.1, 2.0]), np.array([-0.2, 0.3, 1.0])
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    p = nn.Parameter(xp.array(p0))  # a copy: the step is in place
    opt = optim.Adam([p], lr=lr, betas=(b1, b2), eps=eps)
    p.grad = xp.asarray(g1)
    opt.step()
    # step 1: m_hat = g, v_hat = g^2, so the update is lr * g / (|g| + eps)
    p1 = p0 - lr * g1 / (np.abs(g1) + eps)
    np.testing.assert_allclose(to_numpy(p.data), p1, rtol=1e-14)
    p.grad = xp.asarray(g2)
    opt.step()
    m = b1 * (1 - b1) * g1 + (1 - b1) * g2
    v = b2 * (1 - b2) * g1 ** 2 + (1 - b2) * g2 ** 2
    p2 = p1 - lr / (1 - b1 ** 2) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** 2) + eps)
    np.testing.assert_allclose(to_numpy(p.data), p2, rtol=1e-14)


def test_adam_weight_decay_is_l2_in_the_gradient(xp):
    p0, g = np.array([1.0, -2.0]), np.array([0.5, -0.1])
    lr, wd, eps = 0.01, 0.1, 1e-8
    p = nn.Parameter(xp.array(p0))  # a copy: the step is in place
    opt = optim.Adam([p], lr=lr, eps=eps, weight_decay=wd)
    p.grad = xp.asarray(g)
    opt.step()
    ge = g + wd * p0
    np.testing.assert_allclose(to_numpy(p.data), p0 - lr * ge / (np.abs(ge) + eps), rtol=1e-14)


def test_adamw_weight_decay_is_decoupled(xp):
    p0, g = np.array([1.0, -2.0]), np.array([0.5, -0.1])
    lr, wd, eps = 0.01, 0.1, 1e-8
    p = nn.Parameter(xp.array(p0))  # a copy: the step is in place
    opt = optim.AdamW([p], lr=lr, eps=eps, weight_decay=wd)
    p.grad = xp.asarray(g)
    opt.step()
    expected = p0 * (1 - lr * wd) - lr * g / (np.abs(g) + eps)
    np.testing.assert_allclose(to_numpy(p.data), expected, rtol=1e-14)
    assert optim.AdamW([p]).param_groups[0]["weight_decay"] == 0.01


# ---------------------------------------------------------------------- PyTorch parity over several steps


@pytest.mark.parametrize("kwargs", [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.001),
])
def test_sgd_matches_torch(torch, xp, kwargs):
    ours = make_params(xp, SHAPES)
    theirs = [torch.tensor(to_numpy(p.data), requires_grad=True) for p in ours]
    grads = grad_sequence(SHAPES, 5)
    run_ours(optim.SGD(ours, **kwargs), ours, grads, xp)
    run_torch(torch, torch.optim.SGD(theirs, **kwargs), theirs, grads)
    assert_same(ours, theirs)


@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
@pytest.mark.parametrize("kwargs", [
    dict(lr=1e-2),
    dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    dict(lr=1e-3, weight_decay=0.0),
])
def test_adam_family_matches_torch(torch, xp, cls, kwargs):
    ours = make_params(xp, SHAPES)
    theirs = [torch.tensor(to_numpy(p.data), requires_grad=True) for p in ours]
    grads = grad_sequence(SHAPES, 5)
    run_ours(getattr(optim, cls)(ours, **kwargs), ours, grads, xp)
    run_torch(torch, getattr(torch.optim, cls)(theirs, **kwargs), theirs, grads)
    assert_same(ours, theirs)


@pytest.mark.parametrize("cls,extra", [("SGD", dict(momentum=0.9)), ("AdamW", {}), ("Adam", {})])
def test_param_groups_match_torch(torch, xp, cls, extra):
    ours = make_params(xp, SHAPES)
    theirs = [torch.tensor(to_numpy(p.data), requires_grad=True) for p in ours]

    def groups(ps):
        return [{"params": [ps[0], ps[2]], "weight_decay": 0.05},
                {"params": [ps[1]], "weight_decay": 0.0, "lr": 0.3}]

    grads = grad_sequence(SHAPES, 5)
    opt = getattr(optim, cls)(groups(ours), lr=0.02, **extra)
    topt = getattr(torch.optim, cls)(groups(theirs), lr=0.02, **extra)
    run_ours(opt, ours, grads[:2], xp)
    run_torch(torch, topt, theirs, grads[:2])
    # change a group's lr mid-run, as a schedule does
    opt.param_groups[1]["lr"] = 0.1
    topt.param_groups[1]["lr"] = 0.1
    run_ours(opt, ours, grads[2:], xp)
    run_torch(torch, topt, theirs, grads[2:])
    assert_same(ours, theirs)


@pytest.mark.parametrize("cls,kwargs", [("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
                                        ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
                                        ("Adam", dict(lr=0.1, weight_decay=0.01)), ("AdamW", dict(lr=0.1))])
def test_a_0d_parameter_matches_torch(torch, cls, kwargs):
    """A parameter with no axes (a learnable scale) keeps arrays, not NumPy scalars, as its state."""
    ours = [nn.Parameter(np.array(1.5))]
    theirs = [torch.tensor(1.5, dtype=torch.float64, requires_grad=True)]
    grads = [[np.array(g)] for g in (0.3, -0.2, 0.7)]
    opt = getattr(optim, cls)(ours, **kwargs)
    run_ours(opt, ours, grads, np)
    run_torch(torch, getattr(torch.optim, cls)(theirs, **kwargs), theirs, grads)
    assert_same(ours, theirs)
    assert all(isinstance(v, np.ndarray) for v in opt.state[id(ours[0])].values() if not isinstance(v, int))


def test_parameters_without_gradient_are_skipped(torch):
    ours = make_params(np, SHAPES)
    theirs = [torch.tensor(p.data.copy(), requires_grad=True) for p in ours]
    opt, topt = optim.Adam(ours, lr=0.1), torch.optim.Adam(theirs, lr=0.1)
    grads = grad_sequence(SHAPES, 3)
    for gs in grads:
        for i, g in enumerate(gs[:2]):  # parameter 2 never gets a gradient
            ours[i].grad, theirs[i].grad = g, torch.tensor(g)
        opt.step()
        topt.step()
    assert_same(ours, theirs)
    np.testing.assert_array_equal(ours[2].data, make_params(np, SHAPES)[2].data)


def test_step_is_in_place_and_keeps_dtype():
    p = nn.Parameter(np.ones((2, 3), dtype=np.float32))
    array = p.data
    opt = optim.AdamW([p], lr=0.1)
    p.grad = np.ones((2, 3), dtype=np.float32)
    opt.step()
    assert p.data is array and p.data.dtype == np.float32
    assert opt.state[id(p)]["exp_avg"].dtype == np.float32


def test_grad_is_never_modified(xp):
    p = nn.Parameter(xp.asarray([1.0, 2.0]))
    g = xp.asarray([0.5, -0.5])
    opt = optim.SGD([p], lr=0.1, momentum=0.9)
    for _ in range(3):
        p.grad = g
        opt.step()
    np.testing.assert_array_equal(to_numpy(g), [0.5, -0.5])


def test_constructor_errors():
    p = nn.Parameter(np.zeros(2))
    with pytest.raises(ValueError, match="empty"):
        optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match="more than one"):
        optim.SGD([{"params": [p]}, {"params": [p]}], lr=0.1)
    with pytest.raises(ValueError, match="Nesterov"):
        optim.SGD([p], lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        optim.Adam([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="unknown hyperparameters"):
        optim.Adam([{"params": [p], "momentum": 0.9}])


def test_lr_property_sets_every_group():
    a, b = nn.Parameter(np.zeros(2)), nn.Parameter(np.zeros(2))
    opt = optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    assert opt.lr == 0.1 and opt.param_groups[1]["lr"] == 0.5
    opt.lr = 0.01
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.01]


# ---------------------------------------------------------------------- state_dict round trip


def _as_if_from_a_file(state):
    """What a checkpoint file gives back: host copies of the arrays, numbers as 0-d arrays, string keys."""
    return {
        "state": {str(k): {n: (np.array(to_numpy(v)) if hasattr(v, "shape") else np.array(v)) for n, v in s.items()}
                  for k, s in state["state"].items()},
        "param_groups": [{n: (np.array(v) if n != "params" else list(v)) for n, v in g.items()}
                         for g in state["param_groups"]],
    }


@pytest.mark.parametrize("make", [
    lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    lambda ps: optim.Adam(ps, lr=0.01, weight_decay=0.01),
    lambda ps: optim.AdamW([{"params": ps[:1], "weight_decay": 0.0}, {"params": ps[1:], "lr": 0.02}],
                           lr=0.01, betas=(0.8, 0.95)),
])
def test_state_dict_round_trip_continues_identically(xp, make):
    grads = grad_sequence(SHAPES, 6)
    a = make_params(xp, SHAPES)
    opt_a = make(a)
    run_ours(opt_a, a, grads[:3], xp)
    saved = _as_if_from_a_file(opt_a.state_dict())

    b = [nn.Parameter(xp.asarray(to_numpy(p.data).copy())) for p in a]
    opt_b = make(b)
    opt_b.param_groups[0]["lr"] = 123.0      # overwritten by the load
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
    if "betas" in opt_b.param_groups[0]:
        assert opt_b.param_groups[0]["betas"] == opt_a.param_groups[0]["betas"]
    run_ours(opt_a, a, grads[3:], xp)
    run_ours(opt_b, b, grads[3:], xp)
    for pa, pb in zip(a, b):
        np.testing.assert_array_equal(to_numpy(pa.data), to_numpy(pb.data))


def test_state_dict_is_plain_and_load_copies():
    a = make_params(np, SHAPES)
    opt = optim.Adam(a, lr=0.1)
    run_ours(opt, a, grad_sequence(SHAPES, 2), np)
    sd = opt.state_dict()
    assert sd["state"][0]["step"] == 2 and isinstance(sd["state"][0]["step"], int)
    assert sd["param_groups"][0]["params"] == [0, 1, 2]
    b = make_params(np, SHAPES)
    opt_b = optim.Adam(b, lr=0.1)
    opt_b.load_state_dict(sd)
    assert opt_b.state[id(b[0])]["exp_avg"] is not sd["state"][0]["exp_avg"]   # no aliasing between optimizers


def test_load_state_dict_rejects_a_mismatch_and_changes_nothing():
    a = make_params(np, SHAPES)
    opt = optim.Adam(a, lr=0.1)
    run_ours(opt, a, grad_sequence(SHAPES, 1), np)
    sd = opt.state_dict()
    other = make_params(np, [(3, 4), (5,), (2, 3, 2)])
    opt_o = optim.Adam(other, lr=0.5)
    with pytest.raises(ValueError, match=r"exp_avg of parameter 1 has shape \(4,\), the parameter \(5,\)"):
        opt_o.load_state_dict(sd)
    assert opt_o.state == {} and opt_o.param_groups[0]["lr"] == 0.5
    with pytest.raises(ValueError, match="saved state has 1 parameter groups, this optimizer 2"):
        optim.Adam([{"params": a[:1]}, {"params": a[1:]}]).load_state_dict(sd)


def test_state_follows_the_model_to_another_dtype():
    lin = nn.Linear(3, 2)
    opt = optim.Adam(lin.parameters(), lr=0.1)
    for p in lin.parameters():
        p.grad = np.ones(p.shape, dtype=p.dtype)
    opt.step()
    lin.to(dtype=np.float64)
    for p in lin.parameters():
        p.grad = np.ones(p.shape)
    opt.step()
    assert all(p.dtype == np.float64 for p in lin.parameters())
    assert all(s["exp_avg"].dtype == np.float64 for s in opt.state.values())


# ---------------------------------------------------------------------- weight-decay groups


class _TinyViTLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.cls_token = nn.Parameter(np.zeros((1, 1, 4)))
        self.pos_embed = nn.Parameter(np.zeros((1, 3, 4)))
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_param_groups_weight_decay_like_timm():
    m = _TinyViTLike()
    no_decay, decay = optim.param_groups_weight_decay(m, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    ids = {id(p): n for n, p in m.named_parameters()}
    assert [ids[id(p)] for p in decay["params"]] == ["proj.weight"]
    assert [ids[id(p)] for p in no_decay["params"]] == ["cls_token", "pos_embed", "proj.bias", "norm.weight",
                                                        "norm.bias"]
    opt = optim.AdamW([no_decay, decay], lr=1e-3)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.05]


# ---------------------------------------------------------------------- clipping


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_matches_torch(torch, xp, max_norm):
    ours = make_params(xp, SHAPES)
    theirs = [torch.tensor(to_numpy(p.data), requires_grad=True) for p in ours]
    for p, t, g in zip(ours, theirs, grad_sequence(SHAPES, 1)[0]):
        p.grad, t.grad = xp.asarray(g), torch.tensor(g)
    old = [p.grad for p in ours]
    norm = optim.clip_grad_norm(ours, max_norm)
    tnorm = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert abs(float(norm) - float(tnorm)) <= 1e-12 * float(tnorm)
    expected_norm = math.sqrt(sum(float((to_numpy(g) ** 2).sum()) for g in old))
    assert abs(float(norm) - expected_norm) <= 1e-12 * expected_norm
    for p, t in zip(ours, theirs):
        np.testing.assert_allclose(to_numpy(p.grad), t.grad.numpy(), rtol=1e-12)
    if max_norm < expected_norm:
        after = math.sqrt(sum(float((to_numpy(p.grad) ** 2).sum()) for p in ours))
        assert abs(after - max_norm) < 1e-5
        assert all(p.grad is not o for p, o in zip(ours, old))       # out of place
        np.testing.assert_array_equal(to_numpy(old[0]), grad_sequence(SHAPES, 1)[0][0])


def test_clip_grad_norm_keeps_float32():
    p = nn.Parameter(np.ones(4, dtype=np.float32))
    p.grad = np.full(4, 10.0, dtype=np.float32)
    norm = optim.clip_grad_norm([p], 1.0)
    assert p.grad.dtype == np.float32 and abs(float(norm) - 20.0) < 1e-5
    np.testing.assert_allclose(p.grad, 0.5, rtol=1e-5)


# ---------------------------------------------------------------------- schedules


def test_warmup_cosine_at_known_steps():
    f = lambda s: optim.warmup_cosine(s, total_steps=110, warmup_steps=10, base_lr=1.0, min_lr=0.1)  # noqa: E731
    assert f(0) == 0.0                                # warmup starts from zero (official ViT code)
    assert f(5) == pytest.approx(0.5)                 # linear warmup
    assert f(10) == pytest.approx(1.0)                # end of warmup: the base lr
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)    # half way through the decay: cos(pi/2) = 0
    assert f(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_warmup_linear_at_known_steps():
    f = lambda s: optim.warmup_linear(s, total_steps=110, warmup_steps=10, base_lr=2.0)  # noqa: E731
    assert f(0) == 0.0 and f(5) == pytest.approx(1.0) and f(10) == pytest.approx(2.0)
    assert f(60) == pytest.approx(1.0) and f(85) == pytest.approx(0.5) and f(110) == 0.0
    assert optim.warmup_linear(3, 10, 0, 1.0) == pytest.approx(0.7)   # no warmup


def test_lr_scheduler_sets_groups_and_resumes():
    a, b = nn.Parameter(np.zeros(2)), nn.Parameter(np.zeros(2))
    opt = optim.SGD([{"params": [a]}, {"params": [b], "lr_scale": 0.5}], lr=9.0)
    fn = lambda s: optim.warmup_cosine(s, 100, 10, 1.0)  # noqa: E731
    sched = optim.LRScheduler(opt, fn)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    for _ in range(15):
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(fn(15))
    assert opt.param_groups[1]["lr"] == pytest.approx(0.5 * fn(15))
    opt2 = optim.SGD([{"params": [a]}, {"params": [b], "lr_scale": 0.5}], lr=9.0)
    sched2 = optim.LRScheduler(opt2, fn)
    sched2.load_state_dict(sched.state_dict())
    assert sched2.step() == sched.step() == pytest.approx(fn(16))
    assert opt2.param_groups[1]["lr"] == opt.param_groups[1]["lr"]


def test_weight_ema_follows_its_formula_swaps_and_resumes():
    """theta_ema <- d theta_ema + (1 - d) theta with d = min(decay, (1 + t) / (10 + t)), against a plain
    loop; applied() shows the average and puts the trained weights back; the state round-trips."""
    rng = np.random.default_rng(0)
    model = nn.Linear(3, 2)
    start = {n: p.data.copy() for n, p in model.named_parameters()}
    ema = optim.WeightEMA(model, decay=0.9)
    expected = {n: a.astype(np.float64) for n, a in start.items()}
    for t in range(1, 31):
        for p in model.parameters():
            p.data += rng.standard_normal(p.shape).astype(p.data.dtype)
        ema.update()
        d = min(0.9, (1 + t) / (10 + t))
        for n, p in model.named_parameters():
            expected[n] = d * expected[n] + (1 - d) * p.data
    trained = {n: p.data.copy() for n, p in model.named_parameters()}
    with ema.applied():
        for n, p in model.named_parameters():
            np.testing.assert_allclose(p.data, expected[n], rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        assert np.array_equal(p.data, trained[n]), f"{n}: the trained weights did not come back"
    again = optim.WeightEMA(nn.Linear(3, 2), decay=0.9)
    again.load_state_dict(ema.state_dict())
    assert again.step_count == 30
    for n in ema.average:
        assert np.array_equal(again.average[n], ema.average[n])
    with pytest.raises(ValueError, match="decay"):
        optim.WeightEMA(model, decay=1.0)
    with pytest.raises(ValueError, match="lacks"):
        optim.WeightEMA(nn.Linear(4, 2), decay=0.9).load_state_dict({"step": 1})
