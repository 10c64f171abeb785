"""What tinyvit.training asks of the World: the run's settings checked across the ranks, the objective
whose evaluation covers every rank's shard of the test set, and the ranks' own random streams after
a resume. Each is the identity in a single process."""
from __future__ import annotations

import json
from dataclasses import asdict, replace

import numpy as np

from .. import backend
from .ranks import DistributedError


def check_run(cfg, world):
    """The run's settings as this rank uses them: the same on every rank (a rank started with other
    flags, or another --config, would train another model: refused, naming the settings), a global
    batch that splits evenly over the ranks, and the rank's own device ('cuda' -> its GPU)."""
    if world.size == 1:
        return cfg
    everyone = world.gather(json.dumps(asdict(cfg), sort_keys=True, default=str))
    ours = json.loads(everyone[0])
    for rank, settings in enumerate(everyone):
        theirs = json.loads(settings)
        differ = sorted(name for name in ours if theirs.get(name) != ours[name])
        if differ:
            listed = ", ".join(f"{name} {theirs[name]!r} (rank 0: {ours[name]!r})" for name in differ)
            raise DistributedError(f"rank {rank} was started with other settings than rank 0: {listed}; start "
                                   "every rank with the same command")
    if cfg.batch_size % world.size:
        near = max(world.size, cfg.batch_size // world.size * world.size)
        raise ValueError(f"--batch-size {cfg.batch_size} is the global batch, split evenly over the {world.size} "
                         f"ranks: make it a multiple of {world.size} (e.g. {near})")
    return replace(cfg, device=world.device(cfg.device))


def describe(world, cfg) -> str:
    """The log line that says how the run is shared."""
    return (f"data parallel over {world.size} ranks: global batch {cfg.batch_size} = {world.size} x "
            f"{cfg.batch_size // world.size} rows, gradients averaged by all-reduce "
            f"({'NCCL' if str(cfg.device).startswith('cuda') else 'MPI'})")


class AcrossRanks:
    """An objective (training.Classification, training.MaskedPrediction) whose ``evaluate`` gives
    every rank the whole test set's loss and accuracy: each rank evaluates its shard of the test
    loader, and the sums (mean times rows) and rows are added over the ranks. So the evaluation takes
    1/N of the time, and every rank takes the same decisions on the result (best checkpoint, a
    diverged run, the time budget). Everything else is the wrapped objective's."""

    def __init__(self, objective, world):
        self.objective, self.world = objective, world

    def __getattr__(self, name):
        if name == "objective":                      # not set yet (copying): no delegation loop
            raise AttributeError(name)
        return getattr(self.objective, name)

    def evaluate(self, model, loader) -> dict:
        result = self.objective.evaluate(model, loader)
        rows = loader.rows_per_epoch()
        loss, correct, seen = self.world.sum_over_ranks(result["loss"] * rows, result["acc"] * rows, rows)
        return {"loss": loss / max(seen, 1), "acc": correct / max(seen, 1)}


def across_ranks(objective, world):
    """``objective`` itself in a single process, else wrapped in AcrossRanks."""
    return objective if world.size == 1 else AcrossRanks(objective, world)


def restart_rank_streams(world, transform, seed: int, step: int) -> None:
    """After a resume, on every rank but 0: new augmentation and dropout streams. The checkpoint holds
    rank 0's streams only (rank 0 alone writes it, and an interrupted run's ranks cannot meet to
    send theirs); restoring them on every rank would give all ranks the same crops and masks. Each
    other rank seeds its streams from (seed, step, rank) instead: reproducible, but not the numbers
    an uninterrupted run would have drawn, so with augmentation, dropout or drop path a resumed run
    of several ranks matches an unstopped one in distribution, not to the bit."""
    if world.rank == 0:
        return
    restart = world.seed(int(np.random.SeedSequence([seed, step]).generate_state(1)[0]))
    if hasattr(transform, "rng"):
        transform.rng = np.random.default_rng(restart)
    backend.manual_seed(restart + 1)
