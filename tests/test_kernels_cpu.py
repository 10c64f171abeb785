"""The CPU kernels (tinyvit/kernels/cpu/) and the switchboard that picks them (tinyvit/kernels/__init__.py).

Every kernel is tested equal to its reference op (tinyvit/ops/): the output and the gradient of every
input, under a random upstream gradient, in float64 (rtol 1e-12) and float32, with the cache blocks
forced small so that small arrays span many blocks, on 1 and 2 threads. Those equality tests live in
one file per kernel module (test_kernels_cpu_<module>.py, threads.py's machinery in
test_kernels_cpu_threads.py), with what they share in kernel_checks.py and conftest.py (the
``small_blocks`` and ``num_threads`` fixtures); this file holds the meta-test that every kernel in CPU_KERNELS has
them (COVERED), the checks that span all kernels (a broadcast upstream gradient, blocks of the real
size on two threads) and the switchboard's tests.
"""
import importlib
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import tinyvit as tv
import tinyvit.functional as F
from tinyvit import kernels
from tinyvit.kernels import CPU_KERNELS, kernel_for, kernels_enabled, use_kernels
from tinyvit.kernels.cpu import attention as k_attention
from tinyvit.kernels.cpu import gelu as k_gelu
from tinyvit.kernels.cpu import layernorm as k_layernorm
from tinyvit.kernels.cpu import linear as k_linear
from tinyvit.ops import activation, attention, basic, norm, patch

from kernel_checks import F64, assert_kernel_equals_reference, cpu_kernel

TESTS = Path(__file__).resolve().parent

# ---------------------------------------------------------------- every kernel has equality tests

# op name in CPU_KERNELS -> the tests proving its kernel equal to the reference ("file::test").
# "encoder" is covered by tests/test_kernels_models.py (whole models, both paths).
COVERED = {
    "linear": ["test_kernels_cpu_linear.py::test_linear_equals_reference",
               "test_kernels_cpu_linear.py::test_linear_with_two_arguments_equals_reference",
               "test_kernels_cpu.py::test_kernels_take_a_broadcast_upstream_gradient"],
    "patch_embed": ["test_kernels_cpu_linear.py::test_patch_embed_equals_reference",
                    "test_kernels_cpu.py::test_kernels_take_a_broadcast_upstream_gradient"],
    "layer_norm": ["test_kernels_cpu_layernorm.py::test_layer_norm_equals_reference",
                   "test_kernels_cpu.py::test_kernels_take_a_broadcast_upstream_gradient"],
    "gelu": ["test_kernels_cpu_gelu.py::test_gelu_equals_reference",
             "test_kernels_cpu_gelu.py::test_gelu_with_bias_equals_reference_of_the_sum",
             "test_kernels_cpu.py::test_kernels_take_a_broadcast_upstream_gradient"],
    "gelu_tanh": ["test_kernels_cpu_gelu.py::test_gelu_equals_reference",
                  "test_kernels_cpu_gelu.py::test_gelu_with_bias_equals_reference_of_the_sum",
                  "test_kernels_cpu.py::test_kernels_take_a_broadcast_upstream_gradient"],
    "multi_head_attention": [
        "test_kernels_cpu_attention.py::test_attention_equals_reference",
        "test_kernels_cpu.py::test_kernels_take_a_broadcast_upstream_gradient",
        "test_kernels_cpu_attention.py::test_attention_map_alone_equals_reference",
        "test_kernels_cpu_attention.py::test_attention_one_input_at_a_time_equals_reference",
        "test_kernels_cpu_attention.py::test_fewer_outputs_equal_the_first_rows_of_the_reference"],
    "optimizer_step": ["test_kernels_cpu_optim.py::test_kernel_step_equals_the_plain_loop_bit_for_bit"],
}


def test_every_kernel_has_equality_tests():
    """Each op in CPU_KERNELS is listed in COVERED with tests that exist, are collected (module-level
    test_ functions of a tests/test_kernels_cpu*.py file) and name the op (the string "<op>" in the
    test's source, or the op among its parametrized values); no entry of COVERED is stale. A kernel
    added to CPU_KERNELS without tests fails here. (The cross-layer fusion, kernels.fuse, is tested
    in tests/test_kernels_fusion.py.)"""
    expected = set(CPU_KERNELS)
    assert set(COVERED) == expected, (f"kernels without equality tests: {sorted(expected - set(COVERED))}; "
                                      f"entries for no kernel: {sorted(set(COVERED) - expected)}")
    for name, specs in COVERED.items():
        assert specs, f"{name}: no tests listed"
        for spec in specs:
            file, function = spec.split("::")
            assert file.startswith("test_kernels_cpu") and (TESTS / file).is_file(), spec
            test = getattr(importlib.import_module(Path(file).stem), function, None)
            assert inspect.isfunction(test) and function.startswith("test_"), f"{spec}: no such test"
            parametrized = [v for mark in getattr(test, "pytestmark", []) if mark.name == "parametrize"
                            for v in mark.args[1]]
            assert f'"{name}"' in inspect.getsource(test) or name in parametrized, f"{spec} does not name the op {name!r}"


# ---------------------------------------------------------------- a broadcast upstream gradient

# op name -> (the reference Function, fn(Function) -> a function of the input Tensors, input shapes)
BROADCAST_CASES = {
    "linear": (basic.Linear, lambda f: f.apply, [(5, 3, 24), (24, 10), (10,)]),
    "patch_embed": (patch.PatchEmbed, lambda f: lambda i, w, b: f.apply(i, w, b, 4), [(3, 3, 8, 8), (48, 16), (16,)]),
    "layer_norm": (norm.LayerNorm, lambda f: lambda x, g, b: f.apply(x, g, b, 1e-6), [(5, 3, 24), (24,), (24,)]),
    "gelu": (activation.GELU, lambda f: f.apply, [(5, 3, 24)]),
    "gelu_tanh": (activation.GELUTanh, lambda f: f.apply, [(5, 3, 24)]),
    "multi_head_attention": (attention.MultiHeadAttention,
                             lambda f: lambda *t: f.apply(*t, 2, return_attention=True),
                             [(5, 4, 6), (6, 18), (18,), (6, 6), (6,)]),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", list(BROADCAST_CASES))
def test_kernels_take_a_broadcast_upstream_gradient(small_blocks, name, dtype):
    """Each kernel fed the gradient of y.sum(), which arrives as a read-only broadcast of 1 with zero
    strides (not a contiguous array), gives the reference's outputs and gradients: no kernel writes
    into its upstream gradient or assumes it contiguous. (The random upstream gradients are in the
    equality tests of each kernel; this is the memory layout alone.)"""
    reference, call, shapes = BROADCAST_CASES[name]
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(s) for s in shapes]
    n_out = 2 if name == "multi_head_attention" else 1
    tol = F64 if dtype == np.float64 else dict(rtol=1e-4, atol=1e-5)
    assert_kernel_equals_reference(call(cpu_kernel(name)), call(reference), arrays, ["sum"] * n_out, dtype,
                                   (tol["rtol"], tol["atol"]))


# ---------------------------------------------------------------- blocks of the real size among 2 threads

# name -> (kernel fn, reference fn, input shapes, number of outputs): arrays of several real blocks
# (BLOCK_ELEMENTS = 2^17 elements), so that NumPy releases the GIL inside each block's steps and the
# two threads really run at once (with the small blocks above they mostly take turns)
FULL_SIZE = {
    "layer_norm": (lambda x, g, b: k_layernorm.LayerNorm.apply(x, g, b, 1e-6),
                   lambda x, g, b: norm.LayerNorm.apply(x, g, b, 1e-6), [(6, 1000, 96), (96,), (96,)], 1),
    "add_layer_norm": (lambda x, r: k_layernorm.AddLayerNorm.apply(x, r, None, None, 1e-6),
                       lambda x, r: ((x + r), norm.LayerNorm.apply(x + r, None, None, 1e-6)),
                       [(6, 1000, 96), (6, 1000, 96)], 2),
    "gelu": (k_gelu.GELU.apply, activation.GELU.apply, [(4100, 96)], 1),
    "gelu with bias": (k_gelu.GELU.apply, lambda x, b: activation.GELU.apply(x + b), [(4100, 96), (96,)], 1),
    "gelu_tanh with bias": (k_gelu.GELUTanh.apply, lambda x, b: activation.GELUTanh.apply(x + b),
                            [(4100, 96), (96,)], 1),
    "multi_head_attention": (lambda *t: k_attention.MultiHeadAttention.apply(*t, 3, 0.1, True, return_attention=True),
                             lambda *t: attention.MultiHeadAttention.apply(*t, 3, 0.1, True, return_attention=True),
                             [(37, 65, 48), (48, 144), (144,), (48, 48), (48,)], 2),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", list(FULL_SIZE))
def test_real_blocks_on_two_threads_equal_reference(num_threads, name, dtype):
    """The element-wise kernels on arrays of several blocks of the real size (and a ragged last one),
    two threads at once: outputs and every gradient equal the reference's (attention: 37 samples, 5
    blocks of 8, with dropout from the same seed). Each thread's temporaries must be its own."""
    num_threads(2)
    kernel_fn, reference_fn, shapes, n_out = FULL_SIZE[name]
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal(s) for s in shapes]
    outs = [rng.standard_normal(shapes[0])] if n_out == 1 else [rng.standard_normal(shapes[0]), None]
    if name == "add_layer_norm":
        outs[1] = rng.standard_normal(shapes[0])
    if name == "multi_head_attention":
        outs[1] = rng.standard_normal((37, 3, 65, 65))

    def seeded(fn):
        return lambda *t: (tv.manual_seed(5), fn(*t))[1]

    tol = F64 if dtype == np.float64 else dict(rtol=1e-4, atol=1e-5)
    assert_kernel_equals_reference(seeded(kernel_fn), seeded(reference_fn), arrays, outs, dtype,
                                   (tol["rtol"], tol["atol"]))


# ---------------------------------------------------------------- the switchboard


def test_use_kernels_as_a_context_manager_and_as_a_call():
    """``with use_kernels(False)`` turns the kernels off inside the block only (also when the block
    raises); ``use_kernels(False)`` as a call turns them off until turned on again. Off, kernel_for
    answers None for every op."""
    x = np.ones((2, 3), np.float32)
    assert tv.use_kernels is use_kernels
    with use_kernels(True):
        assert kernels_enabled() and kernel_for("gelu", x) is k_gelu.GELU
        with use_kernels(False):
            assert not kernels_enabled()
            assert all(kernel_for(name, x) is None for name in CPU_KERNELS)
        assert kernels_enabled()
        with pytest.raises(RuntimeError, match="inside"):
            with use_kernels(False):
                raise RuntimeError("inside")
        assert kernels_enabled()
        use_kernels(False)
        try:
            assert not kernels_enabled() and kernel_for("layer_norm", x) is None
        finally:
            use_kernels(True)
        assert kernels_enabled() and kernel_for("layer_norm", x) is k_layernorm.LayerNorm


@pytest.mark.parametrize("bad", [0, 1, "off", "ALL", None])
def test_use_kernels_wants_a_bool_or_all(bad):
    """use_kernels(0) or ("off") is a TypeError, and leaves the setting as it was."""
    before = kernels_enabled()
    with pytest.raises(TypeError, match="expected True, False or 'all'"):
        use_kernels(bad)
    assert kernels_enabled() == before


@pytest.mark.parametrize("value,enabled", [("0", False), ("off", False), (" OFF ", False), ("false", False),
                                           ("no", False), ("1", True), ("on", True), ("", True), (None, True)])
def test_environment_words(monkeypatch, value, enabled):
    """TINYVIT_KERNELS: 0, off, false, no (any case, spaces around) turn the kernels off; anything else,
    or no variable, leaves them on."""
    if value is None:
        monkeypatch.delenv("TINYVIT_KERNELS", raising=False)
    else:
        monkeypatch.setenv("TINYVIT_KERNELS", value)
    assert kernels._from_environment() is enabled


@pytest.mark.parametrize("value,expected", [("0", "False tinyvit.ops.norm"), (None, "True tinyvit.kernels.cpu.layernorm")])
def test_environment_variable_at_import(value, expected):
    """A fresh process started with TINYVIT_KERNELS=0 has the kernels off (kernels_enabled() False and
    F.layer_norm computed by the reference); without the variable, on (the kernel)."""
    env = {k: v for k, v in os.environ.items() if k != "TINYVIT_KERNELS"}
    if value is not None:
        env["TINYVIT_KERNELS"] = value
    code = ("import numpy as np, tinyvit, tinyvit.functional as F; from tinyvit.kernels import kernels_enabled; "
            "y = F.layer_norm(tinyvit.Tensor(np.ones((2, 3)), requires_grad=True), None, None); "
            "print(kernels_enabled(), type(y._ctx).__module__)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == expected


def _calls(x32):
    """(op name, a call of the functional API that records the op on x32, kernel class, reference class)."""
    rng = np.random.default_rng(0)
    w = lambda *s: tv.Tensor(rng.standard_normal(s).astype(x32.dtype), requires_grad=True)  # noqa: E731
    images = tv.Tensor(rng.standard_normal((2, 3, 4, 4)).astype(x32.dtype), requires_grad=True)
    return [
        ("linear", lambda: F.linear(x32, w(6, 4), w(4)), k_linear.Linear, basic.Linear),
        ("patch_embed", lambda: F.patch_embed(images, w(12, 5), w(5), 2), k_linear.PatchEmbed, patch.PatchEmbed),
        ("layer_norm", lambda: F.layer_norm(x32, w(6), w(6)), k_layernorm.LayerNorm, norm.LayerNorm),
        ("gelu", lambda: F.gelu(x32), k_gelu.GELU, activation.GELU),
        ("gelu_tanh", lambda: F.gelu(x32, approximate="tanh"), k_gelu.GELUTanh, activation.GELUTanh),
        ("multi_head_attention", lambda: F.multi_head_attention(x32, w(6, 18), w(18), w(6, 6), w(6), 2),
         k_attention.MultiHeadAttention, attention.MultiHeadAttention),
    ]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_functional_dispatches_to_the_kernel_or_the_reference(dtype):
    """tinyvit.functional records the kernel Function (the class CPU_KERNELS names) when kernels are on
    and the array dtype is float32 or float64, and the reference Function when they are off; float16
    (no kernel) gets the reference either way. Checked on the Function each output's _ctx holds."""
    x = tv.Tensor(np.random.default_rng(1).standard_normal((2, 3, 6)).astype(dtype), requires_grad=True)
    for name, call, kernel_cls, reference_cls in _calls(x):
        assert cpu_kernel(name) is kernel_cls, name
        for enabled in (True, False):
            with use_kernels(enabled):
                y = call()
            want = kernel_cls if enabled and dtype != np.float16 else reference_cls
            assert type(y._ctx) is want, f"{name}, kernels {'on' if enabled else 'off'}: {type(y._ctx)}"
            assert y.dtype == dtype


def test_optimizer_step_dispatches_to_the_kernel(monkeypatch):
    """Optimizer.step hands its (parameter, gradient, state, group) items to kernels/cpu/optim.py's step
    when kernels are on, and updates them in its own loop when they are off."""
    from tinyvit.kernels.cpu import optim as k_optim
    seen = []
    real = k_optim.step
    monkeypatch.setattr(k_optim, "step", lambda items, update: (seen.append(len(items)), real(items, update)))
    ps = [tv.Parameter(np.ones(3)), tv.Parameter(np.ones((2, 2)))]
    opt = tv.optim.SGD(ps, lr=0.5)
    for enabled in (True, False):
        for p in ps:
            p.grad = np.ones(p.shape)
        with use_kernels(enabled):
            opt.step()
    assert seen == [2]                                   # once, with both parameters, kernels on only
    np.testing.assert_array_equal(ps[1].data, 0.0)       # and both steps happened: 1 - 0.5 - 0.5


def test_no_kernel_for_other_dtypes_or_no_arrays():
    """kernel_for answers a kernel only when every array is float32 or float64 (None entries ignored):
    not for float16, integers, a float16 among float32s, Python numbers or no array at all."""
    f32, f64 = np.ones((2, 3), np.float32), np.ones((2, 3))
    for name in CPU_KERNELS:
        assert kernel_for(name, f32) is not None and kernel_for(name, f64, None) is not None, name
        for arrays in [(f32.astype(np.float16),), (np.ones(3, np.int64),), (f32, f32.astype(np.float16)),
                       (f32, np.ones(3, np.int32)), (2.0,), (), (None,)]:
            assert kernel_for(name, *arrays) is None, f"{name} for {arrays!r}"


def test_arrays_of_another_module_get_the_cuda_table(monkeypatch):
    """Arrays that are not NumPy's (CuPy's) never get a CPU kernel: kernel_for looks them up in
    CUDA_KERNELS, and gives one only when kernels/cuda/passed.json records that its GPU tests passed,
    or when the setting is "all"; everything else falls back to the reference."""
    fake_cupy = types.SimpleNamespace(__name__="cupy")
    monkeypatch.setattr(kernels, "get_array_module", lambda *arrays: fake_cupy)
    monkeypatch.setattr(kernels, "_load", lambda package, where: (package, where))
    monkeypatch.setattr(kernels, "CUDA_KERNELS", {"layer_norm": "layernorm:LayerNorm", "gelu": "gelu:GELU"})
    monkeypatch.setattr(kernels, "_cuda_passed", lambda: {"gelu": [{"gpu": "H100"}]})
    x = np.ones((2, 3), np.float32)
    for name in CPU_KERNELS:
        assert kernel_for(name, x) == (("cuda", "gelu:GELU") if name == "gelu" else None), name
    with use_kernels("all"):
        assert kernel_for("layer_norm", x) == ("cuda", "layernorm:LayerNorm")
        assert kernel_for("gelu", x) == ("cuda", "gelu:GELU")
        assert kernel_for("linear", x) is None
    with use_kernels(False):
        assert kernel_for("gelu", x) is None


def test_cupy_arrays_get_no_cpu_kernel(xp):
    """Real arrays of each backend: NumPy's get the CPU kernels, CuPy's none but the CUDA kernels whose
    GPU tests are recorded as passed (kernels/cuda/passed.json)."""
    from tinyvit.kernels.cuda import passed_kernels
    x = xp.ones((2, 3), dtype=xp.float32)
    for name in CPU_KERNELS:
        if xp is np:
            assert kernel_for(name, x) is cpu_kernel(name), name
        else:
            recorded = name in kernels.CUDA_KERNELS and name in passed_kernels()
            assert (kernel_for(name, x) is None) == (not recorded), name
