"""Nothing outside the run folder is ever written (issue 32, item 1).

A run folder whose files are symbolic links (`ln -s /somewhere/else RUN/metrics.jsonl`) is refused
in one line before anything is written, on a new run and on --resume: the link's target stays byte
for byte as it was, and a dangling link creates nothing where it points. Underneath, every file a
run writes is created without following links (O_NOFOLLOW, O_EXCL) and replaced by a rename, which
replaces a link and never what it points to, so a link made while the run is under way is not
followed either. Tiny models on tiny synthetic data: a run takes a fraction of a second.
"""
import os
from pathlib import Path

import pytest
from helpers import cli, one_line

import tinyvit.training.loop
from tinyvit.io.arrays import append_text, write_bytes_atomically
from tinyvit.training.run_folder import RUN_FILES, RunFolderLock

TINY = ["--model", "vit-cifar/4", "--model-arg", "dim=8", "--model-arg", "depth=1",
        "--model-arg", "num_heads=2", "--model-arg", "mlp_dim=16"]
DATA = "[dataset]\ntrain_size = 16\ntest_size = 8\nimage_size = 8\nchannels = 3\nnum_classes = 2\n"
# Every file a run writes or appends in its folder, and the temporary name curves.png was once
# drawn under (a fixed name, so a link could wait there).
WRITTEN = (".lock", "config.json", "metrics.jsonl", "steps.jsonl", "curves.png", "latest.safetensors",
           "best.safetensors", "curves.png.tmp.png")


@pytest.fixture(scope="module", autouse=True)
def _no_progress_bars():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tinyvit.training.loop, "_progress_bar", lambda *args: None)
        yield


def train(capsys, tmp_path, out, *extra):
    config = tmp_path / "data.toml"
    config.write_text(DATA)
    return cli(capsys, "train", "--dataset", "synthetic", "--config", config, *TINY, "--epochs", "1",
               "--batch-size", "8", "--out", out, *extra)


def outside(tmp_path) -> Path:
    """A file outside the run folder that a link points at, with content of its own."""
    victim = tmp_path / "elsewhere" / "victim"
    victim.parent.mkdir()
    victim.write_bytes(b"not the run's: must stay as it is\n")
    return victim


def test_every_file_a_run_writes_is_checked():
    assert set(WRITTEN[:-1]) <= set(RUN_FILES)


@pytest.mark.parametrize("name", WRITTEN)
@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_a_new_run_in_a_folder_with_a_link_is_refused(tmp_path, capsys, name, dangling):
    victim = outside(tmp_path)
    target = victim.parent / "nothing-here" if dangling else victim
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(target)
    code, stdout, err = train(capsys, tmp_path, out)
    if name == "curves.png.tmp.png":             # not a file of the run: the run ignores it, and writes its own
        assert code == 0, err
    else:
        assert code == 1
        line = one_line(err)
        assert f"{out / name} is a symbolic link" in line and "--out DIR" in line
        assert sorted(p.name for p in out.iterdir()) == [name]           # nothing written, not even the lock
    assert victim.read_bytes() == b"not the run's: must stay as it is\n"
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"]    # a dangling link created nothing
    assert (out / name).is_symlink() and os.readlink(out / name) == str(target)


@pytest.mark.parametrize("name", WRITTEN)
@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_resuming_a_folder_with_a_link_is_refused(tmp_path, capsys, name, dangling):
    out = tmp_path / "run"
    assert train(capsys, tmp_path, out, "--epochs", "2")[0] == 0
    victim = outside(tmp_path)
    target = victim.parent / "nothing-here" if dangling else victim
    if name in ("latest.safetensors",):            # a resume needs a checkpoint: the link points at a copy
        victim.write_bytes((out / name).read_bytes())
    before = victim.read_bytes()
    (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(target)
    files = {p.name: p.read_bytes() for p in out.iterdir() if not p.is_symlink()}
    code, stdout, err = train(capsys, tmp_path, out, "--epochs", "2", "--resume")
    if name == "curves.png.tmp.png":
        assert code == 0, err
    else:
        assert code == 1
        line = one_line(err)
        assert "is a symbolic link" in line and "--out DIR" in line
        assert {p.name: p.read_bytes() for p in out.iterdir() if not p.is_symlink()} == files
    assert victim.read_bytes() == before
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"]
    assert (out / name).is_symlink() and os.readlink(out / name) == str(target)


def test_the_lock_never_follows_a_link(tmp_path):
    """RunFolderLock itself, should a link appear after the folder was checked."""
    victim = outside(tmp_path)
    for target in (victim, victim.parent / "nothing-here"):
        out = tmp_path / f"run-{target.name}"
        out.mkdir()
        (out / ".lock").symlink_to(target)
        with pytest.raises(OSError, match="is a symbolic link"):
            with RunFolderLock(out):
                pass
    assert victim.read_bytes() == b"not the run's: must stay as it is\n"
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"]


def test_writes_replace_a_link_and_appends_refuse_one(tmp_path):
    """The two ways a run writes a file, for a link that appears while the run is under way."""
    victim = outside(tmp_path)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").symlink_to(victim)
    write_bytes_atomically(folder / "config.json", b"{}")
    assert not (folder / "config.json").is_symlink() and (folder / "config.json").read_bytes() == b"{}"
    (folder / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OSError, match="is a symbolic link"):
        append_text(folder / "metrics.jsonl", "{}\n")
    (folder / "steps.jsonl").symlink_to(victim.parent / "nothing-here")
    with pytest.raises(OSError, match="is a symbolic link"):
        append_text(folder / "steps.jsonl", "{}\n")
    assert victim.read_bytes() == b"not the run's: must stay as it is\n"
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"]
    append_text(folder / "new.jsonl", "a\n")
    append_text(folder / "new.jsonl", "b\n")
    assert (folder / "new.jsonl").read_text() == "a\nb\n"
    assert oct((folder / "new.jsonl").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
