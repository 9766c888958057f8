"""`dlo.enable()`: bind streamed blocks to their host source (a packed private buffer or the
checkpoint mapping), place the rest on the device, allocate slots and install the hooks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from dlo.backend.device import resolve_device
from dlo.backend.handle import OffloadHandle, refuse_if_managed
from dlo.backend.mapping_registration import NOT_APPLICABLE, register_mapping, release_mapping
from dlo.config import OffloadConfig
from dlo.errors import ConfigError, EnableError
from dlo.backend.gather_group import GatherGroup, ParallelGroups, check_backend, resolve_gather_group
from dlo.host.block_sources import BlockSource, MappedSource, PackedSource, ShardSource
from dlo.host.host_weight_plan import HostWeightPlan, HostWeights
from dlo.host.pinned_buffer import HostBuffer
from dlo.host.registration import RegistrationCleanupError
from dlo.host.tensor_source import TensorSource
from dlo.hotpath.compiled_call import StreamedCallHandle
from dlo.hotpath.gather import BlockGather
from dlo.hotpath.runtime import StreamingRuntime
from dlo.hotpath.staging import Stager, default_pack_threads
from dlo.hotpath.streamed_block import Binding, StreamedBlock
from dlo.hotpath.transfer import CudaTransfer, make_transfer
from dlo.observe.ledger import TransferLedger
from dlo.planning.block_layout import BlockLayout, TensorSpec, align_up, plan_block_layout, view_placement
from dlo.planning.offload_plan import BlockRef, OffloadPlan, discover, resolve_blocks
from dlo.planning.tensor_walk import owned_tensors, unique_tensors


@dataclass(frozen=True)
class _BlockTensors:
    ref: BlockRef
    specs: tuple[TensorSpec, ...]
    tensors: tuple[torch.Tensor, ...]
    bindings: tuple[Binding, ...]


def _check_streamable(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type == "meta":
        raise EnableError(
            f"{name!r} is on the meta device (weights not loaded). Load the model before dlo.enable(); a model "
            "from dlo.load_transformer needs plan=<the HostWeightPlan it returned>"
        )
    if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.layout != torch.strided or tensor.is_quantized:
        raise EnableError(
            f"{name!r} is a {type(tensor).__name__} ({tensor.layout}); dlo streams plain dense tensors only"
        )


def _collect(ref: BlockRef) -> _BlockTensors:
    index: dict[int, int] = {}
    specs: list[TensorSpec] = []
    tensors: list[torch.Tensor] = []
    bindings: list[Binding] = []
    for owned in owned_tensors(ref.module):
        tensor = owned.tensor
        if id(tensor) not in index:
            _check_streamable(f"{ref.name}.{owned.name}", tensor)
            index[id(tensor)] = len(tensors)
            tensors.append(tensor)
            specs.append(TensorSpec(owned.name, tuple(tensor.shape), tensor.dtype))
        bindings.append(Binding(owned.owner, owned.key, owned.is_parameter, tensor))
    return _BlockTensors(ref, tuple(specs), tuple(tensors), tuple(bindings))


def _refuse_shared(streamed: list[_BlockTensors], rest: dict[int, str]) -> None:
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


def _bind_planned(
    module: nn.Module,
    weights: HostWeights,
    device: torch.device,
    sources: dict[int, TensorSource],
    stand_ins: list[torch.Tensor],
) -> None:
    """Replace the plan's meta tensors with stand-ins of the runtime shape and dtype (one
    element, broadcast) so they can be repointed, filling id(stand-in) -> its source and the
    list of stand-ins as it goes (a failure midway leaves both describing what was done). A
    stand-in's value is never used: streamed ones are repointed to slots, the others get
    their bytes from the mapping in _place_rest, or in enable()'s rollback."""
    replaced: dict[int, torch.Tensor] = {}  # id(meta tensor) -> stand-in: tied tensors stay tied
    for owned in list(owned_tensors(module)):
        source = weights.bindings.get(owned.name)
        if source is None:
            continue
        if id(owned.tensor) not in replaced:
            if owned.tensor.device.type == "meta":
                data = torch.empty((), dtype=source.dtype, device=device).expand(source.shape)
                new = nn.Parameter(data, requires_grad=False) if owned.is_parameter else data
                stand_ins.append(new)
            else:  # already a view of the mapping (host weight cache): the same object stays
                new = owned.tensor
            replaced[id(owned.tensor)] = new
            sources[id(new)] = source
        table = owned.owner._parameters if owned.is_parameter else owned.owner._buffers
        table[owned.key] = replaced[id(owned.tensor)]
    missing = set(weights.bindings) - {o.name for o in owned_tensors(module) if id(o.tensor) in sources}
    if missing:
        raise EnableError(f"the HostWeightPlan names tensors this module does not have: {sorted(missing)[:5]}")


def _mapped_source(
    block: _BlockTensors, weights: HostWeights | None, planned: dict[int, TensorSource], pin_private: bool = False
) -> MappedSource | None:
    """`pin_private`: page-lock the snapshots (direct copies from pageable memory would make
    the host wait for the copy stream)."""
    if weights is None or not any(id(t) in planned for t in block.tensors):
        return None
    # Tensors the checkpoint does not hold are snapshotted: the live ones become placeholders.
    snapshot = (lambda t: t.detach().clone().pin_memory()) if pin_private else (lambda t: t.detach().clone())
    return MappedSource(weights.checkpoint, tuple(planned.get(id(t)) or snapshot(t) for t in block.tensors))


def _streamed(
    block: _BlockTensors, layout: BlockLayout, source: BlockSource, placeholder: dict[torch.dtype, torch.Tensor]
) -> StreamedBlock:
    return StreamedBlock(
        name=block.ref.name,
        layout=layout,
        tensors=block.tensors,
        bindings=block.bindings,
        source=source,
        placeholders=tuple(placeholder[t.dtype] for t in block.tensors),
    )


def _bind_block(
    block: _BlockTensors,
    weights: HostWeights | None,
    planned: dict[int, TensorSource],
    pin: bool,
    placeholder: dict[torch.dtype, torch.Tensor],
    direct: bool,
) -> StreamedBlock:
    """Give the block its host source and release its original storage. `direct`: the
    mapping is registered and copied from straight into the slots."""
    layout = plan_block_layout(block.specs)
    source: BlockSource | None = _mapped_source(block, weights, planned, pin_private=direct and pin)
    if source is None:
        try:
            host = HostBuffer(layout.nbytes, pin)
        except EnableError as err:
            raise EnableError(f"block {block.ref.name!r}: {err}") from None
        for tensor, placement in zip(block.tensors, layout.placements):
            view_placement(host.tensor, placement).copy_(tensor)
        source = PackedSource(host)
    streamed = _streamed(block, layout, source, placeholder)
    streamed.point_at(streamed.placeholders)
    return streamed


def _shard(block: _BlockTensors, mapped: MappedSource | None, group: GatherGroup, pin: bool) -> tuple[BlockLayout, ShardSource]:
    """This rank's shard of the block, built without touching the module: the block is laid
    out in a temporary buffer (from its tensors, or packed from the mapping), padded to
    `size` equal 512-aligned shards, and only bytes [rank*S, (rank+1)*S) are kept."""
    layout = plan_block_layout(block.specs)
    width = align_up(-(-layout.nbytes // group.size))
    whole = torch.zeros(width * group.size, dtype=torch.uint8)
    if mapped is not None:
        for task in mapped.copy_tasks(layout, whole):
            task.run()
    else:
        for tensor, placement in zip(block.tensors, layout.placements):
            view_placement(whole, placement).copy_(tensor)
    try:
        host = HostBuffer(width, pin)
    except EnableError as err:
        raise EnableError(f"block {block.ref.name!r}: {err}") from None
    host.tensor.copy_(whole[group.rank * width : (group.rank + 1) * width])
    return layout, ShardSource(host, width, group.rank, group.size)


def _place_rest(
    tensors: list[torch.Tensor],
    device: torch.device,
    weights: HostWeights | None,
    planned: dict[int, TensorSource],
    registered: bool,
) -> int:
    """Move non-streamed tensors to `device` in place (ties survive: one tensor object each).
    On "cpu" they are copied too: mmap'd or oddly aligned storage becomes an ordinary
    allocation. Planned tensors of resident blocks are read from the mapping: straight from
    its pages when it is registered, else through a private copy."""
    for tensor in tensors:
        source = planned.get(id(tensor))
        if source is not None and weights is not None and registered:
            value = torch.empty(source.shape, dtype=source.dtype, device=device)
            for piece in source.pieces(weights.checkpoint, value):
                piece.target.copy_(piece.source)
            tensor.data = value
        elif source is not None and weights is not None:
            tensor.data = source.materialize(weights.checkpoint).to(device)
        else:
            tensor.data = tensor.data.to(device) if device.type != "cpu" else tensor.data.clone()
    return sum(t.numel() * t.element_size() for t in tensors)


def _backing(host_plan: HostWeightPlan | None, gather_group: GatherGroup | None, pin: bool) -> str:
    """Where the streamed blocks live on the host, for stats and reports."""
    if gather_group is not None:
        return "shards"
    if host_plan is not None:
        return host_plan.backing
    return "pinned" if pin else "pageable"


def _slot_bytes(block: StreamedBlock) -> int:
    if isinstance(block.source, ShardSource):
        return block.source.shard_bytes * block.source.size
    return block.layout.nbytes


def _gather_group(config: OffloadConfig, groups: ParallelGroups | None, device: torch.device) -> GatherGroup | None:
    if not config.use_allgather:
        if groups is not None:
            raise ConfigError("groups= is used by all-gather mode only; set OffloadConfig(use_allgather=True)")
        return None
    chosen = resolve_gather_group(groups)
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
    slots just before they run. A host weight cache mapping is registered with the driver
    when it can be (SPEC §5.3), so its blocks are copied straight from the shared pages.
    Call the model under torch.inference_mode() or torch.no_grad().

    With `config.use_allgather`, each rank keeps 1/G of every streamed block and the group
    chosen from `groups` (default: an initialized torch.distributed world, as pure data
    parallelism) rebuilds blocks with all-gathers; every rank must call enable(), the model
    and disable() alike (see [Note: lockstep schedule]).
    """
    config = OffloadConfig() if config is None else config
    if not isinstance(config, OffloadConfig):
        raise ConfigError(f"config must be a dlo.OffloadConfig, got {type(config).__name__}")
    offload_plan, host_plan = _resolve_plans(module, plan)
    device = resolve_device(device)
    gather_group = _gather_group(config, groups, device)
    refuse_if_managed(module)
    refs = resolve_blocks(module, offload_plan)

    resident_count = config.resident_layers
    if resident_count > len(refs):
        raise ConfigError(
            f"OffloadConfig.resident_layers={resident_count} but {type(module).__name__} has {len(refs)} blocks"
        )
    for ref in refs[:resident_count]:
        if not offload_plan.is_resident_eligible(ref.list_path):
            raise ConfigError(
                f"OffloadConfig.resident_layers={resident_count} would keep {ref.name!r} resident, but the plan "
                f"allows resident blocks only in {offload_plan.resident_eligible!r}"
            )
    streamed_refs = refs[resident_count:]

    started = time.perf_counter()
    weights = None
    if host_plan is not None:
        weights = host_plan.take()  # See [Note: plan hand-off]
        if weights is None:
            raise EnableError(
                "this HostWeightPlan was already taken by an earlier dlo.enable(); a plan is consumed once. "
                "Load the model again with dlo.load_transformer"
            )
    planned: dict[int, TensorSource] = {}
    registered = NOT_APPLICABLE
    cleanup_pending = None  # a registration whose rollback failed: its mapping must stay
    stand_ins: list[torch.Tensor] = []
    bound: list[StreamedBlock] = []
    sharded: list[StreamedBlock] = []  # all-gather mode: bound at the very end, see below
    stager = None
    try:
        if weights is not None:
            _bind_planned(module, weights, device, planned, stand_ins)
            if host_plan.backing == "host_weight_cache" and gather_group is None:
                try:
                    registered = register_mapping(weights.checkpoint, config, device)
                except RegistrationCleanupError as err:
                    cleanup_pending = err.registration
                    raise
        streamed_tensors = [_collect(ref) for ref in streamed_refs]
        skip = frozenset(id(sub) for ref in streamed_refs for sub in ref.module.modules())
        rest = unique_tensors(module, skip)
        for owned in rest.values():
            _check_streamable(owned.name, owned.tensor)
        _refuse_shared(streamed_tensors, {key: owned.name for key, owned in rest.items()})
        rest_tensors = [owned.tensor for owned in rest.values()]

        pin = config.pin_memory and device.type == "cuda"
        direct = registered.registration is not None  # copies straight from the mapping: no staging
        placeholder: dict[torch.dtype, torch.Tensor] = {}
        for block in streamed_tensors:
            for tensor in block.tensors:
                placeholder.setdefault(tensor.dtype, torch.empty(0, dtype=tensor.dtype, device=device))

        with torch.no_grad():
            for block in streamed_tensors:
                if gather_group is not None:
                    layout, shard = _shard(block, _mapped_source(block, weights, planned), gather_group, pin)
                    sharded.append(_streamed(block, layout, shard, placeholder))
                else:
                    bound.append(_bind_block(block, weights, planned, pin, placeholder, direct))
            device_weight_bytes = _place_rest(rest_tensors, device, weights, planned, direct)
            transfer = make_transfer(device)
            slot_bytes = max((_slot_bytes(b) for b in bound + sharded), default=0)
            slots = [transfer.allocate_slot(slot_bytes) for _ in range(config.num_slots)]
            mapped = [b.layout.nbytes for b in bound if isinstance(b.source, MappedSource)]
            if mapped and isinstance(transfer, CudaTransfer) and not direct:
                stager = Stager(transfer, max(mapped), config.pack_threads or default_pack_threads(), pin)
            ledger = TransferLedger(transfer, config.record_timeline)
            gather = BlockGather(gather_group, transfer) if gather_group is not None else None
            runtime = StreamingRuntime(bound + sharded, slots, transfer, ledger, stager, gather, direct)
    except BaseException:
        # Nothing is lost: every bound block gets its weights back as ordinary tensors, and
        # no stand-in of a planned tensor survives with an undefined value. See [Note: plan hand-off]
        with torch.no_grad():
            for block in bound:
                block.restore()
                block.source.release()
            in_bound = {id(t) for block in bound for t in block.tensors}
            for tensor in stand_ins:
                if id(tensor) not in in_bound and weights is not None:
                    tensor.data = planned[id(tensor)].materialize(weights.checkpoint)
            if weights is not None:  # a cache plan's tensors view the mapping closed below
                for owned in owned_tensors(module):
                    if weights.checkpoint.holds(owned.tensor):
                        owned.tensor.data = owned.tensor.data.clone()
        if stager is not None:
            stager.close()
        for block in sharded:
            block.source.release()
        if weights is not None:  # See [Note: mapping lifetime]
            release_mapping(weights.checkpoint, registered.registration or cleanup_pending)
        raise

    # All-gather mode: the module is changed only now that nothing can fail, since a failed
    # rank could not get its weights back without its peers. The mapping is not needed any
    # more: every rank holds its shards.
    for block in sharded:
        block.point_at(block.placeholders)
    if gather_group is not None and weights is not None:
        weights.checkpoint.close()
        weights = None

    # Not forward hooks: they would run inside a compiled block. See [Note: compiled blocks]
    hooks = [StreamedCallHandle(ref.module, runtime, index) for index, ref in enumerate(streamed_refs)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return OffloadHandle(
        module=module,
        device=device,
        config=config,
        plan=offload_plan,
        runtime=runtime,
        hooks=hooks,
        managed=[module, *(ref.module for ref in refs)],
        resident_blocks=resident_count,
        device_weight_bytes=device_weight_bytes + slot_bytes * len(slots),
        setup_s=time.perf_counter() - started,
        checkpoint=weights.checkpoint if weights is not None else None,
        backing=_backing(host_plan, gather_group, pin),
        registration=registered,
    )

