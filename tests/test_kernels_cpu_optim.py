"""kernels/cpu/optim.py (the optimizer step with the large parameters' updates among threads) against
the plain loop of tinyvit/optim.py's Optimizer.step (kernels off): bit for bit, as each parameter's
update is the same arithmetic in whichever thread runs it (the shared helpers and the meta-test are in
test_kernels_cpu.py)."""
import threading

import numpy as np
import pytest

import tinyvit.nn as nn
import tinyvit.optim as optim
from tinyvit.kernels import use_kernels
from tinyvit.kernels.cpu import optim as k_optim

from kernel_checks import cpu_kernel

THRESHOLD = 100                 # THREADED_UPDATE_SIZE in these tests: the (40, 30), (100,), (64, 64) go to threads
SHAPES = [(40, 30), (100,), (7,), (64, 64), (3, 5), (99,)]

OPTIMIZERS = {
    "SGD": lambda groups: optim.SGD(groups, lr=0.1),
    "SGD momentum": lambda groups: optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01),
    "SGD nesterov": lambda groups: optim.SGD(groups, lr=0.01, momentum=0.9, nesterov=True),
    "Adam": lambda groups: optim.Adam(groups, lr=0.01, weight_decay=0.1),
    "AdamW": lambda groups: optim.AdamW(groups, lr=0.01, weight_decay=0.1),
}


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


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads_", [1, 2])
def test_kernel_step_equals_the_plain_loop_bit_for_bit(num_threads, monkeypatch, name, dtype, threads_):
    """The "optimizer_step" kernel: after three steps of SGD (plain, momentum with weight decay,
    Nesterov), Adam or AdamW, on 1 and 2 threads, every parameter and every state array (momentum
    buffers, moments, step counts) is bit for bit what the plain loop of Optimizer.step gives, with
    parameters on both sides of THREADED_UPDATE_SIZE, two groups and a parameter without gradient."""
    assert cpu_kernel("optimizer_step") is k_optim.step
    monkeypatch.setattr(k_optim, "THREADED_UPDATE_SIZE", THRESHOLD)
    num_threads(threads_)
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    grads = [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(3)]
    assert {a.size >= THRESHOLD for a in init[:-1]} == {True, False}
    got, got_state = run_steps(OPTIMIZERS[name], init, grads, kernels_on=True)
    want, want_state = run_steps(OPTIMIZERS[name], init, grads, kernels_on=False)
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
            assert [i for i, _ in calls] == [3, 0, 1, 2, 4, 5]          # 4096, 1200, 100 elements; then the rest
