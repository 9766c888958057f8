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
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import ParamSpec, TypeVar

import torch

# Signals a program may give a handler that raises; the others stop the process by default.
_HELD = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT")
    if hasattr(signal, name)
)
_holding = False  # a step is holding signals (main thread only): inner ones add nothing

Handler = Callable[[int, FrameType | None], object]
P = ParamSpec("P")
R = TypeVar("R")


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
    except BaseException:
        if _holding:
            _restore(handlers)
        # The step's own error goes on; a held Ctrl-C adds nothing to it, other handlers run.
        _run_held(handlers, [(sig, frame) for sig, frame in pending if handlers[sig] is not signal.default_int_handler])
        raise
    if _holding:
        _restore(handlers)
    _run_held(handlers, pending)  # the step ended normally: now the held signals' handlers run


def _run_held(handlers: dict[int, Handler], pending: list[tuple[int, FrameType | None]]) -> None:
    """Run every held signal's handler, in arrival order, each once per signal as the kernel
    delivers it (two of one kind pending merge into one); the first exception one raises is
    raised once all have run."""
    raised: BaseException | None = None
    for sig in dict.fromkeys(sig for sig, _ in pending):
        try:
            handlers[sig](sig, next(frame for seen, frame in pending if seen == sig))
        except BaseException as error:
            raised = raised or error
    if raised is not None:
        raise raised


def inference_mode_off(function: Callable[P, R]) -> Callable[P, R]:
    """`function` run with inference mode off, switched by torch's C guard. What the hot path
    makes inside a call and keeps for later calls (slot buffers, their views) must not be
    inference tensors, whatever mode the caller runs in; `torch.inference_mode(False)` enters
    and exits in Python, where a second Ctrl-C (ForcedInterrupt, raised at once) can land
    between the guard's start and its end and leave the thread in inference mode for good."""

    @functools.wraps(function)
    def off(*args: P.args, **kwargs: P.kwargs) -> R:
        with torch._C._InferenceMode(False):
            return function(*args, **kwargs)

    return off
