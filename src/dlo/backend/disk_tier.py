"""`host_budget_gib` at enable(): which blocks stay in host memory, the disk sources of the
others and the reads that serve them (See [Note: the disk tier] in dlo.hotpath.read_ahead)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from dlo.config import OffloadConfig
from dlo.config.offload_config import AUTO
from dlo.host.block_sources import DiskSource, MappedSource, PackedSource
from dlo.host.checkpoint import Checkpoint
from dlo.host.direct_reads import DIRECT_ALIGNMENT, BlockReads, DiskReader
from dlo.host.host_weight_plan import HostWeightPlan
from dlo.host.memory_budget import available_host_bytes
from dlo.host.pinned_buffer import HostBuffer, aligned_empty
from dlo.host.tensor_source import MappedTensor, QuantizedSource, TensorSource
from dlo.hotpath.executors import Executor
from dlo.hotpath.interrupts import interrupts_held
from dlo.hotpath.read_ahead import ReadAhead
from dlo.hotpath.streamed_block import StreamedBlock
from dlo.planning.adapters import adapter_modules
from dlo.planning.block_layout import ALIGNMENT
from dlo.planning.fp8_selection import quantized_tensors
from dlo.planning.host_tier import GIB, HostTier, plan_host_tier
from dlo.planning.offload_plan import BlockRef
from dlo.planning.tensor_walk import owned_tensors
from dlo.planning.wire_layout import Fp8Format, wire_targets

logger = logging.getLogger(__name__)

READ_THREADS = 8  # read requests in flight: a disk needs several to reach its rate
# Why the mapping is not registered when blocks are read from disk.
UNREGISTERED = "host_budget_gib: blocks beyond the budget are read from disk, and registering would fault every page in"


@dataclass(frozen=True)
class DiskTier:
    """The plan, and each block's reads (None: a block not in a file)."""

    tier: HostTier
    reads: tuple[BlockReads | None, ...]


def budget_bytes(config: OffloadConfig) -> int:
    if config.host_budget_gib == AUTO:
        return available_host_bytes()
    assert isinstance(config.host_budget_gib, (int, float))
    return int(config.host_budget_gib * GIB)


def plan_disk_tier(
    module: nn.Module, refs: list[BlockRef], host_plan: HostWeightPlan | None, config: OffloadConfig
) -> DiskTier | None:
    """See `plan_from_sources`; from the pending plan's mapping and bindings."""
    weights = host_plan.peek() if host_plan is not None else None
    if weights is None:
        return plan_from_sources(module, refs, None, {}, config)
    return plan_from_sources(module, refs, weights.checkpoint, weights.bindings, config)


def plan_from_sources(
    module: nn.Module,
    refs: list[BlockRef],
    checkpoint: Checkpoint | None,
    bindings: Mapping[str, MappedTensor],
    config: OffloadConfig,
) -> DiskTier | None:
    """None without a budget; refuses (ConfigError) a budget that cannot hold what must stay,
    before the plan is taken or anything changed. From names alone (the planned tensors are
    still on the meta device): a block is read from its files when the plan maps some of its
    tensors and none is to be quantized at enable(). What a block kept in host memory holds
    is counted from above: the larger of its reads (alignment included) and its tensors in
    their runtime dtypes, plus ALIGNMENT per tensor (the private copy's layout)."""
    if config.host_budget_gib is None:
        return None
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
    tier = plan_host_tier([r.name for r in refs], host, [r.nbytes if r else None for r in reads], budget_bytes(config))
    if tier.active:
        logger.info(
            "dlo: host_budget_gib=%.2f GiB: %d of %d streamed blocks are read from disk on every use",
            tier.budget_bytes / GIB, len(tier.on_disk), len(refs),
        )
    return DiskTier(tier, tuple(reads))


def place_blocks(
    streamed: list[StreamedBlock], disk: DiskTier | None, pin: bool, undo: contextlib.ExitStack
) -> list[StreamedBlock]:
    """Under an active disk tier: the blocks on disk get their disk sources, and the mapped
    blocks that stay in host memory are read once, with direct I/O like the others, into
    private (pinned) copies. Neither fills the page cache, and what the budget holds is this
    process's own memory. See [Note: which blocks stay in RAM]"""
    if not is_active(disk):
        return streamed
    assert disk is not None
    placed = list(streamed)
    reader = DiskReader(READ_THREADS)
    try:
        _read_kept(placed, disk, pin, undo, reader)
    finally:
        reader.close()
    return placed


def _read_kept(
    placed: list[StreamedBlock], disk: DiskTier, pin: bool, undo: contextlib.ExitStack, reader: DiskReader
) -> None:
    scratch = aligned_empty(disk.tier.read_buffer_bytes, torch.device("cpu"), DIRECT_ALIGNMENT)
    for index, block in enumerate(placed):
        source, reads = block.source, disk.reads[index]
        if not isinstance(source, MappedSource) or reads is None:
            continue
        read = DiskSource(source, reads)
        if index in disk.tier.on_disk:
            placed[index] = replace(block, source=read)
            continue
        with interrupts_held():  # a pinned buffer is never without its undo
            host = HostBuffer(block.wire.nbytes, pin)
            undo.callback(host.unpin)
        reader.read(reads, scratch)
        for task in read.copy_tasks(scratch, wire_targets(block.layout, block.wire, host.tensor, host.tensor[block.wire.plain_bytes :])):
            task.run()
        placed[index] = replace(block, source=PackedSource(host))


def read_ahead(
    streamed: list[StreamedBlock], disk: DiskTier | None, executor: Executor, pin: bool
) -> ReadAhead | None:
    if not is_active(disk):
        return None
    assert disk is not None
    sources = {i: b.source for i, b in enumerate(streamed) if isinstance(b.source, DiskSource)}
    tier = disk.tier
    return ReadAhead(sources, DiskReader(READ_THREADS), tier.read_buffers, tier.read_buffer_bytes, pin, executor.staging_event)


def is_active(disk: DiskTier | None) -> bool:
    return disk is not None and disk.tier.active
