"""kernels/cuda/record.py, the bookkeeping of kernels/cuda/passed.json, on the CPU: which test files
cover which ops (their OPS), the per-test results read from pytest's JUnit XML (fake reports, and one
real pytest run on generated test files), which ops passed, the merge into the record, and the whole
command with the GPU run replaced by a fake one. No GPU is needed; nothing here touches the real
passed.json or runs git.
"""
import json
import textwrap

import pytest

from tinyvit import kernels
from tinyvit.kernels.cuda import record

ENTRY = {"gpu": "NVIDIA H100 80GB HBM3", "cupy": "14.2.0", "cuda": "12.9", "driver": "575.57.08",
         "commit": "abc123", "date": "2025-01-01T00:00:00+00:00"}


# ---------------------------------------------------------------- which files cover which ops


def test_ops_of_reads_the_module_constant(tmp_path):
    path = tmp_path / "test_kernels_cuda_x.py"
    path.write_text('import pytest\nOPS = ["gelu", "gelu_tanh"]\n\ndef test_a():\n    OPS = ["not this"]\n')
    assert record.ops_of(path) == ["gelu", "gelu_tanh"]
    path.write_text("def test_a():\n    pass\n")
    assert record.ops_of(path) is None
    path.write_text("OPS = [1, 2]\n")
    with pytest.raises(ValueError, match="OPS must be a list of op names"):
        record.ops_of(path)


def test_every_cuda_kernel_has_gpu_tests_that_name_it():
    """Each op of the switchboard's CUDA table is named by the OPS of some
    tests/test_kernels_cuda_<module>.py (so the record command can record it), and every op a test
    file names is in the table."""
    files = record.test_files()
    named = {op for ops in files.values() for op in ops}
    assert set(kernels.CUDA_KERNELS) <= named, f"CUDA kernels no test file names: {set(kernels.CUDA_KERNELS) - named}"
    assert named <= set(kernels.CUDA_KERNELS), f"OPS naming no CUDA kernel: {named - set(kernels.CUDA_KERNELS)}"
    assert files["test_kernels_cuda_layernorm"] == ["layer_norm"]
    assert files["test_kernels_cuda_optim"] == ["optimizer_step"]
    assert "test_kernels_cuda_compile" not in files and "test_kernels_cuda_record" not in files


# ---------------------------------------------------------------- the JUnit report

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="7">
  <testcase classname="tests.test_kernels_cuda_layernorm" name="test_a[gpu-float32]" time="0.1"/>
  <testcase classname="tests.test_kernels_cuda_layernorm" name="test_a[gpu-float64]" time="0.1"/>
  <testcase classname="tests.test_kernels_cuda_layernorm.TestGroup" name="test_b[gpu]" time="0.1"/>
  <testcase classname="tests.test_kernels_cuda_gelu" name="test_c[gpu]" time="0.1">
    <failure message="AssertionError">assert 1 == 2</failure></testcase>
  <testcase classname="tests.test_kernels_cuda_gelu" name="test_d[gpu]" time="0.1"/>
  <testcase classname="tests.test_kernels_cuda_optim" name="test_e[gpu]" time="0.0">
    <skipped type="pytest.skip" message="no CUDA device">skip</skipped></testcase>
  <testcase classname="tests.test_kernels_cuda_optim" name="test_f[gpu]" time="0.0">
    <skipped type="pytest.skip" message="no CUDA device">skip</skipped></testcase>
  <testcase classname="" name="tests.test_kernels_cuda_broken" time="0.0">
    <error message="collection failure">ImportError</error></testcase>
  <testcase classname="tests.test_other" name="test_g" time="0.0"/>
</testsuite></testsuites>
"""
MODULES = ["test_kernels_cuda_layernorm", "test_kernels_cuda_gelu", "test_kernels_cuda_optim",
           "test_kernels_cuda_broken", "test_kernels_cuda_empty"]


def test_results_by_module_counts_each_outcome():
    """Passed, failed (failure or error, a collection error included), skipped, per test module,
    tests in classes counted with their module, other modules ignored."""
    counts = record.results_by_module(JUNIT, MODULES)
    assert counts == {
        "test_kernels_cuda_layernorm": {"passed": 3, "failed": 0, "skipped": 0},
        "test_kernels_cuda_gelu": {"passed": 1, "failed": 1, "skipped": 0},
        "test_kernels_cuda_optim": {"passed": 0, "failed": 0, "skipped": 2},
        "test_kernels_cuda_broken": {"passed": 0, "failed": 1, "skipped": 0},
        "test_kernels_cuda_empty": {"passed": 0, "failed": 0, "skipped": 0},
    }


def test_op_outcomes():
    """An op passed when no test of any file naming it failed and one passed; failed when one failed
    (even if another file naming it passed); not run when all its tests were skipped or none ran."""
    files = {"test_kernels_cuda_layernorm": ["layer_norm"], "test_kernels_cuda_gelu": ["gelu", "gelu_tanh"],
             "test_kernels_cuda_optim": ["optimizer_step"], "test_kernels_cuda_broken": ["attention"],
             "test_kernels_cuda_empty": ["cross_entropy"], "test_kernels_cuda_more": ["layer_norm", "gelu"]}
    counts = record.results_by_module(JUNIT, MODULES)
    assert record.op_outcomes(files, counts) == {
        "layer_norm": "passed", "gelu": "failed", "gelu_tanh": "failed", "optimizer_step": "not run",
        "attention": "failed", "cross_entropy": "not run"}
    counts["test_kernels_cuda_more"] = {"passed": 0, "failed": 1, "skipped": 0}
    assert record.op_outcomes(files, counts)["layer_norm"] == "failed"


def test_real_pytest_junit_report(tmp_path):
    """One real `pytest -m gpu --junitxml` run on generated test files (plain, parametrized, in a
    class, failing, skipped, not marked gpu, one that does not import): the report is read as it
    should be. This is the record command's own pytest invocation."""
    (tmp_path / "test_kernels_cuda_good.py").write_text(textwrap.dedent("""
        import pytest
        OPS = ["good_op"]
        gpu = pytest.mark.gpu

        @gpu
        @pytest.mark.parametrize("n", [1, 2])
        def test_plain(n):
            assert n

        @gpu
        class TestGroup:
            def test_in_class(self):
                pass

        @gpu
        def test_skipped():
            pytest.skip("not here")

        def test_not_gpu():
            assert False, "deselected by -m gpu"
    """))
    (tmp_path / "test_kernels_cuda_bad.py").write_text(textwrap.dedent("""
        import pytest
        OPS = ["bad_op"]

        @pytest.mark.gpu
        def test_fails():
            assert 1 == 2

        @pytest.mark.gpu
        def test_passes():
            pass
    """))
    (tmp_path / "test_kernels_cuda_broken.py").write_text('OPS = ["broken_op"]\nimport no_such_module\n')
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    files = record.test_files(tmp_path)
    assert files == {"test_kernels_cuda_bad": ["bad_op"], "test_kernels_cuda_broken": ["broken_op"],
                     "test_kernels_cuda_good": ["good_op"]}
    codes, counts = {}, {}
    for module in files:
        junit = tmp_path / f"junit_{module}.xml"
        codes[module] = record.run_pytest(tmp_path / f"{module}.py", junit, ["-q"], cwd=tmp_path)
        counts[module] = record.file_counts(module, codes[module], junit)
    assert codes == {"test_kernels_cuda_bad": 1, "test_kernels_cuda_broken": 1, "test_kernels_cuda_good": 0}
    assert counts["test_kernels_cuda_good"] == {"passed": 3, "failed": 0, "skipped": 1}
    assert counts["test_kernels_cuda_bad"] == {"passed": 1, "failed": 1, "skipped": 0}
    assert counts["test_kernels_cuda_broken"]["failed"] >= 1
    assert record.op_outcomes(files, counts) == {"good_op": "passed", "bad_op": "failed", "broken_op": "failed"}


def test_each_file_runs_in_its_own_process_with_launch_blocking_and_a_time_limit(tmp_path):
    """A file whose test never returns (a deadlocked kernel) is killed at its limit and fails its own
    ops only; CUDA_LAUNCH_BLOCKING=1 is set for the tests; a process-wide fault (here a module-level
    flag standing for a sticky CUDA error) stays in its file."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    (tmp_path / "test_kernels_cuda_hangs.py").write_text(textwrap.dedent("""
        import time, pytest
        OPS = ["hanging_op"]
        @pytest.mark.gpu
        def test_hangs():
            time.sleep(60)
    """))
    (tmp_path / "test_kernels_cuda_env.py").write_text(textwrap.dedent("""
        import os, sys, pytest
        OPS = ["env_op"]
        @pytest.mark.gpu
        def test_launch_blocking():
            assert os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"
        @pytest.mark.gpu
        def test_poison_this_process():
            sys.sticky_error = True          # what an illegal address does to a CUDA context
    """))
    (tmp_path / "test_kernels_cuda_later.py").write_text(textwrap.dedent("""
        import sys, pytest
        OPS = ["later_op"]
        @pytest.mark.gpu
        def test_not_poisoned():
            assert not getattr(sys, "sticky_error", False)
    """))
    hang = record.run_pytest(tmp_path / "test_kernels_cuda_hangs.py", tmp_path / "j1.xml", cwd=tmp_path, timeout=3)
    assert hang is None
    assert record.file_counts("test_kernels_cuda_hangs", hang, tmp_path / "j1.xml")["failed"] == 1
    for i, module in enumerate(["test_kernels_cuda_env", "test_kernels_cuda_later"]):
        junit = tmp_path / f"j{i + 2}.xml"
        code = record.run_pytest(tmp_path / f"{module}.py", junit, cwd=tmp_path, timeout=60)
        assert code == 0 and record.file_counts(module, code, junit) == {"passed": 1 + (i == 0), "failed": 0,
                                                                          "skipped": 0}


# ---------------------------------------------------------------- the record


def test_merge_replaces_this_gpus_entry_and_keeps_the_rest():
    old = {"layer_norm": [dict(ENTRY, commit="old"), dict(ENTRY, gpu="NVIDIA A100-SXM4-80GB")],
           "gelu": [dict(ENTRY, commit="old")],
           "gelu_tanh": [dict(ENTRY, gpu="NVIDIA A100-SXM4-80GB")],
           "optimizer_step": [dict(ENTRY, commit="old")]}
    snapshot = json.loads(json.dumps(old))
    outcomes = {"layer_norm": "passed", "gelu": "failed", "gelu_tanh": "failed", "optimizer_step": "not run",
                "new_op": "passed"}
    new = record.merge(old, outcomes, ENTRY)
    assert old == snapshot                                               # the input is not changed
    assert new == {
        "gelu_tanh": [dict(ENTRY, gpu="NVIDIA A100-SXM4-80GB")],         # failed here: A100's kept
        "layer_norm": [dict(ENTRY, gpu="NVIDIA A100-SXM4-80GB"), ENTRY],  # this GPU's entry replaced
        "new_op": [ENTRY],
        "optimizer_step": [dict(ENTRY, commit="old")],                   # not run: untouched
    }                                                                    # gelu: its only entry removed
    assert list(new) == sorted(new)


def test_version_numbers():
    assert record._version(12090) == "12.9" and record._version(13000) == "13.0" and record._version(11080) == "11.8"


@pytest.fixture
def fake_gpu_run(monkeypatch, tmp_path):
    """The record command with the GPU run faked: pytest "runs" by writing JUNIT (exit code 1: some
    tests failed), the machine, commit and date are ENTRY's; the tests directory is a copy of
    the OPS of the modules in JUNIT; the record goes to tmp_path/passed.json."""
    tests = tmp_path / "tests"
    tests.mkdir()
    for module, ops in {"test_kernels_cuda_layernorm": ["layer_norm"], "test_kernels_cuda_gelu": ["gelu", "gelu_tanh"],
                        "test_kernels_cuda_optim": ["optimizer_step"]}.items():
        (tests / f"{module}.py").write_text(f"OPS = {ops!r}\n")
    calls = []

    def fake_pytest(path, junit, extra=(), cwd=None, timeout=None):
        calls.append((path.name, list(extra), cwd))
        junit.write_text(JUNIT)
        return 1

    monkeypatch.setattr(record, "run_pytest", fake_pytest)
    monkeypatch.setattr(record, "cuda_device_present", lambda: True)
    monkeypatch.setattr(record, "machine", lambda: {k: ENTRY[k] for k in ("gpu", "cupy", "cuda", "driver")})
    monkeypatch.setattr(record, "commit", lambda repository=None: ENTRY["commit"])
    monkeypatch.setattr(record, "now", lambda: ENTRY["date"])
    output = tmp_path / "passed.json"
    return ["--tests", str(tests), "--output", str(output)], output, calls


def test_main_records_the_ops_that_passed(fake_gpu_run, capsys):
    args, output, calls = fake_gpu_run
    output.write_text(json.dumps({"gelu": [ENTRY], "other": [dict(ENTRY, gpu="A100")]}))
    assert record.main(args + ["--", "-x"]) == 1                         # gelu failed
    assert sorted(calls) == [(f"test_kernels_cuda_{m}.py", ["-x"], output.parent)     # one run per file,
                             for m in ("gelu", "layernorm", "optim")]                  # from the checkout's root
    assert json.loads(output.read_text()) == {"layer_norm": [ENTRY], "other": [dict(ENTRY, gpu="A100")]}
    out = capsys.readouterr().out
    assert "layer_norm passed" in out and "gelu failed" in out and "optimizer_step not run" in out


def test_main_dry_run_writes_nothing(fake_gpu_run):
    args, output, _ = fake_gpu_run
    assert record.main(args + ["--dry-run"]) == 1
    assert not output.exists()


def test_main_records_nothing_when_pytest_breaks_or_there_is_no_gpu(fake_gpu_run, monkeypatch):
    args, output, _ = fake_gpu_run
    monkeypatch.setattr(record, "run_pytest", lambda path, junit, extra=(), cwd=None, timeout=None: 2)  # Ctrl-C
    assert record.main(args) == 1 and not output.exists()
    monkeypatch.setattr(record, "cuda_device_present", lambda: False)
    assert record.main(args) == 2 and not output.exists()


def test_main_a_file_that_times_out_fails_its_ops_and_keeps_the_others(fake_gpu_run, monkeypatch):
    args, output, _ = fake_gpu_run

    def run(path, junit, extra=(), cwd=None, timeout=None):
        if "gelu" in path.name:
            return None                                   # killed at its time limit
        junit.write_text(JUNIT)
        return 1
    monkeypatch.setattr(record, "run_pytest", run)
    output.write_text(json.dumps({"gelu": [ENTRY], "gelu_tanh": [ENTRY]}))
    assert record.main(args) == 1
    assert json.loads(output.read_text()) == {"layer_norm": [ENTRY]}      # gelu's entries removed


# ---------------------------------------------------------------- the switchboard reads passed.json once


def test_passed_json_is_read_once_and_reloaded_on_demand(tmp_path, monkeypatch):
    """kernel_for asks on every op which CUDA kernels passed: passed.json is read at the first question
    and kept, so a change on disk shows only after reload_passed() (which the record command calls)."""
    from tinyvit import kernels
    from tinyvit.kernels import cuda
    path = tmp_path / "passed.json"
    path.write_text(json.dumps({"gelu": [ENTRY]}))
    monkeypatch.setattr(cuda, "RECORD", path)
    monkeypatch.setattr(cuda, "_passed", None, raising=False)
    reads = []
    original = type(path).read_text
    monkeypatch.setattr(type(path), "read_text", lambda self, *a, **k: reads.append(self) or original(self, *a, **k))
    for _ in range(3):
        assert set(kernels._cuda_passed()) == {"gelu"}
    assert reads == [path]
    path.write_text(json.dumps({"layer_norm": [ENTRY]}))
    assert set(kernels._cuda_passed()) == {"gelu"}
    assert set(cuda.reload_passed()) == {"layer_norm"} and set(kernels._cuda_passed()) == {"layer_norm"}


def test_main_reloads_what_it_wrote(fake_gpu_run, monkeypatch):
    from tinyvit.kernels import cuda
    args, output, _ = fake_gpu_run
    monkeypatch.setattr(cuda, "RECORD", output)
    monkeypatch.setattr(cuda, "_passed", {"stale": []})
    record.main(args)
    assert set(cuda.passed_kernels()) == {"layer_norm"}
