"""Proving, before any weight is loaded, that a checkpoint can stand in for the runtime
tensors (SPEC §5.1). Pure bookkeeping over names, shapes and dtypes: nothing is read or
changed. Any doubt returns a `Fallback`, and the caller loads the ordinary way."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from dlo.host.checkpoint import Checkpoint
from dlo.host.tensor_source import TensorSource
from dlo.planning.offload_plan import OffloadPlan
from dlo.planning.tensor_walk import owned_tensors

FALLBACK_CODES = (
    # checkpoint mmap plans (SPEC §5.1)
    "unsupported_tp",
    "unsupported_hsdp",
    "unsupported_online_quantization",
    "checkpoint_plan_incompatible",
    # the host weight cache (SPEC §5.2)
    "unsupported_load_format",
    "unsupported_expert_parallel",
    "unsupported_quantization",
    "unsupported_cfg_parallel",
    "unsupported_pp",
    "invalid_configuration",
    "ambiguous_ownership",
    "unsupported_tensor",
    "unsupported_alias",
    "unstable_identity",
    "insufficient_disk",
    "lock_failed",
    "lock_timeout",
    "cache_operation_failed",
)


@dataclass(frozen=True)
class Fallback:
    code: str  # one of FALLBACK_CODES
    reason: str

    def __post_init__(self) -> None:
        if self.code not in FALLBACK_CODES:
            raise ValueError(f"unknown fallback code {self.code!r}")


@dataclass(frozen=True)
class CheckpointSources:
    """Sources for every runtime parameter and persistent buffer: `planned` ones (under the
    block lists) are streamed from the mapping, `rest` ones are copied out at load time."""

    planned: dict[str, TensorSource]
    rest: dict[str, TensorSource]


# Fused projections diffusers' fuse_qkv_projections() creates, and the tensors they join.
FUSED_PROJECTIONS = {
    "to_qkv": ("to_q", "to_k", "to_v"),
    "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
}


def fused_projection_keys(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Runtime name of each fused tensor -> the checkpoint names it concatenates (dim 0)."""
    fused: dict[str, tuple[str, ...]] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for target, parts in FUSED_PROJECTIONS.items():
            if isinstance(getattr(module, target, None), nn.Module):
                for tensor_name, _ in getattr(module, target).named_parameters(recurse=False):
                    fused[f"{prefix}{target}.{tensor_name}"] = tuple(f"{prefix}{p}.{tensor_name}" for p in parts)
    return fused


def _runtime_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name (tied tensors under each of their names)."""
    found = {}
    for owned in owned_tensors(model):
        if owned.is_parameter or owned.key not in owned.owner._non_persistent_buffers_set:
            found[owned.name] = owned.tensor
    return found


def _source_for(
    name: str,
    tensor: torch.Tensor,
    keys: tuple[str, ...],
    checkpoint: Checkpoint,
    runtime_dtype: Callable[[str, torch.dtype], torch.dtype],
) -> TensorSource | str:
    """The source of one runtime tensor, or why there is none."""
    missing = [k for k in keys if k not in checkpoint.tensors]
    if missing:
        return f"{name}: checkpoint has no {missing[0]!r}"
    entries = [checkpoint.tensors[k].entry for k in keys]
    misaligned = [e.key for e in entries if not e.aligned]
    if misaligned:
        return f"{name}: {misaligned[0]!r} is not aligned to its element size in the file (cannot be viewed in place)"
    if len({e.dtype for e in entries}) != 1:
        return f"{name}: fused parts have different dtypes"
    shape = tuple(tensor.shape)
    if len(entries) == 1:
        fits = entries[0].shape == shape
    else:
        fits = all(len(e.shape) == len(shape) and e.shape[1:] == shape[1:] for e in entries) and (
            sum(e.shape[0] for e in entries) == shape[0]
        )
    if not fits:
        return f"{name}: runtime shape {list(shape)} but checkpoint has {[list(e.shape) for e in entries]}"
    stored = entries[0].dtype
    # Floats may be cast (an adapter); anything else must match the module's own dtype.
    if tensor.dtype.is_floating_point != stored.is_floating_point or (
        not stored.is_floating_point and stored != tensor.dtype
    ):
        return f"{name}: {stored} in the checkpoint, {tensor.dtype} in the module (only float casts are adapters)"
    return TensorSource(keys, shape, runtime_dtype(name, stored))


def plan_checkpoint_sources(
    skeleton: nn.Module,
    offload_plan: OffloadPlan,
    checkpoint: Checkpoint,
    runtime_dtype: Callable[[str, torch.dtype], torch.dtype],
    fused: Mapping[str, tuple[str, ...]],
) -> CheckpointSources | Fallback:
    """Exactly one source per runtime tensor, every checkpoint tensor used, every
    non-identity step a declared adapter; else `checkpoint_plan_incompatible`."""
    prefixes = tuple(f"{path}." for path in offload_plan.block_lists)
    planned: dict[str, TensorSource] = {}
    rest: dict[str, TensorSource] = {}
    used: set[str] = set()
    problems: list[str] = []
    for name, tensor in _runtime_tensors(skeleton).items():
        keys = fused.get(name, (name,))
        source = _source_for(name, tensor, keys, checkpoint, runtime_dtype)
        if isinstance(source, str):
            problems.append(source)
            continue
        used.update(keys)
        (planned if name.startswith(prefixes) else rest)[name] = source
    unexpected = sorted(set(checkpoint.tensors) - used)
    if unexpected:
        problems.append(
            f"{len(unexpected)} checkpoint tensors belong to no runtime tensor (e.g. {unexpected[0]!r}): "
            "the file holds more than this transformer"
        )
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return Fallback("checkpoint_plan_incompatible", problems[0] + more)
    return CheckpointSources(planned, rest)
