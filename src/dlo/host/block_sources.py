"""Where a streamed block's bytes come from: a private packed host buffer, a read-only
mapping (packed into a staging buffer on every load, or, registered, copied from directly),
or, under a host memory budget, the mapping's files read on every use; in all-gather mode,
this rank's shard of the block, in host memory or read from the files on every use.

[Note: shards read from disk]
Under `host_budget_gib` in all-gather mode, a rank reads from the files only its own bytes of
a block on disk: the pieces of the padded wire image `ShardLayout.pieces(rank)` names, cut
out of the segments the image is made of (dlo.host.image_segments), so across the group each
byte of a block is read by one rank per use (and the 4 KiB pages at the edges of a rank's
ranges, which direct I/O reads whole, by two). The ranges are read with direct I/O into a read
buffer (dlo.host.direct_reads) and, on the reader's thread, copied into the shard's layout
after them (its pieces one after another, as a private shard holds them), from where the
load copies each piece into its place in the slot and the group all-gathers the rest, as
for a shard kept in host memory. A block is read so only when every byte of its image is a
file's byte as saved or a tensor of its own (no cast, no weight quantized at enable()); the
others keep their shards in host memory. Bytes of a piece that no segment covers (the
alignment gaps and the padding) are whatever the buffer held: nothing reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dlo.host.checkpoint import Checkpoint
from dlo.host.direct_reads import BlockReads, DiskReader, ReadImage
from dlo.host.fp8_codec import dequantized
from dlo.host.image_segments import ImageSegment
from dlo.host.pinned_buffer import HostBuffer
from dlo.host.safetensors_file import SafetensorsFile
from dlo.host.tensor_source import CopyTask, MappedTensor, TensorViews, coalesced
from dlo.planning.block_layout import BlockLayout, view_placement
from dlo.planning.shard_layout import ShardLayout
from dlo.planning.wire_layout import WireLayout, landing_views, wire_targets


def restored_image(image: torch.Tensor, layout: BlockLayout, wire: WireLayout) -> tuple[torch.Tensor, ...]:
    """A block's tensors from its wire `image` on the host: views of the plain region (no
    copy), float8 weights dequantized into new CPU tensors."""
    weights = {
        q.index: dequantized(data, scale, layout.placements[q.index].spec.dtype)
        for q, (data, scale) in zip(wire.quantized, landing_views(image[wire.plain_bytes :], wire))
    }
    return tuple(weights[i] if i in weights else view_placement(image, p) for i, p in enumerate(layout.placements))


@dataclass(frozen=True)
class PackedSource:
    """The block's wire image in one private host buffer (See [Note: fp8 streaming]): a load
    copies its plain region into the slot, and its landing region, if any, into the landing
    buffer."""

    host: HostBuffer

    @property
    def host_bytes(self) -> int:
        return self.host.nbytes

    @property
    def pinned(self) -> bool:
        return self.host.pinned

    def release(self) -> None:
        self.host.unpin()

    def restored(self, layout: BlockLayout, wire: WireLayout) -> tuple[torch.Tensor, ...]:
        """The tensors to give back on disable(): see `restored_image`."""
        return restored_image(self.host.tensor, layout, wire)

    values = restored  # the block's tensors to read now (a save)


@dataclass(frozen=True)
class MappedSource:
    """The block's tensors in the read-only checkpoint mapping: a load packs them (with the
    loader's adapters) into a buffer holding the block's wire image, then copies that.
    Float8 weights of the checkpoint stay float8 on the way (See [Note: fp8 streaming]).
    Tensors the checkpoint does not hold (non-persistent buffers such as RoPE tables) are
    private tensors, packed the same way."""

    checkpoint: Checkpoint
    sources: tuple[MappedTensor | torch.Tensor, ...]  # one per layout placement

    pinned = False

    @property
    def host_bytes(self) -> int:
        """Private bytes only: the mapped ones are shared page cache, but for those of a
        private file (what the load computed)."""
        own = sum(s.numel() * s.element_size() for s in self.sources if isinstance(s, torch.Tensor))
        computed = {
            key for s in self.sources if not isinstance(s, torch.Tensor) for key in s.keys
            if self.checkpoint.tensors[key].file.private
        }
        return own + sum(self.checkpoint.tensors[key].entry.nbytes for key in computed)

    def copy_tasks(
        self,
        targets: Sequence[torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
        whole: bool = False,
        views: TensorViews | None = None,
    ) -> list[CopyTask]:
        """Tasks that fill `targets` (see `wire_targets`); large tensors are split in chunks
        for several host threads unless `whole`: direct device copies, as few as the layout
        they are read from allows (See [Note: one copy per block]). `views`: where the
        checkpoint tensors are read from (default: the mapping)."""
        tasks: list[CopyTask] = []
        for source, target in zip(self.sources, targets):
            if isinstance(source, torch.Tensor):
                tasks.append(CopyTask(target, source))
            elif whole:
                tasks.extend(source.pieces(views or self.checkpoint, target))
            else:
                tasks.extend(source.copy_tasks(self.checkpoint, target))
        return coalesced(tasks) if whole else tasks

    def pack(self, layout: BlockLayout, wire: WireLayout, buffer: torch.Tensor) -> None:
        """The block's wire image into the host `buffer` (this thread, one copy at a time)."""
        for task in self.copy_tasks(wire_targets(layout, wire, buffer, buffer[wire.plain_bytes :])):
            task.run()

    def restored(self, layout: BlockLayout, wire: WireLayout) -> tuple[torch.Tensor, ...]:
        """Private copies (float8 weights dequantized): the mapping is read-only and closes
        with the handle."""
        return self._read(private=True)

    def values(self, layout: BlockLayout, wire: WireLayout) -> tuple[torch.Tensor, ...]:
        """The block's tensors to read while the mapping is open (a save): views of the mapping
        where a tensor is one range of it as saved, private copies of the rest."""
        return self._read(private=False)

    def _read(self, private: bool) -> tuple[torch.Tensor, ...]:
        return tuple(
            source if isinstance(source, torch.Tensor)
            else (source.materialize if private else source.readable)(self.checkpoint)
            for source in self.sources
        )

    def release(self) -> None:
        pass


@dataclass(frozen=True)
class DiskSource:
    """A mapped block read from its files on every use into a read buffer of the disk tier,
    then copied from there (See [Note: the disk tier] in dlo.hotpath.read_ahead): a load never
    reads the mapping, so the block's pages stay out of the page cache. Everything else (the
    private tensors, restoring, packing once) is its mapping's."""

    mapped: MappedSource
    reads: BlockReads

    pinned = False

    @property
    def host_bytes(self) -> int:
        return self.mapped.host_bytes

    @property
    def buffer_bytes(self) -> int:
        """What a read buffer needs to hold the block's read."""
        return self.reads.nbytes

    def read(self, reader: DiskReader, buffer: torch.Tensor) -> None:
        reader.read(self.reads, buffer)

    def copy_tasks(
        self, buffer: torch.Tensor, targets: Sequence[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    ) -> list[CopyTask]:
        """Copies filling `targets` from `buffer`, which holds the block's read."""
        return self.mapped.copy_tasks(targets, whole=True, views=ReadImage(self.mapped.checkpoint, self.reads, buffer))

    def pack(self, layout: BlockLayout, wire: WireLayout, buffer: torch.Tensor) -> None:
        """The wire image into the host `buffer`, from the mapping (a one-off: promoting the
        block, or rewriting its weights)."""
        self.mapped.pack(layout, wire, buffer)

    def restored(self, layout: BlockLayout, wire: WireLayout) -> tuple[torch.Tensor, ...]:
        return self.mapped.restored(layout, wire)

    def values(self, layout: BlockLayout, wire: WireLayout) -> tuple[torch.Tensor, ...]:
        return self.mapped.values(layout, wire)

    def release(self) -> None:
        pass


@dataclass(frozen=True)
class ShardSource:
    """All-gather mode: this rank's bytes of the block's (padded) wire image in host memory,
    one tensor per piece of `shards.pieces(rank)`, in chunk order. A load copies each piece
    into its place in the slot and the group all-gathers the rest, chunk by chunk (See [Note:
    chunked gathers]). The pieces are views of a private buffer (`buffer`) holding them one
    after another, or, with `buffer` None, of the node's shared cache entry: See [Note: shards
    from the shared entry] in dlo.backend.block_binding."""

    shards: ShardLayout
    rank: int
    pieces: tuple[torch.Tensor, ...]
    buffer: HostBuffer | None

    @classmethod
    def private(cls, buffer: HostBuffer, shards: ShardLayout, rank: int) -> ShardSource:
        """Pieces of `buffer`, which holds the rank's shard (its pieces one after another)."""
        pieces = tuple(buffer.tensor[p.shard_start : p.shard_start + p.nbytes] for p in shards.pieces(rank))
        return cls(shards, rank, pieces, buffer)

    @classmethod
    def shared(cls, image: torch.Tensor, shards: ShardLayout, rank: int) -> ShardSource:
        """Pieces of `image`, the padded block image where it lies in the shared mapping."""
        pieces = tuple(image[p.image_start : p.image_start + p.nbytes] for p in shards.pieces(rank))
        return cls(shards, rank, pieces, None)

    @property
    def shard_bytes(self) -> int:
        return self.shards.shard_bytes

    @property
    def views_entry(self) -> bool:
        """The pieces are views of the shared cache entry (no private buffer)."""
        return self.buffer is None

    @property
    def host_bytes(self) -> int:
        """Private bytes only: a shared entry's are page cache, one copy per node."""
        return self.buffer.nbytes if self.buffer is not None else 0

    @property
    def pinned(self) -> bool:
        return self.buffer is not None and self.buffer.pinned

    def release(self) -> None:
        if self.buffer is not None:
            self.buffer.unpin()


@dataclass(frozen=True)
class ShardFill:
    """`nbytes` at `shard_start` of the rank's shard: from the read range `label` of the
    block's reads, or, with `label` None, the bytes of `private`."""

    shard_start: int
    nbytes: int
    label: int | None
    private: torch.Tensor | None


@dataclass(frozen=True)
class DiskShardSource:
    """All-gather mode under a host memory budget: this rank's shard of the block, read from
    its files on every use into a read buffer, its bytes first, the assembled shard after
    them (See [Note: shards read from disk])."""

    shards: ShardLayout
    rank: int
    reads: BlockReads
    fills: tuple[ShardFill, ...]

    pinned = False

    @classmethod
    def plan(cls, segments: Sequence[ImageSegment], shards: ShardLayout, rank: int) -> DiskShardSource:
        """The ranges of the files (and of private tensors) that make up `rank`'s pieces."""
        ranges: list[tuple[int, SafetensorsFile, int, int]] = []
        fills = []
        for piece in shards.pieces(rank):
            end = piece.image_start + piece.nbytes
            for segment in segments:
                low, high = max(piece.image_start, segment.image_start), min(end, segment.image_start + segment.nbytes)
                if low >= high:
                    continue
                at, inner = piece.shard_start + low - piece.image_start, low - segment.image_start
                if segment.file is None:
                    assert segment.private is not None
                    # A copy of the rank's part: a view would keep the whole tensor alive.
                    fills.append(ShardFill(at, high - low, None, segment.private[inner : inner + high - low].clone()))
                    continue
                start = segment.file_start + inner
                fills.append(ShardFill(at, high - low, len(ranges), None))
                ranges.append((len(ranges), segment.file, start, start + high - low))
        # Only the rank's own bytes: the gaps between its ranges are its peers' pieces.
        return cls(shards, rank, BlockReads.of_ranges(ranges, merge_gap=0), tuple(fills))

    @property
    def shard_bytes(self) -> int:
        return self.shards.shard_bytes

    @property
    def buffer_bytes(self) -> int:
        """What a read buffer needs: the reads, then the assembled shard."""
        return self.reads.nbytes + self.shard_bytes

    @property
    def host_bytes(self) -> int:
        """The private tensors' bytes (the files' are read per use)."""
        return sum(f.nbytes for f in self.fills if f.label is None)

    def read(self, reader: DiskReader, buffer: torch.Tensor) -> None:
        """The shard into `buffer` (at `buffer_bytes`, aligned for direct I/O): read, then
        assembled after the reads."""
        reader.read(self.reads, buffer)
        shard = buffer[self.reads.nbytes : self.buffer_bytes]
        for fill in self.fills:
            if fill.label is None:
                source = fill.private
            else:
                start = self.reads.placed[fill.label]
                source = buffer[start : start + fill.nbytes]
            CopyTask(shard[fill.shard_start : fill.shard_start + fill.nbytes], source).run()

    def pieces_in(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The shard's pieces, as `ShardSource.pieces`, in a buffer `read` filled."""
        base = self.reads.nbytes
        return tuple(buffer[base + p.shard_start : base + p.shard_start + p.nbytes] for p in self.shards.pieces(self.rank))

    def kept(self, buffer: torch.Tensor, host: HostBuffer) -> ShardSource:
        """The shard a `read` left in `buffer`, copied into `host` (shard_bytes): a shard
        kept in host memory."""
        shard, assembled = host.tensor[: self.shard_bytes], buffer[self.reads.nbytes : self.buffer_bytes]
        shard.zero_()  # the gaps and the padding, as a packed shard has them
        for fill in self.fills:
            span = slice(fill.shard_start, fill.shard_start + fill.nbytes)
            CopyTask(shard[span], assembled[span]).run()
        return ShardSource.private(host, self.shards, self.rank)

    def release(self) -> None:
        pass


BlockSource = PackedSource | MappedSource | DiskSource | ShardSource | DiskShardSource
ReadSource = DiskSource | DiskShardSource
"""A block read from its files on every use (See [Note: the disk tier] in dlo.hotpath.read_ahead)."""
ShardedSource = ShardSource | DiskShardSource
"""All-gather mode: this rank's shard, in host memory or read from disk."""
