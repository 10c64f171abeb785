"""What the CUDA kernels' tests (test_kernels_cuda_*.py) share: the parameters of a kernel's entry
point read off its CUDA source, a check of a launch's arguments against them, the emulation of a
launch on the CPU (NumPy), the ``device`` fixture (a real GPU, or the emulation), one forward and
backward on either, and the PTX of a source by entry point."""
import re
from types import SimpleNamespace

import numpy as np
import pytest

import tinyvit as tv
from tinyvit.backend import to_numpy

from conftest import CUDA
from kernel_checks import assert_same

_SCALARS = {"int": np.int32, "long long": np.int64, "float": np.float32, "double": np.float64}
_POINTEES = {"float": np.float32, "double": np.float64}
_MAX_GRID = (2 ** 31 - 1, 65535, 65535)


def cuda_signature(source, entry):
    """[(C type, name), ...] of the parameters of ``extern "C" __global__ void entry(...)`` in source."""
    match = re.search(r'extern\s+"C"\s+__global__\s+void\s+' + re.escape(entry) + r"\s*\(([^)]*)\)", source)
    assert match, f'no extern "C" __global__ void {entry}(...) in the source'
    params = []
    for param in match.group(1).split(","):
        words = param.replace("*", " * ").split()
        params.append((" ".join(words[:-1]), words[-1]))
    return params


def check_arguments(source, entry, args, array_type):
    """Each argument of a launch of ``entry`` has its parameter's type; returns {name: argument}."""
    params = cuda_signature(source, entry)
    assert len(args) == len(params), f"{entry}: {len(args)} arguments for {len(params)} parameters"
    named = {}
    for (ctype, name), arg in zip(params, args):
        if ctype.endswith("*"):
            assert isinstance(arg, array_type), f"{entry}({name}): {type(arg).__name__} for {ctype}"
            pointee = ctype.replace("const", "").replace("*", "").strip()
            if pointee in _POINTEES:
                assert arg.dtype == _POINTEES[pointee], f"{entry}({name}): {arg.dtype} array for {ctype}"
            assert arg.flags.c_contiguous, f"{entry}({name}): not C-contiguous"
        else:
            assert type(arg) is _SCALARS[ctype], f"{entry}({name}): {type(arg).__name__} for {ctype}"
        named[name] = arg
    return named


def _dims(t):
    t = tuple(t)
    assert 1 <= len(t) <= 3 and all(isinstance(n, (int, np.integer)) and n >= 1 for n in t), t
    return tuple(int(n) for n in t) + (1,) * (3 - len(t))


class Emulation:
    """A replacement for a kernel module's _launch(name, dtype, grid, block, args): checks the launch
    against the module's SOURCE and runs emulators[name](arguments, grid, block), where arguments
    has the launch's arguments as attributes named after the kernel's parameters, and T, the dtype;
    grid and block are padded to 3 dimensions."""

    def __init__(self, module, emulators):
        self.module, self.emulators = module, emulators
        self.launches, self.arguments = [], []     # (entry, grid, block) and {parameter: argument} of each

    def __call__(self, name, dtype, grid, block, args):
        entry = self.module.entry(name, dtype)
        named = check_arguments(self.module.SOURCE, entry, args, np.ndarray)
        grid, block = _dims(grid), _dims(block)
        assert all(g <= m for g, m in zip(grid, _MAX_GRID)), f"{entry}: grid {grid} beyond CUDA's limits"
        assert block[0] * block[1] * block[2] <= 1024, f"{entry}: block {block} has more than 1024 threads"
        self.launches.append((entry, grid, block))
        self.arguments.append(named)
        arguments = SimpleNamespace(**named)
        arguments.T = np.dtype(dtype)          # the kernel's type T (the entry point's suffix)
        self.emulators[name](arguments, grid, block)


def make_device_fixture(module, emulators):
    """A ``device`` fixture for tests of ``module``'s kernels: "emulated" (NumPy, launches emulated)
    and "gpu" (CuPy, marked gpu, skipped without a CUDA device). Yields SimpleNamespace(name, xp,
    emulation)."""

    @pytest.fixture(params=["emulated", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not CUDA, reason="no CUDA device with CuPy here (pip install 'tinyvit[gpu]' on a GPU machine)")])])
    def device(request, monkeypatch):
        if request.param == "gpu":
            import cupy
            return SimpleNamespace(name="gpu", xp=cupy, emulation=None)
        emulation = Emulation(module, emulators)
        monkeypatch.setattr(module, "_launch", emulation)
        return SimpleNamespace(name="emulated", xp=np, emulation=emulation)

    return device


def forward_backward_on(xp, fn, arrays, upstream, dtype, wants_grad=None):
    """kernel_checks.forward_backward on xp's device: fn on Tensors made from the NumPy ``arrays``
    (None stays None; wants_grad[i] false: a constant), one backward of sum_k sum(upstream[k] * out_k)
    over the outputs whose upstream is not None ("sum": sum(out_k), whose gradient arrives as a
    broadcast of 1). Returns NumPy copies: (the outputs, each input's gradient or None)."""
    ins = [None if a is None else tv.Tensor(xp.asarray(np.asarray(a, dtype=dtype)),
                                            requires_grad=wants_grad is None or bool(wants_grad[i]))
           for i, a in enumerate(arrays)]
    outs = fn(*ins)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    assert len(upstream) == len(outs), f"{len(outs)} outputs, {len(upstream)} upstream gradients"
    terms = [o.sum() if isinstance(g, str) else (o * tv.Tensor(xp.asarray(np.asarray(g, dtype=dtype)))).sum()
             for o, g in zip(outs, upstream) if g is not None]
    loss = terms[0]
    for term in terms[1:]:
        loss = loss + term
    loss.backward()
    return ([to_numpy(o.data) for o in outs],
            [None if t is None or t.grad is None else to_numpy(t.grad) for t in ins])


def assert_equal_results(got, want, tol, names):
    """Outputs and gradients of forward_backward_on, kernel (got) against reference (want)."""
    (outs_k, grads_k), (outs_r, grads_r) = got, want
    assert len(outs_k) == len(outs_r)
    for i, (a, b) in enumerate(zip(outs_k, outs_r)):
        assert_same(a, b, *tol, what=f"output {i}")
    for name, a, b in zip(names, grads_k, grads_r):
        assert_same(a, b, *tol, what=f"gradient of {name}")


def ptx_by_entry(source, arch="compute_80"):
    """{entry point: its PTX} of source compiled by NVRTC (skips when NVRTC is not usable here)."""
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as exc:
        pytest.skip(f"NVRTC is not usable here ({exc!r})")
    from tinyvit.kernels.cuda import NVRTC_OPTIONS
    program = nvrtc.createProgram(source, "kernels.cu", [], [])
    try:
        nvrtc.compileProgram(program, [f"--gpu-architecture={arch}", *NVRTC_OPTIONS])
        ptx = nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    parts = re.split(r"(?=\.visible \.entry )", ptx)[1:]
    return {re.match(r"\.visible \.entry (\w+)", p).group(1): p for p in parts}


