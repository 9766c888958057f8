"""A streamed block's host copy rewritten from new values: a private buffer in place, a
read-only mapping copied on write, float8 weights requantized where their values changed.

[Note: rewriting a host copy]
The new values arrive as the block's slot image (the layout dlo streams into, float8 weights
dequantized there), read back from the device after an edit. The new wire image is the old
one with the plain region replaced and, per float8 weight, its data and scales requantized
(`quantize_into`, as enable() quantizes) only if the weight's values differ from the old ones
dequantized: an unchanged weight keeps its bytes, so a block changed elsewhere streams its
other float8 weights exactly as before (requantizing dequantized values may round
differently). A block whose image did not change is left as it was. Otherwise:
- a private buffer (`PackedSource`, or a private all-gather shard) is overwritten in place,
  with one copy of the finished image: it is the weight, and an interrupt cannot leave half
  of it written;
- a read-only mapping (checkpoint, host weight cache) is never written: the block gets a
  private buffer of its own (copy on write), counted in `Rewrite.copied_bytes`, and the
  rest of the mapping stays as it is. A shard viewing the shared cache entry gets a private
  shard the same way.
Every rank of an all-gather group makes the same edit and so writes the same image: its
shard is its pieces of it, the padding zeros.
A private buffer of plain tensors only (no float8 weights: its image is the slot image) takes
the fast way, `rewrite_in_place`: compared with the block's memory where that memory is (the
device), a chunk at a time, then written with one copy from it (on a GPU, a DMA into the
pinned buffer): no block-sized host buffers are made, so fusing a LoRA into a 700 MB block
costs milliseconds, not a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlo.host.block_sources import BlockSource, DiskShardSource, DiskSource, MappedSource, PackedSource, ShardSource
from dlo.host.fp8_codec import dequantize_into, dequantized, quantize_into
from dlo.host.pinned_buffer import HostBuffer
from dlo.planning.block_layout import BlockLayout, view_placement
from dlo.planning.wire_layout import WireLayout, landing_views


@dataclass(frozen=True)
class Rewrite:
    """source: what the block streams from now (the same object when written in place).
    image: its new wire image on the host. requantized: indices into `wire.quantized` of
    the float8 weights whose bytes changed. copied_bytes: private host bytes made for it."""

    source: BlockSource
    image: torch.Tensor
    requantized: tuple[int, ...]
    copied_bytes: int


def old_image(source: BlockSource, layout: BlockLayout, wire: WireLayout, gathered: torch.Tensor | None) -> torch.Tensor:
    """The block's wire image as its source holds it now: the private buffer itself, the
    mapping packed into a new buffer, or (all-gather mode) `gathered`, the whole padded block
    its group gathered."""
    if isinstance(source, PackedSource):
        return source.host.tensor
    if isinstance(source, (MappedSource, DiskSource)):
        image = torch.empty(wire.nbytes, dtype=torch.uint8)
        source.pack(layout, wire, image)
        return image
    assert gathered is not None, "a shard's image is gathered by its group"
    return gathered[: wire.nbytes]


def load_image(memory: torch.Tensor, image: torch.Tensor, layout: BlockLayout, wire: WireLayout) -> tuple[torch.Tensor, ...]:
    """Fill `memory` (a flat buffer laid out like a slot, on any device) from the host wire
    `image`: the plain region as it is, float8 weights dequantized. Returns the tensors' views."""
    views = tuple(view_placement(memory, p) for p in layout.placements)
    memory[: wire.plain_bytes].copy_(image[: wire.plain_bytes])
    landed = landing_views(image[wire.plain_bytes :].to(memory.device), wire)
    for q, (data, scale) in zip(wire.quantized, landed):
        dequantize_into(views[q.index], data, scale)
    return views


def _new_image(
    old: torch.Tensor, layout: BlockLayout, wire: WireLayout, values: torch.Tensor, name: str
) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """The wire image holding `values` (the slot image, on the host), and the float8 weights
    requantized; None when it equals `old`. See [Note: rewriting a host copy]"""
    image = old.clone()
    image[: wire.plain_bytes].copy_(values[: wire.plain_bytes])
    requantized = []
    for k, (q, (data, scale)) in enumerate(zip(wire.quantized, landing_views(image[wire.plain_bytes :], wire))):
        placement = layout.placements[q.index]
        value = view_placement(values, placement)
        if not torch.equal(value, dequantized(data, scale, placement.spec.dtype)):
            quantize_into(value, data, scale, f"{name}.{placement.spec.name}")
            requantized.append(k)
    if not requantized and not _plain_changed(values, old, layout, wire):
        return None
    return image, tuple(requantized)


def _plain_changed(values: torch.Tensor, old: torch.Tensor, layout: BlockLayout, wire: WireLayout) -> bool:
    """Whether a plain tensor's bytes differ. The padding between tensors is not compared:
    an image packed from a mapping leaves it as the allocator gave it."""
    quantized = {q.index for q in wire.quantized}
    return any(
        not torch.equal(values[p.offset : p.offset + p.spec.nbytes], old[p.offset : p.offset + p.spec.nbytes])
        for i, p in enumerate(layout.placements)
        if i not in quantized
    )


# Host bytes moved at a time to compare with a device block: the compare's device memory
# (the chunk and torch.equal's mask) stays small beside the slots.
COMPARE_CHUNK_BYTES = 16 * 2**20


def rewrite_in_place(source: PackedSource, wire: WireLayout, memory: torch.Tensor) -> Rewrite | None:
    """rewrite() of a private buffer of plain tensors (`not wire.quantized`) from the block's
    `memory` (its slot image, on any device); None when nothing changed. Nothing is written
    before the final copy, so a failure before it (out of device memory for a chunk) leaves
    the host copy as it was. See [Note: rewriting a host copy]"""
    assert not wire.quantized, "float8 weights are requantized by rewrite()"
    host, values = source.host.tensor[: wire.plain_bytes], memory[: wire.plain_bytes]
    for start in range(0, wire.plain_bytes, COMPARE_CHUNK_BYTES):
        end = min(start + COMPARE_CHUNK_BYTES, wire.plain_bytes)
        if not torch.equal(values[start:end], host[start:end].to(values.device, non_blocking=True)):
            break
    else:
        return None
    host.copy_(values)  # one copy: an interrupt cannot leave half of the weight written
    return Rewrite(source, source.host.tensor, (), 0)


def rewrite(
    source: BlockSource,
    old: torch.Tensor,
    layout: BlockLayout,
    wire: WireLayout,
    values: torch.Tensor,
    name: str,
    pin: bool,
) -> Rewrite | None:
    """Give block `name` the host copy of `values` (its slot image on the host), from its
    `old` wire image (`old_image`); None when nothing changed. `pin`: page-lock a private
    copy made for a mapping. See [Note: rewriting a host copy]"""
    made = _new_image(old, layout, wire, values, name)
    if made is None:
        return None
    image, requantized = made
    if isinstance(source, PackedSource):
        source.host.tensor.copy_(image)
        return Rewrite(source, source.host.tensor, requantized, 0)
    if isinstance(source, (MappedSource, DiskSource)):  # read-only: copied on write
        buffer = HostBuffer(wire.nbytes, pin)
        buffer.tensor.copy_(image)
        return Rewrite(PackedSource(buffer), buffer.tensor, requantized, buffer.nbytes)
    padded = torch.zeros(source.shards.padded_bytes, dtype=torch.uint8)
    padded[: wire.nbytes] = image
    copied = 0
    if isinstance(source, DiskShardSource) or source.views_entry:  # read-only: copied on write
        source = ShardSource.private(HostBuffer(source.shard_bytes, pin), source.shards, source.rank)
        copied = source.shard_bytes
    for piece, host in zip(source.shards.pieces(source.rank), source.pieces):
        host.copy_(padded[piece.image_start : piece.image_start + piece.nbytes])
    return Rewrite(source, image, requantized, copied)
