"""Rank-local streaming: every rank streams whole blocks from its own host copy, in the
execution order the planner learns, and may keep blocks on the device (promote) or change
its slots between calls."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from dlo.errors import StreamingError
from dlo.host.block_sources import DiskSource, PackedSource, ShardSource
from dlo.host.fp8_codec import dequantize_into
from dlo.host.pinned_buffer import aligned_empty
from dlo.hotpath.executors import DeviceSlot, Executor
from dlo.hotpath.interrupts import interrupts_held
from dlo.hotpath.read_ahead import ReadAhead
from dlo.hotpath.runtime import StreamingRuntime
from dlo.hotpath.staging import Stager
from dlo.hotpath.streamed_block import StreamedBlock
from dlo.observe.ledger import TransferLedger
from dlo.planning.block_layout import view_placement
from dlo.planning.wire_layout import landing_views


class RankLocalRuntime(StreamingRuntime):
    _unsure = False  # a step ended midway: See [Note: one writer per slot]
    _stepping = False  # a step is running: one inside it is part of it

    def __init__(
        self,
        blocks: Sequence[StreamedBlock],
        slots: Sequence[DeviceSlot],
        executor: Executor,
        ledger: TransferLedger,
        stager: Stager | None = None,
        read_ahead: ReadAhead | None = None,
    ) -> None:
        super().__init__(blocks, slots, executor, ledger, stager=stager, read_ahead=read_ahead)
        self._slot_shape = (len(slots), self.slot_capacity)  # the last (count, bytes) fully allocated

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        if self._stepping:
            yield
            return
        with interrupts_held():
            self._stepping = True
            try:
                if self._unsure:
                    self._recover()
                self._unsure = True
                yield
                self._unsure = False
            finally:
                self._stepping = False

    def _recover(self) -> None:
        """After a step that ended midway: wait for every load still queued, then hold nothing
        anywhere but what is certain (promoted blocks' own memory), so every streamed block is
        loaded again at its next use."""
        for queue in self.queues:
            queue.supersede()
        if self.stager is not None:
            self.stager.wait_idle()
        self.executor.synchronize()
        self.planner.release_running()
        self._on_host_now.clear()  # every block is pointed below
        if self.planner.num_slots != len(self.queues) or len(self.queues) != self._slot_shape[0]:
            self._use_slots(())  # replace_slots() stopped midway: back to the last shape it reached
            self.planner.resize(0)
            self._allocate_slots(*self._slot_shape)
        self.planner.forget(*range(len(self.queues)))
        self.planner.set_resident(self.promoted.keys())
        for index, block in enumerate(self.blocks):
            cut_short = self.loads.blocks[index] is not block or (  # replace_source() stopped midway
                self.read_ahead is not None and index in self.read_ahead.blocks and not isinstance(block.source, DiskSource)
            )
            if cut_short:
                self._use_source(index)
            memory = self.promoted.get(index)
            block.point_at(block.placeholders if memory is None else self._views_of(index, memory))

    def start_call(self) -> None:
        super().start_call()
        self.planner.call_starts()

    def end_call(self) -> None:
        super().end_call()
        self.planner.call_ends()

    def _views_of(self, index: int, memory: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(view_placement(memory, p) for p in self.blocks[index].layout.placements)

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
        if self.is_running(index):
            raise StreamingError(f"streamed block {block.name!r} is running and cannot be promoted")
        # Outside inference mode: the block's weights outlive the call that promoted it (an
        # inference tensor refuses later autograd, such as PEFT's DoRA unmerge).
        with self._step(), torch.inference_mode(False):
            memory = aligned_empty(block.layout.nbytes, self.executor.device)
            views = self._views_of(index, memory)
            wire = block.wire
            if isinstance(source, PackedSource):
                image = source.host.tensor
            else:  # a mapping: pack its wire image on the host first (this happens once)
                image = torch.empty(wire.nbytes, dtype=torch.uint8)
                source.pack(block.layout, wire, image)
            memory[: wire.plain_bytes].copy_(image[: wire.plain_bytes])
            if wire.quantized:  # a landing buffer of its own: the shared ones are the copy stream's
                landed = landing_views(image[wire.plain_bytes :].to(memory.device), wire)
                for q, (data, scale) in zip(wire.quantized, landed):
                    dequantize_into(views[q.index], data, scale)
            # Only now that nothing can fail: the block's slot is dropped (after any staged load
            # into it has been issued, so the stager never writes it later).
            slot = self.planner.slot_of(index)
            if slot is not None:
                self.queues[slot].supersede()
            self.promoted[index] = memory
            self.planner.promote(index)
            if self.read_ahead is not None:
                self.read_ahead.forget(index)  # its reads would go to waste
            block.point_at(views)
        return block.layout.nbytes

    def demote(self, index: int) -> int:
        """Stream block `index` again from its next use; its own device memory is freed once
        the device finished what is queued on it. Between calls; a block larger than the
        slots needs `replace_slots()` before the next call. Returns the bytes freed."""
        block = self.blocks[index]
        if index not in self.promoted:
            raise StreamingError(f"streamed block {block.name!r} is not resident")
        with self._step():
            self.executor.synchronize()
            block.point_at(block.placeholders)
            self.planner.demote(index)
            memory = self.promoted.pop(index)
            if self.read_ahead is not None:
                self.read_ahead.remember(index)
        return memory.numel()

    def release_slots(self) -> int:
        """Between calls: every slot's buffer goes back to the caching allocator once the device
        finished what is queued on it, and each slot takes a buffer again at its next load (See
        [Note: slots per size class]). Promoted blocks keep their memory. From then on no call
        prefetches for the next. For a component that runs once per pipeline call (See [Note:
        pipeline budget]). Returns the bytes released."""
        self.planner.keep_calls_apart()  # a load for the next call would be dropped unread
        held = sum(queue.state.size for queue in self.queues)
        if not held:
            return 0
        with self._step():
            self.release_running()
            for queue in self.queues:  # a load still queued is a prefetch nobody will read
                queue.supersede()
            self.executor.synchronize()
            self.planner.forget(*range(len(self.queues)))
            for queue in self.queues:
                queue.release()
        return held

    @torch.inference_mode(False)  # See BlockLoads.__init__
    def replace_slots(self, count: int, nbytes: int) -> None:
        """Stream through `count` new slots of `nbytes` each (0: every block is to be
        promoted before the next call). Between calls: the old slots are dropped after the
        device finished every copy and kernel using them, and before the new ones are
        allocated (a memory budget holds one set). If allocating fails, slots of the old
        shape are allocated again; if that fails too, the runtime is left without slots (a
        streamed block then raises a StreamingError) and the error says so."""
        with self._step():
            self._replace_slots(count, nbytes)

    def _replace_slots(self, count: int, nbytes: int) -> None:
        old_shape = (len(self.queues), self.slot_capacity)  # a slot's buffer may be a smaller class's
        self.drain()
        self.executor.synchronize()
        self.planner.resize(count)  # first: it refuses a count it cannot serve
        self.planner.resize(0)
        self._use_slots(())
        try:
            self._allocate_slots(count, nbytes)
        except BaseException as failure:
            try:
                self._allocate_slots(*old_shape)
            except BaseException as second:
                self._slot_shape = (0, 0)  # what it holds now: recovery allocates nothing
                raise StreamingError(
                    f"allocating {count} slots of {nbytes} bytes failed ({failure}), and so did allocating the "
                    f"{old_shape[0]} slots of before ({second}): no block can stream until disable()"
                ) from second
            raise

    def _allocate_slots(self, count: int, nbytes: int) -> None:
        """From no slots: `count` slots of `nbytes` (0: none, and no landing buffers either),
        with landing buffers if float8 blocks need them; then the planner serves them. Fails
        with no slots and no landing buffers."""
        executor = self.executor
        try:
            if count and self._landing_bytes and not executor.landings:
                executor.allocate_landings(self._landing_bytes)
                self.loads.use_landings()
            self._use_slots([executor.allocate_slot(nbytes) for _ in range(count)])
        finally:
            if not self.queues:
                self._drop_landings_without_slots()
        self.planner.resize(count)
        self._slot_shape = (count, nbytes)

    def _drop_landings_without_slots(self) -> None:
        """Without slots nothing streams, so nothing lands: the landing buffers go too, and
        replace_slots() makes them again with slots (See [Note: fp8 landing]). The device is
        idle (replace_slots synchronized it)."""
        if not self.queues and self.executor.landings:
            self.executor.drop_landings()
            self.loads.use_landings()
