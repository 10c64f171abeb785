"""How a run stops without losing work: Ctrl-C, SIGTERM and SIGHUP during training.

SIGTERM and SIGHUP (how a scheduler stops a job, how a closed terminal ends it) raise ``Stopped``,
a KeyboardInterrupt, so the training loop saves its checkpoint as it does on Ctrl-C; and while an
optimizer update is applied, all three wait until it is whole (``ctrl_c_after_block``).

Among several ranks (mpirun) a signal cannot stop one rank where it stands: the others would wait for
it in their next collective, or end it (MPI_Abort) before rank 0 has saved. There the first signal
is a request, noted (``request_stop``); at the next check, a step that every rank has reached, the
ranks share their requests (``stop_together``) and all raise Stopped at that same step, so rank 0
saves while the others wait for it. A second signal stops a rank at once, as one process stops.
"""
from __future__ import annotations

import contextlib
import signal
import threading


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (how a scheduler stops a job, how a closed terminal ends it) during train():
    handled as Ctrl-C is, so the epoch in progress is saved, not lost. The CLI exits with the status
    a shell gives a process the signal ended: 128 + ``signum`` (143 for SIGTERM, 129 for SIGHUP)."""

    def __init__(self, signum: int, together: bool = False):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.together = together          # every rank stopped at the same step (stop_together)


def raise_stopped(signum, frame):
    raise Stopped(signum)


# The stop signals this rank has received and not yet shared with the others (several ranks only).
_requested: list = []


def request_stop(signum, frame):
    """Among several ranks: note the first Ctrl-C, SIGTERM or SIGHUP for the next check; a second
    one raises at once (the ranks part wherever they are; the last checkpoint is kept)."""
    if _requested:
        raise Stopped(signum)
    _requested.append(signum)


def stop_together(world) -> None:
    """At a step every rank has reached: when any rank has received a stop signal, raise Stopped on
    every rank (with the signal of the lowest rank that had one), so that all stop at this step. In a
    single process nothing is ever noted (its signals raise at once): nothing happens."""
    signum = next((s for s in world.gather(_requested[0] if _requested else 0) if s), 0)
    if signum:
        raise Stopped(signum, together=True)


# The signals train() turns into Stopped (SIGHUP does not exist on Windows).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def stop_signals_interrupt(several_ranks: bool = False):
    """SIGTERM and SIGHUP raise Stopped during the block, in the main thread, where they would kill the
    process (their default action); an ignored one (nohup ignores SIGHUP) or a caller's own handler
    is left alone, and the previous handlers come back after. With ``several_ranks`` they, and
    Ctrl-C, are requests instead (``request_stop``), which the training loop shares at its checks."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, *STOP_SIGNALS)}
    replaced = {s: raise_stopped for s in STOP_SIGNALS if previous[s] is signal.SIG_DFL}
    if several_ranks:
        replaced = {s: request_stop for s in (*replaced, signal.SIGINT)
                    if s != signal.SIGINT or previous[s] is signal.default_int_handler}
    _requested.clear()
    try:                                  # (a signal arriving while they are installed still gets them restored)
        for s, handler in replaced.items():
            signal.signal(s, handler)
        yield
    finally:
        for s in replaced:
            signal.signal(s, previous[s])
        _requested.clear()


@contextlib.contextmanager
def ctrl_c_after_block():
    """Hold Ctrl-C (and SIGTERM and SIGHUP, while they raise Stopped) back until the block has run, so
    an update is applied whole or not at all (in the main thread, over the handlers that raise;
    elsewhere it changes nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raising = {s: handler for s in (signal.SIGINT, *STOP_SIGNALS)
               if (handler := signal.getsignal(s)) in (signal.default_int_handler, raise_stopped, request_stop)}
    pending = []
    try:
        for s in raising:
            signal.signal(s, lambda signum, frame: pending.append(signum))
        yield
    finally:
        for s, handler in raising.items():
            signal.signal(s, handler)
    for signum in pending:              # what the signals would have done: raise, or (several ranks) note
        raising[signum](signum, None)
