"""What a load of each streamed block copies where: the one place a block's host source
becomes a `BlockLoad` for the executor.

A block is loaded one of six ways, fixed at enable() by where its bytes live:
- packed: its wire image in a private host buffer, copied whole;
- direct: straight from a mapping registered with the driver (or, on the CPU, any mapping
  that is not staged), as few copies as its layout allows (See [Note: one copy per block]);
- staged: packed from an unregistered mapping into a staging buffer on the stager's thread,
  then copied whole from there (See [Note: staged loads]);
- read: read from its files into a read buffer of the disk tier, then copied from there as
  a direct load copies from its mapping, on the stager's thread (See [Note: the disk tier]);
- gathered: this rank's shard copied and the rest all-gathered (See [Note: chunked gathers]);
- read and gathered: this rank's shard read from its files into a read buffer, then gathered
  from there on the caller's thread, which issues every collective (See [Note: shards read
  from disk]).
Each of them, for a block with float8 weights, lands in a landing buffer and is finished into
the slot from there (See [Note: fp8 landing]).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from dlo.host.block_sources import DiskShardSource, DiskSource, MappedSource, PackedSource, ShardedSource, ShardSource
from dlo.host.fp8_codec import dequantize_into
from dlo.host.tensor_source import CopyTask
from dlo.hotpath.executors import BlockLoad, DeviceSlot, Executor
from dlo.hotpath.gather import BlockGather
from dlo.hotpath.interrupts import inference_mode_off
from dlo.hotpath.streamed_block import StreamedBlock
from dlo.planning.block_layout import view_placement
from dlo.planning.wire_layout import landing_views, wire_targets


class LoadKind(enum.Enum):
    PACKED = "packed"
    DIRECT = "direct"
    STAGED = "staged"
    READ = "read"
    GATHERED = "gathered"
    READ_GATHERED = "read and gathered"


class PerBlock:
    """One value per block, each made at its first use and kept. A slot takes a new buffer at
    every refit (with blocks of two size classes, several times a call): making every block's
    views and copies for each new buffer cost more host time than the copies themselves
    (benchmarks/investigations/gguf_mapped_profile.py). Filling an entry is idempotent: one
    cut short by an interrupt is made again at the next use.

    Entries are made inside calls, under whatever grad mode the caller chose, and kept for
    later calls: made under inference mode, views would be inference tensors that a later call
    under no_grad cannot write into (a float8 weight is dequantized into its view). So they are
    made with inference mode off (`inference_mode_off`)."""

    def __init__(self, make: Callable[[int], Any]) -> None:
        self._make = inference_mode_off(make)
        self._made: dict[int, Any] = {}

    def __getitem__(self, index: int) -> Any:
        if index not in self._made:
            self._made[index] = self._make(index)
        return self._made[index]


@dataclass(frozen=True)
class SlotState:
    """A slot's buffer with what is made once for it: each block's views in it (None for a
    block larger than the buffer) and, from a registered mapping, each block's copies into
    it (both at the block's first load into this buffer). Replaced whole at a refit: one cut
    short leaves the old state or the new one."""

    slot: DeviceSlot
    views: PerBlock  # index -> tuple[torch.Tensor, ...] | None
    direct: PerBlock  # index -> tuple[CopyTask, ...]

    @property
    def size(self) -> int:
        return self.slot.buffer.numel()


class BlockLoads:
    # Views and copies are made once and used by every later call. Made under inference mode
    # they would be inference tensors that a call under no_grad cannot copy into.
    @torch.inference_mode(False)
    def __init__(
        self, blocks: Sequence[StreamedBlock], executor: Executor, gather: BlockGather | None, staged: bool
    ) -> None:
        """`staged`: mapped blocks go through the stager; else they are copied directly."""
        self.blocks = tuple(blocks)
        self._executor = executor
        self._gather = gather
        self._staged = staged
        self.kinds = tuple(self._kind(b, staged) for b in self.blocks)
        self.use_landings()

    def use_block(self, index: int, block: StreamedBlock) -> None:
        """Block `index` is now `block` (its source replaced between calls): a private copy, or
        its files read on every use, so nothing made once per slot for the old source is used
        again."""
        kind = self._kind(block, self._staged)
        assert kind in (LoadKind.PACKED, LoadKind.GATHERED, LoadKind.READ), kind  # direct copies are made per slot once
        blocks = (*self.blocks[:index], block, *self.blocks[index + 1 :])
        kinds = (*self.kinds[:index], kind, *self.kinds[index + 1 :])
        self.blocks, self.kinds = blocks, kinds  # one line: no interrupt lands between the two

    @staticmethod
    def _kind(block: StreamedBlock, staged: bool) -> LoadKind:
        if isinstance(block.source, ShardSource):
            return LoadKind.GATHERED
        if isinstance(block.source, PackedSource):
            return LoadKind.PACKED
        if isinstance(block.source, DiskSource):
            return LoadKind.READ
        if isinstance(block.source, DiskShardSource):
            return LoadKind.READ_GATHERED
        return LoadKind.STAGED if staged else LoadKind.DIRECT

    def link_bytes(self, index: int) -> int:
        """What a load of block `index` moves across this rank's link."""
        source = self.blocks[index].source
        return source.shard_bytes if isinstance(source, ShardedSource) else self.blocks[index].wire.nbytes

    def break_off(self, reason: str) -> None:
        """All-gather mode: a load failed before its collectives, so this rank's no longer pair
        with its peers' (See BlockGather.break_off)."""
        assert self._gather is not None
        self._gather.break_off(f"rank {self._gather.rank}: {reason}; its collectives no longer pair with its peers': restart the job")

    @torch.inference_mode(False)
    def use_landings(self) -> None:
        """Per landing buffer of the executor, each float8 block's (data, scale) views and,
        for a directly copied block, its copies into that buffer: made once, like slot views."""
        landings = self._executor.landings
        self._landed = [
            [landing_views(landing[b.wire.plain_bytes :], b.wire) if b.wire.quantized else () for b in self.blocks]
            for landing in landings
        ]
        self._land_copies = [
            [
                self._direct_copies(i, landing, landing[b.wire.plain_bytes :]) if b.wire.quantized else ()
                for i, b in enumerate(self.blocks)
            ]
            for landing in landings
        ]

    def state_of(self, slot: DeviceSlot) -> SlotState:
        size = slot.buffer.numel()

        def views(index: int) -> tuple[torch.Tensor, ...] | None:
            block = self.blocks[index]
            if block.layout.nbytes > size:
                return None
            return tuple(view_placement(slot.buffer, p) for p in block.layout.placements)

        def direct(index: int) -> tuple[CopyTask, ...]:
            block = self.blocks[index]
            if block.layout.nbytes > size or block.wire.quantized:
                return ()
            return self._direct_copies(index, slot.buffer, slot.buffer[:0])

        return SlotState(slot, PerBlock(views), PerBlock(direct))

    def _direct_copies(self, index: int, plain: torch.Tensor, landing: torch.Tensor) -> tuple[CopyTask, ...]:
        block = self.blocks[index]
        if self.kinds[index] is not LoadKind.DIRECT:
            return ()
        assert isinstance(block.source, MappedSource)
        return tuple(block.source.copy_tasks(wire_targets(block.layout, block.wire, plain, landing), whole=True))

    def pack_tasks(self, index: int, staging: torch.Tensor) -> list[CopyTask]:
        """A staged block's copies from its mapping into the host `staging` buffer."""
        block = self.blocks[index]
        assert isinstance(block.source, MappedSource)
        return block.source.copy_tasks(wire_targets(block.layout, block.wire, staging, staging[block.wire.plain_bytes :]))

    def load(self, index: int, state: SlotState, image: torch.Tensor | None = None) -> BlockLoad:
        """Block `index` into the slot of `state`; `image`: the staging buffer a staged block
        was packed into, or the read buffer a disk block was read into."""
        block = self.blocks[index]
        finish = partial(self._finish, index, state) if block.wire.quantized else None
        kind = self.kinds[index]
        if kind is LoadKind.READ:
            assert image is not None
            return BlockLoad(state.slot, partial(self._read_copies, index, state.slot, image, finish is not None), None, finish)
        if kind is LoadKind.GATHERED:
            assert self._gather is not None and isinstance(block.source, ShardSource)
            source = block.source
            return self._gather.block_load(state.slot, source.shards, source.pieces, finish, self._executor.landings)
        if kind is LoadKind.READ_GATHERED:
            assert self._gather is not None and isinstance(block.source, DiskShardSource) and image is not None
            source = block.source
            return self._gather.block_load(state.slot, source.shards, source.pieces_in(image), finish, self._executor.landings)
        if kind is LoadKind.DIRECT:
            copies = partial(self._landing_copies, index) if finish is not None else partial(_fixed, state.direct[index])
            return BlockLoad(state.slot, copies, None, finish)
        if image is None:
            assert isinstance(block.source, PackedSource)
            image = block.source.host.tensor
        nbytes = block.wire.nbytes
        return BlockLoad(state.slot, partial(self._image_copy, state.slot, image[:nbytes], finish is not None), None, finish)

    def _image_copy(self, slot: DeviceSlot, image: torch.Tensor, landed: bool, k: int) -> tuple[CopyTask, ...]:
        target = self._executor.landings[k] if landed else slot.buffer
        return (CopyTask(target[: image.numel()], image),)

    def _read_copies(self, index: int, slot: DeviceSlot, image: torch.Tensor, landed: bool, k: int) -> list[CopyTask]:
        block = self.blocks[index]
        assert isinstance(block.source, DiskSource)
        plain = self._executor.landings[k] if landed else slot.buffer
        return block.source.copy_tasks(image, wire_targets(block.layout, block.wire, plain, plain[block.wire.plain_bytes :]))

    def _landing_copies(self, index: int, k: int) -> tuple[CopyTask, ...]:
        return self._land_copies[k][index]

    def _finish(self, index: int, state: SlotState, k: int) -> None:
        """Block `index`, landed in landing buffer k, into its slot: the plain region as it
        is, the float8 weights dequantized (on the stream current at the call)."""
        wire = self.blocks[index].wire
        views = state.views[index]
        assert views is not None  # checked before the load was queued
        if wire.plain_bytes:
            state.slot.buffer[: wire.plain_bytes].copy_(self._executor.landings[k][: wire.plain_bytes])
        for q, (data, scale) in zip(wire.quantized, self._landed[k][index]):
            dequantize_into(views[q.index], data, scale)


def _fixed(copies: tuple[CopyTask, ...], k: int) -> tuple[CopyTask, ...]:
    return copies
