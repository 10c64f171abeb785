"""How a run stops without losing work: Ctrl-C, SIGTERM and SIGHUP during training.

SIGTERM and SIGHUP (how a scheduler stops a job, how a closed terminal ends it) raise ``Stopped``,
a KeyboardInterrupt, so the training loop saves its checkpoint as it does on Ctrl-C; and while an
optimizer update is applied, all three wait until it is whole (``ctrl_c_after_block``).
"""
from __future__ import annotations

import contextlib
import signal
import threading


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (how a scheduler stops a job, how a closed terminal ends it) during train():
    handled as Ctrl-C is, so the epoch in progress is saved, not lost. The CLI exits with the status
    a shell gives a process the signal ended: 128 + ``signum`` (143 for SIGTERM, 129 for SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_stopped(signum, frame):
    raise Stopped(signum)


# The signals train() turns into Stopped (SIGHUP does not exist on Windows).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def stop_signals_interrupt():
    """SIGTERM and SIGHUP raise Stopped during the block, in the main thread, where they would kill the
    process (their default action); an ignored one (nohup ignores SIGHUP) or a caller's own handler
    is left alone, and the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    replaced = [s for s in STOP_SIGNALS if signal.getsignal(s) is signal.SIG_DFL]
    try:                                  # (a signal arriving while they are installed still gets them restored)
        for s in replaced:
            signal.signal(s, raise_stopped)
        yield
    finally:
        for s in replaced:
            signal.signal(s, signal.SIG_DFL)


@contextlib.contextmanager
def ctrl_c_after_block():
    """Hold Ctrl-C (and SIGTERM and SIGHUP, while they raise Stopped) back until the block has run, so
    an update is applied whole or not at all (in the main thread, over the handlers that raise;
    elsewhere it changes nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raising = {s: handler for s in (signal.SIGINT, *STOP_SIGNALS)
               if (handler := signal.getsignal(s)) in (signal.default_int_handler, raise_stopped)}
    pending = []
    try:
        for s in raising:
            signal.signal(s, lambda signum, frame: pending.append(signum))
        yield
    finally:
        for s, handler in raising.items():
            signal.signal(s, handler)
    if pending:
        raising[pending[0]](pending[0], None)                # raise what the first signal would have raised
