"""kernels/cpu/optim.py (the optimizer step: SGD's, Adam's and AdamW's updates in place, the large
parameters' updates among threads) against the plain loop of tinyvit/optim.py's Optimizer.step
(kernels off, the reference updates): bit for bit, as the in-place update makes the reference's
operations in the reference's order, in whichever thread runs it (the shared helpers and the
meta-test are in test_kernels_cpu.py)."""
import threading

import numpy as np
import pytest

import tinyvit.nn as nn
import tinyvit.optim as optim
from tinyvit.kernels import use_kernels
from tinyvit.kernels.cpu import optim as k_optim

from kernel_checks import cpu_kernel

THRESHOLD = 100                 # THREADED_UPDATE_SIZE in these tests: the (40, 30), (100,), (64, 64) go to threads
SHAPES = [(40, 30), (100,), (7,), (64, 64), (3, 5), (), (99,)]       # () a 0-d parameter

OPTIMIZERS = {
    "SGD": lambda groups: optim.SGD(groups, lr=0.1),
    "SGD weight decay": lambda groups: optim.SGD(groups, lr=0.1, weight_decay=0.01),
    "SGD momentum": lambda groups: optim.SGD(groups, lr=0.1, momentum=0.9),
    "SGD momentum weight decay dampening": lambda groups: optim.SGD(groups, lr=0.1, momentum=0.9, dampening=0.1,
                                                                    weight_decay=0.01),
    "SGD nesterov": lambda groups: optim.SGD(groups, lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": lambda groups: optim.Adam(groups, lr=0.01),
    "Adam weight decay": lambda groups: optim.Adam(groups, lr=0.01, weight_decay=0.1),
    "AdamW": lambda groups: optim.AdamW(groups, lr=0.01, weight_decay=0.1),
    "AdamW betas": lambda groups: optim.AdamW(groups, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
}
STEPS = 4


def run_steps(make, init, grads, kernels_on):
    """Parameters from init in two groups (the second with its own lr and no weight decay, one
    parameter without a gradient), stepped once per entry of grads; returns the parameters and the
    optimizer's state arrays."""
    ps = [nn.Parameter(a.copy()) for a in init]
    opt = make([{"params": ps[:3]}, {"params": ps[3:], "lr": 0.003, "weight_decay": 0.0}])
    with use_kernels(kernels_on):
        for step_grads in grads:
            for i, (p, g) in enumerate(zip(ps, step_grads)):
                p.grad = None if i == len(ps) - 1 else g        # the last parameter never has a gradient
            opt.step()
    state = [{k: v for k, v in opt.state.get(id(p), {}).items()} for p in ps]
    return [p.data for p in ps], state


@pytest.fixture
def in_place_calls(monkeypatch):
    """The parameters each in-place update of kernels/cpu/optim.py ran for, one entry per update."""
    calls = []
    sgd, adam = k_optim._sgd, k_optim._adam
    monkeypatch.setattr(k_optim, "_sgd", lambda p, *rest: (calls.append(p), sgd(p, *rest))[1])
    monkeypatch.setattr(k_optim, "_adam", lambda decoupled, p, *rest: (calls.append(p), adam(decoupled, p, *rest))[1])
    return calls


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads_", [1, 2])
def test_kernel_step_equals_the_plain_loop_bit_for_bit(num_threads, monkeypatch, in_place_calls, name, dtype,
                                                       threads_):
    """The "optimizer_step" kernel: after several steps of SGD (plain, with weight decay, momentum,
    dampening, Nesterov), Adam (with and without its L2 weight decay) or AdamW, on 1 and 2 threads,
    every parameter and every state array (momentum buffers, moments, step counts) is bit for bit
    what the plain loop of Optimizer.step gives, with parameters on both sides of
    THREADED_UPDATE_SIZE, two groups and a parameter without gradient; and each update was the
    kernel's own in-place one, not the reference's."""
    assert cpu_kernel("optimizer_step") is k_optim.step
    monkeypatch.setattr(k_optim, "THREADED_UPDATE_SIZE", THRESHOLD)
    num_threads(threads_)
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    grads = [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(STEPS)]
    assert {a.size >= THRESHOLD for a in init[:-1]} == {True, False}
    got, got_state = run_steps(OPTIMIZERS[name], init, grads, kernels_on=True)
    assert len(in_place_calls) == STEPS * (len(SHAPES) - 1)
    in_place_calls.clear()
    want, want_state = run_steps(OPTIMIZERS[name], init, grads, kernels_on=False)
    assert in_place_calls == []
    for i, (a, b) in enumerate(zip(got, want)):
        if i < len(SHAPES) - 1:
            assert not np.array_equal(a, init[i]), f"parameter {i} not updated"
        assert a.dtype == dtype
        np.testing.assert_array_equal(a, b, err_msg=f"{name}: parameter {i}")
    np.testing.assert_array_equal(got[-1], init[-1])                        # no gradient: untouched
    for i, (a, b) in enumerate(zip(got_state, want_state)):
        assert a.keys() == b.keys(), f"{name}: state keys of parameter {i}"
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{name}: state {key!r} of parameter {i}")


def test_the_gradient_is_never_changed(in_place_calls):
    """The in-place updates write into the parameter, the state and their scratch arrays only."""
    rng = np.random.default_rng(1)
    for name, make in OPTIMIZERS.items():
        p = nn.Parameter(rng.standard_normal((5, 4)))
        g = rng.standard_normal((5, 4))
        kept = g.copy()
        opt = make([p])
        for _ in range(2):
            k_optim.step([(p, g, opt._state_of(p), opt.param_groups[0])], opt._update)
        np.testing.assert_array_equal(g, kept, err_msg=name)
    assert len(in_place_calls) == 2 * len(OPTIMIZERS)


def test_other_updates_and_items_go_to_the_reference(in_place_calls):
    """An optimizer with its own _update (a subclass overriding it), a gradient of another dtype than
    its parameter, and hyperparameters that are NumPy numbers (which NumPy computes with in float64)
    are left to the reference's update, with the reference's numbers."""

    class MyAdam(optim.Adam):
        def _update(self, p, g, state, group):
            super()._update(p, g, state, group)

    assert k_optim.in_place_update(MyAdam([nn.Parameter(np.zeros(2))])._update) is None
    assert k_optim.in_place_update(lambda p, g, state, group: None) is None
    rng = np.random.default_rng(2)
    init, grad = rng.standard_normal(7).astype(np.float32), rng.standard_normal(7)
    cases = [
        (lambda ps: MyAdam(ps, lr=0.01), np.float32),
        (lambda ps: optim.AdamW(ps, lr=0.01), np.float64),                 # a float64 gradient
        (lambda ps: optim.AdamW(ps, lr=np.float64(0.01)), np.float32),     # a NumPy number
        (lambda ps: optim.SGD(ps, lr=0.1, momentum=np.float32(0.9)), np.float32),
    ]
    for make, grad_dtype in cases:
        results = []
        for kernels_on in (True, False):
            p = nn.Parameter(init.copy())
            opt = make([p])
            with use_kernels(kernels_on):
                for _ in range(2):
                    p.grad = grad.astype(grad_dtype)
                    opt.step()
            results.append(p.data)
        np.testing.assert_array_equal(*results)
    assert in_place_calls == []


def test_step_updates_each_item_once_large_in_threads_small_in_the_caller(num_threads, monkeypatch):
    """kernels/cpu/optim.py's step(items, update) calls update once per item: on one thread the large
    parameters first, largest first, then the small ones in their order; on two threads the small ones
    still in the calling thread."""
    monkeypatch.setattr(k_optim, "THREADED_UPDATE_SIZE", THRESHOLD)
    ps = [nn.Parameter(np.zeros(s)) for s in SHAPES]
    items = [(p, None, {}, {}) for p in ps]
    for n in (1, 2):
        num_threads(n)
        calls = []
        k_optim.step(items, lambda p, g, state, group: calls.append((ps.index(p), threading.get_ident())))
        assert sorted(i for i, _ in calls) == list(range(len(ps))), f"{n} threads: {calls}"
        small = [i for i, p in enumerate(ps) if p.data.size < THRESHOLD]
        assert [i for i, _ in calls if i in small] == small
        assert all(ident == threading.get_ident() for i, ident in calls if i in small)
        if n == 1:
            assert [i for i, _ in calls] == [3, 0, 1, 2, 4, 5, 6]       # 4096, 1200, 100 elements; then the rest
