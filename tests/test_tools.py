"""The scripts in tools/ that a GPU session or a lesson refresh runs by hand still work (on the CPU)."""
import importlib.util
import sys
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_step_profile_times_every_op_of_a_step():
    """tools/step_profile.py: the fused step's ops and the optimizer appear with positive host times,
    the wrapped methods are put back afterwards, and the printed table names them."""
    profile = _load("step_profile")
    from tinyvit.autograd import Function
    from tinyvit.kernels.cpu.attention import MultiHeadAttention
    before = {cls: dict(vars(cls)) for cls in profile.function_classes()}
    result = profile.profile("vit-mnist/7", batch_size=4, steps=1, warmup=1)
    ops = {(r["op"], r["phase"]) for r in result["rows"]}
    assert ("kernels.cpu.attention.MultiHeadAttention", "forward") in ops
    assert ("kernels.cpu.attention.MultiHeadAttention", "backward") in ops
    assert ("optimizer", "AdamW.step") in ops
    assert all(r["host_ms"] >= 0 and r["calls_per_step"] > 0 for r in result["rows"])
    assert result["step_ms"] > 0 and result["gpu"] is None
    assert vars(MultiHeadAttention)["forward"] is before[MultiHeadAttention]["forward"], "forward not restored"
    assert issubclass(MultiHeadAttention, Function)
    text = profile.format_profile(result)
    assert "MultiHeadAttention" in text and "ms per step" in text
    assert np.isfinite(result["step_ms"])
