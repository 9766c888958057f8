"""All-gather streaming: every load is a collective, so every rank of the group runs the
same planner steps in the plan's static order. See [Note: lockstep schedule] in
dlo.hotpath.gather."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from dlo.errors import StreamingError
from dlo.host.block_sources import DiskShardSource, ShardedSource, ShardSource, restored_image
from dlo.host.direct_reads import DIRECT_ALIGNMENT, READ_THREADS, DiskReader
from dlo.host.pinned_buffer import aligned_empty
from dlo.hotpath.executors import DeviceSlot, Executor
from dlo.hotpath.gather import Agreement, BlockGather, plan_digest
from dlo.hotpath.interrupts import ForcedInterrupt, interrupts_held
from dlo.hotpath.read_ahead import ReadAhead
from dlo.hotpath.runtime import StreamingRuntime
from dlo.hotpath.streamed_block import StreamedBlock
from dlo.observe.ledger import TransferLedger


class LockstepRuntime(StreamingRuntime):
    lockstep = True

    def __init__(
        self,
        blocks: Sequence[StreamedBlock],
        slots: Sequence[DeviceSlot],
        executor: Executor,
        ledger: TransferLedger,
        gather: BlockGather,
        read_ahead: ReadAhead | None = None,
    ) -> None:
        """`read_ahead`: the disk tier's reads of the shards on disk (See [Note: shards read
        from disk])."""
        super().__init__(blocks, slots, executor, ledger, gather=gather, read_ahead=read_ahead)
        self.gather: BlockGather = gather
        self._calls = 0  # agreements issued
        self._cursor: int | None = None  # next scheduled block of the open call; None: no call open
        self._poisoned = False
        # Issued at the end of the previous call, with the next call's first loads: read when
        # the next call starts. None: issue it then.
        self._next_agreement: Agreement | None = None
        self._plan_digest = plan_digest(len(slots), self.blocks)

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        """A planner step and its collectives run whole: See [Note: interrupts between
        collectives]. dlo's own errors leave the rank in step (a schedule break is raised after
        the peers were given their collectives; a failed collective broke the group already);
        anything else that ends a step midway leaves the rank's loads unlike its peers'."""
        with interrupts_held():  # a Ctrl-C it held is raised as it ends: the step ran whole
            try:
                yield
            except StreamingError:
                raise
            except ForcedInterrupt:
                self.gather.break_off(
                    f"rank {self.gather.rank} was stopped by a second Ctrl-C between its collectives, so they no "
                    "longer pair with its peers': restart the job"
                )
                raise
            except BaseException as failure:
                self.gather.break_off(
                    f"rank {self.gather.rank} stopped between its collectives ({type(failure).__name__}: "
                    f"{failure}), so they no longer pair with its peers': restart the job"
                )
                raise

    def _enter(self, index: int) -> None:
        self.gather.raise_if_broken()
        if self._cursor is None:
            raise StreamingError(
                f"block {self.blocks[index].name!r} ran outside a call of the module dlo.enable() was given; in "
                "all-gather mode every load is a collective agreed at the start of a call"
            )
        if index != self._cursor:
            expected = repr(self.blocks[self._cursor].name) if self._cursor < len(self.blocks) else "the end of the call"
            self._poisoned = True  # also past the last block, where no load is left to issue
            self._end_call_here()
            raise StreamingError(
                f"rank {self.gather.rank} ran block {self.blocks[index].name!r} where the agreed schedule has "
                f"{expected}: in all-gather mode every rank runs the streamed blocks in plan order. Its peers were "
                "given this call's remaining collectives; the next call fails on every rank"
            )
        self._cursor += 1

    def start_call(self) -> None:
        """Before the root module runs: release blocks an interrupt left running, close the
        call it cut short, then check the group's agreement on this call (issued with this
        call's first loads at the end of the previous one, or now) and load the first blocks if
        they are not loaded yet. See [Note: lockstep schedule]"""
        with self._step():
            self.gather.raise_if_broken()
            self._end_call_here()
            agreement, self._next_agreement = self._next_agreement, None
            if agreement is None:
                agreement = self._issue_agreement()
            self.gather.check(agreement)
            self._cursor = 0
            if not agreement.loads_issued:
                self._preload()

    def end_call(self) -> None:
        """After the root module ran (or raised): issue whatever peers still expect of this
        call, then the next call's agreement and first loads, so they overlap this call's last
        blocks instead of the next call's start."""
        if self._cursor is not None:
            with self._step():
                self._finish_call()

    def _end_call_here(self) -> None:
        """End the call at this point. Blocks still marked running are over: a BaseException
        such as Ctrl-C skipped their end, or a schedule break raises through them; no more of
        their work is queued, so their slots are released. The call is then closed as the peers
        close theirs, from the same planner state (nothing running): the same collectives."""
        self.release_running()
        if self._cursor is not None:
            self._finish_call()

    def _finish_call(self) -> None:
        """Close the open call: issue what peers still expect of it (when it ended early),
        then the next call's agreement and first loads."""
        assert self._cursor is not None
        if self._cursor < len(self.blocks):
            self._leave_schedule()
        self._cursor = None
        self._next_agreement = self._issue_agreement(preload=True)

    def _issue_agreement(self, preload: bool = False) -> Agreement:
        gathered = self.gather.issue_agreement(self._calls, self._plan_digest, self._poisoned)
        self._calls += 1
        if preload:
            self._preload()
        return Agreement(gathered, loads_issued=preload)

    def _preload(self) -> None:
        if not self.blocks:
            return
        loads, after = self.planner.decide_preload(0)
        for load in loads:
            self.queues[load.slot].load(load.block)
        self.planner.record(after)

    def _leave_schedule(self) -> None:
        """Issue the rest of the call's loads as peers that follow the schedule issue them,
        and poison the next agreement. The same planner steps in the same order: the same
        collectives, and slots that end the call holding what the peers' hold, so the next
        call's first loads match too (with as many slots as blocks, peers load none)."""
        assert self._cursor is not None
        self._poisoned = True  # first: even if what follows fails, the next agreement fails
        for index in range(self._cursor, len(self.blocks)):
            start = self.planner.decide(index)
            for load in (start.demand, *start.prefetch):
                if load is not None:
                    self.queues[load.slot].load(load.block)
            self.planner.commit(start)
            self.executor.mark_free(self.queues[start.slot].state.slot)
            self.planner.end(index)

    def close_call(self) -> None:
        """Issue the collectives a call cut short (Ctrl-C while a block computed skips the
        call's end) still owes its peers, while every source can still load: the read-ahead
        of shards on disk is released before the blocks are restored. If that fails, the rank
        breaks off, so restore_blocks() raises why."""
        if self._cursor is None:
            return
        try:
            with self._step():
                self._end_call_here()
        except Exception as failure:
            self.gather.break_off(f"rank {self.gather.rank} could not close the call an interrupt cut short ({failure})")
            raise

    def restore_blocks(self, weights: bool = True) -> None:
        """Give every block ordinary CPU tensors (disable()): collectives, after those of a
        call Ctrl-C interrupted here, which its peers issued. With `weights` False, the
        blocks keep their stand-ins (no gather; every rank passes the same `weights`)."""
        closing = self._cursor is not None
        with self._step():
            if self.gather.size > 1:
                self.gather.raise_if_broken()  # first: a broken rank's loads would fail for another reason
                self._end_call_here()
            else:  # no peer waits for the rest of a call cut short: nothing to close
                self.release_running()
                self._cursor = None
            for index, block in enumerate(self.blocks):
                if not weights:
                    block.point_at(block.placeholders)
                elif isinstance(block.source, ShardedSource):
                    block.point_at(restored_image(self.gathered(index), block.layout, block.wire))
                else:
                    block.restore()
        if closing:  # the call's closing loads (float8 finished on the gather's stream) end before the slots go
            self.executor.synchronize()

    def gathered(self, index: int) -> torch.Tensor:
        """Block `index`'s whole (padded) wire image as a CPU tensor, gathered from every
        rank's shard (collectives: every rank calls it at the same point). A shard on disk is
        read by path into a buffer of its own (disable() gathers after the read-ahead closed; a
        file cut short since enable() then fails with an error, where its mapping would end the
        process). A failure breaks the rank off: its peers are in that block's gather."""
        if self.gather.size > 1:
            self.gather.raise_if_broken()
        source = self.blocks[index].source
        try:
            if isinstance(source, ShardSource):
                return self.gather.gather_full(source.shards, source.pieces)
            assert isinstance(source, DiskShardSource)
            reader = DiskReader(READ_THREADS)
            try:
                buffer = aligned_empty(source.buffer_bytes, torch.device("cpu"), DIRECT_ALIGNMENT)
                source.read(reader, buffer)
            finally:
                reader.close()
            return self.gather.gather_full(source.shards, source.pieces_in(buffer))
        except Exception as failure:
            self.loads.break_off(f"block {self.blocks[index].name!r} was not gathered ({failure})")
            raise
