"""docs/bench/gemms.py, the standalone GEMM microbenchmark (not part of the installed package, so
loaded here by its path): the products it records from a step, its direct OpenBLAS call, and its
report and command line on a tiny model. No timing is asserted."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyvit.bench import machine
from tinyvit.kernels.cpu import threads

SCRIPT = Path(__file__).resolve().parents[1] / "docs" / "bench" / "gemms.py"


@pytest.fixture(scope="module")
def gemms():
    spec = importlib.util.spec_from_file_location("tinyvit_docs_bench_gemms", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_records_the_products_of_a_step(gemms):
    # vit-mnist/4: D 128, depth 4, MLP 256, 7 x 7 patches of 1 x 4 x 4 + the class token = 50 tokens; batch 2.
    calls = gemms.record_products("vit-mnist/4", batch_size=2)
    rows, d, mlp, full = 2 * 50, 128, 256, 3          # the last of the 4 blocks computes class-token rows only
    product, gradient = gemms.PRODUCT, gemms.GRADIENT
    assert calls[product, rows, d, 3 * d] == full                # qkv
    assert calls[gradient, rows, d, 3 * d] == full               # its weight gradient
    assert calls[product, rows, 3 * d, d] == full                # its dL/dx
    assert calls[product, rows, d, mlp] == full + 1 + full       # fc1; the last block's k, v; fc2's dL/dx
    assert calls[gradient, rows, mlp, d] == full                 # fc2's weight gradient
    assert calls[product, 2, d, d] >= 1                          # the last block's class-token rows
    assert calls[gradient, 2 * 49, 16, d] == 1                   # the patch embedding's kernel
    # the recording is undone: every tinyvit module calls tinyvit's own functions again
    for module, name, fn in gemms.tinyvit_functions():
        assert fn.__module__.startswith("tinyvit."), f"{module.__name__}.{name} is still wrapped"
    assert threads.aligned_matmul.__module__ == "tinyvit.kernels.cpu.threads"


def test_direct_openblas_sgemm_adds_onto_c(gemms):
    sgemm = gemms.openblas_sgemm()
    if sgemm is None:
        assert not machine.blas_info().startswith("OpenBLAS"), "NumPy uses OpenBLAS, but its sgemm was not found"
        pytest.skip(f"NumPy's BLAS is {machine.blas_info()}, not an OpenBLAS")
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((7, 5), dtype=np.float32), rng.standard_normal((5, 3), dtype=np.float32)
    c = np.zeros((7, 3), np.float32)
    sgemm(False, a, b, c)
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-5)
    sgemm(False, a, b, c)                               # beta = 1: adds to what is there
    np.testing.assert_allclose(c, 2 * (a @ b), rtol=1e-5, atol=1e-5)
    x, g = rng.standard_normal((9, 4), dtype=np.float32), rng.standard_normal((9, 6), dtype=np.float32)
    w = np.zeros((4, 6), np.float32)
    sgemm(True, x, g, w)
    np.testing.assert_allclose(w, x.T @ g, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        sgemm(False, a, a, c)                           # (7, 5) @ (7, 5): would read past b


def test_report_on_a_tiny_model(gemms):
    before = threads._num_threads
    report = gemms.run_gemm_benchmark("vit-mnist/14", batch_size=2, threads=1, repeats=2)
    assert threads._num_threads == before               # thread settings put back
    assert report["threads"] == 1 and report["repeats"] == 2 and report["products"]
    assert report["date"] and "commit" in report and report["machine"]["cpu"]
    sides = set(report["per_step_s"])
    assert "numpy" in sides and "torch" not in sides
    for p in report["products"]:
        assert p["calls"] >= 1 and p["gflop"] == pytest.approx(2e-9 * p["rows"] * p["inner"] * p["cols"])
        assert set(p["seconds"]) == sides and all(t > 0 for t in p["seconds"].values())
    for side in sides:
        assert report["per_step_s"][side] == pytest.approx(sum(p["calls"] * p["seconds"][side]
                                                                for p in report["products"]))
    text = gemms.format_gemm_report(report)
    assert "per step: calls x median" in text and gemms.GRADIENT in text


def test_command_with_torch_and_json(gemms, torch, tmp_path, capsys):
    out = tmp_path / "gemms.json"
    assert gemms.main(["--compare", "torch", "--model", "vit-mnist/14", "--batch-size", "2", "--repeats", "1",
                       "--threads", "1", "--model-arg", "depth=1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "torch" in report["per_step_s"] and report["machine"]["torch"] == torch.__version__
    assert report["command"].startswith("python docs/bench/gemms.py --compare torch")
    assert "torch" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [(["--repeats", "0"], "repeats >= 1"),
                                            (["--model-arg", "depth"], "KEY=VALUE")])
def test_command_rejects_bad_settings(gemms, extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gemms.main(["--model", "vit-mnist/14", "--batch-size", "2", *extra])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_script_runs_on_its_own():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True)
    assert "usage: python docs/bench/gemms.py" in out.stdout and "--compare" in out.stdout
