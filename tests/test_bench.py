"""`tinyvit bench` (tinyvit.bench): the report's fields on a tiny model, 1 warmup + 1 timed step.
No timing is asserted: speed is measured by running the command, never by tests."""
import json
import os

import numpy as np
import pytest

from tinyvit import bench
from tinyvit.cli import main

TINY = dict(dim=16, depth=1, num_heads=2, mlp_dim=32)


def _run(**kwargs):
    return bench.run_benchmark(model="vit-cifar/8", batch_size=4, warmup=1, steps=1, model_args=TINY,
                               peak_tflops=1.0, **kwargs)


def _check_side(side, steps):
    assert side["step_time_s"] > 0 and side["cpu_time_s"] >= 0
    assert len(side["step_times_s"]) == steps
    assert side["images_per_s"] == pytest.approx(4 / side["step_time_s"])
    assert side["peak_memory_bytes"] >= 0 and side["memory_method"] in ("rss-peak", "maxrss-growth")
    assert side["tflops"] > 0 and side["mfu"] == pytest.approx(side["tflops"] / 1.0)
    assert len(side["losses"]) == 1 + steps and all(np.isfinite(side["losses"]))


def test_report_fields():
    report = _run()
    assert report["model"] == "vit-cifar/8" and report["config"]["dim"] == 16
    assert report["batch_size"] == 4 and report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["threads"] >= 1 and report["peak_source"] == "given" and report["peak_tflops"] == 1.0
    assert report["train_flops_per_image"] > 0 and report["parameters"] > 0
    _check_side(report["tinyvit"], steps=1)
    assert "torch" not in report and "ratio" not in report
    assert "tinyvit" in bench.format_report(report)


def test_threads_and_dtype_are_applied_and_restored():
    from tinyvit.ops import common
    before = common.get_num_threads()
    report = _run(threads=1, dtype="float64")
    assert report["threads"] == 1 and report["dtype"] == "float64"
    assert report["blas_threads"] in (1, None)          # None: a BLAS whose threads cannot be set
    assert common.get_num_threads() == before


def test_compare_torch(torch):
    report = _run(compare="torch", rounds=2)
    _check_side(report["tinyvit"], steps=2)
    _check_side(report["torch"], steps=2)
    assert report["ratio"] == pytest.approx(report["tinyvit"]["step_time_s"] / report["torch"]["step_time_s"])
    assert report["torch"]["attention"] == "explicit" and report["torch"]["torch_version"] == torch.__version__
    # the same model, weights, batch and optimizer: the same losses, step after step
    np.testing.assert_allclose(report["tinyvit"]["losses"], report["torch"]["losses"], rtol=1e-4)
    assert "ratio" in bench.format_report(report)
    # one step per round here: each round's ratio is that round's two steps
    tiny, ref = report["tinyvit"]["step_times_s"], report["torch"]["step_times_s"]
    assert report["round_ratios"] == pytest.approx([tiny[0] / ref[0], tiny[1] / ref[1]])
    assert "ratio in each round: " in bench.format_report(report)


def test_round_ratios_are_each_rounds_medians():
    """Round i's ratio is the median of tinyvit's steps in round i over the median of PyTorch's."""
    tiny = [1.0, 3.0, 2.0, 5.0, 4.0, 6.0, 9.0, 1.0, 1.0]
    ref = [2.0, 2.0, 2.0, 4.0, 4.0, 5.0, 1.0, 2.0, 4.0]
    assert bench.round_ratios(tiny, ref, 3) == [1.0, 1.25, 0.5]
    assert bench.round_ratios(tiny[:3], ref[:3], 3) == [1.0]


def test_invalid_settings_are_rejected():
    with pytest.raises(ValueError, match="tf32"):
        _run(tf32=True)
    with pytest.raises(ValueError, match="dtype"):
        _run(dtype="float16")
    with pytest.raises(ValueError, match="steps"):
        _run(rounds=0)


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", "vit-cifar/8", "--batch-size", "2", "--warmup", "0", "--steps", "1",
            "--peak-tflops", "1", "--json", str(out)] + [f"--model-arg={k}={v}" for k, v in TINY.items()]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["batch_size"] == 2 and report["tinyvit"]["step_time_s"] > 0
    assert report["command"].startswith("tinyvit ")
    assert "step (median)" in capsys.readouterr().out


def test_cli_rejects_tf32_on_cpu(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--tf32", "--steps", "1"])
    assert exc.value.code == 2
    assert "tf32" in capsys.readouterr().err


# ---------------------------------------------------------------- the threaded, cache-blocked ops


def _grads_of(fn, arrays, upstream):
    import tinyvit as tv
    ts = [tv.Tensor(a, requires_grad=True) for a in arrays]
    y = fn(*ts)
    y.backward(upstream)
    return [y.numpy()] + [t.grad for t in ts]


@pytest.mark.parametrize("op", ["layer_norm", "gelu", "attention"])
def test_threads_give_the_same_numbers(op):
    """The element-wise blocks are split among threads; each block is computed the same way, so the
    results must not depend on the thread count (several blocks per thread here)."""
    from tinyvit import functional as F
    from tinyvit.ops import common
    rng = np.random.default_rng(0)
    b, n, d = 24, 65, 96                      # LayerNorm: 1560 rows of 96, several row blocks
    x = rng.standard_normal((b, n, d)).astype(np.float32)
    if op == "layer_norm":
        fn, arrays = (lambda x, w, c: F.layer_norm(x, w, c)), [x, rng.standard_normal(d).astype(np.float32),
                                                               rng.standard_normal(d).astype(np.float32)]
    elif op == "gelu":
        x = rng.standard_normal((b, n, 4 * d)).astype(np.float32) * 3
        fn, arrays = F.gelu, [x]
    else:
        w = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in ((d, 3 * d), (3 * d,), (d, d), (d,))]
        fn, arrays = (lambda *a: F.multi_head_attention(*a, num_heads=3)), [x, *w]
    upstream = rng.standard_normal(fn(*arrays).shape).astype(np.float32)
    before = common._num_threads
    try:
        common.set_num_threads(1)
        serial = _grads_of(fn, arrays, upstream)
        common.set_num_threads(3)
        threaded = _grads_of(fn, arrays, upstream)
    finally:
        common.set_num_threads(before)
    for s, t in zip(serial, threaded):
        np.testing.assert_array_equal(s, t)


def test_for_each_block_nested_and_ordered():
    from tinyvit.ops import common
    before = common._num_threads
    try:
        common.set_num_threads(2)
        inner = lambda i: common.for_each_block(lambda j: 10 * i + j, list(range(3)))   # noqa: E731
        assert common.for_each_block(inner, list(range(5))) == [[10 * i + j for j in range(3)] for i in range(5)]
        with pytest.raises(ValueError):
            common.set_num_threads(0)
    finally:
        common.set_num_threads(before)


def test_retain_freed_memory_keeps_a_freed_array_resident():
    """After retain_freed_memory, a freed 64 MiB array stays in the process (glibc), where by default
    glibc unmaps it at once. Run in a child process: the setting is process-wide and irreversible."""
    import platform
    import subprocess
    import sys
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the setting applies to glibc's malloc only")
    child = """
import sys, numpy as np
from tinyvit.ops.common import retain_freed_memory
def resident_mib():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
if sys.argv[1] == 'retain':
    assert retain_freed_memory()
before = resident_mib()
a = np.ones(16 << 20, np.float32)   # 64 MiB, touched
del a
print(resident_mib() - before)
"""
    kept = {mode: float(subprocess.run([sys.executable, "-c", child, mode], capture_output=True, text=True,
                                       check=True).stdout) for mode in ("retain", "default")}
    assert kept["retain"] > 48, kept
    assert kept["default"] < 16, kept


def test_import_sets_openblas_thread_timeout_unless_set():
    """`import tinyvit` asks OpenBLAS's idle threads to sleep at once (before NumPy loads), and
    leaves a value the user set alone."""
    import os
    import subprocess
    import sys
    code = "import os, tinyvit; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "4"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OPENBLAS_THREAD_TIMEOUT": "28"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "28"


def test_compare_makes_pytorch_threads_sleep_when_idle(torch):
    """With --compare torch in a fresh process, PyTorch is loaded with OMP_WAIT_POLICY=PASSIVE
    (unless set), and the report says so."""
    import subprocess
    import sys
    code = ("import json; from tinyvit.bench import run_benchmark; "
            "r = run_benchmark(model='vit-cifar/4', model_args=dict(dim=16, depth=1, num_heads=2, mlp_dim=32), "
            "batch_size=2, steps=1, warmup=0, compare='torch', peak_tflops=1.0); "
            "import os; print(json.dumps([r['machine']['env'].get('OMP_WAIT_POLICY'), os.environ['OMP_WAIT_POLICY']]))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["PASSIVE", "PASSIVE"]
