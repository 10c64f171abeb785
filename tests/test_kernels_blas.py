"""tinyvit.kernels.cpu.blas: OpenBLAS's thread timeout applied at run time, whatever the import order.

The real library is only touched in fresh subprocesses that import NumPy first (the case the module
exists for); in this process the library lookup is replaced by fakes, so the tests never restart the
BLAS threads of the test run itself."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tinyvit.kernels.cpu import blas

ROOT = Path(__file__).resolve().parents[1]
BLAS_FILE = ROOT / "tinyvit" / "kernels" / "cpu" / "blas.py"


def _numpy_uses_openblas() -> bool:
    try:
        return "openblas" in np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"].lower()
    except Exception:
        return False


needs_openblas = pytest.mark.skipif(not (sys.platform.startswith("linux") and _numpy_uses_openblas()),
                                    reason="NumPy is not linked to OpenBLAS on Linux here")


def _run(code: str, **env) -> dict:
    """Run ``code`` in a fresh interpreter (OPENBLAS_THREAD_TIMEOUT unset unless given) and return
    the JSON object it prints last."""
    environ = {k: v for k, v in os.environ.items() if k != blas.ENV}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# NumPy first, then blas.py loaded from its file alone (it needs nothing of tinyvit), so that nothing
# set OPENBLAS_THREAD_TIMEOUT before OpenBLAS loaded. spin() is the CPU time the process burns while
# its main thread sleeps right after a GEMM: an idle OpenBLAS worker that spins (the default, ~0.1 s)
# shows up there; one that sleeps at once does not.
_PRELUDE = f"""
    import numpy as np
    import importlib.util, json, os, time
    spec = importlib.util.spec_from_file_location("blas_alone", {str(BLAS_FILE)!r})
    blas = importlib.util.module_from_spec(spec); spec.loader.exec_module(blas)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2048, 192)).astype(np.float32)
    b = rng.standard_normal((192, 576)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)

    def spin():
        burned = []
        for _ in range(3):
            a @ b
            c = time.process_time(); time.sleep(0.25); burned.append(time.process_time() - c)
        return min(burned)
"""


@needs_openblas
def test_numpy_imported_first_gets_the_timeout_at_run_time():
    out = _run(_PRELUDE + """
    before = blas.thread_timeouts()
    spin_before = spin()
    first = blas.configure_blas_threads()
    after = blas.thread_timeouts()
    spin_after = spin()
    second = blas.configure_blas_threads()
    print(json.dumps(dict(before=list(before.values()), after=list(after.values()), first=first,
                          second=second, env=os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
                          spin_before=spin_before, spin_after=spin_after,
                          correct=bool(np.allclose(a @ b, want, rtol=1e-4, atol=1e-3)))))
    """)
    assert out["before"] and set(out["before"]) == {0}   # OpenBLAS loaded without the variable
    assert out["first"] == blas.APPLIED
    assert set(out["after"]) == {blas.DEFAULT_THREAD_TIMEOUT}
    assert out["second"] == blas.ALREADY                  # safe to call again: nothing restarted
    assert out["env"] == str(blas.DEFAULT_THREAD_TIMEOUT)
    assert out["correct"]                                 # the restarted threads compute right
    # The workers now sleep at once: no CPU burned while the main thread sleeps after a GEMM
    # (before, an idle worker spun ~0.1 s when the machine had a core for it).
    assert out["spin_after"] < 0.04, out


@needs_openblas
def test_a_value_set_before_numpy_is_kept_and_an_explicit_one_applied():
    out = _run(_PRELUDE + """
    kept = blas.configure_blas_threads()
    read = list(blas.thread_timeouts().values())
    explicit = blas.configure_blas_threads(5)
    print(json.dumps(dict(kept=kept, read=read, explicit=explicit,
                          after=list(blas.thread_timeouts().values()),
                          correct=bool(np.allclose(a @ b, want, rtol=1e-4, atol=1e-3)))))
    """, OPENBLAS_THREAD_TIMEOUT="6")
    assert out["kept"] == blas.ALREADY and set(out["read"]) == {6}
    assert out["explicit"] == blas.APPLIED and set(out["after"]) == {5}
    assert out["correct"]


@needs_openblas
@pytest.mark.parametrize("first", ["numpy", "tinyvit"])
def test_through_tinyvit_the_first_cpu_kernel_applies_the_timeout(first):
    """Whichever of NumPy and tinyvit is imported first: `import tinyvit` touches neither OpenBLAS
    (its threads keep the timeout they loaded with, none) nor the environment, and does not load the
    CPU kernels; the first CPU kernel the switchboard picks applies the timeout, so that from the
    first step on the idle workers sleep at once after each GEMM (no CPU burned while the main
    thread sleeps), in either order alike. Two BLAS threads, so that there is a worker to spin."""
    second = "tinyvit" if first == "numpy" else "numpy"
    code = _PRELUDE.replace("import numpy as np\n", f"import {first}\n    import {second}\n    import numpy as np\n", 1)
    out = _run(code + """
    import sys
    import tinyvit
    import tinyvit.functional as F
    before = dict(read=list(blas.thread_timeouts().values()), env=os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
                  kernels_loaded="tinyvit.kernels.cpu" in sys.modules)
    y = F.gelu(F.linear(tinyvit.Tensor(a, requires_grad=True), b))   # the first CPU kernels (float32)
    kernel = type(y._ctx).__module__
    after = dict(read=list(blas.thread_timeouts().values()), env=os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
                 spin=spin(), again=blas.configure_blas_threads(),
                 correct=bool(np.allclose(a @ b, want, rtol=1e-4, atol=1e-3)))
    print(json.dumps(dict(before=before, after=after, kernel=kernel)))
    """, OPENBLAS_NUM_THREADS="2")
    assert out["before"] == dict(read=[0], env=None, kernels_loaded=False), out
    assert out["kernel"] == "tinyvit.kernels.cpu.gelu", out
    after = out["after"]
    assert set(after["read"]) == {blas.DEFAULT_THREAD_TIMEOUT} and after["env"] == str(blas.DEFAULT_THREAD_TIMEOUT)
    assert after["again"] == blas.ALREADY and after["correct"]
    assert after["spin"] < 0.04, out


@needs_openblas
def test_the_loaded_openblas_is_found():
    paths = blas.openblas_library_paths()
    assert paths and all("openblas" in os.path.basename(p).lower() for p in paths)
    assert blas.thread_timeouts()                          # its openblas_thread_timeout answers


# ---------------------------------------------------------------- no-ops, in this process (fakes)


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(blas.ENV, raising=False)            # restored after the test
    return monkeypatch


def test_no_openblas_loaded_is_a_no_op(env):
    env.setattr(blas, "_loaded_library_paths", lambda: ["/usr/lib/libmkl_rt.so", "/lib/libc.so.6"])
    assert blas.configure_blas_threads() == blas.NO_OPENBLAS
    assert blas.ENV not in os.environ                      # nothing touched
    env.setattr(blas, "_loaded_library_paths", lambda: [])  # macOS Accelerate, unreadable maps...
    assert blas.configure_blas_threads() == blas.NO_OPENBLAS
    assert blas.thread_timeouts() == {}


def test_a_path_that_is_not_loaded_is_not_loaded_now(env):
    env.setattr(blas, "_loaded_library_paths", lambda: ["/nonexistent/libopenblas.so.0"])
    assert blas.configure_blas_threads() == blas.UNSUPPORTED
    assert blas.thread_timeouts() == {}


def test_windows_is_a_no_op(env):
    env.setattr(blas.sys, "platform", "win32")
    env.setattr(blas, "_loaded_library_paths", lambda: pytest.fail("looked for libraries"))
    assert blas.configure_blas_threads() == blas.UNSUPPORTED


class FakeOpenBLAS:
    """The functions configure_blas_threads calls, as Python functions (which take the restype and
    argtypes it sets), with OpenBLAS's behaviour: the timeout is what openblas_read_env read."""

    def __init__(self, parallel=1, read_at_load=0, prefix=""):
        self.calls, self.read = [], read_at_load
        setattr(self, f"{prefix}openblas_get_parallel", self._fn(lambda: parallel))
        self.openblas_thread_timeout = self._fn(lambda: self.read)
        self.openblas_read_env = self._fn(self._read_env)
        self.blas_thread_shutdown_ = self._fn(lambda: self.calls.append("shutdown") or 0)
        self.blas_thread_init = self._fn(lambda: self.calls.append("init") or 0)

    @staticmethod
    def _fn(f):
        def fn():
            return f()
        return fn

    def _read_env(self):
        self.calls.append("read_env")
        value = os.environ.get("OPENBLAS_THREAD_TIMEOUT", "")
        self.read = int(value) if value.isdigit() else 0


def _use(monkeypatch, *libs):
    paths = [f"/fake/libopenblas{i}.so" for i in range(len(libs))]
    monkeypatch.setattr(blas, "openblas_library_paths", lambda: paths)
    monkeypatch.setattr(blas, "open_loaded", lambda path: libs[int(path[len("/fake/libopenblas"):-3])])


def test_restarts_the_threads_after_re_reading_the_environment(env):
    lib = FakeOpenBLAS()
    _use(env, lib)
    assert blas.configure_blas_threads() == blas.APPLIED
    assert lib.calls == ["read_env", "shutdown", "init"] and lib.read == blas.DEFAULT_THREAD_TIMEOUT
    assert os.environ[blas.ENV] == str(blas.DEFAULT_THREAD_TIMEOUT)
    assert blas.configure_blas_threads() == blas.ALREADY and len(lib.calls) == 3  # no second restart


def test_the_environment_value_wins_and_every_openblas_is_configured(env):
    env.setenv(blas.ENV, "7")
    first, second = FakeOpenBLAS(read_at_load=7), FakeOpenBLAS(prefix="scipy_", read_at_load=0)
    second.scipy_openblas_get_parallel64_ = second.scipy_openblas_get_parallel  # the wheels' name
    del second.scipy_openblas_get_parallel
    _use(env, first, second)
    assert blas.configure_blas_threads() == blas.APPLIED
    assert first.calls == [] and second.calls == ["read_env", "shutdown", "init"] and second.read == 7


def test_openmp_or_incomplete_openblas_is_left_alone(env):
    openmp = FakeOpenBLAS(parallel=2)
    incomplete = FakeOpenBLAS()
    del incomplete.openblas_read_env                      # an OpenBLAS too old to re-read
    _use(env, openmp, incomplete)
    assert blas.configure_blas_threads() == blas.UNSUPPORTED
    assert openmp.calls == [] and incomplete.calls == []


@pytest.mark.parametrize("bad", [0, 31, -1, True, "4", 4.0])
def test_rejects_a_timeout_out_of_range(bad):
    with pytest.raises(ValueError):
        blas.configure_blas_threads(bad)
