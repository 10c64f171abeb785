"""Helpers the tests share: float64 inputs on a backend, comparisons with PyTorch, running the
`tinyvit` command in-process, and starting several ranks with mpirun."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import tinyvit as tv
from tinyvit.backend import to_numpy
from tinyvit.cli import main


def cli(capsys, *argv):
    """(exit status, stdout, stderr) of `tinyvit ARGV` run in-process."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:             # argparse and usage errors exit through parser.exit
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    """The error message, checked to be exactly one line (so no traceback either)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected a one-line error, got:\n{err}"
    return lines[0]


def param(xp, rng, *shape, scale=1.0, dtype=np.float64):
    """A Tensor with requires_grad=True filled with N(0, scale^2), on xp's device."""
    return tv.Tensor(xp.asarray(rng.standard_normal(shape) * scale, dtype=dtype), requires_grad=True)


def const(xp, array, dtype=None):
    """A Tensor that needs no gradient."""
    return tv.Tensor(xp.asarray(array if dtype is None else np.asarray(array, dtype=dtype)))


def assert_close(actual, expected, rtol, atol=0.0, what="value"):
    """np.testing.assert_allclose on host copies, with a name in the message."""
    actual = to_numpy(actual.data if isinstance(actual, tv.Tensor) else actual)   # (a CuPy array's .data is its pointer)
    expected = np.asarray(expected.detach().cpu().numpy() if hasattr(expected, "detach") else expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


def torch_parity(torch, ours_fn, torch_fn, arrays, dtype, rtol, atol=None, seed=1):
    """Run ``ours_fn`` (on tinyvit Tensors) and ``torch_fn`` (on torch tensors) on the same float
    ``arrays``, backpropagate the same random upstream gradient, and compare the output and the
    gradient of every input. ``arrays``: list of NumPy arrays (all get requires_grad)."""
    atol = (1e-10 if dtype == np.float64 else 1e-5) if atol is None else atol
    ours_in = [tv.Tensor(np.asarray(a, dtype=dtype), requires_grad=True) for a in arrays]
    theirs_in = [torch.tensor(np.asarray(a, dtype=dtype), requires_grad=True) for a in arrays]
    y = ours_fn(*ours_in)
    t = torch_fn(*theirs_in)
    assert_close(y, t, rtol, atol, what="forward")
    g = np.random.default_rng(seed).standard_normal(y.shape).astype(dtype)
    y.backward(g)
    t.backward(torch.tensor(g))
    for i, (a, b) in enumerate(zip(ours_in, theirs_in)):
        assert a.grad is not None, f"input {i} got no gradient"
        assert a.grad.dtype == dtype, f"input {i}: gradient dtype {a.grad.dtype} != {np.dtype(dtype)}"
        assert_close(a.grad, b.grad, rtol, atol, what=f"gradient of input {i}")


def _mpi_env():
    """The environment of ranks started by the tests: one BLAS thread each, no progress bars."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MPLBACKEND": "Agg", "TQDM_DISABLE": "1",
           # shared memory without the kernel's cross-process copies, which containers often forbid (ptrace)
           "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}
    if os.geteuid() == 0:                    # Open MPI refuses root unless told (CI runs as root)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def run_ranks(mpirun, n, *args, cwd=None, timeout=120):
    """(exit status, stdout, stderr) of `mpirun -n N python ARGS` on this machine. On a timeout the
    whole process group is killed (mpirun and its ranks) and the test fails: a hang is a bug."""
    cmd = [mpirun, "-n", str(n), "--oversubscribe", sys.executable, *[str(a) for a in args]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_mpi_env(),
                            cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`{' '.join(cmd)}` still running after {timeout} s (a rank waiting forever?):\n{err[-3000:]}")
    return proc.returncode, out, err
