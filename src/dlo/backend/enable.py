"""`dlo.enable()`: bind streamed blocks to their host source (a packed private buffer or the
checkpoint mapping), place the rest on the device, allocate slots and install the hooks.

Every step that changes the module or takes a resource registers its undo before it runs
(`contextlib.ExitStack`), so a failure or an interrupt anywhere leaves the module as it was:
weights where they were, nothing pinned, registered or mapped. In all-gather mode the blocks
are pointed at their placeholders after that, once nothing can fail; an interrupt in that
loop leaves a module that streams correctly (each call points a block at its slot) but keeps
some host tensors alive, under a handle the caller did not receive.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from dlo.backend import disk_tier
from dlo.backend.auto_residency import AutoResidency, residency_budget
from dlo.backend.block_binding import (
    BlockTensors,
    bind_block,
    check_streamable,
    collect_block,
    landing_bytes,
    placeholders,
    quantizes_privately,
    refuse_shared,
    shard_block,
)
from dlo.backend.device import resolve_device
from dlo.backend.fp8_compute import Fp8GemmConversion, check_fp8_gemms
from dlo.backend.gather_group import ParallelGroups, check_backend, resolve_gather_group
from dlo.backend.handle import OffloadHandle, refuse_if_managed
from dlo.backend.mapping_registration import NOT_APPLICABLE, registration_refused
from dlo.backend.outside_use import OutsideUseProbe
from dlo.backend.plan_binding import BoundPlan
from dlo.config import OffloadConfig
from dlo.config.offload_config import AUTO
from dlo.errors import ConfigError
from dlo.host.block_sources import DiskSource, MappedSource, ShardSource
from dlo.host.direct_reads import drop_cached
from dlo.host.fp8_codec import DequantizedWeight, prepare_dequantization
from dlo.host.host_weight_plan import HostWeightPlan
from dlo.host.tensor_source import TensorSource
from dlo.hotpath.compiled_call import StreamedCallHandle
from dlo.hotpath.gather import BlockGather, GatherGroup
from dlo.hotpath.interrupts import interrupts_held
from dlo.hotpath.lockstep import LockstepRuntime
from dlo.hotpath.rank_local import RankLocalRuntime
from dlo.hotpath.runtime import StreamingRuntime
from dlo.hotpath.staging import Stager, default_pack_threads
from dlo.hotpath.streamed_block import StreamedBlock
from dlo.hotpath.executors import DeviceSlot, Executor, make_executor
from dlo.observe.ledger import TransferLedger
from dlo.planning.adapters import adapter_tensors
from dlo.planning.fp8_selection import fp8_format, quantized_tensors
from dlo.planning.offload_plan import BlockRef, OffloadPlan, discover, resolve_blocks
from dlo.planning.plan_summary import summarize
from dlo.planning.tensor_walk import OwnedTensor, owned_tensors
from dlo.planning.wire_layout import Fp8Format


def _rest_tensors(
    module: nn.Module, streamed_refs: list[BlockRef], blocks: list[BlockTensors]
) -> tuple[list[torch.Tensor], dict[str, tuple[nn.Module, int]]]:
    """The tensors that stay on the device: non-block parts, resident blocks, and the
    adapters inside streamed blocks (See [Note: adapters stay resident]); and the aliases:
    modules outside the streamed blocks whose own tensors are all one streamed block's (a
    weight tied to it), by name -> (module, block index)."""
    skip = frozenset(id(sub) for ref in streamed_refs for sub in ref.module.modules())
    block_of = {id(tensor): index for index, block in enumerate(blocks) for tensor in block.tensors}
    aliases = {}
    for name, sub in module.named_modules():
        own = [t for t in (*sub._parameters.values(), *sub._buffers.values()) if t is not None]
        indices = {block_of.get(id(t)) for t in own}
        if id(sub) not in skip and own and len(indices) == 1 and None not in indices:
            aliases[name] = (sub, indices.pop())
    # Every other holder of a tensor keeps it here: one tied to a block is then refused below.
    alias_ids = {id(sub) for sub, _ in aliases.values()}
    rest: dict[int, OwnedTensor] = {}
    for owned in owned_tensors(module, skip):
        if id(owned.owner) not in alias_ids:
            rest.setdefault(id(owned.tensor), owned)
    for ref in streamed_refs:
        for owned in adapter_tensors(ref.module):
            rest.setdefault(id(owned.tensor), replace(owned, name=f"{ref.name}.{owned.name}"))
    for owned in rest.values():
        check_streamable(owned.name, owned.tensor)
    refuse_shared(blocks, {key: owned.name for key, owned in rest.items()})
    return [owned.tensor for owned in rest.values()], aliases


def _place_rest(
    tensors: list[torch.Tensor], device: torch.device, plan: BoundPlan | None, undo: contextlib.ExitStack
) -> int:
    """Move non-streamed tensors to `device` in place (ties survive: one tensor object each);
    the undo puts every one back where it was. On "cpu" they are copied too: mmap'd or
    oddly aligned storage becomes an ordinary allocation. Planned tensors of resident blocks
    are read from the mapping: straight from its pages when it is registered, else through a
    private copy (float8 weights: dequantized on the CPU, the same values as on the device)."""
    originals = [tensor.data for tensor in tensors]

    def put_back() -> None:
        for tensor, original in zip(tensors, originals):
            tensor.data = original

    undo.callback(put_back)
    for tensor in tensors:
        source = plan.planned.get(id(tensor)) if plan is not None else None
        if isinstance(source, TensorSource) and plan.direct:
            value = torch.empty(source.shape, dtype=source.dtype, device=device)
            for piece in source.pieces(plan.weights.checkpoint, value):
                piece.target.copy_(piece.source)
            tensor.data = value
        elif source is not None:
            tensor.data = source.materialize(plan.weights.checkpoint).to(device)
        else:
            tensor.data = tensor.data.to(device) if device.type != "cpu" else tensor.data.clone()
    return sum(t.numel() * t.element_size() for t in tensors)


def _bind_blocks(
    blocks: list[BlockTensors],
    plan: BoundPlan | None,
    gather_group: GatherGroup | None,
    pin: bool,
    device: torch.device,
    fp8: Fp8Format | None,
    undo: contextlib.ExitStack,
    chunk_bytes: int,
    converted: bool,
    on_host: frozenset[int] = frozenset(),
    from_disk: frozenset[int] = frozenset(),
) -> list[StreamedBlock]:
    """Every block bound to its host source, each registering its undo. All-gather mode only
    builds the shards here (gathered in chunks of about `chunk_bytes`): the module changes
    once nothing can fail (see enable()). `converted`: Linears were made FP8 GEMMs (See
    [Note: fp8 compute]), so no block's host image holds the tensors enable() found. The
    blocks `on_host` (their indices) run from their host copy and never cross the link: not
    pinned. All-gather mode: the shards of blocks `from_disk` are read from the files (See
    [Note: shards read from disk])."""
    placeholder = placeholders(blocks, device)
    streamed: list[StreamedBlock] = []
    for index, block in enumerate(blocks):
        pin_block = pin and index not in on_host
        if gather_group is not None:
            bound = shard_block(block, plan, gather_group, pin, placeholder, fp8, chunk_bytes, index in from_disk)
            undo.callback(bound.source.release)
            streamed.append(bound)
            continue
        # Ctrl-C is held from the source's making to its undo's registration (a pinned buffer
        # without its undo would stay pinned), and the module changes only after it.
        with interrupts_held():
            if any(block.quantize) or converted:
                # restore() would give back the dequantized weights, or views of an image that
                # holds float8 ones: a failed enable() gives back the tensors it found (planned
                # stand-ins then get their values from the plan).
                originals = tuple(tensor.data for tensor in block.tensors)
                bound = bind_block(block, plan, pin_block, placeholder, fp8)
                undo.callback(_put_back, bound, originals)
            else:
                bound = bind_block(block, plan, pin_block, placeholder)
                undo.callback(_unbind, bound)
                if plan is not None:
                    plan.restored_by_blocks(bound.tensors)
        bound.point_at(bound.placeholders)
        streamed.append(bound)
    return streamed


def _unbind(block: StreamedBlock) -> None:
    with torch.no_grad():
        block.restore()
    block.source.release()


def _put_back(block: StreamedBlock, originals: tuple[torch.Tensor, ...]) -> None:
    block.point_at(originals)
    block.source.release()


def _dequantized_weights(blocks: list[StreamedBlock]) -> set[DequantizedWeight]:
    return {
        DequantizedWeight(q.dtype, b.layout.placements[q.index].spec.dtype, q.shape, q.scale_shape)
        for b in blocks
        for q in b.wire.quantized
    }


def _allocate_slots(executor: Executor, nbytes: int, count: int, undo: contextlib.ExitStack) -> list[DeviceSlot]:
    slots: list[DeviceSlot] = []
    undo.callback(slots.clear)  # a failed enable() drops its device memory with the exception
    for _ in range(count):
        slots.append(executor.allocate_slot(nbytes))
    return slots


def _stager(
    blocks: list[StreamedBlock], executor: Executor, plan: BoundPlan | None, config: OffloadConfig, pin: bool
) -> Stager | None:
    """Pinned staging buffers for blocks packed from a mapping on every load (not needed when
    the mapping is registered), and the thread disk-tier loads run on. On the CPU too, where
    the slots are host memory: the suite then runs the staging thread the GPU runs."""
    mapped = [b.wire.nbytes for b in blocks if isinstance(b.source, MappedSource)]
    read = any(isinstance(b.source, DiskSource) for b in blocks)  # its loads run on the stager's thread
    if not (mapped or read) or (plan is not None and plan.direct):
        return None
    return Stager(executor, max(mapped, default=0), config.pack_threads or default_pack_threads(), pin)


def _backing(host_plan: HostWeightPlan | None, gather_group: GatherGroup | None, pin: bool, views: bool) -> str:
    """Where the streamed blocks live on the host, for stats and reports. `views`: shards
    view the cache entry (See [Note: shards from the shared entry])."""
    if gather_group is not None:
        return "host_weight_cache shards" if views else "shards"
    if host_plan is not None:
        return host_plan.backing
    return "pinned" if pin else "pageable"


def _gather_group(
    config: OffloadConfig, groups: ParallelGroups | None, device: torch.device, module: nn.Module
) -> GatherGroup | None:
    if not config.use_allgather:
        if groups is not None:
            raise ConfigError("groups= is used by all-gather mode only; set OffloadConfig(use_allgather=True)")
        return None
    chosen = resolve_gather_group(groups, module)
    if chosen.group is not None:
        check_backend(str(torch.distributed.get_backend(chosen.group)), device, chosen.role)
    return chosen


def _resolve_plans(module: nn.Module, plan: object) -> tuple[OffloadPlan, HostWeightPlan | None]:
    if plan is None:
        return discover(module), None
    if isinstance(plan, OffloadPlan):
        return plan, None
    if isinstance(plan, HostWeightPlan):
        return plan.offload_plan, plan
    raise ConfigError(f"plan must be a dlo.OffloadPlan, a dlo.HostWeightPlan or None, got {type(plan).__name__}")


def _check_host_lookups(refs: list[BlockRef], host_plan: HostWeightPlan | None, gather_group: GatherGroup | None) -> None:
    """Host lookups read a private host copy in place (See [Note: token embeddings looked up on
    the host]): refused from a mapping, or from a shard."""
    names = [ref.name for ref in refs if ref.on_host]
    if names and (host_plan is not None or gather_group is not None):
        where = "a checkpoint mapping (HostWeightPlan)" if host_plan is not None else "all-gather mode's shards"
        raise ConfigError(
            f"OffloadPlan.host_lookups names {names}, which look their rows up in a private host copy, not in {where}; "
            "leave them out of host_lookups"
        )


def _resident_count(config: OffloadConfig, offload_plan: OffloadPlan, refs: list[BlockRef], module: nn.Module) -> int:
    if config.resident_layers == AUTO:
        return 0  # every block streams until the measured call; then see [Note: automatic residency]
    count = config.resident_layers
    if count > len(refs):
        raise ConfigError(f"OffloadConfig.resident_layers={count} but {type(module).__name__} has {len(refs)} blocks")
    for ref in refs[:count]:
        if not offload_plan.is_resident_eligible(ref.list_path):
            raise ConfigError(
                f"OffloadConfig.resident_layers={count} would keep {ref.name!r} resident, but the plan "
                f"allows resident blocks only in {offload_plan.resident_eligible!r}"
            )
    return count


def enable(
    module: nn.Module,
    device: str | torch.device,
    config: OffloadConfig | None = None,
    plan: OffloadPlan | HostWeightPlan | None = None,
    groups: ParallelGroups | None = None,
) -> OffloadHandle:
    """Stream the blocks of `module` to `device`; returns the handle that undoes it.

    Non-streamed parts and the first `config.resident_layers` blocks move to `device`; the
    other blocks are packed into (pinned) host memory, or read from the checkpoint or cache
    mapping of a `HostWeightPlan` from `dlo.load_transformer`, and copied into rotating device
    slots just before they run. A mapping whose tensors are used in their saved dtype is registered with
    the driver when it can be (docs/guides/host-weight-cache.md), so its blocks are copied straight from the shared
    pages.
    Call the model under torch.inference_mode() or torch.no_grad().

    With `config.use_allgather`, each rank keeps 1/G of every streamed block and the group
    chosen from `groups` rebuilds blocks with all-gathers (default: the sequence-parallel
    group of a diffusers model with context parallelism enabled, else an initialized
    torch.distributed world as pure data parallelism); every rank must call enable(), the
    model and disable() alike (see [Note: lockstep schedule]).
    """
    config = OffloadConfig() if config is None else config
    if not isinstance(config, OffloadConfig):
        raise ConfigError(f"config must be a dlo.OffloadConfig, got {type(config).__name__}")
    offload_plan, host_plan = _resolve_plans(module, plan)
    device = resolve_device(device)
    if config.fp8_compute:
        if host_plan is not None:
            raise ConfigError(
                "OffloadConfig.fp8_compute=True quantizes the model's own weights at enable(), not a checkpoint "
                "mapping: load the model with checkpoint_mmap=False (no HostWeightPlan)"
            )
        check_fp8_gemms(device)
    gather_group = _gather_group(config, groups, device, module)
    refuse_if_managed(module)
    refs = resolve_blocks(module, offload_plan)
    resident_count = _resident_count(config, offload_plan, refs, module)
    streamed_refs = refs[resident_count:]
    _check_host_lookups(streamed_refs, host_plan, gather_group)
    budget = None
    if config.resident_layers == AUTO:  # refused here when too small: before anything moves
        budget = residency_budget(config, summarize(module, offload_plan, config), device)
    pin = config.pin_memory and device.type == "cuda"
    # Refused here when too small; in all-gather mode each block counts as this rank's shard.
    disk = disk_tier.plan_disk_tier(module, streamed_refs, host_plan, config, gather_group)

    started = time.perf_counter()
    with contextlib.ExitStack() as undo:  # unwinds only if a step raises: see pop_all() below
        bound_plan = None
        if host_plan is not None:
            bound_plan = BoundPlan(host_plan)  # See [Note: plan hand-off]
            undo.callback(bound_plan.release)
            # Registered before bind(), which may fail halfway; runs after the blocks' and the
            # placement's undos: every tensor then has its private value before the mapping closes.
            undo.callback(bound_plan.give_back, module)
            bound_plan.bind(module, device)
        fp8_gemms = Fp8GemmConversion()  # See [Note: fp8 compute]
        if config.fp8_compute:
            undo.callback(fp8_gemms.rollback)
            fp8_gemms.convert(module, streamed_refs, config)
        blocks = [collect_block(ref, quantized_tensors(module, ref, config)) for ref in streamed_refs]
        # All-gather mode copies the shards out of a checkpoint mapping and closes it, but reads
        # them from a cache entry's (See [Note: shards from the shared entry]); blocks with
        # weights to quantize are packed into private buffers: they never copy from the mapping.
        private_only = bool(blocks) and all(quantizes_privately(b, bound_plan) for b in blocks)
        shards_copied = gather_group is not None and bound_plan is not None and bound_plan.backing != "host_weight_cache"
        if bound_plan is not None and disk_tier.is_active(disk):
            bound_plan.registration = registration_refused(disk_tier.UNREGISTERED, quiet=True)
        elif bound_plan is not None and not shards_copied and not private_only:
            bound_plan.register(config, device)
        rest, aliases = _rest_tensors(module, streamed_refs, blocks)
        with torch.no_grad():
            streamed = _bind_blocks(
                blocks,
                bound_plan,
                gather_group,
                pin,
                device,
                fp8_format(config),
                undo,
                config.gather_chunk_bytes,
                converted=len(fp8_gemms) > 0,
                on_host=frozenset(i for i, ref in enumerate(streamed_refs) if ref.on_host),
                from_disk=_from_disk(disk),
            )
            streamed, disk_sources = disk_tier.place_blocks(streamed, disk, pin, undo)
            streamed = [replace(block, on_host=ref.on_host) for block, ref in zip(streamed, streamed_refs)]
            device_weight_bytes = _place_rest(rest, device, bound_plan, undo)
        if bound_plan is not None and disk_tier.is_active(disk):
            drop_cached(bound_plan.weights.checkpoint)  # See [Note: the disk tier]
        executor = make_executor(device, gathers=gather_group is not None and gather_group.size > 1)
        slot_size = max((b.slot_bytes for b in streamed), default=0)
        slots = _allocate_slots(executor, slot_size, config.num_slots, undo)
        # See [Note: fp8 landing]
        undo.callback(executor.drop_landings)  # a failed enable() drops them with the exception
        executor.allocate_landings(max((landing_bytes(b) for b in streamed), default=0))
        prepare_dequantization(executor.device, _dequantized_weights(streamed))
        ledger = TransferLedger(executor, config.record_timeline)
        with interrupts_held():  # pinned buffers and a thread are never without their undo
            reads = disk_tier.read_ahead(streamed, disk, executor, pin)
            if reads is not None:
                undo.callback(reads.close)  # after the stager's: its jobs may wait for reads
        runtime: StreamingRuntime
        if gather_group is not None:
            runtime = LockstepRuntime(streamed, slots, executor, ledger, BlockGather(gather_group, executor), reads)
        else:
            stager = _stager(streamed, executor, bound_plan, config, pin)
            if stager is not None:
                undo.callback(stager.close)
            runtime = RankLocalRuntime(streamed, slots, executor, ledger, stager, reads)
        tuner = None
        if budget is not None:
            tuner = _auto_residency(runtime, budget, device, device_weight_bytes, offload_plan, streamed_refs, config)

        # All-gather mode releases the mapping below unless shards view it (See [Note: shards
        # from the shared entry]): private shards do not need it.
        views = any(isinstance(b.source, ShardSource) and b.source.views_entry for b in streamed)
        # Shards read from disk keep it too: a file dlo made in memory is read through it.
        keeps_mapping = bound_plan is not None and (gather_group is None or views or disk_tier.is_active(disk))
        # Not forward hooks: they would run inside a compiled block. See [Note: compiled blocks]
        # Each undo is registered before its step: an interrupt inside a step is undone too.
        calls = [StreamedCallHandle(ref.module, runtime, index) for index, ref in enumerate(streamed_refs)]
        undo.callback(lambda: [call.remove() for call in reversed(calls)])
        for call in calls:
            call.install()
        probe = OutsideUseProbe(runtime, streamed_refs, aliases)  # See [Note: blocks used outside their call]
        undo.callback(probe.remove)
        probe.install()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        handle = OffloadHandle(
            module=module,
            device=device,
            config=config,
            plan=offload_plan,
            runtime=runtime,
            streamed_refs=streamed_refs,
            streamed_calls=calls,
            managed=[module, *(ref.module for ref in refs)],
            resident_blocks=resident_count,
            device_weight_bytes=device_weight_bytes,
            setup_s=time.perf_counter() - started,
            checkpoint=bound_plan.weights.checkpoint if keeps_mapping else None,
            backing=_backing(host_plan, gather_group, pin, views),
            registration=bound_plan.registration if keeps_mapping else NOT_APPLICABLE,
            probe=probe,
            residency=tuner,
            fp8_gemms=fp8_gemms,
            disk=disk,
            disk_sources=disk_sources,
        )
        undo.callback(handle.abandon)
        handle.activate()
        undo.pop_all()  # every step succeeded: keep what they did
    fp8_gemms.commit()

    # All-gather mode: the module is changed only now that nothing can fail, since a failed
    # rank could not get its weights back without its peers.
    if gather_group is not None:
        for block in streamed:
            block.point_at(block.placeholders)
        if bound_plan is not None and not keeps_mapping:
            bound_plan.release()  # a failed unregister keeps the mapping open and is logged
    return handle


def _from_disk(disk: disk_tier.DiskTier | None) -> frozenset[int]:
    """The blocks whose files a disk tier reads (on disk, or kept after one read)."""
    if not disk_tier.is_active(disk):
        return frozenset()
    assert disk is not None
    return frozenset(i for i, reads in enumerate(disk.reads) if reads is not None)


def _auto_residency(
    runtime: StreamingRuntime,
    budget: int,
    device: torch.device,
    weight_bytes: int,
    offload_plan: OffloadPlan,
    streamed_refs: list[BlockRef],
    config: OffloadConfig,
) -> AutoResidency:
    if device.type == "cuda":
        peak = partial(torch.cuda.max_memory_allocated, device)
        limit = partial(_cuda_limit, device)
    else:  # no allocator: what dlo keeps on the device (activations are not counted)
        peak = partial(_cpu_device_bytes, runtime, weight_bytes)
        limit = None
    eligible = frozenset(
        i for i, ref in enumerate(streamed_refs) if offload_plan.is_resident_eligible(ref.list_path) and not ref.on_host
    )
    slot_counts = tuple(sorted({2, 3, 4, config.num_slots}))
    return AutoResidency(runtime, budget, peak, limit, weight_bytes, eligible, slot_counts)


def _cuda_limit(device: torch.device) -> int:
    """What this process could hold on the device now: what it holds plus what is free."""
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)


def _cpu_device_bytes(runtime: StreamingRuntime, weight_bytes: int) -> int:
    return weight_bytes + runtime.held_bytes
