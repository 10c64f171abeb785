"""kernels/cuda/optim.py (one kernel launch for the AdamW step of every parameter) against the plain
loop of tinyvit/optim.py's Optimizer.step (kernels off): after several steps every parameter and
every state array (moments, step counts) equal, with two parameter groups (their own lr and weight
decay), parameters of 0, 1 and 7 elements, of one block, of several blocks with a ragged last one,
0-d, and one without gradient; and every other optimizer sent to the plain loop.

Each equality test runs on the GPU (marked gpu; Optimizer.step through the switchboard with
use_kernels("all")) and emulated on the CPU: the launch is checked against the CUDA source and a
NumPy emulation follows the table's addresses block by block (tests/test_kernels_cuda_layernorm.py
has the harness). Emulated, the step must be bit for bit the loop's (the host computes each
parameter's numbers exactly as the reference does, NumPy rounds each operation as CuPy does). On the
GPU the kernel makes the same roundings with explicitly rounded intrinsics, so it should be bit for bit
too; the test allows float32 rtol 1e-6 (float64 1e-14), a few ulps, as the roundings of CuPy's own
kernels (how it passes a Python float to a float32 kernel) are CuPy's, not ours to promise.
"""
import bisect

import numpy as np
import pytest

import tinyvit.nn as nn
import tinyvit.optim as optim
from tinyvit.backend import to_numpy
from tinyvit.kernels import kernel_for, use_kernels
from tinyvit.kernels.cuda import optim as k_optim

from kernel_checks import assert_same
from cuda_checks import make_device_fixture

OPS = ["optimizer_step"]      # the ops these tests cover (python -m tinyvit.kernels.cuda.record)

# 4096 elements: 2 blocks of 2048; 5000: 3 blocks, the last ragged; an empty one, tiny ones. (No 0-d
# parameter: the reference's update fails on 0-d NumPy arrays, whose products are NumPy scalars.)
SHAPES = [(64, 64), (5000,), (7,), (1,), (0, 3), (3, 5), (2048,), (99,)]


# ---------------------------------------------------------------- the emulated kernel (NumPy)


def _array_at(address, size, dtype):
    """The NumPy array of ``size`` elements of ``dtype`` at ``address`` (memory of a live array)."""
    buffer = (np.ctypeslib.as_ctypes_type(dtype) * size).from_address(address)
    return np.ctypeslib.as_array(buffer)


def _emulate_adamw_step(a, grid, block):
    """Block by block as the kernel: find the block's tensor by first_block, update its slice."""
    records = a.tensors.view(k_optim.TENSOR)
    assert len(records) == int(a.count) and int(a.elements_per_block) == k_optim.ELEMENTS_PER_BLOCK
    assert block == (k_optim.THREADS, 1, 1) and grid[1:] == (1, 1)
    first = records["first_block"]
    ends = first + -(-records["size"] // int(a.elements_per_block))
    assert (records["size"] > 0).all() and (first[1:] == ends[:-1]).all() and first[0] == 0
    assert grid[0] == ends[-1], f"grid {grid} for {ends[-1]} blocks"
    t = a.T.type
    for b in range(grid[0]):
        r = records[bisect.bisect_right(first, b) - 1]
        start = (b - int(r["first_block"])) * int(a.elements_per_block)
        part = slice(start, min(start + int(a.elements_per_block), int(r["size"])))
        p, g, m, v = (_array_at(int(r[k]), int(r["size"]), a.T)[part]
                      for k in ("param", "grad", "exp_avg", "exp_avg_sq"))
        p *= t(r["decay"])
        m[...] = m * t(r["beta1"]) + g * t(r["one_minus_beta1"])
        v[...] = v * t(r["beta2"]) + (g * g) * t(r["one_minus_beta2"])
        denom = np.sqrt(v) / t(r["bias_correction2_sqrt"]) + t(r["eps"])
        p -= (m / denom) * t(r["step_size"])


device = make_device_fixture(k_optim, {"adamw_step": _emulate_adamw_step})

# ---------------------------------------------------------------- equal to the plain loop

OPTIMIZERS = {
    "AdamW": lambda groups: optim.AdamW(groups, lr=0.01, weight_decay=0.1),
    "AdamW betas": lambda groups: optim.AdamW(groups, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
    "Adam without weight decay": lambda groups: optim.Adam(groups, lr=0.01),
}


def run_steps(device, make, init, grads, kernels):
    """Parameters from init on device in two groups (the second with its own lr and no weight decay,
    the last parameter never with a gradient), one optimizer step per entry of grads, with the
    kernel (kernels=True) or the plain loop; returns host copies of the parameters and states."""
    xp = device.xp
    ps = [nn.Parameter(xp.array(a, copy=True)) for a in init]
    opt = make([{"params": ps[:4]}, {"params": ps[4:], "lr": 0.003, "weight_decay": 0.0}])
    for step_grads in grads:
        for i, (p, g) in enumerate(zip(ps, step_grads)):
            p.grad = None if i == len(ps) - 1 else xp.array(g, copy=True)
        if not kernels:
            with use_kernels(False):
                opt.step()
        elif device.name == "gpu":
            with use_kernels("all"):
                assert kernel_for("optimizer_step", ps[0]) is k_optim.step
                opt.step()
        else:                           # NumPy arrays get the CPU kernel from the switchboard: call ours
            items = [(p, p.grad, opt._state_of(p), group) for group in opt.param_groups
                     for p in group["params"] if p.grad is not None]
            k_optim.step(items, opt._update)
    state = [{k: (to_numpy(v) if hasattr(v, "shape") else v) for k, v in opt.state.get(id(p), {}).items()}
             for p in ps]
    return [to_numpy(p.data) for p in ps], state


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_step_equals_the_plain_loop(device, name, dtype):
    """After three steps every parameter and state array is the plain loop's: bit for bit emulated,
    within a few ulps on the GPU (module docstring); the parameter without gradient untouched."""
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    grads = [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(3)]
    got, got_state = run_steps(device, OPTIMIZERS[name], init, grads, kernels=True)
    want, want_state = run_steps(device, OPTIMIZERS[name], init, grads, kernels=False)
    tol = {np.float32: (1e-6, 1e-6), np.float64: (1e-14, 1e-14)}[dtype]

    def same(a, b, what):
        assert a.dtype == dtype, what
        if device.name == "emulated":
            np.testing.assert_array_equal(a, b, err_msg=what)
        else:
            assert_same(a, b, *tol, what=what)

    for i, (a, b) in enumerate(zip(got, want)):
        if i < len(SHAPES) - 1 and a.size:
            assert not np.array_equal(a, init[i]), f"parameter {i} not updated"
        same(a, b, f"{name}: parameter {i}")
    np.testing.assert_array_equal(got[-1], init[-1])
    for i, (a, b) in enumerate(zip(got_state, want_state)):
        assert a.keys() == b.keys(), f"{name}: state keys of parameter {i}"
        assert a.get("step") == b.get("step")
        for key in ("exp_avg", "exp_avg_sq"):
            if key in a:
                same(a[key], b[key], f"{name}: {key} of parameter {i}")
    if device.emulation:
        assert len(device.emulation.launches) == 3              # one launch per step for all parameters


def test_gradients_of_any_layout(device):
    """A gradient that is a broadcast (zero strides) or a transposed view is read correctly."""
    xp = device.xp
    rng = np.random.default_rng(1)
    init = rng.standard_normal((30, 40)).astype(np.float32)
    row = rng.standard_normal(40).astype(np.float32)
    results = []
    for kernels in (True, False):
        p, q = nn.Parameter(xp.array(init, copy=True)), nn.Parameter(xp.array(init.T, copy=True))
        opt = optim.AdamW([p, q], lr=0.01)
        p.grad = xp.broadcast_to(xp.asarray(row), (30, 40))           # zero strides
        q.grad = xp.array(init, copy=True).T                           # (40, 30), not C-contiguous
        items = _items(opt)
        if kernels:
            k_optim.step(items, opt._update)
        else:
            for item in items:
                opt._update(*item)
        results.append([to_numpy(p.data), to_numpy(q.data)])
    for a, b in zip(*results):
        assert_same(a, b, 1e-6, 1e-6, what="parameter")


# ---------------------------------------------------------------- which items the kernel takes


def _spy_on_the_kernel(monkeypatch):
    """The items that step() sends to the kernel (_fused_step), collected in the returned list."""
    fused = []
    monkeypatch.setattr(k_optim, "_fused_step", fused.extend)
    return fused


def _items(opt):
    return [(p, p.grad, opt._state_of(p), group) for group in opt.param_groups for p in group["params"]]


def _params(*shapes, dtype=np.float32):
    ps = [nn.Parameter(np.zeros(s, dtype)) for s in shapes]
    for p in ps:
        p.grad = np.ones(p.shape, dtype)
    return ps


def test_other_optimizers_go_to_the_plain_loop(monkeypatch):
    """SGD, an Adam subclass with its own update, and Adam with (L2) weight decay are never fused:
    step() runs their update once for every item."""

    class MyAdam(optim.Adam):
        def _update(self, p, g, state, group):
            super()._update(p, g, state, group)

    fused = _spy_on_the_kernel(monkeypatch)
    sgd = optim.SGD(_params((3,), (4, 5)), lr=0.1, momentum=0.9)
    mine = MyAdam(_params((3,), (4, 5)), lr=0.1)
    adam_l2 = optim.Adam(_params((3,), (4, 5)), lr=0.1, weight_decay=0.01)
    assert not k_optim.fusable_optimizer(sgd._update) and not k_optim.fusable_optimizer(mine._update)
    assert k_optim.fusable_optimizer(adam_l2._update)            # Adam's update, but not its items
    for opt in (sgd, mine, adam_l2):
        items = _items(opt)
        k_optim.step(items, opt._update)
        assert fused == []
        for p, _, state, _ in items:
            assert state.get("step", 1) == 1 and ("momentum_buffer" in state or "exp_avg" in state)


def test_only_standard_items_are_fused(monkeypatch):
    """Within an AdamW step: a float16 parameter, a non-contiguous parameter, a state with other
    entries and a learning rate that is an array go to the loop; the standard one to the kernel."""
    fused = _spy_on_the_kernel(monkeypatch)
    good, half, strided, odd_state, array_lr = _params((3, 4), (5,), (4, 6), (2,), (3,))
    half.data, half.grad = half.data.astype(np.float16), half.grad.astype(np.float16)
    strided.data = np.zeros((6, 4), np.float32).T                       # a transposed view
    opt = optim.AdamW([{"params": [good, half, strided, odd_state]},
                       {"params": [array_lr], "lr": np.array(0.1)}], lr=0.1)
    opt.state[id(odd_state)] = {"step": 1, "exp_avg": np.zeros(2, np.float32),
                                "exp_avg_sq": np.zeros(2, np.float32), "max_exp_avg_sq": np.zeros(2)}
    items = _items(opt)
    assert [k_optim.fusable(item, decoupled=True) for item in items] == [True, False, False, False, False]
    k_optim.step([items[0], items[1]], opt._update)
    assert [item[0] for item in fused] == [good]
    assert opt.state[id(half)]["step"] == 1                             # updated by the loop


def test_adam_with_weight_decay_is_not_fusable_but_without_is():
    p, = _params((3,))
    opt = optim.Adam([p], lr=0.1, weight_decay=0.1)
    (item,) = _items(opt)
    assert not k_optim.fusable(item, decoupled=False)
    assert k_optim.fusable(item, decoupled=True)
    item[3]["weight_decay"] = 0.0
    assert k_optim.fusable(item, decoupled=False)


# ---------------------------------------------------------------- the table


def test_table_layout_is_the_cuda_struct():
    """TENSOR has struct AdamWTensor's fields, in its order, 8 bytes each: the records the host
    writes are the structs the kernel reads."""
    import re
    body = re.search(r"struct AdamWTensor \{(.*?)\};", k_optim.SOURCE, re.DOTALL).group(1)
    fields = []
    for line in body.splitlines():
        line = line.split("//")[0].strip().rstrip(";")
        if line:
            ctype, names = re.match(r"(unsigned long long|long long|double)\s+(.*)", line).groups()
            fields += [(ctype, n.strip()) for n in names.split(",")]
    assert [n for _, n in fields] == list(k_optim.TENSOR.names)
    kinds = {"unsigned long long": "u", "long long": "i", "double": "f"}
    assert all(k_optim.TENSOR[n].kind == kinds[c] and k_optim.TENSOR[n].itemsize == 8 for c, n in fields)
    assert k_optim.TENSOR.itemsize == 8 * len(fields)


def test_table_records_each_parameters_numbers():
    """One record per non-empty parameter, consecutive block ranges, and the reference's numbers:
    1 - lr wd, lr / (1 - beta1^t), sqrt(1 - beta2^t) for each parameter's own step t."""
    ps = _params((5000,), (0,), (7,), (2048,))
    opt = optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.5, "weight_decay": 0.0}],
                      lr=0.01, betas=(0.8, 0.9), weight_decay=0.1)
    items = _items(opt)
    for k, (_, _, state, _) in enumerate(items):
        state.update(step=k + 1, exp_avg=np.zeros(1), exp_avg_sq=np.zeros(1))
    records, blocks = k_optim.table(items)
    assert list(records["size"]) == [5000, 7, 2048] and list(records["first_block"]) == [0, 3, 4]
    assert blocks == 5
    assert list(records["param"]) == [p.data.ctypes.data for p in (ps[0], ps[2], ps[3])]
    np.testing.assert_array_equal(records["decay"], [1 - 0.01 * 0.1, 1.0, 1.0])
    np.testing.assert_array_equal(records["step_size"], [0.01 / (1 - 0.8), 0.5 / (1 - 0.8 ** 3), 0.5 / (1 - 0.8 ** 4)])
    np.testing.assert_array_equal(records["bias_correction2_sqrt"],
                                  [(1 - 0.9) ** 0.5, (1 - 0.9 ** 3) ** 0.5, (1 - 0.9 ** 4) ** 0.5])
    np.testing.assert_array_equal(records["one_minus_beta1"], 1 - 0.8)


def test_entry_points_for_float32_and_float64_only():
    from test_kernels_cuda_layernorm import cuda_signature
    assert cuda_signature(k_optim.SOURCE, "adamw_step_f32") == cuda_signature(k_optim.SOURCE, "adamw_step_f64")
    with pytest.raises(TypeError, match="float32 or float64"):
        k_optim.entry("adamw_step", np.float16)


def test_float32_kernel_rounds_each_operation_apart():
    """No fused multiply-add in the float32 or float64 kernel: every product, sum, quotient and square
    root rounded on its own, as the reference's separate CuPy kernels do."""
    from test_kernels_cuda_layernorm import ptx_by_entry
    for name, code in ptx_by_entry(k_optim.SOURCE).items():
        assert "fma." not in code, f"{name} contracts a multiply-add"
        assert "div.rn.f" in code and "sqrt.rn.f" in code, f"{name}: not IEEE division and square root"

