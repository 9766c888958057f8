"""Ctrl-C held back while an all-gather rank issues a run of collectives.

[Note: interrupts between collectives]
In all-gather mode every rank issues the same collectives in the same order, and a rank whose
call was cut short issues the rest of it as its peers did (See [Note: lockstep schedule]).
That works only from a state where the planner and the collectives issued agree. Python raises
KeyboardInterrupt at any bytecode: between a load's collective and the planner's record of it,
the rank would later issue that load twice, or skip one, and its peers' collectives would pair
with the wrong ones (a crash, a hang, or blocks mixed up). So SIGINT is held while a planner
step and its collectives are issued, and raised as KeyboardInterrupt as the step ends (unless
the step raised an error of its own, which then goes on). A second Ctrl-C meanwhile raises
ForcedInterrupt at Python's next chance: the rank is then out of step, and the caller breaks
off its collectives so that later ones raise instead of pairing wrongly. Python runs signal
handlers only between bytecodes: a collective blocked in C (a Gloo wait, a device sync) is
ended by the group's timeout or the watch of dead ranks, not by Ctrl-C, held or not. Only
where Python's own SIGINT handler is installed, and on the main thread, the only one Python
runs handlers on; a handler of the program's own is left alone.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_holding = False  # a step is holding SIGINT (main thread only): inner ones add nothing


class ForcedInterrupt(KeyboardInterrupt):
    """A second Ctrl-C inside a held step: it stopped the step midway."""


def _release() -> None:
    global _holding
    _holding = False
    signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    global _holding
    if (
        _holding
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    pending: list[int] = []

    def hold(sig: int, frame) -> None:
        if pending:
            _release()  # first: the step's own exit may never run its cleanup
            raise ForcedInterrupt
        pending.append(sig)

    try:
        _holding = True
        signal.signal(signal.SIGINT, hold)
        yield
    finally:
        if _holding:
            _release()
    if pending:  # the step ended normally: now the first Ctrl-C stops the run
        raise KeyboardInterrupt
