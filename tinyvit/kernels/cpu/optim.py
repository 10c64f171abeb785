"""The optimizer step on the CPU, fast: tinyvit/optim.py's SGD, Adam and AdamW updates

    in place          each update's operations, in the reference's order, written into the moments,
                      the parameter and two per-thread scratch arrays (threads.scratch) instead of
                      a fresh temporary per operation
    threaded          the large parameters' updates shared among the kernels' threads, largest
                      first (each parameter's update is independent of the others', and NumPy
                      releases the GIL inside each array operation); the small ones (biases, norms:
                      a thread hand-over would cost more than their update) in the calling thread

Any other optimizer, and any item these in-place updates do not take (below), gets the reference's
own update(p, g, state, group). Measured on vit-cifar/4 with 2 threads: 13 -> 9 ms per AdamW step.
Tests: tests/test_kernels_cpu_optim.py (bit for bit the reference's numbers and states).
"""
from __future__ import annotations

import math

import numpy as np

from ...optim import SGD, Adam
from .threads import for_each_block, scratch

# Parameters of at least this many elements go to the threads.
THREADED_UPDATE_SIZE = 1 << 14


def _sgd(p, g, state, group):
    """SGD._update in place: the same operations in the same order, so the same numbers."""
    lr, mu, tau, wd = group["lr"], group["momentum"], group["dampening"], group["weight_decay"]
    x = p.data
    s, t = scratch("optimizer", 2, x)
    if wd != 0:
        np.multiply(x, wd, out=s)
        s += g
        g = s                                              # g + wd p (the gradient itself is never changed)
    if mu != 0:
        b = state.get("momentum_buffer")
        if b is None:
            b = state["momentum_buffer"] = g.copy()
        else:
            b *= mu
            np.multiply(g, 1 - tau, out=t)
            b += t                                         # mu b + (1 - tau) g
        if group["nesterov"]:
            np.multiply(b, mu, out=t)
            t += g
            g = t                                          # g + mu b
        else:
            g = b
    np.multiply(g, lr, out=s)
    x -= s


def _adam(decoupled, p, g, state, group):
    """Adam._update (AdamW's when ``decoupled``) in place: the same operations in the same order."""
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    x = p.data
    if not state:
        state.update(step=0, exp_avg=np.zeros_like(x), exp_avg_sq=np.zeros_like(x))
    state["step"] = t = state["step"] + 1
    m, v = state["exp_avg"], state["exp_avg_sq"]
    s, l2 = scratch("optimizer", 2, x)
    if wd != 0 and decoupled:
        x *= 1 - lr * wd
    elif wd != 0:
        np.multiply(x, wd, out=l2)
        l2 += g
        g = l2                                             # g + wd p
    np.multiply(g, 1 - b1, out=s)
    m *= b1
    m += s                                                 # m = b1 m + (1 - b1) g
    np.multiply(g, g, out=s)
    s *= 1 - b2
    v *= b2
    v += s                                                 # v = b2 v + (1 - b2) g^2
    np.sqrt(v, out=s)
    s /= math.sqrt(1 - b2 ** t)
    s += eps                                               # sqrt(v) / sqrt(1 - b2^t) + eps
    np.divide(m, s, out=s)
    s *= lr / (1 - b1 ** t)
    x -= s


_HYPERPARAMETERS = {SGD: ("lr", "momentum", "dampening", "weight_decay"), Adam: ("lr", "eps", "weight_decay")}


def in_place_update(update):
    """The in-place version of ``update`` (an optimizer's bound _update): a function of
    (p, g, state, group) for SGD's, Adam's and AdamW's own updates; None for any other (a subclass
    that overrides _update included)."""
    func = getattr(update, "__func__", None)
    if func is SGD._update:
        return _sgd
    if func is Adam._update:
        decoupled = update.__self__._decoupled
        return lambda p, g, state, group: _adam(decoupled, p, g, state, group)
    return None


def _takes(item, kind) -> bool:
    """Whether the in-place update of ``kind`` (SGD or Adam) gives the reference's numbers for this
    item: NumPy arrays of one dtype, and hyperparameters that are Python numbers. (NumPy rounds a
    Python number to the arrays' dtype, but computes with a NumPy float64 or a 0-d array in float64:
    the reference's expressions would round once at their end, the in-place steps at each step.)"""
    p, g, state, group = item
    arrays = [p.data, g] + [a for a in state.values() if isinstance(a, np.ndarray)]
    numbers = [group[k] for k in _HYPERPARAMETERS[kind]] + list(group["betas"] if kind is Adam else ())
    return (all(isinstance(a, np.ndarray) and a.dtype == p.data.dtype for a in arrays)
            and all(type(n) in (int, float) for n in numbers))


def step(items, update) -> None:
    """update(p, g, state, group) for every (p, g, state, group) of items, in place where
    in_place_update has a version of update and the item fits it (_takes), by update itself
    otherwise; the large NumPy parameters among the threads, largest first, then the small ones in
    this thread."""
    own = in_place_update(update)
    kind = SGD if own is _sgd else Adam

    def run(item):
        if own is not None and _takes(item, kind):
            own(*item)
        else:
            update(*item)

    def threaded(item):
        data = item[0].data
        return isinstance(data, np.ndarray) and data.size >= THREADED_UPDATE_SIZE

    large = sorted((item for item in items if threaded(item)), key=lambda item: -item[0].data.size)
    for_each_block(run, large)
    for item in items:
        if not threaded(item):
            run(item)
