"""`host_budget_gib` at enable(): which blocks stay in host memory, the disk sources of the
others and the reads that serve them (See [Note: the disk tier] in dlo.hotpath.read_ahead)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from dlo.config import OffloadConfig
from dlo.config.offload_config import AUTO
from dlo.errors import EnableError
from dlo.host.block_sources import DiskShardSource, DiskSource, MappedSource, PackedSource, ReadSource, ShardSource
from dlo.host.checkpoint import Checkpoint
from dlo.host.direct_reads import DIRECT_ALIGNMENT, READ_THREADS, BlockReads, DiskReader
from dlo.host.host_weight_plan import HostWeightPlan
from dlo.host.image_segments import image_segments
from dlo.host.memory_budget import available_host_bytes
from dlo.host.pinned_buffer import HostBuffer, aligned_empty
from dlo.host.tensor_source import MappedTensor, QuantizedSource, TensorSource
from dlo.hotpath.executors import Executor
from dlo.hotpath.gather import GatherGroup
from dlo.hotpath.interrupts import interrupts_held
from dlo.hotpath.read_ahead import ReadAhead
from dlo.hotpath.streamed_block import StreamedBlock
from dlo.planning.adapters import adapter_modules
from dlo.planning.block_layout import ALIGNMENT, TensorSpec
from dlo.planning.fp8_selection import fp8_format, quantized_tensors
from dlo.planning.host_tier import GIB, NOT_IN_A_FILE, HostTier, plan_host_tier
from dlo.planning.offload_plan import BlockRef
from dlo.planning.shard_layout import plan_shards
from dlo.planning.tensor_walk import owned_tensors
from dlo.planning.wire_layout import plan_wire_layout, wire_targets

logger = logging.getLogger(__name__)

# Why the mapping is not registered when blocks are read from disk.
UNREGISTERED = "host_budget_gib: blocks beyond the budget are read from disk, and registering would fault every page in"


@dataclass(frozen=True)
class DiskTier:
    """The plan, each block's reads (None: a block not in a file) and what it holds in host
    memory when it stays there."""

    tier: HostTier
    reads: tuple[BlockReads | None, ...]
    host_bytes: tuple[int, ...]


def budget_bytes(config: OffloadConfig) -> int:
    if config.host_budget_gib == AUTO:
        return available_host_bytes()
    assert isinstance(config.host_budget_gib, (int, float))
    return int(config.host_budget_gib * GIB)


def plan_disk_tier(
    module: nn.Module,
    refs: list[BlockRef],
    host_plan: HostWeightPlan | None,
    config: OffloadConfig,
    group: GatherGroup | None = None,
) -> DiskTier | None:
    """See `plan_from_sources`; from the pending plan's mapping and bindings."""
    weights = host_plan.peek() if host_plan is not None else None
    if weights is None:
        return plan_from_sources(module, refs, None, {}, config, group)
    return plan_from_sources(module, refs, weights.checkpoint, weights.bindings, config, group)


def plan_from_sources(
    module: nn.Module,
    refs: list[BlockRef],
    checkpoint: Checkpoint | None,
    bindings: Mapping[str, MappedTensor],
    config: OffloadConfig,
    group: GatherGroup | None = None,
) -> DiskTier | None:
    """None without a budget; refuses (ConfigError) a budget that cannot hold what must stay,
    before the plan is taken or anything changed. From names alone (the planned tensors are
    still on the meta device): a block is read from its files when the plan maps some of its
    tensors and none is to be quantized at enable(). What a block kept in host memory holds
    is counted from above: the larger of its reads (alignment included) and its tensors in
    their runtime dtypes, plus ALIGNMENT per tensor (the private copy's layout). In all-gather
    mode (`group`) each block counts as this rank's shard, exactly (`_shard_tier`)."""
    if config.host_budget_gib is None:
        return None
    if group is not None:
        return _shard_tier(module, refs, checkpoint, bindings, config, group)
    reads: list[BlockReads | None] = []
    host: list[int] = []
    for ref in refs:
        owned = {id(o.tensor): o for o in owned_tensors(ref.module, adapter_modules(ref.module))}
        sources = {key: bindings.get(f"{ref.name}.{o.name}") for key, o in owned.items()}
        selected = quantized_tensors(module, ref, config)
        to_quantize = any(key in selected and not isinstance(s, QuantizedSource) for key, s in sources.items())
        unplanned = sum(o.tensor.numel() * o.tensor.element_size() for key, o in owned.items() if sources[key] is None)
        padding = ALIGNMENT * len(owned)
        keys = [k for s in sources.values() if s is not None for k in s.keys]
        # Runtime bytes of the planned tensors (a float8 one is kept as read: its reads count it).
        planned = sum(
            math.prod(s.shape) * s.dtype.itemsize for s in sources.values() if isinstance(s, TensorSource)
        )
        if checkpoint is None or not keys or to_quantize:
            reads.append(None)
            host.append(planned + unplanned + padding)
            continue
        block_reads = BlockReads.plan(checkpoint, keys)
        reads.append(block_reads)
        host.append(max(block_reads.nbytes, planned) + unplanned + padding)  # a cast may widen what was read
    return _planned(refs, host, reads, [r.nbytes if r else None for r in reads], config)


def _shard_tier(
    module: nn.Module,
    refs: list[BlockRef],
    checkpoint: Checkpoint | None,
    bindings: Mapping[str, MappedTensor],
    config: OffloadConfig,
    group: GatherGroup,
) -> DiskTier:
    """All-gather mode: each block's wire image and shards laid out as binding will lay them
    (from the planned runtime shapes and dtypes), so what a rank keeps (its shard) and what a
    read of it needs (`DiskShardSource.buffer_bytes`) are exact. Every rank plans with the
    largest read of any rank's shard, so ranks given the same budget (a number: 'auto' is
    refused in this mode) and the same files make the same split, or all refuse the budget
    (one refusing alone would leave its peers waiting in their first collective). See [Note:
    shards read from disk]"""
    fp8 = fp8_format(config)
    reads: list[BlockReads | None] = []
    host: list[int] = []
    buffers: list[int | None] = []
    for ref in refs:
        owned = list({id(o.tensor): o for o in owned_tensors(ref.module, adapter_modules(ref.module))}.values())
        sources = [bindings.get(f"{ref.name}.{o.name}") for o in owned]
        selected = quantized_tensors(module, ref, config)
        # The runtime shape and dtype: the plan's for planned tensors (still meta here).
        shaped = [
            (tuple(s.shape), s.dtype) if s is not None else (tuple(o.tensor.shape), o.tensor.dtype)
            for o, s in zip(owned, sources)
        ]
        specs = [TensorSpec(o.name, shape, dtype) for o, (shape, dtype) in zip(owned, shaped)]
        formats = [
            s.format if isinstance(s, QuantizedSource) else (fp8 if id(o.tensor) in selected else None)
            for o, s in zip(owned, sources)
        ]
        layout, wire = plan_wire_layout(specs, formats)
        shards = plan_shards(wire.nbytes, group.size, config.gather_chunk_bytes)
        host.append(shards.shard_bytes)
        segments = None
        if checkpoint is not None and any(s is not None for s in sources):
            segments = image_segments([o.tensor for o in owned], sources, layout, wire, checkpoint)
        if segments is None:
            reads.append(None)
            buffers.append(None)
            continue
        every_rank = [DiskShardSource.plan(segments, shards, rank) for rank in range(group.size)]
        reads.append(every_rank[group.rank].reads)
        buffers.append(max(source.buffer_bytes for source in every_rank))
    unreadable = NOT_IN_A_FILE if checkpoint is None else (
        "no streamed block's shard can be read from disk: all-gather mode reads a shard's bytes as the files hold "
        "them, and every block needs a cast or weights quantized at enable() (load the model in the dtype it was "
        "saved in, or use rank-local mode: use_allgather=False)"
    )
    return _planned(refs, host, reads, buffers, config, unreadable)


def _planned(
    refs: list[BlockRef],
    host: list[int],
    reads: list[BlockReads | None],
    buffers: list[int | None],
    config: OffloadConfig,
    unreadable: str = NOT_IN_A_FILE,
) -> DiskTier:
    tier = plan_host_tier([r.name for r in refs], host, buffers, budget_bytes(config), unreadable)
    if tier.active:
        logger.info(
            "dlo: host_budget_gib=%.2f GiB: %d of %d streamed blocks are read from disk on every use",
            tier.budget_bytes / GIB, len(tier.on_disk), len(refs),
        )
    return DiskTier(tier, tuple(reads), tuple(host))


def place_blocks(
    streamed: list[StreamedBlock], disk: DiskTier | None, pin: bool, undo: contextlib.ExitStack
) -> tuple[list[StreamedBlock], dict[int, ReadSource]]:
    """Under an active disk tier: the blocks on disk get their disk sources, and the file
    blocks that stay in host memory are read once, with direct I/O like the others, into
    private (pinned) copies (all-gather mode: of the rank's shard). Neither fills the page
    cache, and what the budget holds is this process's own memory. Also returns every file
    block's disk source (by index), for the measured choice to move blocks between host
    memory and disk later. See [Note: which blocks stay in RAM]"""
    if not is_active(disk):
        return streamed, {}
    assert disk is not None
    placed = list(streamed)
    sources: dict[int, ReadSource] = {
        index: block.source if isinstance(block.source, DiskShardSource) else DiskSource(block.source, reads)
        for index, (block, reads) in enumerate(zip(streamed, disk.reads))
        if isinstance(block.source, (MappedSource, DiskShardSource)) and reads is not None
    }
    # Checks of the plan against the blocks bound (the same layouts, from the same sources).
    packed_instead = [b.name for b, r in zip(streamed, disk.reads) if r is not None and isinstance(b.source, ShardSource)]
    if packed_instead or any(source.buffer_bytes > disk.tier.read_buffer_bytes for source in sources.values()):
        raise EnableError(
            f"the blocks bound differ from the disk tier's plan ({', '.join(packed_instead) or 'a read beyond its buffer'}): "
            "a bug in dlo, please report it"
        )
    scratch = aligned_empty(disk.tier.read_buffer_bytes, torch.device("cpu"), DIRECT_ALIGNMENT)
    with HostCopies(scratch, pin) as copies:
        for index, source in sources.items():
            if index in disk.tier.on_disk:
                placed[index] = replace(placed[index], source=source)
            else:
                placed[index] = replace(placed[index], source=copies.read(placed[index], source, undo.callback))
    return placed, sources


class HostCopies:
    """Reads blocks from their files, with direct I/O, through `scratch` (aligned for it, one
    read's bytes) into private (pinned) copies; a reader while open."""

    def __init__(self, scratch: torch.Tensor, pin: bool) -> None:
        self._scratch = scratch
        self._pin = pin

    def __enter__(self) -> HostCopies:
        self._reader = DiskReader(READ_THREADS)
        return self

    def __exit__(self, *exc: object) -> None:
        self._reader.close()

    def read(
        self, block: StreamedBlock, source: ReadSource, on_release: Callable[[Callable[[], None]], Any]
    ) -> PackedSource | ShardSource:
        """Block `block`'s private copy (of the rank's shard, for a shard read from disk), read
        from `source`; `on_release` is given its release as soon as it holds pinned memory (a
        failed read releases it first)."""
        with interrupts_held():  # a pinned buffer is never without its release
            host = HostBuffer(source.shard_bytes if isinstance(source, DiskShardSource) else block.wire.nbytes, self._pin)
            on_release(host.unpin)
        source.read(self._reader, self._scratch)
        if isinstance(source, DiskShardSource):
            return source.kept(self._scratch, host)
        targets = wire_targets(block.layout, block.wire, host.tensor, host.tensor[block.wire.plain_bytes :])
        for task in source.copy_tasks(self._scratch, targets):
            task.run()
        return PackedSource(host)


def read_ahead(
    streamed: list[StreamedBlock], disk: DiskTier | None, executor: Executor, pin: bool
) -> ReadAhead | None:
    if not is_active(disk):
        return None
    assert disk is not None
    sources = {i: b.source for i, b in enumerate(streamed) if isinstance(b.source, ReadSource)}
    tier = disk.tier
    return ReadAhead(sources, DiskReader(READ_THREADS), tier.read_buffers, tier.read_buffer_bytes, pin, executor.staging_event)


def is_active(disk: DiskTier | None) -> bool:
    return disk is not None and disk.tier.active
