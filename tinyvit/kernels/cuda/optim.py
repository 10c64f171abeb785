"""The AdamW step on an NVIDIA GPU: one kernel launch updates every parameter, with the same numbers
as tinyvit/optim.py's Adam._update (AdamW: decoupled weight decay). Per parameter p with gradient g,
moments m, v, at its step t (the reference's order of operations, each rounded to the dtype):

    p <- p * (1 - lr lambda)                                    (decoupled weight decay)
    m <- beta1 m + (1 - beta1) g
    v <- beta2 v + (1 - beta2) g^2
    p <- p - (m / (sqrt(v) / sqrt(1 - beta2^t) + eps)) * (lr / (1 - beta1^t))

The plain loop launches about ten element-wise CuPy kernels per parameter (~150 parameters in a
ViT-B/16: ~1500 launches a step, most on small arrays). Here one launch does them all.

How the kernel finds the parameters: a table of one AdamWTensor record per parameter (the device
addresses of p, g, m, v, the size, and the per-parameter numbers, 1 - lr lambda, lr / (1 - beta1^t),
sqrt(1 - beta2^t), ..., computed on the host in Python floats exactly as the reference computes
them), copied to the GPU with each step (112 bytes per parameter; cupy.asarray copies through a
pinned buffer asynchronously, so the step still never waits for the GPU). Not one flat buffer of all
parameters: the parameters, gradients and moments are separate arrays owned by Parameters and the
optimizer state, and concatenating them would cost two extra passes over memory per step.
Each parameter gets ceil(size / ELEMENTS_PER_BLOCK) consecutive blocks of the grid; a block finds its
parameter by binary search over the records' first_block, then its THREADS threads update its
ELEMENTS_PER_BLOCK elements (coalesced, stride THREADS).
Every operation is an explicitly rounded intrinsic (__fmul_rn, __fdiv_rn, __fsqrt_rn, ...), which
the compiler never contracts into fused multiply-adds: the same roundings as the reference's
separate CuPy kernels, so the same numbers, bit for bit where CuPy's kernels round correctly.
Both sides flush float32 denormals to zero on a GPU (CuPy compiles its own kernels with -ftz=true
too); against NumPy, which keeps them (the emulated test), the bits agree while no float32 number of
the step is denormal (below 1.2e-38: a gradient below about 1e-19 has a denormal square).

step(items, update) uses the kernel for the parameters of an Adam optimizer whose update is
Adam._update with decoupled weight decay (AdamW) or no weight decay, standard hyperparameters
(lr, betas, eps, weight_decay as numbers), and float32/float64 contiguous arrays; every other item
goes to update(*item), the reference loop.
Tests: tests/test_kernels_cuda_optim.py (on a GPU: `pytest -m gpu`; on the CPU the Python side runs
against a NumPy emulation of the kernel that follows the table's addresses).
"""
from __future__ import annotations

import collections
import contextlib
import math
import numbers

import numpy as np

from ...backend import device_of, get_array_module, is_cupy_array
from ...optim import Adam
from . import entry, kernel, load_source

THREADS = 256
ELEMENTS_PER_BLOCK = THREADS * 8
MAX_BLOCKS = 2 ** 31 - 1                      # CUDA's limit on grid.x

SOURCE = load_source("optim.cu")          # the CUDA C++ of the kernels below

# The host side of struct AdamWTensor: the same fields in the same order, 8 bytes each.
TENSOR = np.dtype([
    ("param", np.uint64), ("grad", np.uint64), ("exp_avg", np.uint64), ("exp_avg_sq", np.uint64),
    ("size", np.int64), ("first_block", np.int64),
    ("decay", np.float64), ("beta1", np.float64), ("one_minus_beta1", np.float64),
    ("beta2", np.float64), ("one_minus_beta2", np.float64), ("bias_correction2_sqrt", np.float64),
    ("eps", np.float64), ("step_size", np.float64),
])

_HYPERPARAMETERS = {"params", "lr", "betas", "eps", "weight_decay", "lr_scale", "name"}


def _launch(name, dtype, grid, block, args):
    """Run entry point ``name`` for ``dtype`` (tests on the CPU replace this with an emulation)."""
    kernel(SOURCE, entry(name, dtype))(grid, block, args)


# The tables of launches that may still be running, with the event that marks each one's end. The
# launch returns at once; the kernel reads the table later. cupy.asarray copies the host records
# through a pinned buffer that CuPy keeps until the copy is done, but in CuPy's unified-memory mode
# (CUPY_ENABLE_UMP=1: system memory the GPU reads directly, on Grace Hopper and HMM systems) the device
# table can be the host records themselves: both must outlive the kernel.
_in_flight = collections.deque()


def _completion_event(device_array):
    """A CUDA event recorded on the current stream after the launch (None for NumPy arrays: nothing
    runs asynchronously there, the launch is done when it returns)."""
    if not is_cupy_array(device_array):
        return None
    import cupy
    event = cupy.cuda.Event(block=False, disable_timing=True)
    event.record()
    return event


def _hold_until_done(records, table) -> None:
    """Keep the host records and the device table alive until the work queued so far on the current
    stream has run; let go of the earlier launches' tables whose events have completed."""
    while _in_flight and _in_flight[0][0].done:
        _in_flight.popleft()
    event = _completion_event(table)
    if event is not None:
        _in_flight.append((event, (records, table)))


def _address(a) -> int:
    return a.data.ptr if is_cupy_array(a) else a.ctypes.data


def _device(a):
    """The context that makes a's GPU the current one (nothing for a NumPy array)."""
    if is_cupy_array(a):
        import cupy
        return cupy.cuda.Device(a.device.id)
    return contextlib.nullcontext()


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def fusable_optimizer(update) -> bool:
    """Whether update (the optimizer's bound _update) is Adam's update, which the kernel computes."""
    return isinstance(getattr(update, "__self__", None), Adam) and getattr(update, "__func__", None) is Adam._update


def fusable(item, decoupled: bool) -> bool:
    """Whether the kernel can update this (p, g, state, group) item: standard hyperparameters
    (numbers; weight decay decoupled, or none), arrays of one kind, float32 or float64, C-contiguous,
    the state empty or the reference's {step, exp_avg, exp_avg_sq}."""
    p, g, state, group = item
    if not set(group) <= _HYPERPARAMETERS:
        return False
    betas = group["betas"]
    if not (all(_is_number(group[k]) for k in ("lr", "eps", "weight_decay")) and len(betas) == 2
            and all(_is_number(b) for b in betas)):
        return False
    if not decoupled and group["weight_decay"] != 0:
        return False
    data = p.data
    if data.dtype not in (np.float32, np.float64) or not data.flags.c_contiguous:
        return False
    arrays = [g]
    if state:
        if set(state) != {"step", "exp_avg", "exp_avg_sq"}:
            return False
        arrays += [state["exp_avg"], state["exp_avg_sq"]]
    # g may be any layout (it is made contiguous); the moments are updated in place, so must be
    return all(type(a) is type(data) and a.dtype == data.dtype and a.shape == data.shape for a in arrays) \
        and all(a.flags.c_contiguous for a in arrays[1:])


def step(items, update) -> None:
    """update(p, g, state, group) for every (p, g, state, group) of items, the Adam(W) ones by the
    kernel (one launch per device and dtype), the others by update itself."""
    if not fusable_optimizer(update):
        for item in items:
            update(*item)
        return
    decoupled = update.__self__._decoupled
    batches = {}
    for item in items:
        if fusable(item, decoupled):
            batches.setdefault((device_of(item[0].data), item[0].dtype), []).append(item)
        else:
            update(*item)
    for batch in batches.values():
        _fused_step(batch)


def table(items):
    """The AdamWTensor records of items (state already advanced to this step) and the grid size:
    (records, total blocks). Parameters with no elements get no record (and no blocks)."""
    records = np.zeros(len(items), dtype=TENSOR)
    block = 0
    for k, (p, g, state, group) in enumerate(items):
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        t = state["step"]
        records[k] = (_address(p.data), _address(g), _address(state["exp_avg"]), _address(state["exp_avg_sq"]),
                      p.data.size, block,
                      1 - lr * wd if wd != 0 else 1.0,          # the reference's Python floats, exactly
                      b1, 1 - b1, b2, 1 - b2,
                      math.sqrt(1 - b2 ** t),
                      eps,
                      lr / (1 - b1 ** t))
        block += -(-p.data.size // ELEMENTS_PER_BLOCK)
    if block > MAX_BLOCKS:
        raise ValueError(f"AdamW kernel: {block} blocks are more than one CUDA grid holds")
    return records[records["size"] > 0], block


def _fused_step(items):
    """Advance each item's state as Adam._update does, then one kernel launch for all of them
    (items of one device and dtype)."""
    p0 = items[0][0].data
    xp = get_array_module(p0)
    with _device(p0):
        ready = []
        for p, g, state, group in items:
            if not state:                                       # the reference's first step
                state["step"] = 0
                state["exp_avg"] = xp.zeros_like(p.data)
                state["exp_avg_sq"] = xp.zeros_like(p.data)
            state["step"] += 1
            ready.append((p, xp.ascontiguousarray(g), state, group))   # g referenced until the launch
        records, blocks = table(ready)
        if blocks:
            tensors = xp.asarray(records.view(np.int64))       # the records, as raw 8-byte words
            _launch("adamw_step", p0.dtype, (blocks,), (THREADS,),
                    (tensors, np.int32(len(records)), np.int32(ELEMENTS_PER_BLOCK)))
            _hold_until_done(records, tensors)
