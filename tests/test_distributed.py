"""Data-parallel training (tinyvit.distributed): N ranks train the model one process would.

In this process: the shards of the DataLoader cover each global batch exactly once; the bucketed
all-reduce gives every rank the global batch's gradient, even for unequal shards, several buckets and
a parameter only some ranks have a gradient for (ranks as threads of this process, their all-reduce
an addition, so the bucket code runs as under MPI); the shared evaluation and the checks of a run's
settings; a missing mpi4py is one line.

With mpirun (two ranks on this machine; `mpirun` fixture: skipped without Open MPI and mpi4py,
a failure in CI): 2 ranks end with the same weights as 1 process with the same global batch, to
float32 round-off (augmentation, dropout and drop path are off: with them each rank draws its own
random numbers, so no run of 2 ranks can equal one process); a run resumes with another number of
ranks; the time budget's plan is rank 0's; pretraining runs; a rank that fails stops the others
at once with one line naming it, instead of leaving them waiting. On a GPU (marked gpu): the NCCL
path, which the CuPy stand-in cannot run.
"""
import copy
import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, one_line, run_ranks

import tinyvit.training.loop
from tinyvit import distributed, io
from tinyvit import functional as F
from tinyvit.backend import default_dtype
from tinyvit.cli import main
from tinyvit.data import DataLoader
from tinyvit.distributed import GradientBuckets, World, ranks
from tinyvit.models import create
from tinyvit.training.run_folder import RunFolderLock
from tinyvit.training import TrainConfig

TINY = ["--model", "vit-cifar/4", "--model-arg", "dim=32", "--model-arg", "depth=2",
        "--model-arg", "num_heads=2", "--model-arg", "mlp_dim=64"]
DATA = dict(train_size=128, test_size=60, image_size=16, channels=3, num_classes=6)
RUN = ["--dataset", "synthetic", *TINY, "--epochs", "2", "--batch-size", "32", "--lr", "3e-3"]
# The same run as a TrainConfig (a resume compares the settings).
RUN_CONFIG = dict(dataset="synthetic", model="vit-cifar/4", model_args=dict(dim=32, depth=2, num_heads=2, mlp_dim=64),
                  dataset_args=DATA, epochs=2, batch_size=32, lr=3e-3)


@pytest.fixture(scope="module", autouse=True)
def _no_progress_bars():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tinyvit.training.loop, "_progress_bar", lambda *args: None)
        yield


# ---------------------------------------------------------------- the data: shards of every batch


def test_shards_cover_every_batch_once():
    """Each rank takes a contiguous slice of the same global batch; together, the batch, in order."""
    n = 52
    images, labels = np.zeros((n, 1, 2, 2), np.uint8), np.arange(n)
    whole = DataLoader(images, labels, 12, shuffle=True, seed=3)
    ranks = [DataLoader(images, labels, 12, shuffle=True, seed=3, shard=(r, 3)) for r in range(3)]
    for epoch in range(2):
        batches = [y for _, y in whole]
        shards = [[y for _, y in loader] for loader in ranks]
        assert len(batches) == 5 and all(len(s) == 5 for s in shards)
        for step, batch in enumerate(batches):
            assert np.array_equal(np.concatenate([s[step] for s in shards]), batch), f"epoch {epoch}, step {step}"
    assert [loader.rows_per_epoch() for loader in ranks] == [17, 17, 18]   # 4 batches of 12, then 1 - 1 - 2 of 4
    assert whole.rows_per_epoch() == n


def test_a_batch_too_small_to_share_is_refused():
    with pytest.raises(ValueError, match="cannot be shared among 3 ranks"):
        DataLoader(np.zeros((5, 1, 2, 2), np.uint8), np.arange(5), 4, shard=(0, 3))


# ---------------------------------------------------------------- the gradients: buckets and their all-reduce


class ThreadWorld(World):
    """One rank of ``size`` threads of this process: all_reduce_sum adds the ranks' arrays, as MPI's
    would, so the bucket code runs exactly as under mpirun."""

    def __init__(self, rank, size, shared):
        self.rank, self.size, self.shared = rank, size, shared

    def all_reduce_sum(self, array):
        arrays, barrier = self.shared["arrays"], self.shared["barrier"]
        arrays[self.rank] = array.copy()
        barrier.wait()
        total = arrays[0].copy()
        for other in arrays[1:]:
            total += other
        barrier.wait()
        array[...] = total


def _gradients(model, x, y):
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_buckets_give_every_rank_the_global_batch_gradient(xp):
    """3 ranks with 2, 3 and 5 rows of a batch of 10 (unequal: a plain mean of their gradients would
    be wrong), buckets of 4 KB (several, and a parameter larger than one), and a parameter that only
    rank 2 has a gradient for: every rank ends with the gradient of the whole batch's mean loss, and
    a parameter no rank has one for keeps None."""
    with default_dtype(np.float64):
        model = create("vit-cifar/4", image_size=8, dim=16, depth=2, num_heads=2, mlp_dim=64, num_classes=3)
    rng = np.random.default_rng(0)
    model.head.weight.data[...] = rng.standard_normal(model.head.weight.shape)   # a zero head: zero gradients below
    model.to(device="cpu" if xp is np else "cuda")
    x, y = xp.asarray(rng.standard_normal((10, 3, 8, 8))), xp.asarray(rng.integers(0, 3, 10))
    expected = _gradients(model, x, y)
    assert all(float(abs(g).max()) > 0 for g in expected.values()), "a zero gradient proves nothing"
    cuts, only_two, nobody = [0, 2, 5, 10], "blocks.0.norm1.weight", "blocks.1.norm2.bias"
    expected[only_two] = expected[only_two] * 0 + _gradients(model, x[5:], y[5:])[only_two] * 5 / 10
    ranks = [copy.deepcopy(model) for _ in range(3)]
    for r, rank_model in enumerate(ranks):
        _gradients(rank_model, x[cuts[r]:cuts[r + 1]], y[cuts[r]:cuts[r + 1]])
        params = dict(rank_model.named_parameters())
        params[nobody].grad = None
        if r != 2:
            params[only_two].grad = None
    shared = {"arrays": [None] * 3, "barrier": threading.Barrier(3)}
    buckets = [GradientBuckets(list(m.parameters()), ThreadWorld(r, 3, shared), bucket_bytes=4096)
               for r, m in enumerate(ranks)]
    assert len(buckets[0].buckets) > 3
    assert any(len(b.params) == 1 and b.params[0].data.nbytes > 4096 for b in buckets[0].buckets)
    threads = [threading.Thread(target=b.average, args=(cuts[r + 1] - cuts[r],)) for r, b in enumerate(buckets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, rank_model in enumerate(ranks):
        for name, p in rank_model.named_parameters():
            if name == nobody:
                assert p.grad is None, f"rank {r}: {name} got a gradient no rank had"
                continue
            np.testing.assert_allclose(_host(p.grad), _host(expected[name]), rtol=1e-10, atol=1e-14,
                                       err_msg=f"rank {r}: {name}")


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def test_one_process_world_changes_nothing():
    world = World()
    a = np.arange(4.0)
    world.all_reduce_sum(a)
    assert np.array_equal(a, np.arange(4.0)) and world.broadcast({"k": 1}) == {"k": 1}
    assert world.seed(7) == 7 and world.shard == (0, 1) and world.writer and world.device("cuda") == "cuda"
    assert world.sum_over_ranks(np.float32(1.5), 2) == (1.5, 2.0)
    assert distributed.launched_size({"OMPI_COMM_WORLD_SIZE": "4"}) == 4 and distributed.launched_size({}) == 1
    assert distributed.launched_rank({"PMI_RANK": "3"}) == 3


class FakeWorld(World):
    """Rank 0 of 2, whose other rank answers with given values (for the checks made on gathered data)."""
    rank, size = 0, 2

    def __init__(self, other):
        self.other = other

    def gather(self, obj):
        return [obj, self.other]

    def sum_over_ranks(self, *numbers):
        return tuple(float(a) + float(b) for a, b in zip(numbers, self.other))


def test_a_run_is_refused_when_ranks_disagree_or_the_batch_does_not_split():
    cfg = TrainConfig(**RUN_CONFIG).resolved()
    other = json.dumps({**json.loads(json.dumps(cfg.__dict__, default=str)), "epochs": 3}, sort_keys=True)
    with pytest.raises(distributed.DistributedError, match=r"rank 1 was started with other settings.*epochs 3"):
        distributed.check_run(cfg, FakeWorld(other))
    same = json.dumps(json.loads(json.dumps(cfg.__dict__, default=str)), sort_keys=True)
    with pytest.raises(ValueError, match="--batch-size 33 is the global batch.*multiple of 2"):
        distributed.check_run(TrainConfig(**{**RUN_CONFIG, "batch_size": 33}).resolved(),
                              FakeWorld(same.replace('"batch_size": 32', '"batch_size": 33')))
    assert distributed.check_run(cfg, FakeWorld(same)).device == "cpu"


def test_evaluation_adds_the_ranks_sums():
    """Rank 0 evaluated 30 rows (loss 1, accuracy 1/3), rank 1 sends 90 rows' sums (loss 3 each, 60 right)."""
    class Fixed:
        def evaluate(self, model, loader):
            return {"loss": 1.0, "acc": 1 / 3}

    loader = DataLoader(np.zeros((60, 1, 2, 2), np.uint8), np.arange(60), 500, shard=(0, 2))
    result = distributed.AcrossRanks(Fixed(), FakeWorld((270.0, 60.0, 90))).evaluate(None, loader)
    assert result["loss"] == pytest.approx(300 / 120) and result["acc"] == pytest.approx(70 / 120)


def test_without_mpi4py_a_launched_rank_fails_in_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setitem(sys.modules, "mpi4py", None)           # import mpi4py -> ImportError
    monkeypatch.setattr(ranks, "_world", None)
    code, _, err = cli(capsys, "train", *RUN, "--out", tmp_path / "run")
    assert code == 1
    line = one_line(err)
    assert "rank 1:" in line and "pip install 'tinyvit[mpi]'" in line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- two ranks with mpirun


def tinyvit_cmd(*args):
    return ["-m", "tinyvit", *args]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("distributed")
    lines = ["[dataset]"] + [f"{k} = {json.dumps(v)}" for k, v in DATA.items()]
    (path / "data.toml").write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def one_process(workdir):
    """The reference: 2 epochs in one process."""
    out = workdir / "one"
    assert main(["train", *RUN, "--config", str(workdir / "data.toml"), "--out", str(out)]) == 0
    return out


def weights(run: Path) -> dict:
    arrays, meta = io.load_arrays(run / "latest.safetensors")
    return arrays, json.loads(meta["training"])


def assert_same_training(a: Path, b: Path):
    """The same weights and optimizer moments to float32 round-off (Adam divides by sqrt(v), which
    magnifies round-off in the smallest gradients), the same data order and schedule, and the same
    logged numbers."""
    arrays_a, state_a = weights(a)
    arrays_b, state_b = weights(b)
    assert sorted(arrays_a) == sorted(arrays_b)
    for name in arrays_a:
        np.testing.assert_allclose(arrays_b[name], arrays_a[name], rtol=1e-4, atol=1e-5, err_msg=name)
    assert state_a["scheduler"] == state_b["scheduler"]
    # the data order, in global batches; not the augmentation's stream, which is each rank's own
    assert {**state_a["loader"], "transform": None} == {**state_b["loader"], "transform": None}
    rows_a, rows_b = ([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in (a, b))
    assert [r["epoch"] for r in rows_a] == [r["epoch"] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b):
        for key in ("train_loss", "train_acc", "test_loss", "test_acc"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), key


def test_two_ranks_train_what_one_process_does(mpirun, workdir, one_process):
    out = workdir / "two"
    code, stdout, stderr = run_ranks(mpirun, 2, *tinyvit_cmd("train", *RUN, "--config", "data.toml", "--out", out),
                                     cwd=workdir)
    assert code == 0, stderr[-3000:]
    assert_same_training(one_process, out)
    assert stdout.count("training vit-cifar/4") == 1 and stdout.count(": best test accuracy") == 1   # rank 0 alone
    assert "data parallel over 2 ranks: global batch 32 = 2 x 16 rows" in stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in one_process.iterdir())


def test_a_run_resumes_with_another_number_of_ranks(mpirun, workdir, one_process):
    """2 ranks for the first epoch, then 1 process; and 1 process, then 2 ranks (through the CLI's
    --resume): both end as the run that never stopped."""
    first = workdir / "two-then-one"
    settings = json.dumps({**RUN_CONFIG, "out": str(first)})
    script = ("import json, sys; from tinyvit.training import TrainConfig, train; "
              "train(TrainConfig(**json.loads(sys.argv[1])), stop_after_epoch=1, progress=False)")
    code, _, stderr = run_ranks(mpirun, 2, "-c", script, settings, cwd=workdir)
    assert code == 0, stderr[-3000:]
    assert main(["train", *RUN, "--config", str(workdir / "data.toml"), "--out", str(first), "--resume"]) == 0
    assert_same_training(one_process, first)

    second = workdir / "one-then-two"
    tinyvit.training.train(TrainConfig(**{**RUN_CONFIG, "out": str(second)}), stop_after_epoch=1, progress=False)
    code, _, stderr = run_ranks(mpirun, 2, *tinyvit_cmd("train", *RUN, "--config", "data.toml", "--out", second,
                                                        "--resume"), cwd=workdir)
    assert code == 0, stderr[-3000:]
    assert_same_training(one_process, second)


def test_the_time_budget_plan_is_rank_zeros(mpirun, workdir):
    """Every rank times the trial steps, but the plan is made from rank 0's timing on all of them:
    rank 1, told here that a step takes a thousand times longer, still trains rank 0's plan (on its
    own it would plan almost no steps, stop early and leave rank 0 waiting in an all-reduce)."""
    script = ("import sys, tinyvit.training.loop as t; from tinyvit import distributed; timed = t._time_run\n"
              "def slow_on_rank_1(*args, **kwargs):\n"
              "    step_s, epoch_s = timed(*args, **kwargs)\n"
              "    return (step_s * 1000, epoch_s) if distributed.world().rank == 1 else (step_s, epoch_s)\n"
              "t._time_run = slow_on_rank_1\n"
              "from tinyvit.cli import main; sys.exit(main(sys.argv[1:]))")
    out = workdir / "budget"
    code, stdout, stderr = run_ranks(mpirun, 2, "-c", script, "train", "--dataset", "synthetic", *TINY, "--time-budget", "10s",
                                     "--batch-size", "32", "--config", "data.toml", "--out", out, cwd=workdir)
    assert code == 0, stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["epochs_trained"] >= 2 and ": best test accuracy" in stdout


def test_pretraining_on_two_ranks(mpirun, workdir):
    """Masked patch prediction goes through the same train(): its shared evaluation too."""
    out = workdir / "pretrain"
    code, stdout, stderr = run_ranks(mpirun, 2, *tinyvit_cmd("pretrain", "--dataset", "synthetic", *TINY,
                                                             "--epochs", "1", "--batch-size", "32", "--config",
                                                             "data.toml", "--out", out), cwd=workdir)
    assert code == 0, stderr[-3000:]
    row = json.loads((out / "metrics.jsonl").read_text())
    assert 0 <= row["test_acc"] <= 1 and np.isfinite(row["test_loss"])


def test_a_rank_that_fails_stops_the_others(mpirun, workdir):
    """Rank 1 fails at its third step, while rank 0 waits for it in the all-reduce: mpirun ends at
    once, non-zero, and the line names the rank and the error."""
    script = ("import sys, tinyvit.training.loop as t; from tinyvit import distributed; step = t._gradients; calls = []\n"
              "def failing(*args):\n"
              "    calls.append(1)\n"
              "    if distributed.world().rank == 1 and len(calls) == 3:\n"
              "        raise ValueError('the disk of rank 1 is full')\n"
              "    return step(*args)\n"
              "t._gradients = failing\n"
              "from tinyvit.cli import main; sys.exit(main(sys.argv[1:]))")
    code, _, stderr = run_ranks(mpirun, 2, "-c", script, "train", *RUN, "--config", "data.toml",
                                "--out", workdir / "fails", cwd=workdir, timeout=60)
    assert code != 0
    assert "tinyvit train: rank 1: the disk of rank 1 is full" in stderr
    assert "Traceback" not in stderr


def test_a_rank_that_cannot_lock_the_folder_stops_the_others(mpirun, workdir):
    """Another run holds the folder: rank 0 cannot lock it and fails; rank 1, already on its way to
    the first collective, is stopped with it."""
    out = workdir / "held"
    with RunFolderLock(out):
        code, _, stderr = run_ranks(mpirun, 2, *tinyvit_cmd("train", *RUN, "--config", "data.toml", "--out", out),
                                    cwd=workdir, timeout=60)
    assert code == 1
    assert "tinyvit: rank 0: " in stderr and "is in use by another run" in stderr


# ---------------------------------------------------------------- NCCL (a real GPU; the CuPy stand-in cannot run it)


def _gpus():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


@pytest.mark.gpu
def test_nccl_all_reduce_on_one_gpu(mpirun, tmp_path):
    """The NCCL path (communicator, dtype, pointers, stream) through a one-rank communicator: the
    buckets' average of one rank's gradients is those gradients."""
    if _gpus() < 1:
        pytest.skip("no CUDA device with CuPy here")
    script = ("import numpy as np, cupy as cp\n"
              "from mpi4py import MPI\n"
              "from tinyvit.distributed import GradientBuckets, MPIWorld\n"
              "from tinyvit.models import create\n"
              "from tinyvit import functional as F\n"
              "world = MPIWorld(MPI.COMM_WORLD)\n"
              "model = create('vit-cifar/4', dim=32, depth=2, num_heads=2, mlp_dim=64).to(device='cuda')\n"
              "model.head.weight.data[...] = cp.random.standard_normal(model.head.weight.shape, dtype=cp.float32)\n"
              "x, y = cp.random.standard_normal((8, 3, 32, 32), dtype=cp.float32), cp.arange(8) % 10\n"
              "F.cross_entropy(model(x), y).backward()\n"
              "before = {n: p.grad.copy() for n, p in model.named_parameters()}\n"
              "GradientBuckets(list(model.parameters()), world, bucket_bytes=65536).average(8)\n"
              "for n, p in model.named_parameters():\n"
              "    assert cp.allclose(p.grad, before[n], rtol=1e-6, atol=1e-9), n\n"
              "print('ok')\n")
    code, out, err = run_ranks(mpirun, 1, "-c", script)
    assert code == 0 and "ok" in out, err[-3000:]


@pytest.mark.gpu
def test_two_gpus_train_what_one_does(mpirun, workdir):
    if _gpus() < 2:
        pytest.skip("two ranks need a GPU each: fewer than 2 CUDA devices here")
    one, two = workdir / "gpu-one", workdir / "gpu-two"
    assert main(["train", *RUN, "--config", str(workdir / "data.toml"), "--device", "cuda", "--out", str(one)]) == 0
    code, _, stderr = run_ranks(mpirun, 2, *tinyvit_cmd("train", *RUN, "--config", "data.toml", "--device", "cuda",
                                                        "--out", two), cwd=workdir)
    assert code == 0, stderr[-3000:]
    assert_same_training(one, two)
