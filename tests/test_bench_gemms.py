"""`tinyvit bench --gemms` (tinyvit.bench_gemms): the products it records from a step, its direct
OpenBLAS call, and its report on a tiny model. No timing is asserted."""
import json

import numpy as np
import pytest

from tinyvit import bench, bench_gemms
from tinyvit.cli import main
from tinyvit.ops import attention, basic, common, patch


def test_records_the_products_of_a_step():
    # vit-mnist/4: D 128, depth 4, MLP 256, 7 x 7 patches of 1 x 4 x 4 + the class token = 50 tokens; batch 2.
    calls = bench_gemms.record_products("vit-mnist/4", batch_size=2)
    rows, d, mlp, full = 2 * 50, 128, 256, 3          # the last of the 4 blocks computes class-token rows only
    product, gradient = bench_gemms.PRODUCT, bench_gemms.GRADIENT
    assert calls[product, rows, d, 3 * d] == full                # qkv
    assert calls[gradient, rows, d, 3 * d] == full               # its weight gradient
    assert calls[product, rows, 3 * d, d] == full                # its dL/dx
    assert calls[product, rows, d, mlp] == full + 1 + full       # fc1; the last block's k, v; fc2's dL/dx
    assert calls[gradient, rows, mlp, d] == full                 # fc2's weight gradient
    assert calls[product, 2, d, d] >= 1                          # the last block's class-token rows
    assert calls[gradient, 2 * 49, 16, d] == 1                   # the patch embedding's kernel
    # the recording is undone: the ops call tinyvit's own functions again
    assert attention.aligned_matmul is common.aligned_matmul and basic.aligned_matmul is common.aligned_matmul
    assert attention.weight_gradient is basic.weight_gradient and patch.weight_gradient is basic.weight_gradient


def test_direct_openblas_sgemm_adds_onto_c():
    sgemm = bench_gemms.openblas_sgemm()
    if sgemm is None:
        assert not bench.blas_info().startswith("OpenBLAS"), "NumPy uses OpenBLAS, but its sgemm was not found"
        pytest.skip(f"NumPy's BLAS is {bench.blas_info()}, not an OpenBLAS")
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


def test_report_on_a_tiny_model():
    threads = common._num_threads
    report = bench_gemms.run_gemm_benchmark("vit-mnist/14", batch_size=2, threads=1, repeats=2)
    assert common._num_threads == threads               # thread settings put back
    assert report["threads"] == 1 and report["repeats"] == 2 and report["products"]
    sides = set(report["per_step_s"])
    assert "numpy" in sides and "torch" not in sides
    for p in report["products"]:
        assert p["calls"] >= 1 and p["gflop"] == pytest.approx(2e-9 * p["rows"] * p["inner"] * p["cols"])
        assert set(p["seconds"]) == sides and all(t > 0 for t in p["seconds"].values())
    for side in sides:
        assert report["per_step_s"][side] == pytest.approx(sum(p["calls"] * p["seconds"][side]
                                                                for p in report["products"]))
    text = bench_gemms.format_gemm_report(report)
    assert "per step: calls x median" in text and bench_gemms.GRADIENT in text


def test_command_with_torch_and_json(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "gemms.json"
    assert main(["bench", "--gemms", "--compare", "torch", "--model", "vit-mnist/14", "--batch-size", "2",
                 "--steps", "1", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "torch" in report["per_step_s"] and report["machine"]["torch"]
    assert "--gemms" in report["command"] and "torch" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [(["--device", "cuda"], "float32 CPU products"),
                                            (["--dtype", "float64"], "float32 CPU products"),
                                            (["--rounds", "2"], "drop --device, --dtype, --tf32 and --rounds"),
                                            (["--steps", "0"], "steps >= 1")])
def test_command_rejects_what_it_cannot_time(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--gemms", "--model", "vit-mnist/14", "--batch-size", "2", *extra])
    assert exc.value.code == 2 and message in capsys.readouterr().err
