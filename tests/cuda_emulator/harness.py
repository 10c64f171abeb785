"""What the emulated kernel tests share (tests/test_kernels_cuda_emulated.py, tests/test_cuda_emulator.py):
every kernels/cuda module's SOURCE compiled once per session, a fixture that makes a module launch
its kernels in the emulator, and the comparison of a kernel with its reference."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kernel_checks import assert_same, forward_backward
from tinyvit.kernels.cuda import attention as k_attention
from tinyvit.kernels.cuda import gelu as k_gelu
from tinyvit.kernels.cuda import layernorm as k_layernorm
from tinyvit.kernels.cuda import loss as k_loss
from tinyvit.kernels.cuda import optim as k_optim

from . import emulator

MODULES = {"layernorm": k_layernorm, "gelu": k_gelu, "attention": k_attention, "loss": k_loss, "optim": k_optim}
TOL = {np.float64: (1e-10, 1e-12), np.float32: (2e-5, 2e-6)}        # (rtol, atol relative to max |want|)
DTYPES = [np.float64, np.float32]

# A test that runs a deliberately broken kernel: a sanitized run (sanitize.py) would stop at its report.
plain_only = pytest.mark.skipif(emulator.sanitizer() is not None,
                                reason="runs a deliberately broken kernel, which a sanitizer stops the run at")


@pytest.fixture(scope="session")
def libraries(tmp_path_factory):
    """Every module's SOURCE compiled once per session (in parallel) for the emulator: ({name: Library},
    the build directory, shared by the test files that use this)."""
    reason = emulator.unavailable_reason()
    if reason:
        pytest.skip(f"CUDA emulation needs g++ with C++20: {reason}")
    build_dir = tmp_path_factory.getbasetemp() / "cuda_emulator"
    with ThreadPoolExecutor(len(MODULES)) as pool:
        built = pool.map(lambda m: emulator.build(m.SOURCE, build_dir), MODULES.values())
        return dict(zip(MODULES, built)), build_dir


@pytest.fixture
def emulate(libraries, monkeypatch):
    """emulate(name): module kernels/cuda/<name> launching its kernels in the emulator; returns the
    Emulation (its log lists the launches)."""
    def patch(name, library=None):
        module = MODULES[name]
        emulation = emulator.Emulation(library or libraries[0][name])
        monkeypatch.setattr(module, "kernel", emulation.kernel)
        monkeypatch.setattr(module, "get_array_module", lambda *a: emulator.nan_numpy)
        if name == "attention":
            monkeypatch.setattr(module, "max_shared_bytes", lambda: emulator.OPTIN_LIMIT)
        return emulation
    return patch


def compare(kernel_fn, reference_fn, arrays, upstream, dtype, what, tol=None):
    """Outputs and input gradients of kernel_fn and reference_fn equal within TOL (or tol); prints the
    largest difference relative to max(1, max |reference|)."""
    tol = tol or TOL
    outs_k, grads_k = forward_backward(kernel_fn, arrays, upstream, dtype)
    outs_r, grads_r = forward_backward(reference_fn, arrays, upstream, dtype)
    assert len(outs_k) == len(outs_r)
    worst = 0.0
    pairs = [(f"output {i}", a, b) for i, (a, b) in enumerate(zip(outs_k, outs_r))]
    pairs += [(f"gradient {i}", a, b) for i, (a, b) in enumerate(zip(grads_k, grads_r))]
    for name, a, b in pairs:
        assert_same(a, b, *tol[dtype], what=f"{what} {np.dtype(dtype).name}: {name}")
        if a is not None and a.size:
            worst = max(worst, float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max())))
    print(f"{what} {np.dtype(dtype).name}: max scaled difference {worst:.2e}")
