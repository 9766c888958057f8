"""Loading through the host weight cache: ordinary load, publish or join the entry, then map
it in place of the private tensors (SPEC §5.2). Any failure keeps the ordinary tensors."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from pathlib import Path

import torch
from torch import nn

from dlo.config import OffloadConfig, Topology
from dlo.host.cache.collect import collect_tensors
from dlo.host.cache.entry_store import CacheUnavailable, Entry, EntryStore
from dlo.host.cache.source_index import SourceIndex, source_key
from dlo.host.cache.identity import build_identity, content_digest
from dlo.host.cache.trust import root_refusal
from dlo.host.checkpoint import Checkpoint, read_model_config
from dlo.host.host_weight_plan import HostWeightPlan
from dlo.host.preflight import Fallback
from dlo.host.tensor_source import TensorSource
from dlo.planning.offload_plan import discover
from dlo.planning.tensor_walk import owned_tensors

logger = logging.getLogger(__name__)


def _topology_fallback(topology: Topology, model_config: dict) -> Fallback | None:
    checks = [
        (topology.hsdp, "unsupported_hsdp", "HSDP shards weights across replicas"),
        (topology.ep_size > 1, "unsupported_expert_parallel", f"expert parallel size {topology.ep_size}"),
        (topology.pp_size > 1, "unsupported_pp", f"pipeline parallel size {topology.pp_size}"),
        (topology.cfg_size > 1, "unsupported_cfg_parallel", f"CFG parallel size {topology.cfg_size}"),
        (bool(model_config.get("quantization_config")), "unsupported_quantization", "the model is quantized"),
    ]
    return next((Fallback(code, reason) for hit, code, reason in checks if hit), None)


def _release_private_memory() -> None:
    """Return the freed private copies to the OS (glibc keeps them in its heap otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _map_entry(tensors: dict[str, torch.Tensor], entry: Entry, identity: dict) -> Checkpoint | Fallback:
    """Map the entry and check it against the model's tensors before anything changes."""
    if entry.manifest.get("identity") != identity:
        return Fallback("cache_operation_failed", "the entry's identity differs from this load's")
    checkpoint = Checkpoint(entry.path, sorted(entry.manifest["files"]))
    problem = None
    if set(checkpoint.tensors) != set(tensors):
        problem = "the entry's tensor names differ from the model's"
    else:
        for name, tensor in tensors.items():
            mapped = checkpoint.tensors[name].entry
            if mapped.dtype != tensor.dtype or mapped.shape != tuple(tensor.shape) or not mapped.aligned:
                problem = f"{name!r} maps as {mapped.dtype} {list(mapped.shape)}"
                break
    if problem is not None:
        checkpoint.close()
        return Fallback("cache_operation_failed", problem)
    return checkpoint


def load_through_cache(
    directory: Path,
    config: OffloadConfig,
    torch_dtype: torch.dtype | None,
    fuse_qkv: bool,
    topology: Topology,
    loader_inputs: dict | None,
) -> tuple[nn.Module, HostWeightPlan | None]:
    from dlo.host.loader import model_class, ordinary_load

    model_config = read_model_config(directory)
    cls = model_class(model_config.get("_class_name"), directory)
    fallback = _topology_fallback(topology, model_config)
    if fallback is not None:
        # Logged before loading: the ordinary loader may fail on its own (a quantized model
        # needs its quantization backend).
        _log_fallback(fallback)
        return ordinary_load(directory, torch_dtype, fuse_qkv), None
    dtype = str(torch_dtype) if torch_dtype is not None else "checkpoint"
    inputs = {"fuse_qkv": fuse_qkv, **(loader_inputs or {})}
    source = source_key(directory, cls, dtype, inputs, topology)
    if source is not None:
        warm = _warm_start(directory, cls, model_config, config, fuse_qkv, source)
        if warm is not None:
            return warm
    model = ordinary_load(directory, torch_dtype, fuse_qkv)
    result = _publish_and_map(model, directory, cls, config, dtype, inputs, topology, source)
    if isinstance(result, Fallback):
        _log_fallback(result)
        return model, None
    return model, result


def _log_fallback(fallback: Fallback) -> None:
    logger.warning(
        "dlo: host weight cache fallback %s: %s; keeping the ordinary tensors",
        fallback.code,
        fallback.reason,
        extra={"dlo_fallback": fallback.code},
    )


def _publish_and_map(model, directory, cls, config, dtype, inputs, topology, source):
    tensors = collect_tensors(model)
    if isinstance(tensors, Fallback):
        return tensors
    built = build_identity(directory, cls, dtype, inputs, topology, content_digest(tensors))
    if isinstance(built, Fallback):
        return built
    identity, key = built
    store = EntryStore(config.cache_dir)
    refusal = root_refusal(store.root, config.cache_allow_any_filesystem)
    if refusal is not None:
        return Fallback("invalid_configuration", refusal)
    try:
        entry = store.publish(key, tensors, identity, config.cache_lock_timeout_s)
        hold = store.hold(key)  # held while mapped: eviction refuses entries in use
    except CacheUnavailable as err:
        return Fallback(err.code, err.reason)
    except OSError as err:
        return Fallback("cache_operation_failed", f"holding {key}: {err}")
    # Entries never change in place, but an eviction between publish and hold removes one.
    checkpoint = _map_entry(tensors, entry, identity) if entry.path.exists() else None
    if not isinstance(checkpoint, Checkpoint):
        os.close(hold)
        return checkpoint or Fallback("cache_operation_failed", f"{key} was evicted while being joined")
    checkpoint.on_close.append(lambda: os.close(hold))
    # Everything is mapped and checked: swap the storage in place. The Parameter objects (and
    # their attributes) stay; no post-load hook runs again.
    with torch.no_grad():
        for owned in owned_tensors(model):
            if owned.tensor is tensors.get(owned.name):
                owned.tensor.data = checkpoint.view(owned.name)
    del tensors
    _release_private_memory()
    if source is not None:
        SourceIndex(store.root).record(source, key)
    return _plan(model, checkpoint)


def _plan(model: nn.Module, checkpoint: Checkpoint) -> HostWeightPlan:
    offload_plan = discover(model)
    prefixes = tuple(f"{path}." for path in offload_plan.block_lists)
    bindings = {
        owned.name: TensorSource((owned.name,), tuple(owned.tensor.shape), owned.tensor.dtype)
        for owned in owned_tensors(model)
        if owned.name.startswith(prefixes) and owned.name in checkpoint.tensors
    }
    return HostWeightPlan("host_weight_cache", offload_plan, checkpoint, bindings)


def _warm_start(directory, cls, model_config, config, fuse_qkv, source):
    """The model built empty and bound to the entry its sources produced last time, without
    running the ordinary loader; None (and the cold path) whenever anything does not match."""
    from dlo.host.loader import skeleton

    store = EntryStore(config.cache_dir)
    key = SourceIndex(store.root).lookup(source)
    if key is None or root_refusal(store.root, config.cache_allow_any_filesystem) is not None:
        return None
    try:
        hold = store.hold(key)
    except OSError:
        return None
    entry = store.validate(key)  # every byte, in parallel threads
    if not isinstance(entry, Entry):
        os.close(hold)
        return None
    checkpoint = Checkpoint(entry.path, sorted(entry.manifest["files"]))
    model = skeleton(cls, model_config, fuse_qkv)
    persistent = [
        o for o in owned_tensors(model) if o.is_parameter or o.key not in o.owner._non_persistent_buffers_set
    ]
    shapes_match = {o.name for o in persistent} == set(checkpoint.tensors) and all(
        checkpoint.tensors[o.name].entry.shape == tuple(o.tensor.shape) and checkpoint.tensors[o.name].entry.aligned
        for o in persistent
    )
    if not shapes_match:
        checkpoint.close()
        os.close(hold)
        return None
    made: dict[int, torch.Tensor] = {}
    for owned in persistent:
        if id(owned.tensor) not in made:
            view = checkpoint.view(owned.name)
            made[id(owned.tensor)] = nn.Parameter(view, owned.tensor.requires_grad) if owned.is_parameter else view
        table = owned.owner._parameters if owned.is_parameter else owned.owner._buffers
        table[owned.key] = made[id(owned.tensor)]
    checkpoint.on_close.append(lambda: os.close(hold))
    logger.info("dlo: warm start from cache entry %s (loading skipped)", key[:16])
    return model.eval(), _plan(model, checkpoint)
