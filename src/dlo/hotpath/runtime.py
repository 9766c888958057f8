"""The per-block hooks shared by both runtimes: wait for the block's slot, point its tensors
there, queue the next blocks' loads, and release the slot when the block is done.

`RankLocalRuntime` (dlo.hotpath.rank_local) streams whole blocks from this rank's host copy and
learns the execution order; `LockstepRuntime` (dlo.hotpath.lockstep) rebuilds blocks from
every rank's shard in the plan's static order. Both run the same steps over the same parts:
the planner's decisions (dlo.planning.slot_planner), one queue per slot (dlo.hotpath.slot_queue),
one executor (dlo.hotpath.executors). Each step runs inside `_step()`, which holds signals
(See [Note: interrupts between collectives]) and says what a step cut short leaves behind.

[Note: token embeddings looked up on the host]
A text encoder's token embedding is its largest tensor (UMT5-XXL: 256k rows of 4096, 2.1 GB of
its 11.4 GB), and a call reads a few hundred of its rows. Streamed, each prompt would copy all
of it over the link. A block named in `OffloadPlan.host_lookups` (a plain `nn.Embedding`, whose
forward gathers rows and computes nothing) never takes a slot: its call points its weight at
views of its host copy, runs on the CPU with the indices copied there, and its output is
copied to the device (`StreamedCall`), while the blocks after it are already being loaded. A
gather copies the rows' bits, so the output equals the device's lookup. Between calls its
weight is a stand-in on the device like every streamed block's (`module.device`, which
pipelines read, stays the device). Promoted (used through a tied alias, or opened by
`editing()`), it runs on the device like any resident block; demoted, on the host again, from
its host copy as rewritten. Only a private host copy of the layout's dtypes can serve it:
enable() refuses host lookups from a mapping (`HostWeightPlan`) and in all-gather mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from dlo.errors import StreamingError
from dlo.host.block_sources import BlockSource, ReadSource
from dlo.hotpath.block_loads import BlockLoads
from dlo.hotpath.executors import DeviceSlot, Executor
from dlo.hotpath.gather import BlockGather
from dlo.hotpath.read_ahead import ReadAhead
from dlo.hotpath.slot_queue import SlotQueue
from dlo.hotpath.staging import Stager
from dlo.hotpath.streamed_block import StreamedBlock
from dlo.observe.ledger import TransferLedger
from dlo.planning.slot_planner import SlotPlanner


class StreamingRuntime:
    lockstep = False  # the planner keeps the static order (all-gather mode)

    def __init__(
        self,
        blocks: Sequence[StreamedBlock],
        slots: Sequence[DeviceSlot],
        executor: Executor,
        ledger: TransferLedger,
        stager: Stager | None = None,
        gather: BlockGather | None = None,
        read_ahead: ReadAhead | None = None,
    ) -> None:
        """`stager`: packs mapped blocks into staging buffers (else they are copied directly
        from their registered mapping) and runs disk-tier loads; `gather`: all-gather mode's
        collectives; `read_ahead`: the disk tier's reads (See [Note: the disk tier])."""
        self.blocks = tuple(blocks)
        self.executor = executor
        self.ledger = ledger
        self.stager = stager
        self.gather = gather
        self.read_ahead = read_ahead
        self.loads = BlockLoads(self.blocks, executor, gather, staged=stager is not None)
        self._landing_bytes = executor.landings[0].numel() if executor.landings else 0
        on_host = frozenset(i for i, block in enumerate(self.blocks) if block.on_host)
        self.planner = SlotPlanner(len(self.blocks), len(slots), lockstep=self.lockstep, on_host=on_host)
        self._on_host_now: set[int] = set()  # running from their host copy
        self._use_slots(slots)
        self._compute_start: dict[int, Any] = {}
        self.promoted: dict[int, torch.Tensor] = {}  # block index -> its own device memory

    def _use_slots(self, slots: Sequence[DeviceSlot]) -> None:
        # What every slot is sized for, the largest streamed block; a slot's buffer is that or,
        # between blocks of a smaller size class, smaller. See [Note: slots per size class]
        self.slot_capacity = slots[0].buffer.numel() if slots else 0
        self.queues = [
            SlotQueue(
                self.loads.state_of(slot), self.loads, self.executor, self.stager, self.ledger,
                self.slot_capacity, fixed_size=self.lockstep, read_ahead=self.read_ahead,
            )
            for slot in slots
        ]

    @property
    def slots(self) -> list[DeviceSlot]:
        return [queue.state.slot for queue in self.queues]

    @property
    def slot_bytes(self) -> int:
        """The most device memory the slots hold at once."""
        return len(self.queues) * self.slot_capacity

    @property
    def held_bytes(self) -> int:
        """The device memory the runtime holds now: slots at their capacity, landing buffers and
        promoted blocks."""
        landing = sum(buffer.numel() for buffer in self.executor.landings)
        return self.slot_bytes + landing + sum(memory.numel() for memory in self.promoted.values())

    @property
    def pack_s(self) -> float:
        return self.stager.pack_s if self.stager is not None else 0.0

    def _step(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.executor.device

    def is_running(self, index: int) -> bool:
        """Block `index` has started and not ended: from its slot or its host copy."""
        return self.planner.is_running(index) or index in self._on_host_now

    def before_block(self, index: int) -> bool:
        """Returns whether the block runs on the host (See [Note: token embeddings looked up on
        the host]): its caller moves its inputs there and its outputs back."""
        if torch.is_grad_enabled():
            # Autograd would save views of a slot that the next copies overwrite.
            raise StreamingError(
                "dlo streams weights for inference only: call the model under torch.inference_mode() "
                "or torch.no_grad()"
            )
        block = self.blocks[index]
        block.check_intact()
        if self.planner.is_resident(index):  # promoted: its tensors are its own device memory
            return False
        self.executor.check_not_capturing()
        if self.planner.runs_on_host(index):
            with self._step():
                self._start_on_host(index)
            return True
        with self._step():
            self._enter(index)
            self._start_block(index)
        if self.ledger.times_blocks:
            self._compute_start[index] = self.executor.mark()
        return False

    def _start_on_host(self, index: int) -> None:
        """Queue the loads of the blocks after block `index`, then point it at its host copy."""
        loads, after = self.planner.decide_preload(index)
        for load in loads:
            self.queues[load.slot].load(load.block)
        self.planner.record(after)
        self.planner.started_on_host(index)
        block = self.blocks[index]
        self._on_host_now.add(index)  # first: an interrupt after it leaves a block that is released
        block.point_at(block.source.restored(block.layout, block.wire))

    def _enter(self, index: int) -> None:
        """Checks before block `index` starts (all-gather mode: the schedule)."""

    def _start_block(self, index: int) -> None:
        """Queue what block `index` needs and point it at its slot, then commit the planner's
        decision. Cut short, nothing is committed: See [Note: one writer per slot]"""
        block = self.blocks[index]
        start = self.planner.decide(index)
        if start.demand is not None:
            self.queues[start.slot].load(index)
        queue = self.queues[start.slot]
        # Marked before waiting for a staged load, so host time spent packing counts as
        # exposed once the device runs out of queued work.
        arrive = self.executor.mark() if self.executor.overlaps_compute else None
        queue.settle()
        if arrive is not None:
            self.ledger.waited(block.name, arrive, queue.ready_mark)
        self.executor.wait_ready(queue.state.slot)
        view = queue.state.views[index]
        if view is None:  # a block demoted without replace_slots() sizing the slots for it
            raise StreamingError(f"streamed block {block.name!r} is larger than the slots")
        for load in start.prefetch:
            self.queues[load.slot].load(load.block)
        self.planner.commit(start)
        block.point_at(view)  # last: a block pointed at a slot is one the planner counts as running

    def after_block(self, index: int) -> None:
        block = self.blocks[index]
        if index in self._on_host_now:
            block.point_at(block.placeholders)
            self._on_host_now.discard(index)
            return
        if not self.planner.is_running(index):  # before_block raised before the block started
            return
        # Not a held step (it runs once per block, and each hold costs system calls): in this
        # order, an interrupt anywhere leaves the block running, and the next call's start
        # releases it again.
        slot_index = self.planner.slot_of(index)
        assert slot_index is not None
        self.executor.mark_free(self.queues[slot_index].state.slot)
        block.point_at(block.placeholders)
        self.planner.end(index)
        if index in self._compute_start:
            self.ledger.computed(index, block.name, self._compute_start.pop(index), self.executor.mark())

    def start_call(self) -> None:
        """Before the root module runs: blocks still marked running were interrupted by a
        BaseException (torch runs no forward hook for those); their slots are released."""
        with self._step():
            self.release_running()

    def end_call(self) -> None:
        """After the root module ran (or raised)."""

    def release_running(self) -> None:
        """Blocks still marked running (a BaseException skipped their end) are over: their
        slots are free and their tensors stand-ins again. No collective: safe in any mode."""
        for index, slot_index in self.planner.release_running():
            self.executor.mark_free(self.queues[slot_index].state.slot)
            self.blocks[index].point_at(self.blocks[index].placeholders)
        for index in self._on_host_now:
            self.blocks[index].point_at(self.blocks[index].placeholders)
        self._on_host_now.clear()

    def close_call(self) -> None:
        """disable(), before anything is released: close a call an interrupt left open (See
        LockstepRuntime); rank-local mode has nothing to close."""

    def restore_blocks(self, weights: bool = True) -> None:
        """Give every block ordinary CPU tensors (disable()), or with `weights` False its
        stand-ins for good (disable(restore=False): nothing is copied)."""
        with self._step():
            self.release_running()
            for block in self.blocks:
                if weights:
                    block.restore()
                else:
                    block.point_at(block.placeholders)

    def discard_loaded(self, indices: Sequence[int]) -> None:
        """Between calls, after the host copies of blocks `indices` changed: wait for every
        queued load (one may still read the old bytes), then no slot counts as holding these
        blocks, so their next use loads them again from their source. In all-gather mode every
        rank calls it at the same point of its calls (it changes which loads the next call issues)."""
        with self._step():
            self.drain()
            self.executor.synchronize()
            for index in indices:
                slot = self.planner.slot_of(index)
                if slot is not None:
                    self.planner.forget(slot)

    def replace_source(self, index: int, source: BlockSource) -> None:
        """Between calls: block `index` streams from `source` from its next load on (a private
        copy of a block whose weights changed, or the disk tier's choice moving it between
        host memory and disk); no slot keeps what it loaded from the old one."""
        with self._step():  # cut short (a second Ctrl-C), the next step matches the rest to self.blocks
            self.discard_loaded([index])
            block = replace(self.blocks[index], source=source)
            self.blocks = (*self.blocks[:index], block, *self.blocks[index + 1 :])
            self._use_source(index)

    def _use_source(self, index: int) -> None:
        """The loads and the disk tier's reads of block `index` follow its source in self.blocks.
        In this order, a step cut short in between leaves the loads on the old source (matched
        again by the next step) or reads of a block nobody takes, never a disk block whose load
        waits for reads nobody makes."""
        block, reads = self.blocks[index], self.read_ahead
        read = isinstance(block.source, ReadSource)
        if reads is not None and read:
            reads.add(index, block.source, streamed=index not in self.promoted)
        self.loads.use_block(index, block)
        if reads is not None and not read:
            reads.forget(index, for_good=True)

    def drain(self) -> None:
        """Wait for every queued staged load (before synchronizing or tearing down), all of
        them even when one failed, then raise the first failure. A slot whose load failed
        holds nothing: its block is loaded again at its next use."""
        failures = []
        with self._step():  # a Ctrl-C between a failed settle and its forget would leave the record wrong
            for slot_index, queue in enumerate(self.queues):
                try:
                    queue.settle()
                except Exception as failure:
                    self.planner.forget(slot_index)
                    failures.append(failure)
        if failures:
            raise failures[0]
