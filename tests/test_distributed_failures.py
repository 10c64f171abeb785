"""mpirun when things go wrong (issue 32, item 6): one line per failure, the exit status of a signal,
and an end for a stopped rank.

Two ranks on this machine (the `mpirun` fixture skips without Open MPI and mpi4py): a bad flag is one
line, rank 0's (the other rank holds its own back and is ended with the job; `mpirun -q` leaves out
Open MPI's banner); SIGTERM to the ranks saves the checkpoint and mpirun exits 143, also when it
reaches one rank only, or the ranks at different moments (they stop together at the next check:
signals.stop_together), and Ctrl-C's SIGINT exits 130 the same way; a rank stopped
with SIGSTOP no longer leaves the others waiting for ever: after TINYVIT_COLLECTIVE_TIMEOUT seconds
in a collective they end the run, every rank, in one line, the checkpoint kept.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import _mpi_env

from tinyvit import io

TINY = ["--model", "vit-cifar/4", "--model-arg", "dim=8", "--model-arg", "depth=1", "--model-arg", "num_heads=2",
        "--model-arg", "mlp_dim=16"]
DATA = "[dataset]\ntrain_size = 512\ntest_size = 32\nimage_size = 8\nchannels = 3\nnum_classes = 2\n"


def start(mpirun, tmp_path, *args, quiet=False, env=None):
    """`mpirun -n 2 python -m tinyvit ARGS` in tmp_path, in a session of its own (so that a test can end
    it whole), stdout and stderr into files."""
    (tmp_path / "data.toml").write_text(DATA)
    cmd = [mpirun, *(["-q"] if quiet else []), "-n", "2", "--oversubscribe", sys.executable, "-m", "tinyvit",
           *[str(a) for a in args]]
    out, err = open(tmp_path / "stdout", "w"), open(tmp_path / "stderr", "w")
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=err, env={**_mpi_env(), **(env or {})},
                            start_new_session=True)


def finish(proc, tmp_path, timeout=90):
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in ranks(proc).values():
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"mpirun still running after {timeout} s:\n{(tmp_path / 'stderr').read_text()[-3000:]}")
    return code, (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()


def ranks(proc) -> dict:
    """{rank: pid} of the processes mpirun started (its children, by the rank Open MPI gave each)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != proc.pid:
                continue
            env = dict(v.split("=", 1) for v in (entry / "environ").read_bytes().decode().split("\0") if "=" in v)
        except (OSError, ValueError, IndexError):
            continue
        if "OMPI_COMM_WORLD_RANK" in env:
            found[int(env["OMPI_COMM_WORLD_RANK"])] = int(entry.name)
    return found


def wait_for_an_epoch(proc, out: Path, timeout=60):
    """Until the run has written its first checkpoint (and both ranks are training)."""
    deadline = time.monotonic() + timeout
    while not (out / "latest.safetensors").exists() or len(ranks(proc)) < 2:
        assert proc.poll() is None, "mpirun ended before its first epoch"
        assert time.monotonic() < deadline, "no checkpoint after a minute"
        time.sleep(0.2)


def ours(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("tinyvit")]


def test_a_bad_flag_is_one_line_from_rank_0(mpirun, tmp_path):
    proc = start(mpirun, tmp_path, "train", "--dataset", "synthetic", "--config", "data.toml", *TINY, "--epochs", "1",
                 "--lr", "nan", "--out", "run", quiet=True)
    code, _, stderr = finish(proc, tmp_path)
    assert code == 2
    assert stderr.strip().splitlines() == ["tinyvit train: error: rank 0: invalid training configuration: --lr must be "
                                           "a finite number, got nan"]
    assert not (tmp_path / "run").exists()


def test_an_argparse_error_is_one_line_too(mpirun, tmp_path):
    """Without -q: Open MPI's banner, but one line of ours."""
    proc = start(mpirun, tmp_path, "train", "--dataset", "synthetic", "--epochs", "many")
    code, _, stderr = finish(proc, tmp_path)
    assert code == 2
    assert ours(stderr) == ["tinyvit train: error: argument --epochs: invalid int value: 'many'"]


def test_sigterm_to_the_ranks_saves_and_exits_143(mpirun, tmp_path):
    """As a scheduler stops a job (SLURM signals every task): each rank stops at a step boundary,
    rank 0 saves, mpirun returns the ranks' 128 + 15."""
    proc = start(mpirun, tmp_path, "train", "--dataset", "synthetic", "--config", "data.toml", *TINY,
                 "--epochs", "500", "--batch-size", "8", "--out", "run")
    wait_for_an_epoch(proc, tmp_path / "run")
    for pid in ranks(proc).values():
        os.kill(pid, signal.SIGTERM)
    code, stdout, stderr = finish(proc, tmp_path)
    assert code == 143, stderr[-2000:]
    assert "stopped by SIGTERM: saved" in stdout and "Traceback" not in stderr
    state = json.loads(io.load_arrays(tmp_path / "run" / "latest.safetensors")[1]["training"])
    assert state["progress"]["epoch"] >= 1


def stopped_together(proc, tmp_path, code: int, said: str) -> dict:
    """The run ended with ``code``, rank 0 said ``said``, and the checkpoint it saved is a step
    boundary of every rank: the interrupted epoch's rows are the sum of the two ranks' rows."""
    code_seen, stdout, stderr = finish(proc, tmp_path)
    assert code_seen == code, stderr[-2000:]
    assert f"{said}: saved" in stdout and "Traceback" not in stderr, (stdout[-2000:], stderr[-2000:])
    state = json.loads(io.load_arrays(tmp_path / "run" / "latest.safetensors")[1]["training"])
    assert state["progress"]["epoch"] >= 1
    return state


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(mpirun, tmp_path):
    """SIGTERM to rank 1 alone (a stop that reaches the ranks at different moments, or one only): the
    ranks agree at the next check to stop at the same step, rank 0 saves, and each exits 143. Before,
    rank 1 stopped where it stood and ended the job (MPI_Abort) before rank 0 could save."""
    proc = start(mpirun, tmp_path, "train", "--dataset", "synthetic", "--config", "data.toml", *TINY,
                 "--epochs", "500", "--batch-size", "8", "--out", "run")
    wait_for_an_epoch(proc, tmp_path / "run")
    os.kill(ranks(proc)[1], signal.SIGTERM)
    state = stopped_together(proc, tmp_path, 143, "stopped by SIGTERM")
    partial = state["progress"]["partial"]
    if partial is not None:               # stopped inside an epoch: every rank's rows, 8 a step
        assert partial["seen"] % 8 == 0 and partial["seen"] > 0


def test_ctrl_c_to_the_ranks_saves_and_exits_130(mpirun, tmp_path):
    """Ctrl-C in mpirun's terminal reaches every rank as SIGINT: saved, 130."""
    proc = start(mpirun, tmp_path, "train", "--dataset", "synthetic", "--config", "data.toml", *TINY,
                 "--epochs", "500", "--batch-size", "8", "--out", "run")
    wait_for_an_epoch(proc, tmp_path / "run")
    for pid in ranks(proc).values():
        os.kill(pid, signal.SIGINT)
    stopped_together(proc, tmp_path, 130, "interrupted")


def test_a_stopped_rank_ends_the_run_in_one_line(mpirun, tmp_path):
    """Rank 1 stopped (SIGSTOP) in the middle of training: rank 0 waits in the next all-reduce, and
    after TINYVIT_COLLECTIVE_TIMEOUT seconds ends every rank, the stopped one too."""
    proc = start(mpirun, tmp_path, "train", "--dataset", "synthetic", "--config", "data.toml", *TINY,
                 "--epochs", "500", "--batch-size", "8", "--out", "run", env={"TINYVIT_COLLECTIVE_TIMEOUT": "4"})
    wait_for_an_epoch(proc, tmp_path / "run")
    stopped = ranks(proc)[1]
    os.kill(stopped, signal.SIGSTOP)
    stopped_at = time.monotonic()
    code, _, stderr = finish(proc, tmp_path, timeout=60)
    assert code != 0 and time.monotonic() - stopped_at < 45
    lines = ours(stderr)
    assert len(lines) == 1 and "rank 0: waited 4 s for the other ranks" in lines[0], stderr[-2000:]
    assert "TINYVIT_COLLECTIVE_TIMEOUT" in lines[0] and "--resume" in lines[0]
    assert not Path(f"/proc/{stopped}").exists() or "Z" in Path(f"/proc/{stopped}/stat").read_text().split()[2]
    arrays, metadata = io.load_arrays(tmp_path / "run" / "latest.safetensors")
    assert json.loads(metadata["training"])["progress"]["epoch"] >= 1


def test_a_bad_timeout_is_one_line(mpirun, tmp_path):
    proc = start(mpirun, tmp_path, "train", "--dataset", "synthetic", "--config", "data.toml", *TINY, "--epochs", "1",
                 "--out", "run", quiet=True, env={"TINYVIT_COLLECTIVE_TIMEOUT": "soon"})
    code, _, stderr = finish(proc, tmp_path)
    assert code == 1
    assert ours(stderr) == ["tinyvit train: rank 0: TINYVIT_COLLECTIVE_TIMEOUT must be a number of seconds >= 0 "
                            "(0: wait for ever), got 'soon'"]


class RankZeroOfTwo:
    """What rank 0 sees of a two-rank world in stop_together: its own value and rank 1's."""

    def __init__(self, rank_1_received: int):
        self.rank_1_received = rank_1_received

    def gather(self, obj) -> list:
        return [obj, self.rank_1_received]


def test_among_ranks_a_signal_is_noted_shared_at_the_check_and_a_second_one_stops_at_once():
    """signals.py in one process, as a rank runs it: no rank stops where it stands on the first
    signal; every rank raises at the check where any rank has one; a second signal raises at once."""
    from tinyvit.training import signals
    before = signal.getsignal(signal.SIGTERM)
    with signals.stop_signals_interrupt(several_ranks=True):
        assert signal.getsignal(signal.SIGINT) is signals.request_stop
        signals.stop_together(RankZeroOfTwo(0))                 # no rank was signalled: training goes on
        with pytest.raises(signals.Stopped) as stop:
            signals.stop_together(RankZeroOfTwo(signal.SIGHUP))  # rank 1 was: rank 0 stops with it
        assert (stop.value.signum, stop.value.together) == (signal.SIGHUP, True)
        with signals.ctrl_c_after_block():                       # during an update: held, then noted
            os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(signals.Stopped) as stop:
            signals.stop_together(RankZeroOfTwo(signal.SIGHUP))  # the lowest rank's signal: rank 0's own
        assert (stop.value.signum, stop.value.together) == (signal.SIGTERM, True)
        with pytest.raises(signals.Stopped) as stop:
            os.kill(os.getpid(), signal.SIGTERM)                 # the second: at once, where it stands
            time.sleep(1)                                        # (the handler runs between bytecodes)
        assert (stop.value.signum, stop.value.together) == (signal.SIGTERM, False)
    assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signals.stop_together(RankZeroOfTwo(0))                      # nothing is left noted after the run
