"""Which rank of an all-gather group is gone, and turning its loss into a StreamingError on
every survivor, with or without a launcher.

[Note: dead ranks]
A rank that dies in all-gather mode leaves its peers' collectives unmatched. With Gloo a
peer's collective fails as soon as the dead process's sockets close. With NCCL nothing fails
in Python: the collectives are queued (dlo never blocks the host), so the survivor waits in
some device synchronize (dlo's agreement read, or the pipeline's own `.cpu()`), and NCCL's
watchdog, once a collective is older than the group's timeout T, first sleeps four times
TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (60 s by default: time for other ranks to dump their
flight recorders) and only then aborts and ends the process with SIGABRT, without naming
the rank (measured on 2 H200s: alive 30 s after the timeout; benchmarks/RESULTS.md).

So every rank of a group of two or more runs a RankWatch thread from its first call:
- Heartbeat: every `period_s` it adds 1 to its counter `dlo-alive/<rank>` in the process
  group's own store (nothing new to set up) and reads its peers' counters.
- Verdict: a peer whose counter has not moved for T/2 (T for a peer never heard from: it may
  still be loading) while this rank has a collective of dlo's unfinished is lost; a store
  that stops answering for T/2 (its host rank is gone) is a loss too. T/2: to act before
  NCCL's watchdog times out the stuck collective, whose 60 s sleep (holding its work list)
  the process would otherwise wait for when it exits. That holds while the stuck collective
  was queued less than T/2 before the death (a survivor runs at most a call ahead).
  Only while a collective is unfinished: a peer that ends its job after a finished call
  leaves nothing unfinished on the others, so it is never taken for dead.
- Then: the message is kept, and every later collective of dlo and the next call's start
  raise it. The group is aborted from a side thread (`ProcessGroup.abort()`: NCCL's
  communicator is torn down, its queued kernels end, so the stuck synchronize returns; a
  pending Gloo operation is not ended by it and fails at the group's timeout). If no dlo
  hook raised the verdict within DELIVERY_GRACE_S, it is raised in the thread that runs the
  calls (`PyThreadState_SetAsyncExc`: as soon as that thread runs Python again), unless that
  thread is inside a collective of dlo's, which raises it when it returns. If it is still
  not delivered EXIT_GRACE_S later (the thread is blocked in C), the watch writes it to
  stderr and ends the process with status 1, as NCCL's own error handling would, later and
  without naming the rank.
- After the abort the survivor's queued results are garbage and the group is unusable: the
  message says so; the job must be restarted.
When a collective fails at once (Gloo), its error names the peers whose counters did not
move in PROBE_PERIODS periods (`name_loss`). Cost on the hot path: one attribute test per
collective, and on CUDA one event recorded after it (how the watch tells, without a host
wait, whether a collective is unfinished).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.distributed.distributed_c10d import _get_process_group_store

from dlo.errors import StreamingError

DELIVERY_GRACE_S = 2.0  # for a dlo hook to raise the verdict itself, before it is raised in the caller's thread
EXIT_GRACE_S = 5.0  # then for that thread to run Python again, before the process is ended
PROBE_PERIODS = 3  # a peer whose counter did not move in this many periods has stopped


class WatchedGather(Protocol):
    in_collective: bool  # a collective call is running in the calling thread

    def unfinished(self) -> bool:
        """Whether a collective this rank issued has not completed (without waiting)."""


def group_timeout_s(group: dist.ProcessGroup, device: torch.device) -> float:
    """The timeout the group's backend applies to a collective (init_process_group's or
    new_group's `timeout`)."""
    options = getattr(group._get_backend(torch.device(device.type)), "options", None)
    # A backend that does not expose its options gets torch's default timeout.
    return (options._timeout if options is not None else default_pg_timeout).total_seconds()


class RankWatch:
    """One group's heartbeat and dead-rank verdict. See [Note: dead ranks]"""

    def __init__(
        self, group: dist.ProcessGroup, rank: int, size: int, role: str, timeout_s: float, owner: WatchedGather
    ) -> None:
        """`owner`: the group's BlockGather, held weakly (the watch ends when it is
        collected: a handle dropped without disable())."""
        self.group = group
        self.rank = rank
        self.role = role
        self.peers = [r for r in range(size) if r != rank]
        self.silence_s = timeout_s / 2
        self.unheard_s = timeout_s
        self.period_s = min(1.0, self.silence_s / 5)
        self._store = _get_process_group_store(group)
        self._owner = weakref.ref(owner)
        self.lost: str | None = None  # the verdict, once made: the StreamingError's message
        self._delivered = threading.Event()
        self._stop = threading.Event()
        self._caller: int | None = None  # the thread that runs the calls
        self._thread: threading.Thread | None = None

    def serve(self) -> None:
        """At each call's start: start the watch (once), note the calling thread, and raise
        the verdict if there is one."""
        self._caller = threading.get_ident()
        if self._thread is None:
            self._store.add(_key(self.rank), 1)  # beat once now: a rank that dies early still beat
            self._thread = threading.Thread(target=self._run, name=f"dlo-rank-watch-{self.role}", daemon=True)
            self._thread.start()
        self.raise_if_lost()

    def raise_if_lost(self) -> None:
        message = self.verdict()
        if message is not None:
            raise StreamingError(message)

    def verdict(self) -> str | None:
        """The verdict's message, noted as delivered (the caller raises it), or None."""
        if self.lost is not None:
            self._delivered.set()
        return self.lost

    def name_loss(self) -> str:
        """After a collective failed at once and before any verdict: the peers that stopped
        beating within PROBE_PERIODS periods (only peers heard from: one that never beat may
        not have started its first call yet), else a generic cause."""
        if self._thread is not None and not self._stop.is_set():
            try:
                before = self._counters()
                time.sleep(PROBE_PERIODS * self.period_s)
                after = self._counters()
            except Exception as err:  # noqa: BLE001  (a store that fails is itself the finding)
                return f"its store failed too ({err}): the rank that hosts it may be gone"
            stopped = [r for r in self.peers if before[r] == after[r] and before[r] > 0]
            if stopped:
                return f"the {self.role} group lost {_ranks(stopped)} (its heartbeat stopped)"
        return "a peer failed, left or issued another collective"

    def stop(self) -> None:
        self._stop.set()

    def _counters(self) -> dict[int, int]:
        return {r: self._store.add(_key(r), 0) for r in self.peers}

    def _run(self) -> None:
        start = time.monotonic()
        heard = dict.fromkeys(self.peers, 0)
        moved = dict.fromkeys(self.peers, start)
        store_failed: float | None = None
        while not self._stop.wait(self.period_s):
            now = time.monotonic()
            if self._owner() is None:
                return
            try:
                self._store.add(_key(self.rank), 1)
                counters = self._counters()
                store_failed = None
            except Exception as err:  # noqa: BLE001  (an unreachable store is a verdict of its own)
                store_failed = now if store_failed is None else store_failed
                if now - store_failed >= self.silence_s and self._is_unfinished():
                    self._give_verdict(f"its store stopped answering for {now - store_failed:.0f} s ({err}): the "
                                       "rank that hosts it is gone or stopped")
                    return
                continue
            for r, count in counters.items():
                if count != heard[r]:
                    heard[r], moved[r] = count, now
            silent = [
                r for r in self.peers if now - moved[r] >= (self.silence_s if heard[r] else self.unheard_s)
            ]
            if silent and self._is_unfinished():
                self._give_verdict(
                    f"{_ranks(silent)} (no heartbeat for {max(now - moved[r] for r in silent):.0f} s while rank "
                    f"{self.rank} waited for it in a collective): its process is gone or stopped"
                )
                return

    def _is_unfinished(self) -> bool:
        owner = self._owner()
        return owner is not None and owner.unfinished()

    def _in_collective(self) -> bool:
        owner = self._owner()
        return owner is not None and owner.in_collective

    def _give_verdict(self, what: str) -> None:
        self.lost = (
            f"all-gather mode: the {self.role} group lost {what}. dlo aborted the group, so this rank cannot "
            "continue (its queued results are lost); restart the job"
        )
        threading.Thread(target=self.group.abort, name="dlo-group-abort", daemon=True).start()
        if self._delivered.wait(DELIVERY_GRACE_S):
            return
        caller = self._caller
        # A thread inside a collective of dlo's raises the verdict itself when it returns.
        if caller is not None and not self._in_collective():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(caller), ctypes.py_object(self._error_type()))
        if not self._delivered.wait(EXIT_GRACE_S):
            os.write(2, f"dlo: {self.lost}; the thread running the calls stayed blocked, ending the process\n".encode())
            os._exit(1)

    def _error_type(self) -> type[StreamingError]:
        """A StreamingError raised by another thread is made without arguments: this one
        carries the verdict and notes its delivery."""
        message, delivered = self.lost, self._delivered

        def init(error: StreamingError) -> None:
            StreamingError.__init__(error, message)
            delivered.set()

        return type("StreamingError", (StreamingError,), {"__init__": init, "__module__": StreamingError.__module__})


def _key(rank: int) -> str:
    return f"dlo-alive/{rank}"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
