"""Who this process is among the processes training one model, and the collectives they share.

    World       one process (the default): rank 0 of 1, every collective the identity
    MPIWorld    one of N processes started by mpirun: MPI (mpi4py) for everything on the host and
                for NumPy arrays; NCCL (cupy.cuda.nccl) for CuPy arrays, one GPU per rank

The processes are called ranks (0 .. N-1). Each has the whole model; they talk only through
collectives, calls that every rank makes at the same point of the program:

    all_reduce_sum(array)     every rank's array becomes the elementwise sum over the ranks
    broadcast(obj)            every rank gets rank 0's Python object (a plan, a state)
    broadcast_arrays(arrays)  every rank's arrays become rank 0's (the weights at the start)
    sum_over_ranks(*numbers)  every rank gets the sums of a few host numbers (losses, counts)

A rank that never reaches a collective the others are in leaves them waiting forever: that is why a
failing rank ends them all (``abort``) instead of just exiting (tinyvit/cli does it). A rank that is
stopped (SIGSTOP, Ctrl-Z in its terminal, a debugger) or hung cannot say so, and MPI has no timeout:
so each rank watches its own waits, and one that has waited COLLECTIVE_TIMEOUT_SECONDS in a
collective (TINYVIT_COLLECTIVE_TIMEOUT in the environment; 0: for ever) says so in one line and
ends every rank; the run's last checkpoint is kept, to continue with --resume.

``world()`` builds the World once per process from the environment the launcher sets, as
torch.distributed's default process group is one per process.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import numpy as np

from .. import backend

# The variables a launcher sets to the number of processes it started: Open MPI's mpirun, and the
# PMI of MPICH/Intel MPI's mpiexec (hydra).
SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")


# How long a rank waits in one collective before it ends the run (seconds; TINYVIT_COLLECTIVE_TIMEOUT).
# A step takes seconds and rank 0 writes a checkpoint between two; a quarter of an hour is a rank gone.
COLLECTIVE_TIMEOUT_SECONDS = 900.0
# A rank other than 0 reports a failure this much later than rank 0 would (tinyvit/cli too): most
# failures are every rank's alike, and rank 0, reporting first, ends the job before the others
# repeat it. One line, not one per rank.
OTHER_RANKS_WAIT_SECONDS = 3.0


class DistributedError(RuntimeError):
    """Several ranks cannot work together as started (no mpi4py, no GPU of their own, no NCCL)."""


def launched_size(env=os.environ) -> int:
    """How many processes the launcher started (1 without one), read from the environment alone:
    MPI is not started to ask."""
    for name in SIZE_VARIABLES:
        if env.get(name, "").isdigit():
            return int(env[name])
    return 1


def launched_rank(env=os.environ) -> int:
    """This process's rank as the launcher numbered it (0 without one)."""
    for name in RANK_VARIABLES:
        if env.get(name, "").isdigit():
            return int(env[name])
    return 0


class World:
    """One process, rank 0 of 1: every collective is the identity, so the training loop calls them
    unconditionally and a single process pays nothing for them."""
    rank, size, local_rank, local_size = 0, 1, 0, 1
    parted = False        # every rank has left the run at the same point (part): none waits for another

    @property
    def writer(self) -> bool:
        """Whether this rank writes the run's files and prints its log (rank 0 alone)."""
        return self.rank == 0

    @property
    def shard(self) -> tuple[int, int]:
        """(rank, size): which share of every batch this rank takes (tinyvit.data.DataLoader)."""
        return self.rank, self.size

    def seed(self, seed: int) -> int:
        """The seed of this rank's own random stream (augmentation, dropout): ``seed`` itself in a
        single process (so one process draws exactly what it always drew), else a number mixed
        from (seed, rank), so that no two ranks draw the same crops, flips and masks."""
        if self.size == 1:
            return seed
        return int(np.random.SeedSequence([seed, self.rank]).generate_state(1)[0])

    def device(self, device: str) -> str:
        """The device this rank computes on: ``device`` itself in a single process."""
        return device

    def all_reduce_sum(self, array) -> None:
        """Replace ``array`` (NumPy or CuPy, contiguous) by its elementwise sum over the ranks, in place."""

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank (a small Python object: pickled)."""
        return obj

    def broadcast_arrays(self, arrays) -> None:
        """Overwrite every rank's ``arrays`` (a list, the same shapes everywhere) with rank 0's, in place."""

    def sum_over_ranks(self, *numbers) -> tuple:
        """The sums over the ranks of a few numbers (host floats, or device scalars read here), as
        floats: the same bits on every rank, so that decisions taken on them agree."""
        return tuple(float(n) for n in numbers)

    def gather(self, obj) -> list:
        """[rank 0's obj, rank 1's, ...] on every rank."""
        return [obj]

    def barrier(self) -> None:
        """Wait until every rank is here (benchmarks start their timed steps together)."""

    def part(self) -> None:
        """Wait until every rank is here, at the end of the run (rank 0 has saved a stopped run), after
        which the ranks exit each with its status and no abort: none is left waiting in a collective."""
        self.barrier()
        self.parted = True

    def abort(self, status: int) -> None:
        """End every rank now with ``status`` (nothing to do for one process)."""


class MPIWorld(World):
    """One of several processes started by mpirun (``comm``: mpi4py's COMM_WORLD).

    NumPy arrays go through MPI; CuPy arrays through NCCL, whose communicator is made at the first
    CuPy all-reduce (every rank reaches it at the same step): rank 0 draws NCCL's unique id, MPI
    broadcasts it, and each rank joins on its own GPU. NCCL runs on the current CUDA stream, so
    the all-reduce is ordered after the kernels that filled the buffer, without the host waiting.
    The CuPy stand-in of the tests cannot run NCCL: that path runs only on real GPUs
    (tests/test_distributed.py, marked gpu)."""

    def __init__(self, comm, timeout: float = COLLECTIVE_TIMEOUT_SECONDS):
        from mpi4py import MPI
        self.comm, self.MPI = comm, MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)          # the ranks on this machine
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        node.Free()
        self._nccl = None
        self.timeout = timeout
        self._waiting = None                                  # (what, since) while in a collective
        if self.timeout:
            threading.Thread(target=self._watch, name="tinyvit-collective-watch", daemon=True).start()

    @contextlib.contextmanager
    def _collective(self, what: str):
        """Mark this rank as waiting for the others in ``what`` (the watch thread reads it)."""
        self._waiting = (what, time.monotonic())
        try:
            yield
        finally:
            self._waiting = None

    def _watch(self) -> None:
        """The daemon thread that ends every rank when this one has waited too long in a collective
        (mpi4py releases the GIL inside MPI calls, so it runs while the main thread waits)."""
        tick = min(1.0, self.timeout / 4)
        patience = self.timeout + (OTHER_RANKS_WAIT_SECONDS if self.rank else 0.0)     # rank 0 reports first
        awake = last = time.monotonic()
        while True:
            time.sleep(tick)
            now = time.monotonic()
            if now - last > tick + 1.0:      # this process was stopped itself (SIGSTOP, then SIGCONT): the
                awake = now                  # others waited for it, not it for them: count afresh
            last, waiting = now, self._waiting
            if waiting is not None and now - max(waiting[1], awake) > patience:
                print(f"tinyvit: rank {self.rank}: waited {self.timeout:g} s for the other ranks ({waiting[0]}): "
                      "one of them has stopped (SIGSTOP, Ctrl-Z, a debugger) or hangs; ending every rank (the "
                      "last checkpoint is kept: continue with --resume). TINYVIT_COLLECTIVE_TIMEOUT sets the wait "
                      "in seconds (0: for ever)", file=sys.stderr, flush=True)
                if self.MPI.Query_thread() == self.MPI.THREAD_MULTIPLE:
                    self.comm.Abort(1)                        # from this thread: MPI allows it at this level
                os._exit(1)                                   # else mpirun ends the others when this one exits

    def device(self, device: str) -> str:
        """'cuda' -> this rank's GPU, 'cuda:<local rank>' (one GPU per rank, as NCCL needs); the CPU
        stays the CPU. A named GPU other than that one is refused: two ranks would share it."""
        device = str(device).lower()
        if device == "cpu":
            return device
        mine = f"cuda:{self.local_rank}"
        if device not in ("cuda", mine):
            raise DistributedError(f"--device {device}: with {self.size} ranks each rank uses the GPU of its "
                                   f"local rank (this one {mine}); pass --device cuda")
        cp = backend.cupy_module()
        count = cp.cuda.runtime.getDeviceCount()
        if self.local_rank >= count:
            raise DistributedError(f"{self.local_size} ranks on this machine but {count} GPU(s): each rank needs "
                                   f"a GPU of its own; start at most {count} ranks per machine (mpirun -n)")
        cp.cuda.Device(self.local_rank).use()        # arrays made without a device go to this rank's GPU
        return mine

    def all_reduce_sum(self, array) -> None:
        if backend.is_cupy_array(array):
            cp = backend.cupy_module()
            nccl = self._nccl_communicator()
            nccl.allReduce(array.data.ptr, array.data.ptr, array.size, _nccl_dtype(array.dtype),
                           _nccl_module().NCCL_SUM, cp.cuda.get_current_stream().ptr)
        else:
            with self._collective("the gradients' all-reduce"):
                self.comm.Allreduce(self.MPI.IN_PLACE, array, op=self.MPI.SUM)

    def broadcast(self, obj):
        with self._collective("a broadcast from rank 0"):
            return self.comm.bcast(obj, root=0)

    def broadcast_arrays(self, arrays) -> None:
        # Once per run (the weights at the start): through the host, for NumPy and CuPy alike.
        for array in arrays:
            host = np.ascontiguousarray(backend.to_numpy(array))
            with self._collective("the broadcast of rank 0's weights"):
                self.comm.Bcast(host, root=0)
            if backend.is_cupy_array(array):
                array.set(host)
            else:
                array[...] = host

    def sum_over_ranks(self, *numbers) -> tuple:
        # Gathered, then summed in rank order on every rank: the same bits everywhere, which an
        # MPI reduction does not promise (its order of additions may differ between ranks).
        with self._collective("the sums of the losses and counts"):
            rows = self.comm.allgather(tuple(float(n) for n in numbers))
        return tuple(sum(column) for column in zip(*rows))

    def gather(self, obj) -> list:
        with self._collective("a gather of every rank's settings"):
            return self.comm.allgather(obj)

    def barrier(self) -> None:
        with self._collective("a barrier"):
            self.comm.Barrier()

    def abort(self, status: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(status)

    def _nccl_communicator(self):
        if self._nccl is None:
            nccl = _nccl_module()
            uid = self.comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
            self._nccl = nccl.NcclCommunicator(self.size, uid, self.rank)
        return self._nccl


def _nccl_module():
    """cupy.cuda.nccl, or a DistributedError naming the fix when CuPy cannot load NCCL."""
    backend.cupy_module()
    from cupy.cuda import nccl
    if not getattr(nccl, "available", False):
        raise DistributedError("several ranks on GPUs need NCCL, which CuPy could not load: pip install "
                               "'nvidia-nccl-cu12>=2.18' (or -cu13, matching the CuPy wheel)")
    return nccl


def _nccl_dtype(dtype):
    nccl = _nccl_module()
    kinds = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
             np.dtype(np.float16): nccl.NCCL_FLOAT16}
    return kinds[np.dtype(dtype)]


def collective_timeout(env=os.environ) -> float:
    """COLLECTIVE_TIMEOUT_SECONDS, or TINYVIT_COLLECTIVE_TIMEOUT's seconds (0: no watch, wait for ever)."""
    text = env.get("TINYVIT_COLLECTIVE_TIMEOUT")
    if text is None:
        return COLLECTIVE_TIMEOUT_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise DistributedError(f"TINYVIT_COLLECTIVE_TIMEOUT must be a number of seconds >= 0 (0: wait for ever), "
                               f"got {text!r}")
    return seconds


_world = None


def world() -> World:
    """This process's World, made on first use from the environment: a single process unless a
    launcher (mpirun) started several, which starts MPI."""
    global _world
    if _world is None:
        _world = _from_environment()
    return _world


def _from_environment() -> World:
    size = launched_size()
    if size <= 1:
        return World()
    timeout = collective_timeout()                   # checked before MPI starts: a bad value ends the job at once
    try:
        from mpi4py import MPI
    except ImportError:
        raise DistributedError(f"started as one of {size} processes (mpirun) but mpi4py is not installed: "
                               "pip install 'tinyvit[mpi]'") from None
    return MPIWorld(MPI.COMM_WORLD, timeout)


def abort_if_running(status: int) -> None:
    """End every rank with ``status`` when this process has joined other ranks (MPI started), since
    they may be waiting for it in a collective; return otherwise. A rank that fails before MPI
    starts needs none of this: mpirun ends the whole job when a process exits with an error; nor do
    ranks that parted together (World.part): an abort would end rank 0 before its output is out."""
    if _world is not None and _world.size > 1 and not _world.parted:
        _world.abort(status)
