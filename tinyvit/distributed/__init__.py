"""Data-parallel training: one model trained by N processes, MPI (mpi4py over Open MPI) between CPUs,
NCCL (cupy.cuda.nccl) between GPUs, one GPU per process.

    mpirun -n 4 tinyvit train ...            # --batch-size stays the global batch

Every process ("rank") holds the whole model and the whole dataset. Each step:

    1. every rank draws the same epoch order (same seed) and takes its contiguous slice of the
       global batch: rows [r B/N, (r+1) B/N) on rank r            tinyvit.data.DataLoader(shard=...)
    2. forward and backward on its B/N rows, as one process would on B
    3. all-reduce: the ranks' gradients, weighted by their rows, summed and divided by the rows
       of all ranks = the gradient of the mean loss over the B rows (buckets.py), before clipping,
       so that the clipping norm is the global one
    4. every rank applies the same update to the same weights, so they stay equal without ever being
       sent again (rank 0's are broadcast once, at the start)

Rank 0 alone writes the run's files and prints; evaluation is shared (each rank evaluates its
shard of the test set and the sums are added: training.AcrossRanks); the loss and accuracy of
the training log are summed over the ranks every 20 steps. Augmentation, dropout and drop path draw
from streams of each rank's own (World.seed): a run of N ranks equals one process with the same
global batch, to float32 round-off, when none of them is on.

When something goes wrong:

    a failure          one line: rank 0's when every rank fails alike (a bad flag, a missing dataset;
                       the other ranks hold theirs back a moment and are ended with the job), else one
                       naming the rank; then every rank ends (MPI_Abort). Open MPI's mpirun adds its own
                       banner; `mpirun -q` (--quiet) leaves it out.
    Ctrl-C, SIGTERM    a rank cannot stop where it stands (the others would wait for it, or it would end
    and SIGHUP         them before rank 0 has saved): the signal is noted, and at the next check (every
                       20 steps, and after each epoch) the ranks share what they received; if any rank
                       has a signal, all stop at that step, rank 0 saves latest.safetensors as one process
                       does while the others wait, and each exits 130 / 143 / 129, which mpirun returns
                       (a scheduler such as SLURM signals every task; one rank signalled is enough).
                       A second signal stops a rank at once (the last checkpoint kept). Open MPI's mpirun,
                       when it is itself signalled, forwards the signal and exits 1 whatever the ranks
                       return (4.1: nothing in the ranks changes that); the checkpoint is saved either way.
    a stopped rank     (SIGSTOP, Ctrl-Z in its terminal, a debugger) or a hung one: the others would wait
                       in the next collective for ever, since MPI has no timeout. Each rank watches its
                       waits: after TINYVIT_COLLECTIVE_TIMEOUT seconds (default 900; 0: for ever) in one
                       collective it says so in one line and ends every rank, the stopped one included;
                       the last checkpoint is kept for --resume.

    ranks.py      World (one process), MPIWorld (mpirun), NCCL, abort, the watch on collectives
    buckets.py    the gradient all-reduce in buckets
    training.py   the run's settings checked across ranks, shared evaluation, streams after a resume
"""
from .buckets import BUCKET_BYTES, GradientBuckets, average_gradients as _average_gradients
from .training import AcrossRanks, across_ranks, check_run, describe, restart_rank_streams
from .ranks import (OTHER_RANKS_WAIT_SECONDS, DistributedError, MPIWorld, World, abort_if_running, launched_rank,
                    launched_size, world)


def average_gradients(model, rows: int) -> None:
    """All-reduce ``model``'s gradients over this process's world (buckets.py); in a single process,
    nothing. ``rows``: this rank's rows in the step."""
    _average_gradients(model, rows, world())


def rank_prefix() -> str:
    """'rank R: ' for a process that mpirun started among several, else '': error messages say
    which rank failed."""
    return f"rank {launched_rank()}: " if launched_size() > 1 else ""


__all__ = ["AcrossRanks", "BUCKET_BYTES", "DistributedError", "OTHER_RANKS_WAIT_SECONDS", "GradientBuckets",
           "MPIWorld", "World",
           "abort_if_running", "across_ranks", "average_gradients", "check_run", "describe", "launched_rank",
           "launched_size", "rank_prefix", "restart_rank_streams", "world"]
