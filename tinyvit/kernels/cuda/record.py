"""Record where the CUDA kernels passed their GPU tests: kernels/cuda/passed.json, which the
switchboard reads (a CUDA kernel runs only once it is recorded there, or with use_kernels("all")).

    python -m tinyvit.kernels.cuda.record            # on a GPU machine, from a checkout of the repository

runs `pytest -m gpu` on every tests/test_kernels_cuda_<module>.py that names its ops (a
module-level constant OPS = ["layer_norm"]), one process per file with CUDA_LAUNCH_BLOCKING=1 and
time limits (an illegal address is a sticky error that fails every later launch of its process, and
a deadlocked barrier never returns: each costs its own file, not the others), reads the per-test
results from pytest's JUnit XML reports, and for each op whose GPU tests all passed (no failure, no
error, at least one passed) writes an entry

    {"gpu": "NVIDIA H100 80GB HBM3", "cupy": "14.2.0", "cuda": "12.9", "driver": "575.57.08",
     "commit": "<git commit>", "date": "2025-01-01T00:00:00+00:00"}

into passed.json under the op's name: one entry per GPU model, the latest run replacing that GPU's
earlier entry, other GPUs' entries and other ops kept. An op whose GPU tests ran and failed loses
this GPU's entry (the kernel is no longer known to work there); an op whose tests did not run is
left as it was. A file that outlives its time limit, or whose pytest dies of a signal, fails its
ops. Exit status 0 when every op that ran passed, 1 otherwise, 2 without a GPU.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from . import RECORD, reload_passed

REPOSITORY = Path(__file__).resolve().parents[3]
TESTS = REPOSITORY / "tests"
PATTERN = "test_kernels_cuda_*.py"


# ---------------------------------------------------------------- which tests cover which ops


def ops_of(path: Path):
    """The module-level OPS list of a test file (read with ast, not imported), or None if it has none."""
    tree = ast.parse(Path(path).read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "OPS" for t in node.targets):
            ops = ast.literal_eval(node.value)
            if not (isinstance(ops, (list, tuple)) and all(isinstance(op, str) for op in ops)):
                raise ValueError(f"{path}: OPS must be a list of op names, got {ops!r}")
            return list(ops)
    return None


def test_files(tests: Path = TESTS) -> dict:
    """{test module name: [op names]} for every tests/test_kernels_cuda_*.py that has OPS."""
    found = {}
    for path in sorted(Path(tests).glob(PATTERN)):
        ops = ops_of(path)
        if ops:
            found[path.stem] = ops
    return found


# ---------------------------------------------------------------- the JUnit report


def _module_of(case, modules):
    """The test module (one of ``modules``) a <testcase> belongs to: pytest writes classname
    "tests.test_kernels_cuda_gelu" (plus ".TestClass" for tests in a class); a file that failed
    to collect is reported with its dotted path as the name and an empty classname."""
    words = (case.get("classname", "") + "." + case.get("name", "")).replace("/", ".").split(".")
    for module in modules:
        if module in words:
            return module
    return None


def results_by_module(junit_xml: str, modules) -> dict:
    """{module: {"passed": n, "failed": n, "skipped": n}} from a JUnit XML report (pytest's
    --junitxml), counting <testcase>s: failed = with <failure> or <error>, skipped = with <skipped>,
    passed = the others. Modules without test cases get all zeros."""
    counts = {m: {"passed": 0, "failed": 0, "skipped": 0} for m in modules}
    for case in ET.fromstring(junit_xml).iter("testcase"):
        module = _module_of(case, modules)
        if module is None:
            continue
        tags = {child.tag for child in case}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        counts[module][outcome] += 1
    return counts


def op_outcomes(files: dict, counts: dict) -> dict:
    """{op: "passed" | "failed" | "not run"} from {module: ops} and results_by_module's counts: an op
    passed when no test of any module naming it failed and at least one passed; it failed when one
    failed; otherwise (all skipped, none collected) it did not run."""
    outcomes = {}
    for module, ops in files.items():
        c = counts.get(module, {"passed": 0, "failed": 0, "skipped": 0})
        for op in ops:
            previous = outcomes.get(op, "not run")
            if c["failed"] or previous == "failed":
                outcomes[op] = "failed"
            elif c["passed"] or previous == "passed":
                outcomes[op] = "passed"
            else:
                outcomes[op] = "not run"
    return outcomes


# ---------------------------------------------------------------- the record


def merge(record: dict, outcomes: dict, entry: dict) -> dict:
    """A new record: for each op that passed, ``entry`` replaces the entry of the same GPU (or is
    added); for each op that failed, the entry of this GPU is removed (an op left with no entry
    is dropped); everything else kept. Ops sorted by name."""
    new = {op: [dict(e) for e in entries] for op, entries in record.items()}
    for op, outcome in outcomes.items():
        if outcome == "not run":
            continue
        others = [e for e in new.get(op, []) if e.get("gpu") != entry["gpu"]]
        if outcome == "passed":
            others.append(dict(entry))
        if others:
            new[op] = others
        else:
            new.pop(op, None)
    return dict(sorted(new.items()))


def _version(number: int) -> str:
    """CUDA's version numbers, 12090 -> "12.9"."""
    return f"{number // 1000}.{number % 1000 // 10}"


def _command_output(args, cwd=None):
    try:
        return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict:
    """GPU name, CuPy, CUDA runtime and driver versions of the current device (needs a GPU)."""
    import cupy
    runtime = cupy.cuda.runtime
    props = runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    driver = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader",
                              f"--id={cupy.cuda.Device().id}"])
    return {"gpu": name.decode() if isinstance(name, bytes) else str(name),
            "cupy": cupy.__version__,
            "cuda": _version(runtime.runtimeGetVersion()),
            "driver": driver or f"CUDA {_version(runtime.driverGetVersion())} (driver API)"}


def commit(repository: Path = REPOSITORY) -> str:
    """The checked-out git commit, with "-dirty" when tracked files have changes; "unknown" outside
    a git checkout; TINYVIT_COMMIT when set (a copy of the tree whose .git is not its own)."""
    if os.environ.get("TINYVIT_COMMIT"):
        return os.environ["TINYVIT_COMMIT"]
    head = _command_output(["git", "rev-parse", "HEAD"], cwd=repository)
    if not head:
        return "unknown"
    changes = _command_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repository)
    return head + ("-dirty" if changes else "")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


FILE_TIMEOUT = 600          # seconds for one test file's pytest process
TEST_TIMEOUT = 120          # seconds for one test (pytest-timeout, where installed)
INTERRUPTED = (2, 3, 4)     # pytest's exit codes for Ctrl-C, an internal error and a usage error


def run_pytest(path: Path, junit: Path, extra=(), cwd: Path = REPOSITORY, timeout: float = FILE_TIMEOUT) -> int:
    """`pytest -m gpu` on one test file in its own process, with a JUnit XML report written to
    ``junit``; pytest's exit code, or None when the process outlived ``timeout`` seconds (killed).
    CUDA_LAUNCH_BLOCKING=1 makes a kernel's fault surface at its own launch, in its own test."""
    per_test = [f"--timeout={TEST_TIMEOUT}"] if importlib.util.find_spec("pytest_timeout") is not None else []
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *per_test,
               "--continue-on-collection-errors",       # a file that fails to import fails its own ops
               f"--junitxml={junit}", str(path), *extra]
    print("$", " ".join(command), flush=True)
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    try:
        return subprocess.run(command, cwd=cwd, env=env, check=False, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return None


def file_counts(module: str, code, junit: Path) -> dict:
    """results_by_module's counts for one file's run: its JUnit report when pytest finished, else
    one failure (it timed out, died of a signal, or wrote no report)."""
    if code is not None and code >= 0 and junit.is_file():
        return results_by_module(junit.read_text(), [module])[module]
    return {"passed": 0, "failed": 1, "skipped": 0}


def cuda_device_present() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tinyvit.kernels.cuda.record", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, default=TESTS, help="the tests directory (default: the checkout's)")
    parser.add_argument("--output", type=Path, default=RECORD, help="the record to update (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="report, but do not write the record")
    parser.add_argument("--jobs", type=int, default=1, help="test files run at once, each its own process (default 1)")
    parser.add_argument("--file-timeout", type=float, default=FILE_TIMEOUT,
                        help="seconds for one file's pytest before it is killed and its ops fail (default %(default)s)")
    parser.add_argument("--junit-dir", type=Path, default=None, help="keep the JUnit reports here (default: discarded)")
    parser.add_argument("pytest_args", nargs="*", help="more arguments for pytest (after --)")
    args = parser.parse_args(argv)

    files = test_files(args.tests)
    if not files:
        print(f"no {PATTERN} with OPS in {args.tests}", file=sys.stderr)
        return 2
    if not cuda_device_present():
        print("no CUDA device (or no CuPy) here: the GPU tests cannot run, nothing recorded", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        reports = args.junit_dir or Path(tmp)
        reports.mkdir(parents=True, exist_ok=True)

        def run(module):
            junit = reports / f"junit_{module}.xml"
            return module, run_pytest(args.tests / f"{module}.py", junit, args.pytest_args, cwd=args.tests.parent,
                                      timeout=args.file_timeout), junit

        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            runs = list(pool.map(run, files))
        broken = [(m, code) for m, code, _ in runs if code in INTERRUPTED]
        if broken:                                      # interrupted, internal or usage error
            print(f"pytest exited with {broken[0][1]} on {broken[0][0]}: nothing recorded", file=sys.stderr)
            return 1
        counts = {m: file_counts(m, code, junit) for m, code, junit in runs}
        for m, code, _ in runs:
            if code is None or code < 0:
                print(f"{m}: {'timed out' if code is None else f'killed by signal {-code}'}: its ops fail",
                      file=sys.stderr)
    outcomes = op_outcomes(files, counts)
    entry = {**machine(), "commit": commit(args.tests.parent), "date": now()}

    print(f"\n{entry['gpu']}, CuPy {entry['cupy']}, CUDA {entry['cuda']}, driver {entry['driver']}, "
          f"commit {entry['commit']}")
    for module, ops in files.items():
        c = counts[module]
        print(f"  {module}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped -> "
              + ", ".join(f"{op} {outcomes[op]}" for op in ops))
    record = json.loads(args.output.read_text()) if args.output.is_file() else {}
    updated = merge(record, outcomes, entry)
    if args.dry_run:
        print("dry run: not written")
    elif updated != record:
        args.output.write_text(json.dumps(updated, indent=2) + "\n")
        reload_passed()                          # this process's switchboard sees the new record
        print(f"written: {args.output}")
    return 0 if all(o != "failed" for o in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
