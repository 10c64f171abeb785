"""`tinyvit bench` (tinyvit/bench/): the record's fields on a tiny model (1 warmup + 1 timed step),
the kernels on, off and both, the PyTorch side, the JSON records, and the command. No timing is
asserted: speed is measured by running the command, never by tests."""
import datetime
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import tinyvit.kernels
from tinyvit import bench
from tinyvit.bench import machine
from tinyvit.cli import main
from tinyvit.kernels import kernels_enabled, use_kernels
from tinyvit.kernels.cpu import threads

TINY = dict(dim=16, depth=1, num_heads=2, mlp_dim=32)
TINY_ARGS = ["--model", "vit-cifar/8", "--batch-size", "2", "--warmup", "0", "--steps", "1", "--peak-tflops", "1"] + [
    f"--model-arg={k}={v}" for k, v in TINY.items()]


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


# ====================================================================== the record


def test_record_fields():
    report = _run()
    assert report["model"] == "vit-cifar/8" and report["config"]["dim"] == 16
    assert report["batch_size"] == 4 and report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["threads"] >= 1 and report["peak_source"] == "given" and report["peak_tflops"] == 1.0
    assert report["train_flops_per_image"] > 0 and report["parameters"] > 0
    assert report["kernels"] == "on" and report["sides"] == ["tinyvit_fused", "tinyvit"] and report["compare"] is None
    _check_side(report["tinyvit_fused"], steps=1)
    _check_side(report["tinyvit"], steps=1)
    assert "torch" not in report and "ratio" not in report and "readability_price" not in report
    text = bench.format_report(report)
    assert "tinyvit, fused" in text and "tinyvit, per-op kernels" in text
    # where, when and what: the date in UTC, the commit (None outside a git checkout), the machine
    date = datetime.datetime.fromisoformat(report["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert report["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", report["commit"])
    assert report["command"] is None                     # the CLI fills it in
    m = report["machine"]
    assert m["cpu"] and m["cpu_count"] >= 1 and m["cpu_threads_available"] >= 1 and m["numpy"] == np.__version__
    assert {"gpus", "torch", "cupy", "blas", "numpy_build", "python", "os", "env"} <= set(m)
    assert m["blas"] and isinstance(m["numpy_build"], dict)
    json.dumps(report)                                    # JSON-ready as it is


def _kernel_loads(monkeypatch):
    """Count the kernels the switchboard hands out (tinyvit.kernels._load runs once per kernel used)."""
    loads = []
    real = tinyvit.kernels._load

    def counting(package, where):
        loads.append(where)
        return real(package, where)
    monkeypatch.setattr(tinyvit.kernels, "_load", counting)
    return loads


def test_kernels_off_runs_the_reference_ops(monkeypatch):
    loads = _kernel_loads(monkeypatch)
    report = _run(kernels="off")
    assert report["kernels"] == "off" and report["sides"] == ["tinyvit_reference"] and loads == []
    _check_side(report["tinyvit_reference"], steps=1)
    assert "tinyvit, reference ops" in bench.format_report(report)
    assert kernels_enabled()                               # the switch is back as it was
    _run(kernels="on")
    assert loads, "with the kernels on the step used none"


def test_kernels_both_give_the_same_losses_and_the_price_of_readability():
    report = _run(kernels="both", rounds=2)
    assert report["sides"] == ["tinyvit_fused", "tinyvit", "tinyvit_reference"]
    fast, per_op, plain = report["tinyvit_fused"], report["tinyvit"], report["tinyvit_reference"]
    for side in (fast, per_op, plain):
        _check_side(side, steps=2)
    # the same model, weights and batch: the three paths compute the same numbers
    np.testing.assert_allclose(fast["losses"], plain["losses"], rtol=1e-5)
    np.testing.assert_allclose(per_op["losses"], plain["losses"], rtol=1e-5)
    assert report["readability_price"] == pytest.approx(plain["step_time_s"] / fast["step_time_s"])
    assert report["fusion_gain"] == pytest.approx(per_op["step_time_s"] / fast["step_time_s"])
    assert report["readability_round_ratios"] == pytest.approx(
        [plain["step_times_s"][i] / fast["step_times_s"][i] for i in range(2)])
    text = bench.format_report(report)
    assert "price of readability" in text and "in each round" in text


def test_kernels_default_follows_the_switch():
    with use_kernels(False):
        assert _run()["kernels"] == "off"
        assert not kernels_enabled()
    assert _run(kernels=True)["kernels"] == "on"
    with pytest.raises(ValueError, match="kernels"):
        _run(kernels="sometimes")


def test_threads_and_dtype_are_applied_and_restored():
    before = threads.get_num_threads()
    report = _run(threads=1, dtype="float64")
    assert report["threads"] == 1 and report["dtype"] == "float64"
    assert report["blas_threads"] in (1, None)          # None: a BLAS whose threads cannot be set
    assert threads.get_num_threads() == before


def test_compare_torch(torch):
    report = _run(compare="torch", rounds=2, kernels="both")
    assert report["sides"] == ["tinyvit_fused", "tinyvit", "tinyvit_reference", "torch"]
    for side in report["sides"]:
        _check_side(report[side], steps=2)
    assert report["ratio"] == pytest.approx(report["tinyvit_fused"]["step_time_s"] / report["torch"]["step_time_s"])
    for side in report["sides"][:-1]:
        assert report[side]["ratio_to_torch"] == pytest.approx(report[side]["step_time_s"]
                                                               / report["torch"]["step_time_s"])
    assert report["torch"]["attention"] == "explicit" and report["torch"]["torch_version"] == torch.__version__
    # the same model, weights, batch and optimizer: the same losses, step after step
    np.testing.assert_allclose(report["tinyvit_fused"]["losses"], report["torch"]["losses"], rtol=1e-4)
    np.testing.assert_allclose(report["tinyvit"]["losses"], report["torch"]["losses"], rtol=1e-4)
    np.testing.assert_allclose(report["tinyvit_reference"]["losses"], report["torch"]["losses"], rtol=1e-4)
    # one step per round here: each round's ratio is that round's two steps
    tiny, ref = report["tinyvit_fused"]["step_times_s"], report["torch"]["step_times_s"]
    assert report["round_ratios"] == pytest.approx([tiny[0] / ref[0], tiny[1] / ref[1]])
    text = bench.format_report(report)
    assert "ratio (tinyvit, fused step time / torch step time)" in text and "ratio in each round: " in text


def test_compare_torch_with_the_kernels_off_compares_the_reference(torch):
    report = _run(compare="torch", kernels="off", torch_attention="sdpa")
    assert report["sides"] == ["tinyvit_reference", "torch"] and report["torch"]["attention"] == "sdpa"
    assert report["ratio"] == pytest.approx(report["tinyvit_reference"]["step_time_s"]
                                            / report["torch"]["step_time_s"])
    np.testing.assert_allclose(report["tinyvit_reference"]["losses"], report["torch"]["losses"], rtol=1e-4)


def test_round_ratios_are_each_rounds_medians():
    """Round i's ratio is the median of one side's steps in round i over the median of the other's."""
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
    with pytest.raises(ValueError, match="compare"):
        _run(compare="jax")


# ====================================================================== records on disk, the commit


def test_records_are_named_by_date_commit_and_name_and_never_replaced(tmp_path):
    report = {"date": "2026-05-09T07:35:25+00:00", "commit": "f9de1fb87f98" + "0" * 28, "model": "vit-cifar/4",
              "device": "cpu", "dtype": "float32", "kernels": "both", "compare": "torch"}
    assert bench.record_name(report) == "2026-05-09-f9de1fb-vit-cifar-4-cpu-float32-kernels-both-vs-torch.json"
    assert bench.record_name(dict(report, commit=None), "my run/2") == "2026-05-09-nocommit-my-run-2.json"
    first = bench.write_record(report, tmp_path / "records", "x")
    second = bench.write_record(report, tmp_path / "records", "x")
    assert first.name == "2026-05-09-f9de1fb-x.json" and second.name == "2026-05-09-f9de1fb-x-2.json"
    assert json.loads(first.read_text()) == json.loads(second.read_text()) == report


def test_git_commit_is_read_from_the_git_folder(tmp_path):
    sha, other = "a" * 40, "b" * 40
    repo = tmp_path / "repo"
    (repo / ".git" / "refs" / "heads").mkdir(parents=True)
    (repo / "src").mkdir()
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert machine.git_commit(repo / "src") is None        # a branch with no commit yet
    (repo / ".git" / "packed-refs").write_text(f"# pack-refs with: peeled\n{other} refs/heads/main\n")
    assert machine.git_commit(repo / "src") == other
    (repo / ".git" / "refs" / "heads" / "main").write_text(sha + "\n")
    assert machine.git_commit(repo / "src") == sha          # a loose ref wins over the packed one
    (repo / ".git" / "HEAD").write_text(other + "\n")        # detached
    assert machine.git_commit(repo) == other
    outside = tmp_path / "plain"
    outside.mkdir()
    if machine._git_dir(outside) is None:                   # unless tmp itself lies in a checkout
        assert machine.git_commit(outside) is None


# ====================================================================== the command


def test_cli_writes_json_and_records(tmp_path, capsys):
    out, records = tmp_path / "bench.json", tmp_path / "records"
    assert main(["bench", *TINY_ARGS, "--kernels", "both", "--json", str(out), "--record", str(records),
                 "--record-name", "tiny"]) == 0
    report = json.loads(out.read_text())
    assert report["batch_size"] == 2 and report["kernels"] == "both" and report["tinyvit"]["step_time_s"] > 0
    assert report["command"].startswith("tinyvit bench ") and "--kernels both" in report["command"]
    [path] = records.iterdir()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-([0-9a-f]{7}|nocommit)-tiny\.json", path.name)
    assert json.loads(path.read_text()) == report
    text = capsys.readouterr().out
    assert "step (median)" in text and "price of readability" in text and str(path) in text


def test_cli_kernels_off_and_the_command_that_repeats_it(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY_ARGS, "--kernels", "off", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sides"] == ["tinyvit_reference"] and report["threads"] == 1
    again = tmp_path / "again.json"
    words = report["command"].split()[2:]                   # drop "tinyvit bench"
    assert main(["bench", *words, "--json", str(again)]) == 0
    repeated = json.loads(again.read_text())
    assert repeated["command"] == report["command"] and repeated["config"] == report["config"]


@pytest.mark.parametrize("extra, message", [(["--tf32"], "tf32"),
                                            (["--record-name", "x"], "--record"),
                                            (["--steps", "0"], "steps >= 1")])
def test_cli_rejects_bad_settings(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *TINY_ARGS, *extra])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--gemms"], ["--kernels", "maybe"]])
def test_cli_has_no_such_options(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *flag])
    assert exc.value.code == 2
    capsys.readouterr()


def test_tinyvit_bench_does_not_import_torch():
    """PyTorch is an optional extra: the package, its bench and the command load without it."""
    code = "import sys, tinyvit, tinyvit.bench, tinyvit.cli.bench; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_compare_makes_pytorch_threads_sleep_when_idle(torch):
    """With --compare torch in a fresh process, PyTorch is loaded with OMP_WAIT_POLICY=PASSIVE
    (unless set), and the record says so."""
    code = ("import json; from tinyvit.bench import run_benchmark; "
            "r = run_benchmark(model='vit-cifar/4', model_args=dict(dim=16, depth=1, num_heads=2, mlp_dim=32), "
            "batch_size=2, steps=1, warmup=0, compare='torch', peak_tflops=1.0); "
            "import os; print(json.dumps([r['machine']['env'].get('OMP_WAIT_POLICY'), os.environ['OMP_WAIT_POLICY']]))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["PASSIVE", "PASSIVE"]


# ====================================================================== the PyTorch reference ViT


@pytest.mark.parametrize("case", [dict(pool="token", posemb="learned-1d"),
                                  dict(pool="gap", posemb="learned-2d", representation_size=6),
                                  dict(pool="token", posemb="sincos-2d", qkv_bias=False),
                                  dict(pool="gap", posemb="none", gelu_approximate="tanh")],
                         ids=lambda c: f"{c['pool']}-{c['posemb']}")
def test_load_tinyvit_weights_gives_the_same_logits(torch, case):
    """The bench's weight copy (load_tinyvit_weights) makes the reference compute tinyvit's logits,
    in float64; sdpa attention gives the same numbers as the explicit one."""
    import tinyvit as tv
    from tinyvit.backend import default_dtype
    from tinyvit.bench.torch_vit import TorchViT, load_tinyvit_weights
    from tinyvit.models import ViT, ViTConfig
    tv.manual_seed(0)
    with default_dtype(np.float64):
        model = ViT(ViTConfig(image_size=8, patch_size=4, num_classes=3, dim=8, depth=2, num_heads=2, mlp_dim=12,
                              **case))
    for p in model.parameters():                            # random everywhere, the zero head included
        p.data[...] = np.random.default_rng(p.data.size).standard_normal(p.data.shape) * 0.5
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8))
    with tv.no_grad():
        expected = model.eval()(tv.Tensor(x)).numpy()
    for attention in ("explicit", "sdpa"):
        ref = TorchViT.from_config(model.config, attention=attention).double().eval()
        load_tinyvit_weights(ref, model)
        with torch.no_grad():
            np.testing.assert_allclose(ref(torch.tensor(x)).numpy(), expected, rtol=1e-9, atol=1e-11)
    with pytest.raises(ValueError, match="sdpa"):
        ref(torch.tensor(x), return_attention=True)
