"""The per-block hooks: wait for the block's slot, point its tensors there, prefetch the
next blocks, and release the slot when the block is done."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch

from dlo.errors import StreamingError
from dlo.host.block_sources import MappedSource, PackedSource, ShardSource, restored_image
from dlo.host.fp8_codec import dequantize_into
from dlo.host.pinned_buffer import aligned_empty
from dlo.host.tensor_source import CopyTask
from dlo.hotpath.gather import Agreement, BlockGather, plan_digest
from dlo.hotpath.interrupts import ForcedInterrupt, interrupts_held
from dlo.hotpath.staging import StagedCopy, Stager
from dlo.hotpath.streamed_block import StreamedBlock
from dlo.hotpath.transfer import DeviceSlot, Transfer
from dlo.observe.ledger import TransferLedger
from dlo.planning.block_layout import view_placement
from dlo.planning.slot_planner import Load, SlotPlanner
from dlo.planning.wire_layout import landing_views, wire_targets


# [Note: slots per size class]
# Models with blocks of two sizes (Flux: double blocks of 679 MB, single blocks of 283 MB at
# 12B) would otherwise hold every slot at the larger size through the smaller blocks' phase,
# whose activations are the larger ones: the peak becomes large slots + large activations.
# So a slot's buffer follows the size of the block loaded into it: when a block needs more
# than the buffer holds, or less than `_SHRINK_BELOW` of it, the buffer goes back to the
# caching allocator and one of the block's size is taken (never more than `slot_capacity`).
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


class StreamingRuntime:
    # Views of slots and landing buffers, and the copies into them, are made once and used by
    # every later call. Made under inference mode they would be inference tensors that a call
    # under no_grad cannot copy into, so they are always made outside it.
    @torch.inference_mode(False)
    def __init__(
        self,
        blocks: Sequence[StreamedBlock],
        slots: Sequence[DeviceSlot],
        transfer: Transfer,
        ledger: TransferLedger,
        stager: Stager | None = None,
        gather: BlockGather | None = None,
        direct: bool = False,
    ) -> None:
        """`stager`: packs mapped blocks into pinned staging buffers. `direct`: the mapping is
        registered, so mapped blocks are copied straight into the slot (or, with float8
        weights, the landing buffer: See [Note: fp8 landing]), as few copies as the mapping's
        layout allows (See [Note: one copy per block])."""
        self.blocks = tuple(blocks)
        self.transfer = transfer
        self.ledger = ledger
        self.stager = stager
        self.gather = gather
        self._landing_bytes = transfer.landings[0].numel() if transfer.landings else 0
        self._direct_copies = direct
        self._use_landings()
        self.planner = SlotPlanner(len(self.blocks), len(slots), lockstep=gather is not None)
        # All-gather mode only. See [Note: lockstep schedule]
        self._calls = 0  # agreements issued
        self._cursor: int | None = None  # next scheduled block of the open call; None: no call open
        self._poisoned = False
        # A planner step and its collectives run whole: See [Note: interrupts between collectives]
        self._collective_step: Callable[[], contextlib.AbstractContextManager[None]] = (
            self._held_step if gather is not None else contextlib.nullcontext
        )
        # Issued at the end of the previous call, with the next call's first loads: read when
        # the next call starts. None: issue it then.
        self._next_agreement: Agreement | None = None
        self._plan_digest = plan_digest(len(slots), self.blocks)
        self.pack_s = 0.0
        self._use_slots(slots)
        self._staged: dict[int, list[tuple[str, int, Future[StagedCopy]]]] = {}
        self._compute_start: dict[int, Any] = {}
        self.promoted: dict[int, torch.Tensor] = {}  # block index -> its own device memory

    def _use_landings(self) -> None:
        """Per landing buffer, each float8 block's (data, scale) views and, for a mapped block,
        its copies into that buffer: made once, like the slot views."""
        landings = self.transfer.landings
        self._landed = [
            [landing_views(landing[b.wire.plain_bytes :], b.wire) if b.wire.quantized else () for b in self.blocks]
            for landing in landings
        ]
        direct_or_unstaged = self._direct_copies or self.stager is None
        self._land_tasks = [
            [
                b.source.copy_tasks(wire_targets(b.layout, b.wire, landing, landing[b.wire.plain_bytes :]), whole=True)
                if b.wire.quantized and isinstance(b.source, MappedSource) and direct_or_unstaged
                else []
                for b in self.blocks
            ]
            for landing in landings
        ]

    def _use_slots(self, slots: Sequence[DeviceSlot]) -> None:
        self.slots = list(slots)
        # What every slot is sized for, the largest streamed block; a slot's buffer is that or,
        # between blocks of a smaller size class, smaller. See [Note: slots per size class]
        self.slot_capacity = self.slots[0].buffer.numel() if self.slots else 0
        # Views of every block in every slot, made once per buffer: the hot path only assigns
        # `.data`. None: a block larger than the slot's buffer.
        self._views = [self._views_in(slot) for slot in self.slots]
        # Registered mapping: each (slot, block)'s copies, made once like the views.
        self._direct = [self._direct_copies_into(slot) for slot in self.slots] if self._direct_copies else None
        self._copy_end: list[Any] = [None] * len(self.slots)

    def _views_in(self, slot: DeviceSlot) -> list[tuple[torch.Tensor, ...] | None]:
        size = slot.buffer.numel()
        return [
            tuple(view_placement(slot.buffer, p) for p in b.layout.placements) if b.layout.nbytes <= size else None
            for b in self.blocks
        ]

    def _direct_copies_into(self, slot: DeviceSlot) -> list[list[CopyTask]]:
        size = slot.buffer.numel()
        return [
            b.source.copy_tasks(wire_targets(b.layout, b.wire, slot.buffer, slot.buffer[:0]), whole=True)
            if isinstance(b.source, MappedSource) and not b.wire.quantized and b.layout.nbytes <= size
            else []
            for b in self.blocks
        ]

    def _drop_landings_without_slots(self) -> None:
        """Without slots nothing streams, so nothing lands: the landing buffers go too, and
        replace_slots() makes them again with slots (See [Note: fp8 landing]). The device is
        idle (replace_slots synchronized it)."""
        if not self.slots and self.transfer.landings:
            self.transfer.drop_landings()
            self._use_landings()

    @property
    def slot_bytes(self) -> int:
        """The most device memory the slots hold at once."""
        return len(self.slots) * self.slot_capacity

    @torch.inference_mode(False)  # See StreamingRuntime.__init__
    def _fit_slot(self, slot_index: int, index: int) -> None:
        """Give slot `slot_index` a buffer of block `index`'s size class before loading it.
        See [Note: slots per size class]"""
        need = self.blocks[index].slot_bytes
        size = self.slots[slot_index].buffer.numel()
        if need <= size and (need >= _SHRINK_BELOW * size or self.gather is not None):
            return
        if need > self.slot_capacity:
            raise StreamingError(f"streamed block {self.blocks[index].name!r} is larger than the slots")
        self._finish_staged(slot_index)  # nothing queued may write the old buffer later
        # Every reference to the old buffer goes before the new one is taken, so the two are
        # never held at once. If taking it fails, the slot stays empty: its next load tries again.
        self.slots[slot_index] = self.transfer.retire_slot(self.slots[slot_index])
        self._views[slot_index] = [None] * len(self.blocks)
        if self._direct is not None:
            self._direct[slot_index] = [[] for _ in self.blocks]
        self.slots[slot_index] = slot = self.transfer.allocate_slot(need)
        self._views[slot_index] = self._views_in(slot)
        if self._direct is not None:
            self._direct[slot_index] = self._direct_copies_into(slot)

    def before_block(self, index: int) -> None:
        if torch.is_grad_enabled():
            # Autograd would save views of a slot that the next copies overwrite.
            raise StreamingError(
                "dlo streams weights for inference only: call the model under torch.inference_mode() "
                "or torch.no_grad()"
            )
        block = self.blocks[index]
        block.check_intact()
        if self.planner.is_resident(index):  # promoted: its tensors are its own device memory
            return
        with self._collective_step():
            if self.gather is not None:
                self._follow_schedule(index)
            self._start_block(index)
        if self.ledger.times_blocks:
            self._compute_start[index] = self.transfer.mark()

    @contextlib.contextmanager
    def _held_step(self) -> Iterator[None]:
        try:
            with interrupts_held():
                yield
        except ForcedInterrupt:
            assert self.gather is not None
            self.gather.break_off(
                f"rank {self.gather.rank} was stopped by a second Ctrl-C between its collectives, so they no longer "
                "pair with its peers': restart the job"
            )
            raise

    def _start_block(self, index: int) -> None:
        block = self.blocks[index]
        start = self.planner.begin(index)
        try:
            if start.demand is not None:
                self._load(start.demand)
            slot = self.slots[start.slot]
            # Marked before waiting for a staged load, so host time spent packing counts as
            # exposed once the device runs out of queued work.
            arrive = self.transfer.mark() if self.transfer.overlaps_compute else None
            self._finish_staged(start.slot)
            if arrive is not None:
                self.ledger.waited(block.name, arrive, self._copy_end[start.slot])
            self.transfer.wait_ready(slot)
            view = self._views[start.slot][index]
            if view is None:  # a block demoted without replace_slots() sizing the slots for it
                raise StreamingError(f"streamed block {block.name!r} is larger than the slots")
            block.point_at(view)
            for load in start.prefetch:
                self._load(load)
        except BaseException:
            # A copy failed or was never issued: no slot of this start may be trusted again,
            # first of all (another Ctrl-C may cut the waits short).
            touched = [start.slot, *(load.slot for load in start.prefetch)]
            self.planner.forget(*touched)
            block.point_at(block.placeholders)
            for slot_index in touched:
                for _, _, future in self._staged.get(slot_index, []):
                    future.exception()  # wait: a job still writing must finish first
                self._staged.pop(slot_index, None)
            raise

    def after_block(self, index: int) -> None:
        slot_index = self.planner.end(index)
        if slot_index is None:  # before_block raised before the block started
            return
        block = self.blocks[index]
        self.transfer.mark_free(self.slots[slot_index])
        block.point_at(block.placeholders)
        if index in self._compute_start:
            self.ledger.computed(index, block.name, self._compute_start.pop(index), self.transfer.mark())

    def promote(self, index: int) -> int:
        """Keep block `index` on the device from now on, in memory of its own laid out like a
        slot (so its kernels see the alignment they see streamed); returns its bytes. On a
        CUDA device the copy runs on the compute stream, ordered before the block's next use."""
        block = self.blocks[index]
        source = block.source
        if isinstance(source, ShardSource):
            raise StreamingError(
                f"block {block.name!r} is needed outside its own call, which all-gather mode cannot serve (every "
                "load is a collective in plan order): keep it resident (resident_layers) or use rank-local mode"
            )
        if self.planner.is_running(index):
            raise StreamingError(f"streamed block {block.name!r} is running and cannot be promoted")
        memory = aligned_empty(block.layout.nbytes, self.transfer.device)
        views = tuple(view_placement(memory, p) for p in block.layout.placements)
        wire = block.wire
        if isinstance(source, PackedSource):
            image = source.host.tensor
        else:  # a mapping: pack its wire image on the host first (this happens once)
            image = torch.empty(wire.nbytes, dtype=torch.uint8)
            source.pack(block.layout, wire, image)
        memory[: wire.plain_bytes].copy_(image[: wire.plain_bytes])
        if wire.quantized:  # a landing buffer of its own: the shared one is the copy stream's
            landed = landing_views(image[wire.plain_bytes :].to(memory.device), wire)
            for q, (data, scale) in zip(wire.quantized, landed):
                dequantize_into(views[q.index], data, scale)
        # Only now that nothing can fail: the planner drops the block's slot (after any staged
        # load into it has been issued, so the stager never writes it later).
        slot = self.planner.slot_of(index)
        if slot is not None:
            self._finish_staged(slot)
        self.planner.promote(index)
        self.promoted[index] = memory
        block.point_at(views)
        return block.layout.nbytes

    def demote(self, index: int) -> int:
        """Stream block `index` again from its next use; its own device memory is freed once
        the device finished what is queued on it. Between calls; a block larger than the
        slots needs `replace_slots()` before the next call. Returns the bytes freed."""
        block = self.blocks[index]
        if index not in self.promoted:
            raise StreamingError(f"streamed block {block.name!r} is not resident")
        self.transfer.synchronize()
        memory = self.promoted.pop(index)
        self.planner.demote(index)
        block.point_at(block.placeholders)
        return memory.numel()

    def discard_loaded(self, indices: Sequence[int]) -> None:
        """Between calls, after the host copies of blocks `indices` changed: wait for every
        queued load (one may still read the old bytes), then no slot counts as holding these
        blocks, so their next use loads them again from their source."""
        self.drain()
        self.transfer.synchronize()
        for index in indices:
            slot = self.planner.slot_of(index)
            if slot is not None:
                self.planner.forget(slot)

    @torch.inference_mode(False)  # See StreamingRuntime.__init__
    def replace_slots(self, count: int, nbytes: int) -> None:
        """Stream through `count` new slots of `nbytes` each (0: every block is to be
        promoted before the next call). Between calls: the old slots are dropped after the
        device finished every copy and kernel using them, and before the new ones are
        allocated (a memory budget holds one set). If allocating fails, slots of the old
        shape are allocated again; if that fails too, the runtime is left without slots (a
        streamed block then raises a StreamingError) and the error says so."""
        if self.gather is not None:
            raise StreamingError("the slots cannot be replaced in all-gather mode: every load there is a collective")
        old_count, old_bytes = len(self.slots), self.slot_capacity  # a slot's buffer may be a smaller class's
        self.drain()
        self.transfer.synchronize()
        self.planner.resize(count)  # first: it refuses a count it cannot serve
        self._use_slots(())
        if count == 0:
            self._drop_landings_without_slots()
        try:
            if count and self._landing_bytes and not self.transfer.landings:
                self.transfer.allocate_landings(self._landing_bytes)
                self._use_landings()
            slots = [self.transfer.allocate_slot(nbytes) for _ in range(count)]
        except BaseException as failure:
            self.planner.resize(0)
            try:
                self._use_slots([self.transfer.allocate_slot(old_bytes) for _ in range(old_count)])
            except BaseException as second:
                self._drop_landings_without_slots()
                raise StreamingError(
                    f"allocating {count} slots of {nbytes} bytes failed ({failure}), and so did allocating the "
                    f"{old_count} slots of before ({second}): no block can stream until disable()"
                ) from second
            self._drop_landings_without_slots()
            self.planner.resize(old_count)
            raise
        self._use_slots(slots)

    def drain(self) -> None:
        """Wait for every queued staged load (before synchronizing or tearing down), all of
        them even when one failed, then raise the first failure."""
        failures = []
        for slot_index in list(self._staged):
            try:
                self._finish_staged(slot_index)
            except Exception as failure:
                failures.append(failure)
        if failures:
            raise failures[0]

    def start_call(self) -> None:
        """Before the root module runs. Blocks still marked running were interrupted by a
        BaseException (torch runs no forward hook for those): release their slots. In
        all-gather mode, then check the group's agreement on this call (issued with this call's
        first loads at the end of the previous one, or now) and load the first blocks if they
        are not loaded yet. See [Note: lockstep schedule]"""
        with self._collective_step():
            self._end_call_here()
            if self.gather is None:
                return
            agreement, self._next_agreement = self._next_agreement, None
            if agreement is None:
                agreement = self._issue_agreement()
            self.gather.check(agreement)
            self._cursor = 0
            if self.blocks and not agreement.loads_issued:
                for load in self.planner.preload(0):
                    self._load(load)

    def _end_call_here(self) -> None:
        """End the call at this point. Blocks still marked running are over: a BaseException
        such as Ctrl-C skipped their end (torch runs no forward hook for those), or a schedule
        break raises through them; no more of their work is queued, so their slots are
        released. In all-gather mode the call is then closed as the peers close theirs, from
        the same planner state (nothing running): the same collectives."""
        for index, slot_index in self.planner.release_running():
            self.transfer.mark_free(self.slots[slot_index])
            self.blocks[index].point_at(self.blocks[index].placeholders)
        if self.gather is not None and self._cursor is not None:
            self._finish_call()

    def end_call(self) -> None:
        """After the root module ran (or raised). All-gather mode: issue whatever peers still
        expect of this call, then the next call's agreement and first loads, so they overlap
        this call's last blocks instead of the next call's start. See [Note: lockstep schedule]"""
        if self.gather is not None and self._cursor is not None:
            with self._collective_step():
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
        assert self.gather is not None
        gathered = self.gather.issue_agreement(self._calls, self._plan_digest, self._poisoned)
        self._calls += 1
        if preload and self.blocks:
            for load in self.planner.preload(0):
                self._load(load)
        return Agreement(gathered, loads_issued=preload)

    def _follow_schedule(self, index: int) -> None:
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

    def _leave_schedule(self) -> None:
        """Issue the rest of the call's loads as peers that follow the schedule issue them,
        and poison the next agreement. The same planner steps in the same order: the same
        collectives, and slots that end the call holding what the peers' hold, so the next
        call's first loads match too (with as many slots as blocks, peers load none)."""
        assert self.gather is not None and self._cursor is not None
        self._poisoned = True  # first: even if what follows fails, the next agreement fails
        for index in range(self._cursor, len(self.blocks)):  # none is resident: promotion is refused here
            start = self.planner.begin(index)
            for load in (start.demand, *start.prefetch):
                if load is not None:
                    self._load(load)
            self.transfer.mark_free(self.slots[start.slot])
            self.planner.end(index)

    def restore_blocks(self) -> None:
        """Give every block ordinary CPU tensors (disable()). Collective in all-gather mode,
        after the collectives of a call Ctrl-C interrupted here, which its peers issued."""
        closing = self.gather is not None and self._cursor is not None
        with self._collective_step():
            self._end_call_here()
            for block in self.blocks:
                if isinstance(block.source, ShardSource):
                    assert self.gather is not None
                    block.point_at(restored_image(self.gather.gather_full(block.source), block.layout, block.wire))
                else:
                    block.restore()
        if closing:  # the call's closing loads (float8 finished on the gather's stream) end before the slots go
            self.transfer.synchronize()

    def _load(self, load: Load) -> None:
        block = self.blocks[load.block]
        nbytes = block.wire.nbytes
        source = block.source
        with torch.profiler.record_function(f"dlo::h2d ({block.name})"):
            self._fit_slot(load.slot, load.block)
            slot = self.slots[load.slot]
            if isinstance(source, PackedSource):
                start, end, ready = self._send(load.block, load.slot, source.host.tensor)
            elif isinstance(source, ShardSource):
                assert self.gather is not None
                if block.wire.quantized:
                    finish = partial(self._finish_landed, load.block, load.slot)
                    start, end, ready = self.gather.load_landed(slot, source, finish)
                else:
                    start, end = self.gather.load(slot, source)
                    ready = end
                nbytes = source.shard_bytes  # what crossed this rank's link
            elif block.wire.quantized and (self._direct is not None or self.stager is None):
                # Registered mapping, or device "cpu": straight from the mapping into the landing buffer.
                finish = partial(self._finish_landed, load.block, load.slot)
                start, end, ready = self.transfer.land_into(slot, partial(self._landing_tasks, load.block), finish)
            elif self._direct is not None:
                start, end = self.transfer.copy_pieces_into(slot, self._direct[load.slot][load.block])
                ready = end
            elif self.stager is not None:  # See [Note: staged loads]
                targets = partial(self._staging_tasks, load.block)
                future = self.stager.submit(targets, partial(self._send, load.block, load.slot))
                self._staged.setdefault(load.slot, []).append((block.name, nbytes, future))
                return
            else:  # device "cpu": the slot is host memory, pack straight into it
                start = self.transfer.mark()
                source.pack(block.layout, block.wire, slot.buffer)
                end = ready = self.transfer.mark()
        self._copy_end[load.slot] = ready  # when the block can run: dequantized, if float8
        self.ledger.copied(block.name, nbytes, start, end)  # the copy alone: the link's rate

    def _send(self, index: int, slot_index: int, image: torch.Tensor) -> tuple[Any, Any, Any]:
        """Copy a block's host wire `image` (a packed buffer, or a filled staging buffer):
        as one copy into the slot, or, with float8 weights, into a landing buffer to be
        dequantized from there into the slot. Returns the marks (start, copied, ready).
        See [Note: fp8 landing]"""
        wire = self.blocks[index].wire
        slot = self.slots[slot_index]
        if not wire.quantized:
            start, end = self.transfer.copy_into(slot, image[: wire.nbytes])
            return start, end, end

        def tasks_for(k: int) -> list[CopyTask]:
            return [CopyTask(self.transfer.landings[k][: wire.nbytes], image[: wire.nbytes])]

        return self.transfer.land_into(slot, tasks_for, partial(self._finish_landed, index, slot_index))

    def _landing_tasks(self, index: int, k: int) -> list[CopyTask]:
        return self._land_tasks[k][index]

    def _finish_landed(self, index: int, slot_index: int, k: int) -> None:
        """Block `index`, landed in landing buffer k, into its slot: the plain region as it
        is, the float8 weights dequantized (on the stream current at the call)."""
        wire = self.blocks[index].wire
        views = self._views[slot_index][index]
        assert views is not None  # checked before the load was issued
        if wire.plain_bytes:
            self.slots[slot_index].buffer[: wire.plain_bytes].copy_(self.transfer.landings[k][: wire.plain_bytes])
        for q, (data, scale) in zip(wire.quantized, self._landed[k][index]):
            dequantize_into(views[q.index], data, scale)

    def _staging_tasks(self, index: int, staging: torch.Tensor) -> list[CopyTask]:
        block = self.blocks[index]
        source = block.source
        assert isinstance(source, MappedSource)
        return source.copy_tasks(wire_targets(block.layout, block.wire, staging, staging[block.wire.plain_bytes :]))

    def _finish_staged(self, slot_index: int) -> None:
        """Wait for every staged load queued for the slot, all of them even when one failed
        (a job left running would write the slot after its next, unstaged, load), then raise
        the first failure, the slot holding nothing: whoever waited (a block's start, drain(),
        promote()), the next use of its block loads it again."""
        jobs = self._staged.get(slot_index, [])
        # Waited for before they leave the queue: a wait cut short (Ctrl-C) leaves them for the next.
        failures = [error for _, _, future in jobs if (error := future.exception()) is not None]
        self._staged.pop(slot_index, None)
        if failures:
            self.planner.forget(slot_index)
            raise failures[0]
        for name, nbytes, future in jobs:
            staged = future.result()
            self.pack_s += staged.pack_s
            self._copy_end[slot_index] = staged.ready
            self.ledger.copied(name, nbytes, staged.start, staged.end)
