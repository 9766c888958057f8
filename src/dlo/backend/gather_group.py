"""Which existing process group rebuilds blocks in all-gather mode (docs/guides/multi-gpu.md).

dlo never creates a transport: it uses a group the caller already has. The rule, on sizes
alone: the data-parallel group if DP > 1, else the sequence-parallel group if SP > 1, else
no collective at all (a group of one). Tensor-parallel ranks hold different weights, so the
TP group is never the one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dlo.errors import ConfigError
from dlo.hotpath.gather import GatherGroup, GatherRole


@dataclass(frozen=True)
class ParallelGroups:
    """The caller's existing process groups around the transformer (None: size 1). `tp` is
    only recorded (identity); `hsdp` says the DP group shards weights (HSDP), which rules
    out all-gather mode."""

    dp: dist.ProcessGroup | None = None
    sp: dist.ProcessGroup | None = None
    tp: dist.ProcessGroup | None = None
    hsdp: bool = False


def choose_gather_role(dp_size: int, sp_size: int) -> GatherRole:
    """DP if DP > 1, else SP if SP > 1, else none."""
    if dp_size > 1:
        return GatherRole.DP
    if sp_size > 1:
        return GatherRole.SP
    return GatherRole.NONE


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


def diffusers_sp_group(module: nn.Module) -> dist.ProcessGroup | None:
    """The sequence-parallel group of a diffusers model on which `enable_parallelism` set up
    context parallelism (Ulysses and/or ring: its flattened mesh), else None. Its ranks run
    every block on their slice of the sequence, so they can share the host weights."""
    parallel = getattr(module, "_parallel_config", None)  # diffusers ModelMixin state, None by default
    context = getattr(parallel, "context_parallel_config", None)
    mesh = getattr(context, "_flattened_mesh", None)
    return mesh.get_group() if mesh is not None else None


def resolve_gather_group(groups: ParallelGroups | None, module: nn.Module | None = None) -> GatherGroup:
    """The group for all-gather mode. Without `groups`: the sequence-parallel group of a
    diffusers model with context parallelism enabled, else an initialized default world taken
    as pure data parallelism; without torch.distributed, a group of one."""
    if groups is None and module is not None and diffusers_sp_group(module) is not None:
        groups = ParallelGroups(sp=diffusers_sp_group(module))
    if groups is None:
        groups = ParallelGroups(dp=dist.group.WORLD) if dist.is_available() and dist.is_initialized() else ParallelGroups()
    if not isinstance(groups, ParallelGroups):
        raise ConfigError(f"groups must be a dlo.ParallelGroups or None, got {type(groups).__name__}")
    if groups.hsdp:
        raise ConfigError(
            "OffloadConfig.use_allgather=True with HSDP (ParallelGroups.hsdp=True): HSDP already shards the "
            "weights across the DP group; use rank-local streaming (use_allgather=False)"
        )
    role = choose_gather_role(_size(groups.dp), _size(groups.sp))
    group = {GatherRole.DP: groups.dp, GatherRole.SP: groups.sp, GatherRole.NONE: None}[role]
    if group is None:
        return GatherGroup(None, 0, 1, role)
    return GatherGroup(group, dist.get_rank(group), dist.get_world_size(group), role)


def check_backend(backend: str, device: torch.device, role: GatherRole) -> None:
    """Block all-gathers run on the slots' device: NCCL for cuda, Gloo for cpu."""
    wanted = "nccl" if device.type == "cuda" else "gloo"
    if backend != wanted:
        raise ConfigError(
            f"OffloadConfig.use_allgather on device {device} needs a {wanted!r} process group; the {role.value} group "
            f"is {backend!r}"
        )
