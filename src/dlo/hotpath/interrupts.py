"""Signals held back while the hot path changes its own state.

[Note: interrupts between collectives]
A Python signal handler may raise (Ctrl-C's KeyboardInterrupt, a program's own alarm), and
Python runs it between any two bytecodes. Inside a step of the hot path (a block's start: the
planner's decision, its loads queued, the slot's events recorded; a block's end; a slot refit;
a call's start and end) an exception at an arbitrary bytecode would leave the planner's
record, the slots and their events disagreeing: a slot recorded as holding a block whose copy
was never queued, an event never recorded that a later copy should wait for. In all-gather
mode it also breaks lockstep: between a load's collective and the planner's record of it the
rank would later issue that load twice, or skip one, and its peers' collectives would pair
with the wrong ones (a crash, a hang, or blocks mixed up).

So every step holds the handlers of Python's own SIGINT and of any signal with a handler
written in Python: a signal that arrives meanwhile is recorded, and its handler runs as the
step ends (unless the step raised an error of its own, which then goes on). A second Ctrl-C
inside a held step raises ForcedInterrupt at once: the step stopped midway, so its runtime no
longer trusts its own state. Rank-local, the next step then starts by waiting for every queued
load and forgetting what every slot holds (See [Note: one writer per slot] in
dlo.hotpath.slot_queue); in all-gather mode the rank is out of step with its peers, and its
collectives are broken off so that later ones raise "restart the job" instead of pairing
wrongly (See [Note: lockstep schedule] in dlo.hotpath.gather). Python runs signal handlers only
between bytecodes and only on the main thread: a collective blocked in C (a Gloo wait, a device
sync) is ended by the group's timeout or the watch of dead ranks, not by Ctrl-C, held or not;
a step on another thread holds nothing (no handler runs there).

Cost: two `signal.signal` calls per handled signal and step (about 2 µs each on the CPU of the
test machine; benchmarks/RESULTS.md has the per-block figure).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

# Signals a program may give a handler that raises; the others stop the process by default.
_HELD = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT")
    if hasattr(signal, name)
)
_holding = False  # a step is holding signals (main thread only): inner ones add nothing

Handler = Callable[[int, FrameType | None], object]


class ForcedInterrupt(KeyboardInterrupt):
    """A second Ctrl-C inside a held step: it stopped the step midway."""


def _python_handlers() -> dict[int, Handler]:
    return {sig: handler for sig in _HELD if callable(handler := signal.getsignal(sig))}


def _restore(handlers: dict[int, Handler]) -> None:
    global _holding
    _holding = False
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    global _holding
    if _holding or threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = _python_handlers()
    pending: list[tuple[int, FrameType | None]] = []

    def hold(sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT and handlers[sig] is signal.default_int_handler and any(
            seen == signal.SIGINT for seen, _ in pending
        ):
            _restore(handlers)  # first: the step's own exit may never run its cleanup
            raise ForcedInterrupt
        pending.append((sig, frame))

    try:
        _holding = True
        for sig in handlers:
            signal.signal(sig, hold)
        yield
    finally:
        if _holding:
            _restore(handlers)
    # The step ended normally: now the held signals' handlers run, in arrival order.
    for sig, frame in pending:
        handlers[sig](sig, frame)
