"""`dlo inspect`: the plan dlo would use for a model, and what it costs on device and link."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dlo.backend.disk_tier import plan_from_sources
from dlo.cli.config_flags import in_flag_terms, torch_dtype
from dlo.cli.flag_checks import inspect_config
from dlo.cli.format import human_bytes, table
from dlo.cli.inspect_file import FILE_SUFFIXES, render_file
from dlo.cli.model_source import check_converter_flags, is_hub_id, resolve_model
from dlo.cli.model_target import build_on_meta, plan_from_configs
from dlo.cli.weight_bytes import payload_bytes
from dlo.host.loader import MappedLoad, preflight
from dlo.host.preflight import Fallback
from dlo.host.single_file_load import checked_single_file, float8_refused, holds_float8, single_file_preflight
from dlo.host.tensor_source import count_adapters
from dlo.hotpath.gather import GatherGroup, GatherRole
from dlo.config import OffloadConfig
from dlo.config.offload_config import AUTO
from dlo.errors import ConfigError
from dlo.pipelines.loading import check_components, pipeline_class
from dlo.planning.offload_plan import discover, resolve_blocks
from dlo.planning.plan_summary import PlanSummary, summarize

if TYPE_CHECKING:
    import torch


def render(summary: PlanSummary, weight_bytes: int) -> str:
    """`weight_bytes`: the model's payload; the summary's sizes are aligned layouts."""
    rows = []
    for path in summary.plan.block_lists:
        sizes = [b for b in summary.blocks if path in (b.name, b.name.rsplit(".", 1)[0])]
        classes = sorted({b.class_name + (" (looked up on the host)" if b.on_host else "") for b in sizes})
        per_block = {human_bytes(b.nbytes) for b in sizes}
        rows.append([path, len(sizes), ", ".join(classes), " / ".join(sorted(per_block))])
    largest = summary.largest_block
    lines = [
        f"{summary.class_name}: {len(summary.blocks)} blocks, {human_bytes(weight_bytes)} of weights "
        f"(plan: {summary.plan.source})",
        "",
        table(["block list", "blocks", "class", "bytes per block"], rows),
        "",
        f"largest block:        {largest.name} ({human_bytes(largest.nbytes)})" if largest else "largest block: -",
        f"resident blocks:      {summary.resident_blocks}",
        f"always on device:     {human_bytes(summary.non_block_bytes)} (embeddings, norms, heads)",
        f"slots:                {summary.num_slots} x {human_bytes(largest.slot_bytes if largest else 0)}",
        f"device weight memory: {human_bytes(summary.device_weight_bytes)} "
        f"(resident run: {human_bytes(weight_bytes)})",
        f"streamed per call:    {human_bytes(summary.streamed_bytes)}",
        f"alignment padding:    {human_bytes(summary.total_bytes - weight_bytes)} (tensors at 512-byte offsets in "
        "slots and host buffers; block sizes above include it)",
    ]
    return "\n".join(lines)


def render_preflight(result: MappedLoad | Fallback) -> str:
    if isinstance(result, Fallback):
        return f"checkpoint mmap:      no, falls back to the ordinary loader ({result.code}: {result.reason})"
    checkpoint = result.checkpoint
    adapters = count_adapters(result.sources.planned.values(), checkpoint)
    steps = ", ".join(f"{count} {step}" for step, count in sorted(adapters.items())) or "none"
    private = sum(any(checkpoint.tensors[k].file.private for k in s.keys) for s in result.sources.planned.values())
    held = f"; {private} of them computed at load, held privately" if private else ""
    return (
        f"checkpoint mmap:      yes, {len(result.sources.planned)} block tensors stream from {len(checkpoint.files)} "
        f"file(s){held}, {human_bytes(checkpoint.nbytes)} mapped read-only (adapters: {steps})"
    )


def render_host_tier(result: MappedLoad, config: OffloadConfig, ranks: int) -> str:
    """Under config.host_budget_gib: which blocks stay in host memory, which are read from disk
    (in all-gather mode, each of `ranks` ranks' split: the same on every rank)."""
    resident = 0 if config.resident_layers == AUTO else config.resident_layers
    refs = resolve_blocks(result.skeleton, result.offload_plan)[resident:]
    group = GatherGroup(None, 0, ranks, GatherRole.DP if ranks > 1 else GatherRole.NONE) if config.use_allgather else None
    try:
        disk = plan_from_sources(result.skeleton, refs, result.checkpoint, result.sources.planned, config, group)
    except ConfigError as err:
        raise ConfigError(in_flag_terms(str(err), {"host_budget_gib", "use_allgather"})) from None
    assert disk is not None
    tier = disk.tier
    budget = human_bytes(tier.budget_bytes) + (
        f" per rank ({ranks} all-gather ranks)" if ranks > 1 else " (all-gather mode, a group of one)" if group else ""
    )
    if not tier.active:
        return f"host budget:          {budget} holds every streamed block: nothing is read from disk"
    names = [refs[i].name for i in tier.on_disk]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    held = f"blocks' shards (1/{ranks} of a block each)" if ranks > 1 else "blocks"
    chosen = "kept in all-gather mode" if group is not None else "chosen again from the second call's measurements"
    return (
        f"host budget:          {budget}: {len(refs) - len(names)} of {len(refs)} streamed {held} stay in host memory "
        f"(read once at enable()), {len(names)} are read from disk on every use into {tier.read_buffers} read "
        f"buffer(s) of {human_bytes(tier.read_buffer_bytes)}\n"
        f"read from disk:       {shown}\n"
        f"                      (as enable() spreads them; {chosen})"
    )


def _print_mapping(
    result: MappedLoad | Fallback, config: OffloadConfig, ranks: int, heading: Callable[[], str]
) -> None:
    """`heading()`, whether the checkpoint stands in for the blocks, and under a host budget which
    blocks are read from disk, printed once all of it is made (a refused budget is one line); the
    mapping of a MappedLoad closed after, whatever raised."""
    try:
        lines = [heading(), render_preflight(result)]
        if config.host_budget_gib is not None:
            lines.append(
                render_host_tier(result, config, ranks) if isinstance(result, MappedLoad)
                else "host budget:          not applicable: the checkpoint cannot be mapped, so no block can be read "
                "from disk"
            )
        print("\n".join(lines))
    finally:
        if isinstance(result, MappedLoad):
            result.checkpoint.close()


def _inspect_file(path: Path, args: argparse.Namespace) -> int:
    """A .gguf or single .safetensors file: its tensors per block from the header; with
    --model-config, whether it streams from its mapping, as dlo.load_transformer would load it."""
    if args.model_config is None:
        defaults = {spec.name: spec.default for spec in dataclasses.fields(OffloadConfig)}
        needing = {
            "--host-budget-gib": args.host_budget_gib is not None, "--converter-option": bool(args.converter_option),
            "--nproc": args.nproc > 1, "--dtype": args.dtype is not None,
            "--use-allgather": args.use_allgather is not None,
            **{f"--{name.replace('_', '-')}": getattr(args, name) != defaults[name]
               for name in ("num_slots", "resident_layers", "gather_chunk_mib")},
        }
        given = [flag for flag, present in needing.items() if present]
        if given:
            raise ConfigError(f"{given[0]}: inspecting a single file's plan needs its model's config: give --model-config DIR")
        print(render_file(path))
        return 0
    directory, cls, dtype = checked_single_file(path, args.model_config, torch_dtype(args.dtype) if args.dtype else None)
    options = check_converter_flags(args.converter_option or [], path, cls)
    config = inspect_config(args)
    result = single_file_preflight(path, directory, dtype, False, options)
    if isinstance(result, Fallback) and holds_float8(path):
        raise float8_refused(path, result)  # as dlo.load_transformer refuses it
    _print_mapping(result, config, args.nproc, lambda: render_file(path))
    return 0


def _plan_text(module, args: argparse.Namespace) -> str:
    if args.dtype:
        module = module.to(torch_dtype(args.dtype))
    return render(summarize(module, discover(module), inspect_config(args)), payload_bytes(module))


def run(args: argparse.Namespace) -> int:
    if Path(args.target).suffix in FILE_SUFFIXES and Path(args.target).is_file():
        return _inspect_file(Path(args.target), args)
    if Path(args.target).suffix in FILE_SUFFIXES and args.model_config is not None:
        raise ConfigError(f"{args.target}: no such file")
    if args.model_config is not None or args.converter_option:
        flag = "--model-config" if args.model_config is not None else "--converter-option"
        raise ConfigError(f"{flag} is for a .gguf or single-file .safetensors MODEL; {args.target} is not one")
    cached = is_hub_id(args.target)
    target = str(resolve_model(args.target, "dlo inspect never downloads")) if cached else args.target
    if not Path(target).expanduser().is_dir():
        print(_plan_text(build_on_meta(target), args))
        if args.host_budget_gib is not None:
            print(f"host budget:          not applicable: {target} has no checkpoint, so no block can be read from disk")
        if args.hbm_budget_gib is not None:
            print(f"pipeline budget:      not applicable: {target} is not a pipeline directory")
        return 0
    config = inspect_config(args)
    result = preflight(target, torch_dtype(args.dtype) if args.dtype else None)
    model = (lambda: result.skeleton) if isinstance(result, MappedLoad) else (lambda: build_on_meta(target))
    _print_mapping(result, config, args.nproc, lambda: _plan_text(model(), args))
    if config.hbm_budget_gib is not None:
        dtype = torch_dtype(args.dtype or "bfloat16")
        print(render_pipeline_plan(Path(target).expanduser(), config, dtype, mapped=isinstance(result, MappedLoad)))
    return 0


def render_pipeline_plan(directory: Path, config: OffloadConfig, dtype: torch.dtype, mapped: bool) -> str:
    """Under config.hbm_budget_gib: the whole pipeline's plan for its default output size, or why
    there is none (See [Note: pipeline budget]). `mapped`: the transformer loads as a checkpoint
    mapping, so it streams (and becomes resident through its residency) as under dlo generate."""
    if not (directory / "model_index.json").is_file():
        return f"pipeline budget:      not applicable: {directory} is not a pipeline directory (no model_index.json)"
    cls, index = pipeline_class(directory)
    check_components(directory, index)
    plan, size = plan_from_configs(directory, cls, index, dtype, config, streamed=("transformer",) if mapped else ())
    shape = f"{size.height}x{size.width}" + (f", {size.frames} frames" if size.frames > 1 else "")
    return f"pipeline budget:      {human_bytes(plan.budget_bytes)} for a {shape} call\n  " + "\n  ".join(plan.describe())
