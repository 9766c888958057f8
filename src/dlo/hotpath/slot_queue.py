"""One device slot and the ordered queue of loads written into it.

[Note: one writer per slot]
A slot is written only through its SlotQueue, whatever the kind of load (See
dlo.hotpath.block_loads): loads run by the caller's thread are enqueued on the device at once;
staged loads and disk-tier reads are handed to the stager's one thread, which runs them in
submission order. The queue keeps the order of the two: before it runs a load of its own, it
supersedes the staged loads still queued on the slot (a job not started is cancelled, one
running is waited for), so no older load can land after a newer one; on the device, each load
waits for the slot's "free" and "ready" events, recorded by the load before it. A block runs
from a slot only after `settle()` waited for the slot's staged loads: their "ready" is
recorded when they enqueue.

Who holds what: the planner's record of what a slot holds is committed only once the slot's
load is queued (See [Note: slot ownership] in dlo.planning.slot_planner), and a hot-path step
is never cut at an arbitrary bytecode (See [Note: interrupts between collectives] in
dlo.hotpath.interrupts). A step that still fails midway, by an error or a second Ctrl-C, leaves
its runtime unsure of its slots: the next step first waits for every queued load, synchronizes,
and forgets what every slot holds, so each block is loaded again (rank-local); in all-gather
mode the rank's collectives are broken off instead. A slot's state (its buffer, views and
direct copies) is replaced whole: a refit cut short leaves the old buffer, or an empty one that
the slot's next load refits again.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from dlo.errors import StreamingError
from dlo.hotpath.block_loads import BlockLoads, LoadKind, SlotState
from dlo.hotpath.executors import Executor, LoadMarks
from dlo.hotpath.interrupts import inference_mode_off
from dlo.hotpath.read_ahead import ReadAhead
from dlo.hotpath.staging import Stager
from dlo.observe.ledger import TransferLedger

# [Note: slots per size class]
# Models with blocks of two sizes (Flux: double blocks of 679 MB, single blocks of 283 MB at
# 12B) would otherwise hold every slot at the larger size through the smaller blocks' phase,
# whose activations are the larger ones: the peak becomes large slots + large activations.
# So a slot's buffer follows the size of the block loaded into it: when a block needs more
# than the buffer holds, or less than `_SHRINK_BELOW` of it, the buffer goes back to the
# caching allocator and one of the block's size is taken (never more than the capacity).
# That is allocator traffic at size-class changes only (Flux: each slot twice a call), served
# from the allocator's cache after the first call; blocks of one class reuse the buffer, and a
# model of one block size never changes it. The old buffer is released on the compute
# stream after it waited for the buffer's last write (`retire_slot`: a block loaded but never
# run may still be landing), and the new one is written only after the compute stream's work
# queued so far (`allocate_slot` records the slot free there), so memory the allocator hands
# over between streams is never written and read at once.
# In all-gather mode slots keep the full size: there a load may fail only in its collective,
# which fails the whole group. An allocation failing on one rank would leave that rank one
# collective behind its peers, each then matching the other's next collective with the wrong one.
_SHRINK_BELOW = 0.8


@dataclass(frozen=True)
class _Job:
    """A staged load handed to the stager."""

    name: str
    nbytes: int
    future: Future[LoadMarks]


class SlotQueue:
    def __init__(
        self,
        state: SlotState,
        loads: BlockLoads,
        executor: Executor,
        stager: Stager | None,
        ledger: TransferLedger,
        capacity: int,
        fixed_size: bool,
        read_ahead: ReadAhead | None = None,
    ) -> None:
        """`capacity`: the most a refit may take; `fixed_size`: never refit (all-gather mode);
        `read_ahead`: the disk tier's reads (its blocks load through the stager)."""
        self.state = state
        self._read_ahead = read_ahead
        self._loads = loads
        self._executor = executor
        self._stager = stager
        self._ledger = ledger
        self._capacity = capacity
        self._fixed_size = fixed_size
        self._jobs: list[_Job] = []  # staged loads not yet waited for, oldest first
        self.ready_mark: Any = None  # when the last load's block can run

    def load(self, index: int) -> None:
        """Queue block `index` into the slot, after everything queued on it."""
        block = self._loads.blocks[index]
        with torch.profiler.record_function(f"dlo::h2d ({block.name})"):
            self._fit(index)
            state = self.state
            kind = self._loads.kinds[index]
            if kind is LoadKind.STAGED:  # See [Note: staged loads]
                assert self._stager is not None
                future = self._stager.submit(
                    lambda staging: self._loads.pack_tasks(index, staging),
                    lambda staging: self._loads.load(index, state, staging),
                )
                self._jobs.append(_Job(block.name, self._loads.link_bytes(index), future))
                return
            if kind is LoadKind.READ:  # See [Note: the disk tier]
                assert self._stager is not None and self._read_ahead is not None
                future = self._stager.submit_read(self._read_ahead, index, partial(self._loads.load, index, state))
                self._jobs.append(_Job(block.name, self._loads.link_bytes(index), future))
                return
            self.supersede()
            if kind is LoadKind.READ_GATHERED:  # a collective: issued here, in plan order (See [Note: shards read from disk])
                assert self._read_ahead is not None
                try:
                    marks = self._read_ahead.copy_out(index, self._executor, partial(self._loads.load, index, state))
                except Exception as failure:
                    self._loads.break_off(f"block {block.name!r}'s shard was not read and gathered ({failure})")
                    raise
                self._account(block.name, self._loads.link_bytes(index), marks)
                return
            self._account(block.name, self._loads.link_bytes(index), self._executor.run(self._loads.load(index, state)))

    def settle(self) -> None:
        """Wait for every staged load queued on the slot, all of them even when one failed,
        then raise the first failure."""
        jobs = self._jobs
        # Waited for before they leave the queue: a wait cut short leaves them for the next.
        failures = [error for job in jobs if (error := job.future.exception()) is not None]
        for job in jobs:
            if job.future.exception() is None:
                self._accept(job)
        self._jobs = []
        if failures:
            raise failures[0]

    def supersede(self) -> None:
        """The slot is about to be written again: staged loads not started are cancelled, the
        others waited for (their failures no longer matter: nobody reads what they wrote)."""
        for job in self._jobs:
            if not job.future.cancel() and job.future.exception() is None:
                self._accept(job)
        self._jobs = []

    @inference_mode_off  # a slot's buffer is kept for later calls: See BlockLoads.__init__
    def release(self) -> None:
        """The slot's buffer goes back to the caching allocator; its next load takes one again
        (as a refit does). The device must be idle: See RankLocalRuntime.release_slots."""
        self.supersede()
        self.state = self._loads.state_of(self._executor.retire_slot(self.state.slot))

    @inference_mode_off  # a slot's buffer is kept for later calls: See BlockLoads.__init__
    def _fit(self, index: int) -> None:
        """Give the slot a buffer of block `index`'s size class. See [Note: slots per size class]"""
        block = self._loads.blocks[index]
        need, size = block.slot_bytes, self.state.size
        if need <= size and (need >= _SHRINK_BELOW * size or self._fixed_size):
            return
        if need > self._capacity:
            raise StreamingError(f"streamed block {block.name!r} is larger than the slots")
        self.supersede()  # nothing queued may write the old buffer later
        # Every reference to the old buffer goes before the new one is taken, so the two are
        # never held at once. If taking it fails, the slot stays empty: its next load tries again.
        self.state = self._loads.state_of(self._executor.retire_slot(self.state.slot))
        self.state = self._loads.state_of(self._executor.allocate_slot(need))

    def _accept(self, job: _Job) -> None:
        self._account(job.name, job.nbytes, job.future.result())

    def _account(self, name: str, nbytes: int, marks: LoadMarks) -> None:
        self.ready_mark = marks.ready  # when the block can run: dequantized, if float8
        self._ledger.copied(name, nbytes, marks.start, marks.copied)  # the copy alone: the link's rate
