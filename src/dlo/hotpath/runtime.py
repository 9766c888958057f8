"""The per-block hooks: wait for the block's slot, point its tensors there, prefetch the
next blocks, and release the slot when the block is done."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch

from dlo.errors import StreamingError
from dlo.host.block_sources import PackedSource
from dlo.hotpath.staging import StagedCopy, Stager
from dlo.hotpath.streamed_block import StreamedBlock
from dlo.hotpath.transfer import DeviceSlot, Transfer
from dlo.observe.ledger import TransferLedger
from dlo.planning.block_layout import view_placement
from dlo.planning.slot_planner import Load, SlotPlanner


class StreamingRuntime:
    def __init__(
        self,
        blocks: Sequence[StreamedBlock],
        slots: Sequence[DeviceSlot],
        transfer: Transfer,
        ledger: TransferLedger,
        stager: Stager | None = None,
    ) -> None:
        self.blocks = tuple(blocks)
        self.slots = tuple(slots)
        self.transfer = transfer
        self.ledger = ledger
        self.stager = stager
        self.planner = SlotPlanner(len(self.blocks), len(self.slots))
        self.pack_s = 0.0
        # Views of every block in every slot, made once: the hot path only assigns `.data`,
        # and views made here are ordinary tensors even when calls run in inference mode.
        self._views = [
            [tuple(view_placement(slot.buffer, p) for p in block.layout.placements) for block in self.blocks]
            for slot in self.slots
        ]
        self._copy_end: list[Any] = [None] * len(self.slots)
        self._staged: dict[int, list[tuple[str, int, Future[StagedCopy]]]] = {}
        self._compute_start: dict[int, Any] = {}

    def before_block(self, index: int) -> None:
        if torch.is_grad_enabled():
            # Autograd would save views of a slot that the next copies overwrite.
            raise StreamingError(
                "dlo streams weights for inference only: call the model under torch.inference_mode() "
                "or torch.no_grad()"
            )
        block = self.blocks[index]
        block.check_intact()
        start = self.planner.begin(index)
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
        block.point_at(self._views[start.slot][index])
        for load in start.prefetch:
            self._load(load)
        if self.ledger.records_timeline:
            self._compute_start[index] = self.transfer.mark()

    def after_block(self, index: int) -> None:
        slot_index = self.planner.end(index)
        if slot_index is None:  # before_block raised before the block started
            return
        block = self.blocks[index]
        self.transfer.mark_free(self.slots[slot_index])
        block.point_at(block.placeholders)
        if self.ledger.records_timeline:
            self.ledger.computed(block.name, self._compute_start.pop(index), self.transfer.mark())

    def drain(self) -> None:
        """Wait for every queued staged load (before synchronizing or tearing down)."""
        for slot_index in list(self._staged):
            self._finish_staged(slot_index)

    def _load(self, load: Load) -> None:
        block = self.blocks[load.block]
        slot = self.slots[load.slot]
        nbytes = block.layout.nbytes
        source = block.source
        with torch.profiler.record_function(f"dlo::h2d ({block.name})"):
            if isinstance(source, PackedSource):
                start, end = self.transfer.copy_into(slot, source.host.tensor)
            elif self.stager is not None:  # See [Note: staged loads]
                future = self.stager.submit(nbytes, partial(source.copy_tasks, block.layout), slot)
                self._staged.setdefault(load.slot, []).append((block.name, nbytes, future))
                return
            else:  # device "cpu": the slot is host memory, pack straight into it
                start = self.transfer.mark()
                for task in source.copy_tasks(block.layout, slot.buffer):
                    task.run()
                end = self.transfer.mark()
        self._copy_end[load.slot] = end
        self.ledger.copied(block.name, nbytes, start, end)

    def _finish_staged(self, slot_index: int) -> None:
        for name, nbytes, future in self._staged.pop(slot_index, ()):
            staged = future.result()
            self.pack_s += staged.pack_s
            self._copy_end[slot_index] = staged.end
            self.ledger.copied(name, nbytes, staged.start, staged.end)
