"""Binding one streamed block to its host source: a packed private buffer, the checkpoint or
cache mapping, or (all-gather mode) this rank's shard.

[Note: shards from the shared entry]
With the host weight cache every rank of a node maps the same entry (its identity names no
rank and no group size), and the entry holds each block as its wire image (See [Note: one
copy per block]). In all-gather mode a rank's shard is then views of that image in the
mapping, one per piece `ShardLayout.pieces(rank)` names (See [Note: chunked gathers]), copied
from straight to the device (the mapping is registered on CUDA): no private copy, one copy of
the weights in RAM per node, and each rank's link carries its 1/G. The padded image runs up
to chunks x G x 512 bytes past the block's: into the next block's bytes, or past a file's
last block into the padding every entry file ends with (FILE_TAIL_BYTES). Those bytes land
in the slot's padding, which nothing reads. (Padding each block to a multiple of G would put
G into the layout, hence into the entry's identity; one tail per file does not.) A block
whose image the mapping does not hold as is (adapters, tensors the entry lacks), a padded
image that would run past its file (many chunks, a large group), or, with pinned memory on
CUDA, a mapping that could not be registered gets a private shard of the same image bytes
instead. Ranks may decide differently (one of them without the cache, say): the image bytes
each contributes are the same either way, only the unread padding differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dlo.backend.plan_binding import BoundPlan
from dlo.errors import EnableError
from dlo.host.block_sources import BlockSource, DiskShardSource, MappedSource, PackedSource, ShardedSource, ShardSource
from dlo.host.fp8_codec import quantize_into
from dlo.host.image_segments import ImageSegment, image_segments
from dlo.host.pinned_buffer import HostBuffer
from dlo.host.tensor_source import QuantizedSource
from dlo.hotpath.gather import GatherGroup
from dlo.hotpath.streamed_block import Binding, StreamedBlock
from dlo.planning.adapters import adapter_modules
from dlo.planning.gguf_weights import is_gguf_parameter
from dlo.planning.block_layout import ALIGNMENT, BlockLayout, TensorSpec
from dlo.planning.offload_plan import BlockRef
from dlo.planning.shard_layout import ShardLayout, plan_shards
from dlo.planning.tensor_walk import owned_tensors
from dlo.planning.wire_layout import Fp8Format, WireLayout, plan_wire_layout, wire_targets


@dataclass(frozen=True)
class BlockTensors:
    """A block's unique tensors in layout order, and every (owner, key) holding one."""

    ref: BlockRef
    specs: tuple[TensorSpec, ...]
    tensors: tuple[torch.Tensor, ...]
    bindings: tuple[Binding, ...]
    quantize: tuple[bool, ...]  # per tensor: streams as float8. See [Note: fp8 streaming]


def check_streamable(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type == "meta":
        raise EnableError(
            f"{name!r} is on the meta device (weights not loaded). Load the model before dlo.enable(); a model "
            "from dlo.load_transformer needs plan=<the HostWeightPlan it returned>"
        )
    plain = type(tensor) in (torch.Tensor, nn.Parameter) or is_gguf_parameter(tensor)
    if not plain or tensor.layout != torch.strided or tensor.is_quantized:
        raise EnableError(
            f"{name!r} is a {type(tensor).__name__} ({tensor.layout}); dlo streams plain dense tensors only"
        )


def collect_block(ref: BlockRef, quantized: frozenset[int] = frozenset()) -> BlockTensors:
    """`quantized`: id() of the block's tensors that stream as float8."""
    index: dict[int, int] = {}
    specs: list[TensorSpec] = []
    tensors: list[torch.Tensor] = []
    bindings: list[Binding] = []
    for owned in owned_tensors(ref.module, adapter_modules(ref.module)):  # See [Note: adapters stay resident]
        tensor = owned.tensor
        if id(tensor) not in index:
            check_streamable(f"{ref.name}.{owned.name}", tensor)
            index[id(tensor)] = len(tensors)
            tensors.append(tensor)
            specs.append(TensorSpec(owned.name, tuple(tensor.shape), tensor.dtype))
        bindings.append(Binding(owned.owner, owned.key, owned.is_parameter, tensor))
    quantize = tuple(id(tensor) in quantized for tensor in tensors)
    return BlockTensors(ref, tuple(specs), tuple(tensors), tuple(bindings), quantize)


def refuse_shared(streamed: list[BlockTensors], rest: dict[int, str]) -> None:
    """A tensor may belong to one streamed block only, and not to a non-streamed part."""
    owner_of: dict[int, str] = {}
    for block in streamed:
        for spec, tensor in zip(block.specs, block.tensors):
            where = owner_of.get(id(tensor)) or rest.get(id(tensor))
            if where is not None:
                raise EnableError(
                    f"{block.ref.name}.{spec.name} is the same tensor as {where!r}; dlo cannot stream a tensor "
                    "shared with another block or with a non-streamed part. Untie it, or leave this block "
                    "resident (resident_layers) or out of the plan."
                )
            owner_of[id(tensor)] = f"{block.ref.name}.{spec.name}"


def stand_in_value(dtype: torch.dtype) -> float | int:
    """NaN; for uint8 (GGUF's packed bytes) 0xFF, whose float16 scales read NaN; 0 for other
    integers. See [Note: stand-ins]"""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return 0xFF if dtype == torch.uint8 else 0


def placeholders(blocks: list[BlockTensors], device: torch.device) -> dict[torch.dtype, torch.Tensor]:
    """One 0-d tensor per dtype on `device`, of stand_in_value: each streamed tensor points at
    it, expanded to its own shape, between its block's runs. See [Note: stand-ins]"""
    found: dict[torch.dtype, torch.Tensor] = {}
    for block in blocks:
        for tensor in block.tensors:
            if tensor.dtype not in found:
                found[tensor.dtype] = torch.full((), stand_in_value(tensor.dtype), dtype=tensor.dtype, device=device)
    return found


def _mapped_source(block: BlockTensors, plan: BoundPlan | None, pin_private: bool = False) -> MappedSource | None:
    """`pin_private`: page-lock the snapshots (direct copies from pageable memory would make
    the host wait for the copy stream)."""
    if plan is None or not any(id(t) in plan.planned for t in block.tensors):
        return None
    # Tensors the checkpoint does not hold are snapshotted: the live ones become placeholders.
    snapshot = (lambda t: t.detach().clone().pin_memory()) if pin_private else (lambda t: t.detach().clone())
    return MappedSource(plan.weights.checkpoint, tuple(plan.planned.get(id(t)) or snapshot(t) for t in block.tensors))


def _streamed(
    block: BlockTensors,
    layout: BlockLayout,
    wire: WireLayout,
    source: BlockSource,
    placeholder: dict[torch.dtype, torch.Tensor],
) -> StreamedBlock:
    return StreamedBlock(
        name=block.ref.name,
        layout=layout,
        wire=wire,
        tensors=block.tensors,
        bindings=block.bindings,
        source=source,
        placeholders=tuple(placeholder[t.dtype].expand(t.shape) for t in block.tensors),
    )


def _host_buffer(block: BlockTensors, nbytes: int, pin: bool) -> HostBuffer:
    try:
        return HostBuffer(nbytes, pin)
    except EnableError as err:
        raise EnableError(f"block {block.ref.name!r}: {err}") from None


def _formats(block: BlockTensors, plan: BoundPlan | None, fp8: Fp8Format | None) -> tuple[Fp8Format | None, ...]:
    """Each tensor's float8 format: as the checkpoint stores it, else the config's for the
    weights it selected, else None (streams as it is)."""
    planned = plan.planned if plan is not None else {}

    def format_of(tensor: torch.Tensor, selected: bool) -> Fp8Format | None:
        source = planned.get(id(tensor))
        if isinstance(source, QuantizedSource):
            return source.format
        return fp8 if selected else None

    return tuple(format_of(t, selected) for t, selected in zip(block.tensors, block.quantize))


def quantizes_privately(block: BlockTensors, plan: BoundPlan | None) -> bool:
    """Whether the block has weights to quantize at enable() (not already float8 in the
    plan's mapping): it then streams from a private buffer, whatever the plan."""
    planned = plan.planned if plan is not None else {}
    return any(q and not isinstance(planned.get(id(t)), QuantizedSource) for t, q in zip(block.tensors, block.quantize))


def bind_block(
    block: BlockTensors,
    plan: BoundPlan | None,
    pin: bool,
    placeholder: dict[torch.dtype, torch.Tensor],
    fp8: Fp8Format | None = None,
) -> StreamedBlock:
    """Give the block its host source; the module is not changed yet: the caller registers
    the undo, then points the tensors at `placeholders`. A block with weights to quantize is
    packed (quantized) into a private buffer, whatever the plan; float8 weights of a
    checkpoint stream from its mapping as stored."""
    layout, wire = plan_wire_layout(block.specs, _formats(block, plan, fp8))
    direct = plan is not None and plan.direct  # copied straight from the registered mapping
    private = quantizes_privately(block, plan)
    source: BlockSource | None = None if private else _mapped_source(block, plan, pin_private=direct and pin)
    if source is None:
        host = _host_buffer(block, wire.nbytes, pin)
        try:
            _pack(block, layout, wire, plan, host.tensor)
        except BaseException:  # e.g. a weight float8 cannot scale: nothing stays page-locked
            host.unpin()
            raise
        source = PackedSource(host)
    return _streamed(block, layout, wire, source, placeholder)


def _pack(block: BlockTensors, layout: BlockLayout, wire: WireLayout, plan: BoundPlan | None, host: torch.Tensor) -> None:
    """Write the block's wire image into `host`: plain tensors as laid out in the slot,
    float8 weights with their scales (copied from the mapping, or quantized here)."""
    planned = plan.planned if plan is not None else {}
    targets = wire_targets(layout, wire, host, host[wire.plain_bytes :])
    for tensor, placement, target in zip(block.tensors, layout.placements, targets):
        source = planned.get(id(tensor))
        if isinstance(source, QuantizedSource):
            for task in source.pieces(plan.weights.checkpoint, target):
                task.run()
            continue
        value = tensor if source is None else source.materialize(plan.weights.checkpoint)
        if isinstance(target, tuple):
            quantize_into(value, *target, f"{block.ref.name}.{placement.spec.name}")
        else:
            target.copy_(value)


def _shared_image(
    block: BlockTensors, layout: BlockLayout, wire: WireLayout, plan: BoundPlan, nbytes: int
) -> torch.Tensor | None:
    """`nbytes` of the mapping from where the block's wire image starts in it, if the mapping
    holds the image as is (every tensor as saved, in the dtype the image has there, at its
    offset in the image from one 512-aligned start in one file) and those bytes lie inside
    that file; else None. A rank that packs its shard privately converts dtypes; bytes taken
    as they are must need no conversion, or the ranks would gather different blocks.
    See [Note: shards from the shared entry]"""
    segments = block_segments(block, layout, wire, plan)
    if segments is None or any(s.file is None for s in segments):
        return None
    files = {id(s.file) for s in segments}
    starts = {s.file_start - s.image_start for s in segments}
    if len(files) != 1 or len(starts) != 1:
        return None
    (start,) = starts
    file = segments[0].file
    assert file is not None
    if start % ALIGNMENT or start < 0 or start + nbytes > file.size:
        return None
    return file.region(start, nbytes)


def block_segments(
    block: BlockTensors, layout: BlockLayout, wire: WireLayout, plan: BoundPlan
) -> tuple[ImageSegment, ...] | None:
    """`image_segments` of a bound block."""
    sources = [plan.planned.get(id(tensor)) for tensor in block.tensors]
    return image_segments(block.tensors, sources, layout, wire, plan.weights.checkpoint)


def shard_block(
    block: BlockTensors,
    plan: BoundPlan | None,
    group: GatherGroup,
    pin: bool,
    placeholder: dict[torch.dtype, torch.Tensor],
    fp8: Fp8Format | None,
    chunk_bytes: int,
    from_disk: bool = False,
) -> StreamedBlock:
    """This rank's shard of the block, built without touching the module. `from_disk`: read
    from the files on every use where the block's image allows it (See [Note: shards read
    from disk]). From the host weight cache, views of the shared entry where it can be (See
    [Note: shards from the shared entry]); else the block's wire image (float8 weights
    quantized, or as the checkpoint stores them) is laid out in a temporary buffer padded as
    `plan_shards` says, and only this rank's pieces of it are kept (See [Note: chunked
    gathers]). The caller points the block at placeholders once every rank's setup succeeded."""
    layout, wire = plan_wire_layout(block.specs, _formats(block, plan, fp8))
    shards = plan_shards(wire.nbytes, group.size, chunk_bytes)
    segments = block_segments(block, layout, wire, plan) if from_disk and plan is not None else None
    if segments is not None:
        return _streamed(block, layout, wire, DiskShardSource.plan(segments, shards, group.rank), placeholder)
    # Registered (or device "cpu", or pageable by choice): the device copies from the shared pages.
    shares = plan is not None and plan.backing == "host_weight_cache" and (plan.direct or not pin)
    image = _shared_image(block, layout, wire, plan, shards.padded_bytes) if shares else None
    if image is not None:
        source = ShardSource.shared(image, shards, group.rank)
    else:
        source = _private_shard(block, layout, wire, plan, shards, group.rank, pin)
    return _streamed(block, layout, wire, source, placeholder)


def _private_shard(
    block: BlockTensors,
    layout: BlockLayout,
    wire: WireLayout,
    plan: BoundPlan | None,
    shards: ShardLayout,
    rank: int,
    pin: bool,
) -> ShardSource:
    """The rank's pieces of the block's padded wire image, one after another in a host buffer."""
    whole = torch.zeros(shards.padded_bytes, dtype=torch.uint8)
    _pack(block, layout, wire, plan, whole)
    source = ShardSource.private(_host_buffer(block, shards.shard_bytes, pin), shards, rank)
    for piece, host in zip(shards.pieces(rank), source.pieces):
        host.copy_(whole[piece.image_start : piece.image_start + piece.nbytes])
    return source


def landing_bytes(block: StreamedBlock) -> int:
    """What a float8 block needs of a landing buffer: its wire image (all-gather mode: all the
    padded shards); 0 for a block without float8 weights. See [Note: fp8 landing]"""
    if not block.wire.quantized:
        return 0
    if isinstance(block.source, ShardedSource):
        return block.source.shards.padded_bytes
    return block.wire.nbytes
