"""The CUDA emulator's sanitizer builds (TINYVIT_EMULATOR_SANITIZE=thread|address, run through
tests/cuda_emulator/sanitize.py) catch what the plain emulator catches only by chance:

    ThreadSanitizer     attention_forward without the __syncthreads at the top of its loop over key
                        tiles (a fast warp overwrites the tile slower ones still read): a data race,
                        reported in every run (5 of 5); the plain emulator's results came out wrong
                        in 3 of 8 runs (only when the threads' timing lets a warp run ahead)
    AddressSanitizer    load_rows without its `row < tokens ?` guard (rows past the last token read
                        from beyond the q, k, v buffer): an invalid read (past the buffer's end, or
                        into a block freed before), every run; the plain emulator's results came out
                        wrong in 1 of 8 (only when a NaN lies there)

and stay silent on the kernels as they are. Each case is one emulated attention forward and backward
(tests/cuda_emulator/mutants.py: B = 1, N = 40, one head of 8) in a process of its own with the
sanitizer's runtime preloaded, two at a time. The two defects run always, CI included (about 40 s of
CPU, 20 s on two cores, nearly all of it compiling the two instrumented builds; each run stops at its
first report); the clean runs of the intact kernels (about 40 s more) with
TINYVIT_SANITIZER_CLEAN_RUNS=1. The whole emulated suite under a sanitizer is an opt-in run, too slow
for CI: `python tests/cuda_emulator/sanitize.py thread|address` (ThreadSanitizer: 4 minutes for the
emulated tests but those of several tiles, on two busy cores, no report; AddressSanitizer: all of
them in 3.5 minutes, no report).
"""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cuda_emulator import emulator, sanitize

ROOT = Path(__file__).resolve().parents[1]
CASES = {   # (sanitizer, mutant): what its report must say, or None for a clean run
    ("thread", "missing-barrier"): "WARNING: ThreadSanitizer: data race",
    ("address", "unbounded-load"): "ERROR: AddressSanitizer: ",     # heap-buffer-overflow, or heap-use-after-free
}                                                                    # when the read lands in a freed block
if os.environ.get("TINYVIT_SANITIZER_CLEAN_RUNS") == "1":
    CASES.update({("thread", "intact"): None, ("address", "intact"): None})


def _runtime_missing():
    if emulator.unavailable_reason():
        return emulator.unavailable_reason()
    for name in sanitize.RUNTIMES:
        try:
            sanitize.environment(name)
        except SystemExit as exc:
            return str(exc)
    return None


def run_case(sanitizer, mutant):
    env = sanitize.environment(sanitizer)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OPENBLAS_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, str(ROOT / "tests" / "cuda_emulator" / "mutants.py"), mutant],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def results():
    """The runs of CASES, two at a time: {(sanitizer, mutant): CompletedProcess}."""
    reason = _runtime_missing()
    if reason:
        pytest.skip(f"sanitized emulation needs g++ with its sanitizer runtimes: {reason}")
    if emulator.sanitizer():
        pytest.skip("already inside a sanitized run")
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(CASES, pool.map(lambda case: run_case(*case), CASES)))


@pytest.mark.parametrize("case", list(CASES), ids=["-".join(c) for c in CASES])
def test_a_sanitizer_reports_its_defect_and_nothing_else(results, case):
    done, report = results[case], CASES[case]
    if report is None:
        assert done.returncode == 0, f"{case}: exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
        assert "max scaled difference" in done.stdout and "Sanitizer" not in done.stderr
    else:
        assert done.returncode != 0 and report in done.stderr, \
            f"{case}: exit {done.returncode}, no '{report}'\n{done.stdout}\n{done.stderr[-3000:]}"
        assert "attention.cu" in done.stderr          # the report points into the kernel's source
        if case[0] == "address":
            assert "READ of size 8" in done.stderr


def test_a_sanitized_build_needs_its_runtime(monkeypatch, tmp_path):
    """TINYVIT_EMULATOR_SANITIZE set in a process started without the runtime: a clear refusal that
    names the command to use, not a crash when the instrumented library loads."""
    if emulator.sanitizer():
        pytest.skip("inside a sanitized run the runtime is there")
    monkeypatch.setenv("TINYVIT_EMULATOR_SANITIZE", "thread")
    with pytest.raises(RuntimeError, match=r"sanitize\.py thread"):
        emulator.build('extern "C" __global__ void k(float* x) { x[0] = 1.0f; }', tmp_path)
    monkeypatch.setenv("TINYVIT_EMULATOR_SANITIZE", "memory")
    with pytest.raises(ValueError, match="expected one of"):
        emulator.sanitizer()
