"""Reading disk-tier blocks ahead of their loads, into a few host buffers.

[Note: the disk tier]
Under `host_budget_gib`, the blocks planned onto disk (See [Note: which blocks stay in RAM] in
dlo.planning.host_tier) are read from their checkpoint or cache files on every use, with
direct I/O (dlo.host.direct_reads), into read buffers that are page-locked like staging
buffers; their copies into a slot go straight from there. The page cache does not grow and
each use reads the block once: a buffer never keeps a block for a later use. The blocks that
stay in host memory are read once at enable(), the same way, into private copies, and the
pages enable() read through the mapping are dropped at its end (dlo.backend.disk_tier), so
what the budget holds is this process's own memory and the checkpoint is not left cached.

The reads run on a thread of their own, ahead of the loads: `ReadAhead` keeps its buffers
filled with the next disk blocks in cyclic index order after the last one taken, so the disk
works while RAM blocks compute, across the end of a call into the next. A load of a disk
block is a staged load (the stager's one thread, in slot-queue order: See [Note: one writer
per slot] in dlo.hotpath.slot_queue): it takes the block's buffer, waiting for its read if it
is not done (a block not predicted is read first, evicting a read not yet taken), enqueues
the copies out of it, records the event they end with and gives the buffer back. The buffer
is read into again only after that event, so no read overwrites bytes a copy still reads.

A read that fails (the file truncated or unreadable since enable()) is read again when its
block is taken, and a second failure fails the load, as a failed staged load does; the block
is read again at its next use.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dlo.errors import StreamingError
from dlo.host.block_sources import ReadSource
from dlo.host.direct_reads import DiskReader
from dlo.host.pinned_buffer import HostBuffer, host_buffers
from dlo.hotpath.executors import BlockLoad, Executor, LoadMarks


class _State(enum.Enum):
    FREE = "free"
    READING = "reading"
    FILLED = "filled"
    TAKEN = "taken"


@dataclass(eq=False)
class ReadBuffer:
    """One read buffer: what it holds (`block`, in `state`), and the event its last copies
    out recorded (read into again only after it)."""

    host: HostBuffer
    copied_out: Any
    state: _State = _State.FREE
    block: int | None = None
    failure: BaseException | None = None
    stale: bool = field(default=False)  # its block left the disk tier while it was being read

    @property
    def tensor(self) -> torch.Tensor:
        return self.host.tensor


class ReadAhead:
    def __init__(
        self,
        sources: dict[int, ReadSource],
        reader: DiskReader,
        count: int,
        nbytes: int,
        pin: bool,
        copied_out_event: Any,
    ) -> None:
        """`sources`: block index -> its disk source; `count` buffers of `nbytes`;
        `copied_out_event()` makes a buffer's event (the executor's staging_event)."""
        self._sources = dict(sources)
        self._order = sorted(self._sources)
        self._reader = reader
        self._buffers = [ReadBuffer(host, copied_out_event()) for host in host_buffers(count, nbytes, pin)]
        # Entered through the lock itself, not the condition: the lock's own __exit__ is C, so
        # an interrupt at any line (even a second Ctrl-C inside a held step) never leaves it held.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._wanted: list[int] = []  # taken blocks no buffer holds or reads: read these first
        self._after: int | None = None  # the last block taken: read-ahead continues after it
        self._stopped = False
        self.read_s = 0.0  # summed read time (the reader thread's)
        self.wait_s = 0.0  # time loads waited for reads (the stager's thread)
        self.reads = 0
        self._thread = threading.Thread(target=self._run, name="dlo-read-ahead", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            for buffer in self._buffers:
                buffer.host.unpin()
            raise

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(self._order)

    @property
    def buffer_bytes(self) -> int:
        return sum(b.host.nbytes for b in self._buffers)

    @property
    def bytes_read(self) -> int:
        return self._reader.bytes_read

    @property
    def direct(self) -> bool:
        return self._reader.direct

    def wait_idle(self) -> None:
        """Wait until no read runs and none is due (every buffer holds its next block, or
        the reads stopped)."""
        with self._lock:
            while not self._stopped and (
                self._next_read() is not None or any(b.state is _State.READING for b in self._buffers)
            ):
                self._cond.wait()

    def take(self, index: int) -> ReadBuffer:
        """Block `index`'s buffer once its read is done; give it back after enqueuing the
        copies out of it. A failed read is read again once (a read ahead may have failed on
        what was true then); a second failure is raised, the buffer given back."""
        started = time.perf_counter()
        retried = False
        while True:
            held = self._filled(index)
            if held.failure is None:
                break
            failure, held.failure = held.failure, None
            self.give_back(held)
            if retried:
                raise failure
            retried = True
        self.wait_s += time.perf_counter() - started
        return held

    def copy_out(self, index: int, executor: Executor, load: Callable[[torch.Tensor], BlockLoad]) -> LoadMarks:
        """Take block `index`'s buffer (`take`), run `load(buffer)`, which copies out of it,
        then give the buffer back with the event those copies end with."""
        buffer = None
        try:
            buffer = self.take(index)
            return executor.run(load(buffer.tensor))
        finally:  # copies enqueued before a failure still read the buffer: it is reused after them
            if buffer is not None:
                executor.record_copied_out(buffer.copied_out)
                self.give_back(buffer)

    def _filled(self, index: int) -> ReadBuffer:
        with self._lock:
            while True:
                held = self._holding(index)
                if held is not None and held.state is _State.FILLED:
                    break
                if self._stopped:
                    raise StreamingError(f"block {index} was to be read from disk after the reads stopped")
                if held is None and index not in self._wanted:
                    self._wanted.append(index)
                    self._cond.notify_all()
                self._cond.wait()
            if index in self._wanted:
                self._wanted.remove(index)
            held.state = _State.TAKEN
            self._after = index
            self._cond.notify_all()
        return held

    @contextlib.contextmanager
    def borrowed(self) -> Iterator[torch.Tensor]:
        """Between calls: one read buffer's memory, for a read outside the read-ahead (no read
        goes into it meanwhile; a block it held is read again when needed)."""
        with self._lock:
            while True:
                if self._stopped:
                    raise StreamingError("a read buffer was asked for after the reads stopped")
                held = next((b for b in self._buffers if b.state is _State.FREE), None) or next(
                    (b for b in self._buffers if b.state is _State.FILLED and b.block not in self._wanted), None
                )
                if held is not None:
                    break
                self._cond.wait()
            held.state, held.block, held.failure = _State.TAKEN, None, None
        try:
            held.copied_out.synchronize()  # the copies out of its last block are done
            yield held.tensor
        finally:
            self.give_back(held)

    def give_back(self, buffer: ReadBuffer) -> None:
        with self._lock:
            buffer.state, buffer.block = _State.FREE, None
            self._cond.notify_all()

    def forget(self, index: int, for_good: bool = False) -> None:
        """Block `index` is not read from disk now (kept on the device; `remember` undoes it),
        or never again (`for_good`: its source was replaced): no read of it is kept or
        started. No load of it may be queued."""
        with self._lock:
            if index in self._order:  # first: the reader takes only blocks with a source
                self._order.remove(index)
            if for_good:
                self._sources.pop(index, None)
            for buffer in self._buffers:
                if buffer.block == index and buffer.state is _State.FILLED:
                    buffer.state, buffer.block, buffer.failure = _State.FREE, None, None
                elif buffer.block == index and buffer.state is _State.READING:
                    buffer.stale = True
            self._cond.notify_all()

    def remember(self, index: int) -> None:
        """Block `index` streams from disk again (demoted from the device)."""
        with self._lock:
            if index in self._sources and index not in self._order:
                bisect.insort(self._order, index)
                self._cond.notify_all()

    def add(self, index: int, source: ReadSource, streamed: bool) -> None:
        """Block `index` is read from `source` from now on (moved from host memory to disk);
        `streamed`: it streams now (False: kept on the device, read only once demoted)."""
        with self._lock:
            self._sources[index] = source
        if streamed:
            self.remember(index)

    def _holding(self, index: int) -> ReadBuffer | None:
        """The buffer holding or reading block `index` for its next use."""
        for buffer in self._buffers:
            if buffer.block == index and buffer.state in (_State.READING, _State.FILLED) and not buffer.stale:
                return buffer
        return None

    def _ahead(self) -> list[int]:
        """The disk blocks expected next, in order, at most one per buffer."""
        order = self._order
        if not order:
            return []
        start = 0 if self._after is None else next((k for k, i in enumerate(order) if i > self._after), 0)
        return [order[(start + k) % len(order)] for k in range(min(len(order), len(self._buffers)))]

    def _next_read(self) -> tuple[ReadBuffer, int] | None:
        """What to read into which buffer now (under the lock): a wanted block first, into a
        free buffer or over a read nobody wants yet; else the next expected block no buffer
        holds, into a free buffer or over a read neither wanted nor expected."""
        free = next((b for b in self._buffers if b.state is _State.FREE), None)
        for index in self._wanted:
            if self._holding(index) is None and index in self._sources:
                spare = free or next(
                    (b for b in self._buffers if b.state is _State.FILLED and b.block not in self._wanted), None
                )
                return (spare, index) if spare is not None else None
        ahead = self._ahead()
        if free is None:  # a read nobody expects soon (the order changed) gives way to one expected
            free = next(
                (b for b in self._buffers if b.state is _State.FILLED and b.block not in ahead and b.block not in self._wanted),
                None,
            )
        if free is None:
            return None
        for index in ahead:
            if self._holding(index) is None:
                return free, index
        return None

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and (chosen := self._next_read()) is None:
                    self._cond.wait()
                if self._stopped:
                    return
                buffer, index = chosen
                buffer.state, buffer.block, buffer.failure, buffer.stale = _State.READING, index, None, False
                source = self._sources[index]
            started = None
            try:
                buffer.copied_out.synchronize()  # the copies out of its last block are done
                started = time.perf_counter()  # the read alone: its duration gives the disk's rate
                source.read(self._reader, buffer.tensor)
            except Exception as failure:  # handed to the load that takes it
                buffer.failure = failure
            if started is not None:
                self.read_s += time.perf_counter() - started
            with self._lock:
                self.reads += 1
                if buffer.stale:
                    buffer.state, buffer.block, buffer.failure, buffer.stale = _State.FREE, None, None, False
                else:
                    buffer.state = _State.FILLED
                self._cond.notify_all()

    def stop(self) -> None:
        """Stop reading (a read under way finishes first); a load still waiting for a read
        fails. Idempotent; after the stager stopped (its jobs may wait for reads)."""
        with self._lock:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()

    def close(self) -> None:
        """Stop, close the files, unpin the buffers (the device must be synchronized first if
        copies out of them may still run)."""
        self.stop()
        self._reader.close()
        for buffer in self._buffers:
            buffer.host.unpin()

