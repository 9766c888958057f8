"""`dlo.load_transformer`: load a diffusers transformer directory, streaming its blocks
straight from the checkpoint mapping when the preflight proves that is exact."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from dlo.config import OffloadConfig, Topology
from dlo.errors import ConfigError
from dlo.host.cache.consume import directory_recipe, load_through_cache
from dlo.host.checkpoint import INDEX_NAME, WEIGHTS_NAME, Checkpoint, find_transformer_dir, read_model_config, read_weight_map
from dlo.host.host_weight_plan import HostWeightPlan
from dlo.host.model_build import model_class, ordinary_load, runtime_dtype_rule, skeleton
from dlo.host.preflight import CheckpointSources, Fallback, MappedLoad, mapped_load, topology_fallback
from dlo.host.quantized_layers import FLOAT8
from dlo.host.safetensors_file import CheckpointError, CheckpointErrorKind, read_entries
from dlo.host.single_file_load import (
    GGUF_SUFFIX,
    checked_single_file,
    float8_refused,
    holds_float8,
    ordinary_single_file_load,
    single_file_preflight,
    single_file_recipe,
)
from dlo.host.single_file_layout import checked_converter_options
from dlo.host.tensor_source import MappedTensor, QuantizedSource
from dlo.planning.gguf_weights import is_gguf_parameter, parameter_like
from dlo.planning.offload_plan import discover
from dlo.planning.tensor_walk import owned_tensors

logger = logging.getLogger(__name__)


def _float8_file(directory: Path) -> Path | None:
    """The first safetensors file diffusers' loader would read that holds float8 tensors, or
    None. Those are the shards the index names (each header read whole: a stale index may
    leave the scales out of its keys) or the single file; a header that cannot be read, or an
    index that cannot, raises `CheckpointError`. Other files in the directory are not the
    loader's and are left alone."""
    if (directory / INDEX_NAME).is_file():
        paths = [directory / name for name in sorted(set(read_weight_map(directory).values()))]
    else:
        paths = [directory / WEIGHTS_NAME] if (directory / WEIGHTS_NAME).is_file() else []
    headers = [(path, read_entries(path)) for path in paths]  # every one read: a bad one is refused too
    return next((path for path, entries in headers if any(e.dtype in FLOAT8 for e in entries.values())), None)


def _check_scales(checkpoint: Checkpoint, sources: CheckpointSources) -> None:
    """Every float8 weight's scales are finite in fp32 (what dequantizing uses), before
    anything runs."""
    for source in [*sources.planned.values(), *sources.rest.values()]:
        if isinstance(source, QuantizedSource) and not bool(torch.isfinite(source.scale(checkpoint).float()).all()):
            raise CheckpointError(
                CheckpointErrorKind.FP8_SCALES,
                checkpoint.tensors[source.scale_key].file.path,
                f"{source.scale_key!r} holds NaN or Inf: the weight {source.data_key!r} cannot be dequantized",
            )


def _materialize(model: nn.Module, checkpoint: Checkpoint, sources: dict[str, MappedTensor]) -> None:
    """Copy the non-planned tensors out of the mapping into ordinary tensors (tied ones once)."""
    made: dict[int, torch.Tensor] = {}
    for owned in list(owned_tensors(model)):
        source = sources.get(owned.name)
        if source is None:
            continue
        if id(owned.tensor) not in made:
            value = source.materialize(checkpoint)
            if owned.is_parameter and is_gguf_parameter(owned.tensor):
                value = parameter_like(owned.tensor, value)
            elif owned.is_parameter:
                value = nn.Parameter(value, owned.tensor.requires_grad)
            made[id(owned.tensor)] = value
        table = owned.owner._parameters if owned.is_parameter else owned.owner._buffers
        table[owned.key] = made[id(owned.tensor)]


def _mapped(result: MappedLoad) -> tuple[nn.Module, HostWeightPlan]:
    """The skeleton with its non-block tensors copied out and the plan that streams the rest."""
    try:
        _check_scales(result.checkpoint, result.sources)
        _materialize(result.skeleton, result.checkpoint, result.sources.rest)
    except BaseException:
        result.checkpoint.close()
        raise
    plan = HostWeightPlan("checkpoint_mmap", result.offload_plan, result.checkpoint, result.sources.planned)
    return result.skeleton.eval(), plan


def _load_single_file(
    path: Path, config: OffloadConfig, torch_dtype: torch.dtype | None, model_config, fuse_qkv: bool,
    topology: Topology, converter_options: Mapping[str, object], loader_inputs: dict | None,
) -> tuple[nn.Module, HostWeightPlan | None]:
    """load_transformer of a single .safetensors or .gguf file. See [Note: single files through
    diffusers' converter] and [Note: GGUF files mapped]; one the mapping cannot stream goes
    through the host weight cache with `config.host_weight_cache` (See [Note: GGUF entries])."""
    directory, cls, torch_dtype = checked_single_file(path, model_config, torch_dtype)
    converter_options = checked_converter_options(cls, converter_options)
    if path.suffix == GGUF_SUFFIX and fuse_qkv:
        raise ConfigError(f"{path}: fuse_qkv=True fuses float projections; a GGUF file's stay packed: set fuse_qkv=False")
    float8 = holds_float8(path)  # reads the header: a damaged file is a CheckpointError here
    if float8 and (config.fp8_compute or not config.checkpoint_mmap):  # the cache never sees one: it maps or is refused
        raise ConfigError(
            f"{path} holds float8 weights, which dlo reads only from the checkpoint mapping: set checkpoint_mmap=True "
            "and fp8_compute=False"
        )
    if config.checkpoint_mmap:
        result = topology_fallback(topology, read_model_config(directory))
        if result is None and config.fp8_compute:  # See [Note: fp8 compute]
            result = Fallback("unsupported_online_quantization", "fp8_compute quantizes the model's own weights at enable()")
        if result is None:
            result = single_file_preflight(path, directory, torch_dtype, fuse_qkv, converter_options)
            if isinstance(result, MappedLoad):
                return _mapped(result)
        if float8:
            raise float8_refused(path, result)
        logger.warning(
            "dlo: checkpoint mmap fallback %s: %s; loading %s %s",
            result.code, result.reason, path,
            "through the host weight cache" if config.host_weight_cache else "with diffusers' single-file loader",
            extra={"dlo_fallback": result.code},
        )
    if config.host_weight_cache:  # converted once per node; later loads map the entry
        recipe = single_file_recipe(path, directory, torch_dtype, fuse_qkv, converter_options, topology, loader_inputs)
        return load_through_cache(recipe, config)
    return ordinary_single_file_load(path, directory, torch_dtype, fuse_qkv, converter_options), None


def preflight(
    model_dir: str | Path,
    torch_dtype: torch.dtype | None = None,
    *,
    fuse_qkv: bool = False,
    topology: Topology | None = None,
) -> MappedLoad | Fallback:
    """Prove (or refute) that the checkpoint can stand in for the block tensors, reading only
    headers and building a meta skeleton. The caller owns (and must close) the mapping of a
    `MappedLoad`. Corrupt files raise `CheckpointError`."""
    topology = Topology() if topology is None else topology
    directory = find_transformer_dir(model_dir)
    model_config = read_model_config(directory)
    cls = model_class(model_config.get("_class_name"), directory)
    fallback = topology_fallback(topology, model_config)
    if fallback is not None:
        return fallback
    checkpoint = Checkpoint(directory)
    try:
        model = skeleton(cls, model_config, fuse_qkv)
        offload_plan = discover(model)
    except BaseException:
        checkpoint.close()
        raise
    return mapped_load(directory, model, offload_plan, checkpoint, runtime_dtype_rule(cls, torch_dtype))


def load_transformer(
    model_dir: str | Path,
    config: OffloadConfig | None = None,
    torch_dtype: torch.dtype | None = None,
    *,
    fuse_qkv: bool = False,
    topology: Topology | None = None,
    loader_inputs: dict | None = None,
    model_config: str | Path | None = None,
    converter_options: Mapping[str, object] | None = None,
) -> tuple[nn.Module, HostWeightPlan | None]:
    """Load a diffusers transformer (a model directory or a pipeline's `transformer/`), or a
    single `.safetensors` file (original key layout or diffusers') or `.gguf` file with
    `model_config`: the transformer's config directory, its pipeline's directory or a hub id
    in the Hugging Face cache. A single file streams from its mapping where diffusers'
    converter makes each block tensor a range of the file (See [Note: single files through
    diffusers' converter]; a GGUF file's packed bytes as they are, See [Note: GGUF files
    mapped]), else it is loaded by diffusers' `from_single_file` (fallback code logged).
    For a GGUF file, torch_dtype is the compute dtype (None: float32, as diffusers').
    `converter_options`: options of diffusers' converter the file cannot tell (e.g. MiniMax-H3's
    `{"qkv_layout": "interleaved"}`); one the class's converter does not take is refused.

    Returns `(model, plan)`. With a plan, the block tensors were NOT loaded: they stream
    from the read-only checkpoint mapping once `dlo.enable(model, device, config, plan=plan)`
    consumes the plan, and processes mapping the same files share one copy in the page
    cache. `plan` is None when the preflight could not prove the checkpoint stands in for
    the runtime tensors (the fallback code is logged), `config.checkpoint_mmap` is False or
    `config.fp8_compute` is set (fallback `unsupported_online_quantization`): the model was
    then loaded the ordinary way.

    torch_dtype=None keeps each tensor's checkpoint dtype; another dtype is applied while
    packing (an adapter). A single file's model is cast as diffusers' `from_single_file` casts
    it: a GGUF file's floats into torch_dtype (its class's fp32-kept modules kept), any other
    file's every float and float buffer into torch_dtype, None meaning the file's most common
    float dtype. (After a fallback with torch_dtype=None, diffusers' loader takes
    the checkpoint's most common float dtype for every float tensor, its class's fp32-kept
    modules aside: it has no per-tensor "as saved" mode.) fuse_qkv=True runs diffusers' fuse_qkv_projections(): the fused
    q/k/v projections are concatenated from the checkpoint's separate tensors.

    With `config.host_weight_cache`, the model is loaded the ordinary way, its final tensors
    are published once per node to a content-addressed cache under `config.cache_dir` (or an
    existing equal entry is validated), and the model's own tensors are swapped in place for
    the entry's read-only mapping; the plan streams from it. `loader_inputs` (JSON-stable) are
    anything else that changed the weights (e.g. LoRA names), part of the entry's identity.
    A single file still streams from its own mapping where it can; the cache takes one the
    mapping cannot stream (converted once per node by diffusers' single-file loader; later
    loads and other processes map the entry).
    """
    config = OffloadConfig() if config is None else config
    if Path(model_dir).expanduser().is_file():
        return _load_single_file(
            Path(model_dir).expanduser(), config, torch_dtype, model_config, fuse_qkv, topology or Topology(),
            converter_options or {}, loader_inputs,
        )
    if model_config is not None:
        raise ConfigError(f"model_config= gives a single file its config; {model_dir} is a directory with its own config.json")
    if converter_options:
        raise ConfigError(
            f"converter_options= are for diffusers' single-file converter; {model_dir} is a directory in diffusers' layout"
        )
    directory = find_transformer_dir(model_dir)
    # See [Note: fp8 streaming]. Only dlo's mapped load reads float8 weights with their
    # scales: diffusers' loader would cast the float8 values and drop the scales, so the files
    # it would read are checked before it does.
    if config.host_weight_cache or not config.checkpoint_mmap or config.fp8_compute:
        float8_file = _float8_file(directory)
        if float8_file is not None and config.fp8_compute:
            raise ConfigError(
                f"{float8_file} holds float8 weights; fp8_compute=True quantizes bf16 weights at enable() and does "
                "not take a float8 checkpoint: set fp8_compute=False (its float8 weights stream and are dequantized)"
            )
        if float8_file is not None:
            raise ConfigError(
                f"{float8_file} holds float8 weights, which dlo reads only from the checkpoint mapping: set "
                "checkpoint_mmap=True and host_weight_cache=False (the file is already half the size of bf16)"
            )
    if config.host_weight_cache:
        recipe = directory_recipe(directory, torch_dtype, fuse_qkv, topology or Topology(), loader_inputs)
        return load_through_cache(recipe, config)
    if config.checkpoint_mmap and config.fp8_compute:  # See [Note: fp8 compute]
        logger.warning(
            "dlo: checkpoint mmap fallback unsupported_online_quantization: fp8_compute quantizes the model's own "
            "weights at enable(); loading %s the ordinary way",
            directory,
            extra={"dlo_fallback": "unsupported_online_quantization"},
        )
    elif config.checkpoint_mmap:
        result = preflight(directory, torch_dtype, fuse_qkv=fuse_qkv, topology=topology)
        if isinstance(result, MappedLoad):
            return _mapped(result)
        float8_file = _float8_file(directory)
        if float8_file is not None:
            raise float8_refused(float8_file, result)
        logger.warning(
            "dlo: checkpoint mmap fallback %s: %s; loading %s the ordinary way",
            result.code,
            result.reason,
            directory,
            extra={"dlo_fallback": result.code},
        )
    return ordinary_load(directory, torch_dtype, fuse_qkv), None

