"""Shared fixtures: the array backend (NumPy; the CuPy stand-in; CuPy when a CUDA device is present)
and torch.

Tests take an ``xp`` argument to run once per backend:

    cpu      numpy
    standin  the CPU stand-in for CuPy (tests/cupy_standin): CuPy's types, names, signatures and
             refusals computed by NumPy, so every ``xp is not np`` branch runs everywhere, CI too
    gpu      cupy on a CUDA device; carries the ``gpu`` marker, so ``pytest -m gpu`` runs exactly
             the GPU half and a machine without a GPU reports why it skipped

A test that only real CuPy can run (CUDA kernels, memory pools, timings) is marked
``@pytest.mark.no_standin("why")``: its stand-in run skips, saying why.
"""
import os

import numpy as np
import pytest

import cupy_standin
from kernel_checks import SMALL_BLOCK, SMALL_SAMPLES


def _cuda_available():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


CUDA = _cuda_available()

BACKENDS = {
    "cpu": pytest.param("numpy", id="cpu"),
    "standin": pytest.param("standin", id="standin", marks=pytest.mark.skipif(
        not cupy_standin.available(), reason="the CuPy stand-in takes its names from the cupy package, "
        "which is not installed (pip install 'tinyvit[cuda-compile]'; no GPU needed)")),
    "gpu": pytest.param("cupy", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not CUDA, reason="no CUDA device with CuPy here (pip install 'tinyvit[gpu]' on a GPU machine)")]),
}


@pytest.fixture(params=list(BACKENDS.values()))
def xp(request, monkeypatch):
    """numpy; the CuPy stand-in (installed as tinyvit's CuPy for the test); or cupy on a CUDA machine."""
    if request.param == "numpy":
        return np
    if request.param == "standin":
        marker = request.node.get_closest_marker("no_standin")
        if marker:
            pytest.skip(f"real CuPy only: {marker.args[0] if marker.args else 'needs a GPU'}")
        return cupy_standin.install(monkeypatch)
    import cupy
    return cupy


def pytest_configure(config):
    config.addinivalue_line("markers", "no_standin(reason): runs on NumPy and real CuPy only, not on "
                            "the CuPy stand-in (it needs a real GPU: CUDA kernels, memory pools, timings)")


# ---------------------------------------------------------------- the two paths: kernels and reference


def pytest_generate_tests(metafunc):
    """A test module that sets BOTH_PATHS = True runs each of its tests twice: with the kernels
    (tinyvit/kernels/, the default) and with the reference ops alone (tinyvit/ops/)."""
    if getattr(metafunc.module, "BOTH_PATHS", False) and "kernel_path" in metafunc.fixturenames:
        metafunc.parametrize("kernel_path", ["kernels", "reference"], indirect=True)


@pytest.fixture(autouse=True)
def kernel_path(request):
    """'kernels' or 'reference': which implementation the switchboard (tinyvit.functional) picks
    during the test. Kernels unless the module asks for both paths (BOTH_PATHS)."""
    from tinyvit.kernels import use_kernels
    path = getattr(request, "param", "kernels")
    with use_kernels(path == "kernels"):
        yield path


# ---------------------------------------------------------------- the CPU kernels' blocks and threads


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def small_blocks(request, monkeypatch):
    """Cache blocks forced small (threads.BLOCK_ELEMENTS = 64 elements, attention.SAMPLES_PER_BLOCK = 2
    samples), so that the small arrays of a test span many blocks and a ragged last one, shared among
    1 or 2 threads (the parameter; the thread count and block sizes are restored afterwards)."""
    from tinyvit.kernels.cpu import attention as k_attention, threads
    monkeypatch.setattr(threads, "BLOCK_ELEMENTS", SMALL_BLOCK)
    monkeypatch.setattr(k_attention, "SAMPLES_PER_BLOCK", SMALL_SAMPLES)
    previous = threads._num_threads
    threads.set_num_threads(request.param)
    yield request.param
    threads.set_num_threads(previous)


@pytest.fixture
def num_threads():
    """threads.set_num_threads, with the previous setting restored after the test."""
    from tinyvit.kernels.cpu import threads
    previous = threads._num_threads
    yield threads.set_num_threads
    threads.set_num_threads(previous)



@pytest.fixture
def torch():
    """PyTorch, the independent reference. Skips when it is not installed, unless
    TINYVIT_REQUIRE_TORCH=1 (set by CI), where a missing torch is a failure, not a silent skip."""
    try:
        import torch as _torch
    except ImportError:
        if os.environ.get("TINYVIT_REQUIRE_TORCH") == "1":
            pytest.fail("TINYVIT_REQUIRE_TORCH=1 but torch is not installed (pip install 'tinyvit[reference]')")
        pytest.skip("torch is not installed (pip install 'tinyvit[reference]')")
    _torch.set_num_threads(max(1, os.cpu_count() or 1))
    return _torch


@pytest.fixture
def mpirun():
    """The path of Open MPI's mpirun, for tests that start several ranks (with this interpreter,
    which must import mpi4py). Skips when either is missing, unless TINYVIT_REQUIRE_MPI=1 (set by
    CI), where a missing one is a failure, not a silent skip."""
    import importlib.util
    import shutil
    missing = [what for what, found in (("mpirun (apt-get install openmpi-bin libopenmpi-dev)", shutil.which("mpirun")),
                                        ("mpi4py (pip install 'tinyvit[mpi]')", importlib.util.find_spec("mpi4py")))
               if not found]
    if missing:
        if os.environ.get("TINYVIT_REQUIRE_MPI") == "1":
            pytest.fail(f"TINYVIT_REQUIRE_MPI=1 but {' and '.join(missing)} missing")
        pytest.skip(f"data-parallel tests need {' and '.join(missing)}")
    return shutil.which("mpirun")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# ---------------------------------------------------------------- the end of a run: skips by reason


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line per reason for skipping, with its count, instead of pytest's one line per test
    location (``-rs``): a run without PyTorch or a GPU skips thousands of parametrised cases for a
    handful of reasons, and the reader wants the reasons. Failures and errors keep pytest's own report."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or "s" in (config.option.reportchars or "").replace("a", "s").replace("A", "s"):
        return                                        # none, or the user asked for pytest's own list (-rs/-ra)
    counts = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        counts[reason] = counts.get(reason, 0) + 1
    terminalreporter.section("skipped, by reason", sep="-")
    for reason, n in sorted(counts.items(), key=lambda item: -item[1]):
        terminalreporter.line(f"{n:6d}  {reason}")
    terminalreporter.line("(pytest -rs lists every skipped test)")
