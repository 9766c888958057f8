"""Accounting of copies, waits and block compute from device marks, settled lazily.

Marks are CUDA events on the GPU; reading one before it completed would block the host, so
records wait in a queue and are settled only once their marks are done (or after a
synchronize). The hot path never waits for the ledger.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

class Clock(Protocol):
    """Opaque device marks (CUDA events, or host times): what the ledger reads. The hot
    path's transfer engines implement it."""

    overlaps_compute: bool

    def mark(self) -> Any: ...

    def is_done(self, mark: Any) -> bool: ...

    def seconds_between(self, start: Any, end: Any) -> float: ...


# Settle once this many records are queued, so memory stays bounded over long runs.
_SETTLE_BATCH = 64


@dataclass(frozen=True)
class Interval:
    """One timeline entry, in seconds since enable."""

    track: str  # "copy" or "compute"
    name: str
    start_s: float
    duration_s: float


@dataclass(frozen=True)
class _Record:
    kind: str  # "copy", "wait" or "compute"
    name: str
    start: Any
    end: Any
    nbytes: int = 0
    block: int | None = None  # compute records while blocks are measured: the block's index


class TransferLedger:
    def __init__(self, transfer: Clock, record_timeline: bool) -> None:
        self._transfer = transfer
        self._origin = transfer.mark()
        self.records_timeline = record_timeline
        self._pending: deque[_Record] = deque()
        self.bytes_streamed = 0
        self.copies = 0
        self.copy_s = 0.0
        self.exposed_copy_s = 0.0
        self.timeline: list[Interval] = []
        # Per-block compute seconds, summed while `measuring_blocks` (automatic residency).
        self.measuring_blocks = False
        self.block_compute_s: dict[int, float] = {}

    @property
    def times_blocks(self) -> bool:
        """Whether the hot path should mark each block's compute."""
        return self.records_timeline or self.measuring_blocks

    def copied(self, name: str, nbytes: int, start: Any, end: Any) -> None:
        self.bytes_streamed += nbytes
        self.copies += 1
        self._queue(_Record("copy", name, start, end, nbytes))

    def waited(self, name: str, arrive: Any, copy_end: Any) -> None:
        """The compute stream reached `arrive` and then waited for a copy ending at `copy_end`."""
        self._queue(_Record("wait", name, arrive, copy_end))

    def computed(self, index: int, name: str, start: Any, end: Any) -> None:
        if self.times_blocks:
            self._queue(_Record("compute", name, start, end, block=index if self.measuring_blocks else None))

    def settle(self) -> None:
        """Account every queued record whose marks completed, oldest first."""
        transfer = self._transfer
        while self._pending and transfer.is_done(self._pending[0].start) and transfer.is_done(self._pending[0].end):
            self._account(self._pending.popleft())

    def _queue(self, record: _Record) -> None:
        self._pending.append(record)
        if len(self._pending) >= _SETTLE_BATCH:
            self.settle()

    def _account(self, record: _Record) -> None:
        seconds = self._transfer.seconds_between
        duration = seconds(record.start, record.end)
        if record.kind == "wait":
            self.exposed_copy_s += max(0.0, duration)
            return
        if record.kind == "copy":
            self.copy_s += duration
            if not self._transfer.overlaps_compute:
                self.exposed_copy_s += duration
        if record.block is not None:
            self.block_compute_s[record.block] = self.block_compute_s.get(record.block, 0.0) + duration
        if self.records_timeline:
            self.timeline.append(Interval(record.kind, record.name, seconds(self._origin, record.start), duration))
