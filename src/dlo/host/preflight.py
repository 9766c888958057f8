"""Proving, before any weight is loaded, that a checkpoint can stand in for the runtime
tensors (docs/guides/checkpoints.md). Pure bookkeeping over names, shapes and dtypes: nothing is read or
changed. Any doubt returns a `Fallback`, and the caller loads the ordinary way."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from torch import nn

from dlo.config import Topology
from dlo.host.checkpoint import Checkpoint
from dlo.host.quantized_layers import FLOAT8, SCALE_SUFFIXES, scale_layout, unquantized_float_dtype
from dlo.host.safetensors_file import CheckpointError, CheckpointErrorKind
from dlo.host.tensor_source import MappedTensor, QuantizedSource, TensorSource
from dlo.planning.offload_plan import OffloadPlan
from dlo.planning.tensor_walk import owned_tensors
from dlo.planning.wire_layout import Fp8Format

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # exact in fp32, which dequantizing uses

FALLBACK_CODES = (
    # checkpoint mmap plans (docs/guides/checkpoints.md)
    "unsupported_tp",
    "unsupported_hsdp",
    "unsupported_online_quantization",
    "checkpoint_plan_incompatible",
    # the host weight cache (docs/guides/host-weight-cache.md)
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


def mapped_load(
    directory: Path, model: nn.Module, offload_plan: OffloadPlan, checkpoint: Checkpoint,
    runtime_dtype: Callable[[str, torch.dtype], torch.dtype],
    concatenated: Mapping[str, tuple[str, ...]] = MappingProxyType({}),
) -> MappedLoad | Fallback:
    """The skeleton `model` with `checkpoint` planned as its sources, or why not; the checkpoint
    is closed unless a MappedLoad (whose caller then owns it) is returned. `concatenated`: tensors
    the checkpoint holds in parts (name -> the parts' keys, joined along dim 0)."""
    try:
        fused = {
            name: tuple(part for key in keys for part in concatenated.get(key, (key,)))
            for name, keys in fused_projection_keys(model).items()
        }
        sources = plan_checkpoint_sources(model, offload_plan, checkpoint, runtime_dtype, {**concatenated, **fused})
    except BaseException:
        checkpoint.close()
        raise
    if isinstance(sources, Fallback):
        checkpoint.close()
        return sources
    return MappedLoad(directory, model, offload_plan, checkpoint, sources)


def topology_fallback(topology: Topology, model_config: dict) -> Fallback | None:
    """Why a checkpoint cannot stand in for this process's tensors whatever it holds."""
    if topology.tp_size > 1:
        return Fallback("unsupported_tp", f"tensor parallel size {topology.tp_size}: checkpoint tensors are not TP slices")
    if topology.hsdp:
        return Fallback("unsupported_hsdp", "HSDP shards weights across replicas")
    if model_config.get("quantization_config"):
        return Fallback("unsupported_online_quantization", "config.json has a quantization_config")
    return None


@dataclass(frozen=True)
class CheckpointSources:
    """Sources for every runtime parameter and persistent buffer: `planned` ones (under the
    block lists) are streamed from the mapping, `rest` ones are copied out at load time."""

    planned: dict[str, MappedTensor]
    rest: dict[str, MappedTensor]


@dataclass(frozen=True)
class MappedLoad:
    """A preflight that passed: the skeleton (block tensors on meta) and its sources."""

    directory: Path
    skeleton: nn.Module
    offload_plan: OffloadPlan
    checkpoint: Checkpoint
    sources: CheckpointSources


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


def _fp8_refusal(checkpoint: Checkpoint, key: str, detail: str) -> CheckpointError:
    where = checkpoint.tensors[key].file.path if key in checkpoint.tensors else checkpoint.directory
    return CheckpointError(CheckpointErrorKind.FP8_SCALES, where, f"{key!r}: {detail}")


def _quantized_source(
    name: str,
    tensor: torch.Tensor,
    keys: tuple[str, ...],
    checkpoint: Checkpoint,
    runtime_dtype: Callable[[str, torch.dtype], torch.dtype],
    unquantized_dtype: torch.dtype,
) -> QuantizedSource:
    """The source of a weight the checkpoint stores as float8, with its scales. Anything
    dlo cannot dequantize exactly as the file means raises: loading the float8 values
    without their scales would silently give wrong weights."""
    data = checkpoint.tensors[keys[0]].entry
    if len(keys) > 1:
        raise _fp8_refusal(checkpoint, keys[0], "float8 projections cannot be fused (load with fuse_qkv=False)")
    if not name.endswith(".weight") or tensor.dim() != 2 or data.shape != tuple(tensor.shape):
        raise _fp8_refusal(
            checkpoint, keys[0], f"{data.dtype} {list(data.shape)} for {name!r} {list(tensor.shape)}: dlo reads "
            "float8 only as the 2-D weight of a Linear layer, with scales"
        )
    stem = name[: -len(".weight")]
    found = [f"{stem}{suffix}" for suffix in SCALE_SUFFIXES if f"{stem}{suffix}" in checkpoint.tensors]
    if len(found) != 1:
        looked = " or ".join(repr(f"{stem}{suffix}") for suffix in SCALE_SUFFIXES)
        problem = "no scales" if not found else "two sets of scales"
        raise _fp8_refusal(checkpoint, keys[0], f"float8 weight with {problem} (looked for {looked})")
    scale = checkpoint.tensors[found[0]].entry
    rows = data.shape[0]
    if scale.dtype not in SCALE_DTYPES:
        raise _fp8_refusal(checkpoint, found[0], f"scales must be fp32, bf16 or fp16, found {scale.dtype}")
    layout = scale_layout(rows, scale.shape)
    if layout is None:
        raise _fp8_refusal(
            checkpoint, found[0], f"scales of shape {list(scale.shape)} for a weight of {rows} rows: dlo reads one "
            f"scale per weight ([] or [1]) or per output row ([{rows}] or [{rows}, 1])"
        )
    # Computed in the dtype the weight would have unquantized: the checkpoint's other floats'
    # (or torch_dtype).
    dtype = runtime_dtype(name, unquantized_dtype)
    return QuantizedSource(keys[0], found[0], tuple(tensor.shape), dtype, Fp8Format(data.dtype, layout == "per row"))


def _source_for(
    name: str,
    tensor: torch.Tensor,
    keys: tuple[str, ...],
    checkpoint: Checkpoint,
    runtime_dtype: Callable[[str, torch.dtype], torch.dtype],
    unquantized_dtype: torch.dtype,
) -> MappedTensor | str:
    """The source of one runtime tensor, or why there is none."""
    missing = [k for k in keys if k not in checkpoint.tensors]
    if missing:
        return f"{name}: checkpoint has no {missing[0]!r}"
    if checkpoint.tensors[keys[0]].entry.dtype in FLOAT8:
        return _quantized_source(name, tensor, keys, checkpoint, runtime_dtype, unquantized_dtype)
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


def _unquantized_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """What the checkpoint's float8 weights are dequantized into (bf16 where it has no other
    floats)."""
    return unquantized_float_dtype({key: source.entry for key, source in checkpoint.tensors.items()}) or torch.bfloat16


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
    planned: dict[str, MappedTensor] = {}
    rest: dict[str, MappedTensor] = {}
    used: set[str] = set()
    problems: list[str] = []
    unquantized = _unquantized_dtype(checkpoint)
    for name, tensor in _runtime_tensors(skeleton).items():
        keys = fused.get(name, (name,))
        source = _source_for(name, tensor, keys, checkpoint, runtime_dtype, unquantized)
        if isinstance(source, str):
            problems.append(source)
            continue
        used.update(source.keys)
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
