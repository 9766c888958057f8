"""Turning a CLI model argument into a module: a built-in tiny model, a diffusers class name
or a diffusers model directory. Class names and directories are built on the meta device."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dlo.backend.auto_residency import residency_budget
from dlo.backend.decode_peak import OutputSize, call_size
from dlo.backend.fp8_compute import check_fp8_gemms
from dlo.backend.pipeline import named_components, pipeline_plan
from dlo.cli.config_flags import in_flag_terms
from dlo.config import OffloadConfig
from dlo.config.offload_config import AUTO
from dlo.errors import ConfigError
from dlo.host.checkpoint import find_transformer_dir, read_model_config
from dlo.host.loader import model_class
from dlo.models.tiny import TINY_MODELS
from dlo.pipelines.loading import pipeline_on_meta
from dlo.planning.fp8_selection import gemm_linears
from dlo.planning.offload_plan import discover, resolve_blocks
from dlo.planning.pipeline_budget import PipelinePlan
from dlo.planning.plan_summary import summarize


def build_on_meta(target: str) -> nn.Module:
    """The module `target` names, with meta tensors (shapes and dtypes only, no memory)."""
    path = Path(target).expanduser()
    if path.is_dir():
        directory = find_transformer_dir(path)
        config = read_model_config(directory)
        cls = model_class(config.get("_class_name"), directory / "config.json")
        with torch.device("meta"):
            return cls.from_config(config)
    if target in TINY_MODELS:
        entry = TINY_MODELS[target]
        with torch.device("meta"):
            return model_class(entry.class_name, "built-in model")(**entry.config)
    try:
        cls = model_class(target, "MODEL")
    except ConfigError:
        raise ConfigError(
            f"{target!r} is neither a directory, a built-in model ({', '.join(TINY_MODELS)}) nor a diffusers "
            "model class (e.g. WanTransformer3DModel)"
        ) from None
    with torch.device("meta"):
        return cls()


def check_config_for_model(
    meta_module: nn.Module, config: OffloadConfig, name: str, dtype: torch.dtype, device: torch.device
) -> None:
    """Refuse what the model's shapes and dtypes rule out, on the meta module in `dtype`, before
    any weight is built or loaded: `--fp8-compute` on a device without FP8 GEMMs or for a model
    with no Linear to run as one; `--resident-layers` beyond the leading blocks the plan lets
    stay resident, or with `--resident auto` a budget below what streaming needs (modules a
    class keeps in fp32 counted in `dtype` too: enable() checks exactly)."""
    if config.fp8_compute:  # See [Note: fp8 compute]
        check_fp8_gemms(device)
        cast = meta_module.to(dtype)
        if not gemm_linears(cast, resolve_blocks(cast, discover(cast)), config):
            raise ConfigError(
                f"--fp8-compute: {name} in {str(dtype).removeprefix('torch.')} has no Linear to run as an FP8 GEMM "
                "(they need bf16 weights: --dtype bfloat16)"
            )
    if config.resident_layers == AUTO:
        residency_budget(config, summarize(meta_module.to(dtype), discover(meta_module), config), device)
        return
    plan = discover(meta_module)
    refs = resolve_blocks(meta_module, plan)
    eligible = 0
    while eligible < len(refs) and plan.is_resident_eligible(refs[eligible].list_path):
        eligible += 1
    if config.resident_layers > eligible:
        where = f"{len(refs)} blocks" + (f", the first {eligible} may stay resident" if eligible < len(refs) else "")
        raise ConfigError(f"--resident-layers {config.resident_layers}: {name} has {where}; give 0 to {eligible}")


def checked_components(model_dir: Path, cls: type, index: dict, dtype: torch.dtype, components) -> tuple[str, ...]:
    """--components (auto, or names) checked on the pipeline built from its configs, before any
    weight loads; the names it streams."""
    if not components or components == "auto":
        return ()
    try:
        return tuple(named_components(pipeline_on_meta(model_dir, cls, index, dtype), components))
    except ConfigError as err:
        raise ConfigError(f"--components: {err}") from None


def plan_from_configs(
    model_dir: Path,
    cls: type,
    index: dict,
    dtype: torch.dtype,
    config: OffloadConfig,
    size: tuple[int | None, int | None, int | None] = (None, None, None),
    streamed: tuple[str, ...] = (),
) -> tuple[PipelinePlan, OutputSize]:
    """--hbm-budget-gib: the whole pipeline's plan (See [Note: pipeline budget]) from its configs
    alone, before any weight loads, for `size` (height, width, frames; what is None the
    pipeline's default), and that size; a budget below the minimum is one line in flag terms.
    `streamed`: components that stream whatever the plan would choose (a mapped transformer)."""
    try:
        pipe = pipeline_on_meta(model_dir, cls, index, dtype)
        output = call_size(pipe, *size)
        return pipeline_plan(pipe, config, output, named=streamed), output
    except ConfigError as err:
        raise ConfigError(in_flag_terms(str(err), {"hbm_budget_gib", "num_slots"})) from None
