"""`dlo.enable()`: pack streamed blocks into host buffers, place the rest on the device,
allocate slots and install the hooks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from dlo.backend.device import resolve_device
from dlo.backend.handle import OffloadHandle, refuse_if_managed
from dlo.config import OffloadConfig
from dlo.errors import ConfigError, EnableError
from dlo.host.pinned_buffer import HostBuffer
from dlo.hotpath.runtime import StreamingRuntime
from dlo.hotpath.streamed_block import Binding, StreamedBlock
from dlo.hotpath.transfer import make_transfer
from dlo.observe.ledger import TransferLedger
from dlo.planning.block_layout import TensorSpec, plan_block_layout, view_placement
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
        raise EnableError(f"{name!r} is on the meta device (weights not loaded); load the model before dlo.enable()")
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


def _pack(block: _BlockTensors, pin: bool, placeholder: dict[torch.dtype, torch.Tensor]) -> StreamedBlock:
    """Copy the block into a new host buffer and release its original storage."""
    layout = plan_block_layout(block.specs)
    try:
        host = HostBuffer(layout.nbytes, pin)
    except EnableError as err:
        raise EnableError(f"block {block.ref.name!r}: {err}") from None
    for tensor, placement in zip(block.tensors, layout.placements):
        view_placement(host.tensor, placement).copy_(tensor)
    streamed = StreamedBlock(
        name=block.ref.name,
        layout=layout,
        tensors=block.tensors,
        bindings=block.bindings,
        host=host,
        placeholders=tuple(placeholder[t.dtype] for t in block.tensors),
    )
    streamed.point_at(streamed.placeholders)
    return streamed


def _place_rest(tensors: list[torch.Tensor], device: torch.device) -> int:
    """Move non-streamed tensors to `device` in place (ties survive: one tensor object each).
    On "cpu" they are copied too: mmap'd or oddly aligned storage becomes an ordinary allocation."""
    for tensor in tensors:
        tensor.data = tensor.data.to(device) if device.type != "cpu" else tensor.data.clone()
    return sum(t.numel() * t.element_size() for t in tensors)


def enable(
    module: nn.Module,
    device: str | torch.device,
    config: OffloadConfig | None = None,
    plan: OffloadPlan | None = None,
) -> OffloadHandle:
    """Stream the blocks of `module` to `device`; returns the handle that undoes it.

    Non-streamed parts and the first `config.resident_layers` blocks move to `device`; the
    other blocks are packed into (pinned) host memory and copied into rotating device slots
    just before they run. Call the model under torch.inference_mode() or torch.no_grad().
    """
    config = OffloadConfig() if config is None else config
    if not isinstance(config, OffloadConfig):
        raise ConfigError(f"config must be a dlo.OffloadConfig, got {type(config).__name__}")
    if plan is not None and not isinstance(plan, OffloadPlan):
        raise ConfigError(f"plan must be a dlo.OffloadPlan or None, got {type(plan).__name__}")
    device = resolve_device(device)
    refuse_if_managed(module)
    plan = discover(module) if plan is None else plan
    refs = resolve_blocks(module, plan)

    resident_count = config.resident_layers
    if resident_count > len(refs):
        raise ConfigError(
            f"OffloadConfig.resident_layers={resident_count} but {type(module).__name__} has {len(refs)} blocks"
        )
    for ref in refs[:resident_count]:
        if not plan.is_resident_eligible(ref.list_path):
            raise ConfigError(
                f"OffloadConfig.resident_layers={resident_count} would keep {ref.name!r} resident, but the plan "
                f"allows resident blocks only in {plan.resident_eligible!r}"
            )
    streamed_refs = refs[resident_count:]

    started = time.perf_counter()
    streamed_tensors = [_collect(ref) for ref in streamed_refs]
    skip = frozenset(id(sub) for ref in streamed_refs for sub in ref.module.modules())
    rest = unique_tensors(module, skip)
    for owned in rest.values():
        _check_streamable(owned.name, owned.tensor)
    _refuse_shared(streamed_tensors, {key: owned.name for key, owned in rest.items()})
    rest_tensors = [owned.tensor for owned in rest.values()]

    pin = config.pin_memory and device.type == "cuda"
    placeholder: dict[torch.dtype, torch.Tensor] = {}
    for block in streamed_tensors:
        for tensor in block.tensors:
            placeholder.setdefault(tensor.dtype, torch.empty(0, dtype=tensor.dtype, device=device))

    packed: list[StreamedBlock] = []
    try:
        with torch.no_grad():
            for block in streamed_tensors:
                packed.append(_pack(block, pin, placeholder))
            device_weight_bytes = _place_rest(rest_tensors, device)
            transfer = make_transfer(device)
            slot_bytes = max((b.layout.nbytes for b in packed), default=0)
            slots = [transfer.allocate_slot(slot_bytes) for _ in range(config.num_slots)]
            ledger = TransferLedger(transfer, config.record_timeline)
            runtime = StreamingRuntime(packed, slots, transfer, ledger)
    except BaseException:
        # Nothing is lost: every packed block gets its host copy back as its tensors.
        for block in packed:
            block.point_at(block.host_views())
            block.host.unpin()
        raise

    hooks = []
    for index, ref in enumerate(streamed_refs):
        hooks.append(ref.module.register_forward_pre_hook(partial(_before_block, runtime, index)))
        hooks.append(ref.module.register_forward_hook(partial(_after_block, runtime, index), always_call=True))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return OffloadHandle(
        module=module,
        device=device,
        config=config,
        plan=plan,
        runtime=runtime,
        hooks=hooks,
        managed=[module, *(ref.module for ref in refs)],
        resident_blocks=resident_count,
        device_weight_bytes=device_weight_bytes + slot_bytes * len(slots),
        setup_s=time.perf_counter() - started,
    )


def _before_block(runtime: StreamingRuntime, index: int, module: nn.Module, args: tuple) -> None:
    runtime.before_block(index)


def _after_block(runtime: StreamingRuntime, index: int, module: nn.Module, args: tuple, output: object) -> None:
    runtime.after_block(index)
