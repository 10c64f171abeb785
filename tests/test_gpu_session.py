"""tools/gpu_session.sh and tools/gpu_cases.py, the prepared GPU session, checked on the CPU so that
they cannot rot between the rare runs on a GPU machine:

- `bash tools/gpu_session.sh --dry-run` lists every step (env, record, sanitize, kbench, bench, profile, train)
  and the commands it would run, and each command parses: its Python program accepts the flags and
  values the script gives it (the program's own argument parser, run with the script's arguments
  and --help; pytest's options checked against its --help, so a plugin the machine may lack, such as
  pytest-timeout, shows up as an unknown option);
- tools/gpu_cases.py's cases build and run (on NumPy, through the reference ops), so a case the
  session sanitizes cannot fail for a reason of its own.
"""
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tinyvit.kernels import use_kernels

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["env", "record", "sanitize", "kbench", "bench", "profile", "train"]
LINE = re.compile(r"^\[dry-run\] \(([\w.-]+), -?\d+s\) (.*)$")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """(the steps announced, [(log name, command tokens)]) of a dry run."""
    out = tmp_path_factory.mktemp("gpu_session")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    done = subprocess.run(["bash", "tools/gpu_session.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    steps = re.findall(r"^=== step (\w+)$", done.stdout, re.MULTILINE)
    commands = [(m.group(1), shlex.split(m.group(2))) for m in map(LINE.match, done.stdout.splitlines()) if m]
    assert (out / "summary.txt").is_file()
    assert not (out / "passed.json").exists() and not (out / "logs.tgz").exists()   # a dry run writes no results
    return steps, commands


def test_the_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(ROOT / "tools" / "gpu_session.sh")]).returncode == 0


def test_the_dry_run_lists_every_step(dry_run):
    steps, commands = dry_run
    assert steps == STEPS
    logs = {log for log, _ in commands}
    assert {"env.txt", "record.txt", "pytest_gpu_others.txt", "memcheck.txt", "racecheck.txt", "synccheck.txt",
            "kbench.txt", "train.txt"} <= logs
    assert sum(log.startswith("bench-") for log in logs) == 5


def test_only_picks_steps(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(["bash", "tools/gpu_session.sh", "--dry-run", "--only", "kbench,train"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and re.findall(r"^=== step (\w+)$", done.stdout, re.MULTILINE) == ["kbench", "train"]


def python_command(tokens):
    """The part of a command after the Python executable (dropping `env VAR=...` and
    `compute-sanitizer [options]` in front of it)."""
    assert sys.executable in tokens, tokens
    return tokens[tokens.index(sys.executable) + 1:]


def flags(args):
    """The --long options among args (their values after '=' dropped)."""
    return sorted({a.split("=", 1)[0] for a in args if a.startswith("--") and a != "--"})


def check(args, scratch):
    """Whether the program of a command takes its arguments: (problem or None). A tinyvit command is
    run with them and --help (its parser checks each value as it reads it, then --help stops it), and
    each --option must be in the help it prints (--help comes before the check for unknown ones);
    pytest collects an empty directory with them (an unknown option is a usage error, exit 4)."""
    if args[:2] == ["-m", "pytest"]:
        given = [a for a in args[2:] if not a.startswith("tests/")]
        missing = [a for a in args[2:] if a.startswith("tests/") and not (ROOT / a).is_file()]
        if missing:
            return f"pytest: no {missing}"
        given = [f"--junitxml={scratch / 'junit.xml'}" if a.startswith("--junitxml=") else a for a in given]
        program = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *given, "--co", str(scratch)]
        done = subprocess.run(program, cwd=ROOT, capture_output=True, text=True, timeout=120)
        return None if done.returncode in (0, 5) else f"{shlex.join(args[:4])}: exit {done.returncode}: " \
                                                        f"{(done.stderr or done.stdout)[-500:]}"
    given = args[:args.index("--")] if "--" in args else args       # after --: pytest's own arguments
    program = [sys.executable, *given, "--help"]
    done = subprocess.run(program, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return f"{shlex.join(program)}: exit {done.returncode}: {done.stderr[-500:]}"
    unknown = [f for f in flags(given) if not re.search(rf"(?<![\w-]){re.escape(f)}\b", done.stdout)]
    return f"{shlex.join(args[:4])}: options not in its --help: {unknown}" if unknown else None


def test_every_command_parses(dry_run, tmp_path):
    _, commands = dry_run
    programs = {tuple(python_command(tokens)) for _, tokens in commands}
    kinds = {p[0] if p[0] != "-m" else p[1] for p in programs}
    assert kinds == {"tools/gpu_cases.py", "tools/step_profile.py", "tinyvit.kernels.cuda.record", "pytest", "tinyvit"}, kinds
    with ThreadPoolExecutor(2) as pool:
        problems = [p for p in pool.map(lambda p: check(list(p), tmp_path), sorted(programs)) if p]
    assert not problems, "\n".join(problems)


def test_a_wrong_flag_would_be_caught(tmp_path):
    """The check can fail: a renamed flag, a value outside a flag's choices, a pytest plugin's option
    where the plugin is not installed, a test file that is not there."""
    assert "--not-a-flag" in check(["-m", "tinyvit", "bench", "--not-a-flag", "1"], tmp_path)
    assert "invalid choice" in check(["-m", "tinyvit", "bench", "--precision", "fp7"], tmp_path)
    assert "invalid choice" in check(["tools/gpu_cases.py", "sanitise"], tmp_path)
    assert "exit 4" in check(["-m", "pytest", "-q", "--definitely-not-pytest=3"], tmp_path)
    assert "no ['tests/test_gone.py']" in check(["-m", "pytest", "tests/test_gone.py"], tmp_path)


def test_the_sanitized_cases_run_on_the_reference():
    """Every case of `gpu_cases.py sanitize` builds and runs (NumPy, reference ops, float64) with finite
    results, but the one of labels out of range, which only the kernel takes (and gives NaN for)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_cases
    finally:
        sys.path.remove(str(ROOT / "tools"))
    with use_kernels(False):
        for name, make in gpu_cases.cases():
            if "NaN expected" in name:            # labels out of range: the reference refuses them (IndexError)
                continue
            results = gpu_cases.run_case(np, make, np.float64)
            assert all(np.isfinite(r).all() for r in results if r is not None), name
        gpu_cases.adamw_case(np, np.float64)
