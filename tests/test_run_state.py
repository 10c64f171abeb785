"""Runs that never lose or mix state (issue 23): what a run records agrees with the files it has
written, two runs never share a folder, a run stopped any way (Ctrl-C, SIGTERM, SIGHUP, a crash
before its first checkpoint) can be resumed or started again, checkpoints get the usual file mode
and an unreadable one says so, and no killed write leaves debris behind.

Tiny ViTs on tiny synthetic data through the real entry point (``tinyvit.cli.main``), and real
processes where only a process will do: one that holds a run folder's lock, one stopped by SIGTERM.
"""
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, one_line
from test_bad_input import DATA, png, snapshot, train_args
from test_train import _interrupt_after, assert_same_run, checkpoint_state, metrics

import tinyvit.training.loop
from tinyvit import io, optim
from tinyvit.cli import main
from tinyvit.io.arrays import TEMPORARY_NAME
from tinyvit.training.run_folder import RunFolderLock
from tinyvit.training import Classification

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _no_progress_bars():
    """tqdm bars would fill the captured stderr the tests read."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tinyvit.training.loop, "_progress_bar", lambda *args: None)
        yield


@pytest.fixture(scope="module")
def data_toml(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "data.toml"
    path.write_text("[dataset]\n" + "".join(f"{k} = {v}\n" for k, v in DATA.items()))
    return path


@pytest.fixture
def finished_run(tmp_path, data_toml, capsys):
    """A finished one-epoch run (2 steps), its folder."""
    out = tmp_path / "run"
    assert cli(capsys, *train_args(data_toml, out))[0] == 0
    return out


def usual_mode() -> int:
    """The mode open() gives a new file: 0o666 less the umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


# ---------------------------------------------------------------- 1. the best model and its record


def test_a_stop_while_best_is_written_keeps_the_record_with_the_file(tmp_path, capsys, data_toml, monkeypatch):
    """Ctrl-C while best.safetensors is written: the file keeps the old best, and so must the
    checkpoint's record of it; the resumed run evaluates that epoch again and saves its best then."""
    out, calls, evaluate, save = tmp_path / "run", [0], Classification.evaluate, io.save

    def better_each_time(self, model, loader):          # every epoch a new best: each writes best.safetensors
        calls[0] += 1
        return {**evaluate(self, model, loader), "acc": calls[0] / 10}

    def stop_in_epoch_2s_best(model, path, **kwargs):
        if Path(path).name == "best.safetensors" and kwargs["metadata"]["epoch"] == "2":
            raise KeyboardInterrupt
        save(model, path, **kwargs)

    monkeypatch.setattr(Classification, "evaluate", better_each_time)
    with monkeypatch.context() as mp:
        mp.setattr(io, "save", stop_in_epoch_2s_best)
        assert cli(capsys, *train_args(data_toml, out, "--epochs", "3"))[0] == 130
    _, state = checkpoint_state(out / "latest.safetensors")
    assert io.load_arrays(out / "best.safetensors")[1]["epoch"] == "1"
    assert state["progress"]["best_acc"] == 0.1 and state["progress"]["epoch"] == 1   # epoch 2: evaluate again

    assert cli(capsys, *train_args(data_toml, out, "--epochs", "3", "--resume"))[0] == 0
    rows, (_, state) = metrics(out), checkpoint_state(out / "latest.safetensors")
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    best_epoch = int(io.load_arrays(out / "best.safetensors")[1]["epoch"])
    assert best_epoch == 3 and state["progress"]["best_acc"] == rows[best_epoch - 1]["test_acc"]


# ---------------------------------------------------------------- 2. a run that died before its first checkpoint


def test_a_run_that_died_before_its_first_checkpoint_starts_again_cleanly(tmp_path, capsys, data_toml,
                                                                           monkeypatch):
    """Killed after epoch 1's metrics row and best model, before latest.safetensors: --resume says
    to start again (and changes nothing); started again, nothing of the dead run is mixed in."""
    out = tmp_path / "run"

    def killed(*args, **kwargs):                         # as kill -9 would: no handler runs, nothing saved
        raise RuntimeError("killed")
    with monkeypatch.context() as mp:
        mp.setattr(tinyvit.training.loop, "save_training_checkpoint", killed)
        with pytest.raises(RuntimeError, match="killed"):
            main([str(a) for a in train_args(data_toml, out)])
    capsys.readouterr()
    assert {"metrics.jsonl", "steps.jsonl", "best.safetensors"} <= {p.name for p in out.iterdir()}
    assert not (out / "latest.safetensors").exists()

    before = snapshot(out)
    code, _, err = cli(capsys, *train_args(data_toml, out, "--resume"))
    assert code == 1
    line = one_line(err)
    assert "no checkpoint" in line and "start the run again without --resume" in line
    assert snapshot(out) == before

    with monkeypatch.context() as mp:                    # started again, and stopped in its first step
        _interrupt_after(mp, Classification, "step", 1)
        assert cli(capsys, *train_args(data_toml, out))[0] == 130
    assert not {"metrics.jsonl", "steps.jsonl", "best.safetensors"} & {p.name for p in out.iterdir()}
    assert cli(capsys, *train_args(data_toml, out, "--resume"))[0] == 0
    assert [r["epoch"] for r in metrics(out)] == [1]
    steps = [json.loads(line)["step"] for line in (out / "steps.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 2


# ---------------------------------------------------------------- 3. one run per folder

# A process that holds a run folder's lock, as a run does, until its stdin closes or it is killed.
HOLD = """import sys
from tinyvit.training.run_folder import RunFolderLock
with RunFolderLock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.read()
"""


def test_a_second_run_on_a_folder_in_use_fails_at_once(finished_run, tmp_path, data_toml, capsys):
    """While another process holds the folder (a finished run being resumed, a new folder whose run
    is still loading its data), a run there fails at once: one line naming the folder, the holder's
    pid and the fix, and no file changed. The holder killed, the OS drops its lock: no stale lock."""
    fresh = tmp_path / "fresh"
    holders = [subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=REPO) for folder in (finished_run, fresh)]
    try:
        for holder in holders:
            assert holder.stdout.readline() == "locked\n"
        runs = (train_args(data_toml, finished_run, "--resume"), train_args(data_toml, fresh))
        for holder, folder, argv in zip(holders, (finished_run, fresh), runs):
            before = snapshot(folder)
            code, _, err = cli(capsys, *argv)
            assert code == 1
            line = one_line(err)
            assert f"{folder} is in use by another run (pid {holder.pid})" in line
            assert "wait" in line and "--out DIR" in line
            assert snapshot(folder) == before
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    assert cli(capsys, *train_args(data_toml, finished_run, "--resume"))[0] == 0
    assert cli(capsys, *train_args(data_toml, fresh))[0] == 0
    with RunFolderLock(fresh):                           # and train() let go of it when it returned
        assert (fresh / ".lock").read_text() == f"{os.getpid()}\n"


def test_a_start_that_fails_before_writing_leaves_no_folder(tmp_path, capsys, data_toml):
    """The lock is taken first, creating the folder: a run refused after that (here: its [dataset]
    settings) removes the folder it made, lock file and all."""
    config = tmp_path / "bad.toml"
    config.write_text(data_toml.read_text() + "trainsize = 8\n")
    code, _, err = cli(capsys, "train", "--dataset", "synthetic", "--config", config, "--out", tmp_path / "run")
    assert code == 1 and "trainsize" in one_line(err)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- 4. file modes and unreadable checkpoints


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002], ids=oct)
def test_checkpoints_get_the_usual_file_mode(tmp_path, umask):
    """Not the 0600 of the temporary file they are written to: 0o666 less the umask, as open() gives."""
    previous = os.umask(umask)
    try:
        io.save_arrays(tmp_path / "a.safetensors", {"x": np.zeros(3, np.float32)})
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "a.safetensors").stat().st_mode) == 0o666 & ~umask


def test_a_runs_files_get_the_usual_file_mode(finished_run):
    for name in ("latest.safetensors", "best.safetensors", "metrics.jsonl", ".lock"):
        assert stat.S_IMODE((finished_run / name).stat().st_mode) == usual_mode(), name


def test_an_unreadable_checkpoint_is_reported_as_unreadable_not_missing(finished_run, tmp_path, data_toml, capsys,
                                                                       monkeypatch):
    """chmod 000, which safetensors reports as "No such file or directory". Root reads any file: run
    as root, the test makes os.access (where the message comes from) answer for these files as the
    kernel answers anyone else, so the message path is checked either way."""
    latest, best = finished_run / "latest.safetensors", finished_run / "best.safetensors"
    for path in (latest, best):
        path.chmod(0)
    if os.geteuid() == 0:
        real_access = os.access

        def access(path, mode, **kwargs):                # as the kernel answers anyone but root
            if Path(path) in (latest, best) and mode & os.R_OK:
                return False
            return real_access(path, mode, **kwargs)
        monkeypatch.setattr(os, "access", access)
    image = png(tmp_path / "img.png", np.zeros((8, 8, 3), np.uint8))
    data_args = [f"--dataset-arg={k}={v}" for k, v in DATA.items()]
    for path, argv in ((best, ["predict", best, image]),
                       (best, ["eval", best, "--dataset", "synthetic", *data_args]),
                       (latest, train_args(data_toml, finished_run, "--resume"))):
        code, out, err = cli(capsys, *argv)
        assert code == 1 and out == ""
        line = one_line(err)
        assert f"cannot read {path}: permission denied" in line and "not found" not in line


# ---------------------------------------------------------------- 5. SIGTERM and SIGHUP stop a run as Ctrl-C does

# Long enough (2 epochs of 300 steps) that a run is still training when the test stops it after its
# first logged interval (20 steps): about a second on a CPU.
SIG_DATA = {"train_size": 2400, "test_size": 32, "image_size": 16, "channels": 3, "num_classes": 4}
SIG_STEPS_PER_EPOCH = 2400 // 8
SIG_ARGS = ["--dataset", "synthetic", "--model", "vit-cifar/4", "--model-arg", "dim=16", "--model-arg", "depth=1",
            "--model-arg", "num_heads=2", "--model-arg", "mlp_dim=32", "--epochs", "2", "--batch-size", "8"]


@pytest.fixture(scope="module")
def sig_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("signals") / "data.toml"
    path.write_text("[dataset]\n" + "".join(f"{k} = {v}\n" for k, v in SIG_DATA.items()))
    return ["train", *SIG_ARGS, "--config", str(path)]


@pytest.fixture(scope="module")
def never_stopped(sig_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("signals") / "straight"
    assert main([*sig_config, "--out", str(out)]) == 0
    return out


def test_sigterm_saves_and_resume_finishes_the_same_run(sig_config, never_stopped, tmp_path, capsys):
    """`python -m tinyvit train` sent SIGTERM after its first steps, as a scheduler stops a job:
    exit status 143 (128 + 15), latest.safetensors saved, and --resume ends with the weights of a
    run that never stopped."""
    out = tmp_path / "run"
    with open(tmp_path / "stdout", "w+") as stdout:
        run = subprocess.Popen([sys.executable, "-m", "tinyvit", *sig_config, "--out", str(out)], cwd=REPO,
                               stdout=stdout, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while not (out / "steps.jsonl").exists() or not (out / "steps.jsonl").read_text().endswith("\n"):
                assert run.poll() is None and time.monotonic() < deadline, "the run ended before its first steps"
                time.sleep(0.005)
            run.send_signal(signal.SIGTERM)
            assert run.wait(timeout=120) == 143
        finally:
            run.kill()
        stdout.seek(0)
        assert f"stopped by SIGTERM: saved {out / 'latest.safetensors'}" in stdout.read()
    _, state = checkpoint_state(out / "latest.safetensors")
    assert state["progress"]["epoch"] == 0 and 20 <= state["scheduler"]["step"] < SIG_STEPS_PER_EPOCH
    assert cli(capsys, *sig_config, "--out", out, "--resume")[0] == 0
    assert_same_run(never_stopped, out)


def test_sighup_during_the_update_lands_after_it(sig_config, never_stopped, tmp_path, capsys, monkeypatch):
    """A closed terminal's SIGHUP while the optimizer writes the weights: held back until the update
    is whole, then the run saves and exits 129 (128 + 1); the previous handler is back after."""
    out, count, original = tmp_path / "run", [0], optim.AdamW.step

    def step(self):
        count[0] += 1
        if count[0] == 5:
            # held back by train() here: without a handler, the signal would end pytest itself
            assert signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL
            os.kill(os.getpid(), signal.SIGHUP)             # delivered before the update starts
        original(self)
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)         # as in a terminal (nohup would ignore it)
    try:
        with monkeypatch.context() as mp:
            mp.setattr(optim.AdamW, "step", step)
            code, stdout, _ = cli(capsys, *sig_config, "--out", out)
        assert code == 129 and "stopped by SIGHUP" in stdout
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)
    _, state = checkpoint_state(out / "latest.safetensors")
    assert state["scheduler"]["step"] == 5                              # the fifth update, whole
    assert cli(capsys, *sig_config, "--out", out, "--resume")[0] == 0
    assert_same_run(never_stopped, out)


# ---------------------------------------------------------------- 6. what killed writes leave behind


def test_a_killed_writes_temporary_files_are_removed_by_the_next_run(finished_run, data_toml, capsys):
    leftovers = [".latest.safetensors.0123456789ab.tmp", ".best.safetensors.fedcba987654.tmp",  # save_arrays'
                 ".tmpA1b2C3"]                                                                 # safetensors'
    others = ["notes.txt", "model.tmp", ".tmp", ".tmpnotes", ".latest.safetensors.tmp"]
    for name in leftovers + others:
        (finished_run / name).write_text("half a checkpoint")
    names = {p.name for p in finished_run.iterdir()}
    assert cli(capsys, *train_args(data_toml, finished_run, "--resume"))[0] == 0
    assert {p.name for p in finished_run.iterdir()} == names - set(leftovers)


def test_the_names_removed_are_the_names_save_arrays_writes(tmp_path, monkeypatch):
    written = []

    def killed(tmp, arrays, metadata):
        written.append(os.path.basename(tmp))
        raise RuntimeError("killed")
    monkeypatch.setattr(io.arrays, "_write_safetensors", killed)
    with pytest.raises(RuntimeError):
        io.save_arrays(tmp_path / "latest.safetensors", {"x": np.zeros(3, np.float32)})
    assert TEMPORARY_NAME.fullmatch(written[0])
    assert not TEMPORARY_NAME.fullmatch("latest.safetensors")
