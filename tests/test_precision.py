"""--precision fp32|tf32 (train and bench) and backend.matmul_precision: TF32 only where it exists
(CuPy on an NVIDIA GPU), the setting restored after the block, bad values one clear line."""
import sys
import types

import numpy as np
import pytest

from tinyvit import backend
from tinyvit.cli import main
from tinyvit.training import TrainConfig


def test_tf32_on_the_cpu_is_a_usage_error(capsys):
    """NumPy has no TF32: asking for it without --device cuda fails at once, naming the fix."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--dataset", "synthetic", "--precision", "tf32", "--epochs", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--precision tf32 needs --device cuda" in err[0]


def test_bf16_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="bf16 is not supported yet: CuPy has no bfloat16 dtype"):
        TrainConfig(dataset="synthetic", precision="bf16").resolved()
    assert TrainConfig(dataset="synthetic", precision="tf32", device="cuda").resolved().precision == "tf32"


def test_fp32_without_cupy_touches_nothing(monkeypatch):
    """On a CPU run (CuPy not in use by tinyvit) fp32 is a no-op that never imports CuPy's internals."""
    monkeypatch.setattr(backend, "_cupy", None)
    monkeypatch.setitem(sys.modules, "cupy._core._routines_linalg", None)   # an import would fail
    with backend.matmul_precision("fp32"):
        pass
    with pytest.raises(ValueError, match="precision must be one of"):
        with backend.matmul_precision("fp16"):
            pass


def test_tf32_sets_cupys_compute_type_and_restores_it(monkeypatch):
    """tf32 switches CuPy's float32 matmuls to its TF32 compute type inside the block only."""
    calls = []
    linalg = types.SimpleNamespace(COMPUTE_TYPE_DEFAULT=1, COMPUTE_TYPE_TF32=7, current=3)
    linalg.get_compute_type = lambda dtype: linalg.current
    linalg.set_compute_type = lambda dtype, value: calls.append((np.dtype(dtype), value))
    core = types.SimpleNamespace(_routines_linalg=linalg)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(_core=core))   # CuPy need not be installed
    monkeypatch.setitem(sys.modules, "cupy._core", core)
    monkeypatch.setitem(sys.modules, "cupy._core._routines_linalg", linalg)
    monkeypatch.setattr(backend, "_cupy", types.SimpleNamespace())
    with backend.matmul_precision("tf32"):
        assert calls == [(np.dtype(np.float32), 7)]
    assert calls[-1] == (np.dtype(np.float32), 3)            # the setting before the block
    calls.clear()
    with backend.matmul_precision("fp32"):
        assert calls == [(np.dtype(np.float32), 1)]
    assert calls[-1] == (np.dtype(np.float32), 3)
