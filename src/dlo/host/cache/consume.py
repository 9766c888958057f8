"""Loading through the host weight cache: warm start from the entry this load published
before, else ordinary load, publish or join the entry, then map it in place of the private
tensors (docs/guides/host-weight-cache.md). Any failure keeps (or restores) the ordinary tensors.

[Note: GGUF entries]
A single GGUF file its mapping cannot stream (or loaded with checkpoint_mmap=False) is loaded
by diffusers' GGUF loader and published like any model: each GGUFParameter's packed bytes are a
uint8 tensor of the entry, and its quant type, which the bytes cannot tell, is in the entry's
identity (`packed`, hashed into the key with the content digest). A warm start rebuilds
diffusers' GGUF model empty from those quant types (the recipe's `empty`) and points each
GGUFParameter, kept with its quant type, at its bytes in the entry; a quant type diffusers does
not pack, one on a tensor that is not the entry's uint8 bytes, or bytes that do not fit the
layer send the load cold.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dlo.config import OffloadConfig, Topology
from dlo.config.offload_config import CacheVerify
from dlo.errors import DloError
from dlo.host.cache.collect import collect_tensors
from dlo.host.cache.entry_layout import block_images
from dlo.host.cache.entry_store import Entry, EntryStore
from dlo.host.cache.fp8_entry import entry_source, expected_entry, quantize_entry, quantized_names, stream_identity
from dlo.host.cache.identity import PACKED, build_identity, content_digest, load_identity, without_content
from dlo.host.cache.source_index import SourceIndex
from dlo.host.cache.trust import root_refusal
from dlo.host.cache.unavailable import CacheUnavailable
from dlo.host.checkpoint import Checkpoint, read_model_config
from dlo.host.host_weight_plan import HostWeightPlan
from dlo.host.model_build import checkpoint_float_dtype, model_class, ordinary_load, runtime_dtype_rule, skeleton
from dlo.host.preflight import Fallback
from dlo.host.safetensors_file import PAD_PREFIX
from dlo.host.tensor_source import MappedTensor, QuantizedSource, TensorSource
from dlo.planning.gguf_weights import is_gguf_parameter, parameter_like
from dlo.planning.offload_plan import discover
from dlo.planning.tensor_walk import OwnedTensor, owned_tensors

logger = logging.getLogger(__name__)


def _release_private_memory() -> None:
    """Return the freed private copies to the OS (glibc keeps them in its heap otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _log_fallback(fallback: Fallback) -> None:
    logger.warning(
        "dlo: host weight cache fallback %s: %s; keeping the ordinary tensors",
        fallback.code,
        fallback.reason,
        extra={"dlo_fallback": fallback.code},
    )


@dataclass(frozen=True)
class LoadRecipe:
    """How a load makes its model, as the cache needs to know it: `identity()`, its load
    identity (or why the cache cannot take it); `ordinary()`, the model loaded the ordinary
    way; `empty(packed)`, the same model on the meta device, for a warm start to bind to an
    entry whose GGUF tensors are `packed` (name -> (shape, quant type)); `runtime_dtype(name,
    dtype)`, the dtype the ordinary loader gives a tensor of the empty model (whose floats are
    all float32)."""

    identity: Callable[[], dict | Fallback]
    ordinary: Callable[[], nn.Module]
    empty: Callable[[Mapping[str, tuple[tuple[int, ...], str]]], nn.Module]
    runtime_dtype: Callable[[str, torch.dtype], torch.dtype]


def directory_recipe(
    directory: Path, torch_dtype: torch.dtype | None, fuse_qkv: bool, topology: Topology, loader_inputs: dict | None
) -> LoadRecipe:
    """The recipe of `dlo.load_transformer(directory)`: diffusers' `from_pretrained`."""
    model_config = read_model_config(directory)
    cls = model_class(model_config.get("_class_name"), directory)
    dtype = str(torch_dtype) if torch_dtype is not None else "checkpoint"
    inputs = {"fuse_qkv": fuse_qkv, **(loader_inputs or {})}

    @functools.cache
    def rule() -> Callable[[str, torch.dtype], torch.dtype]:  # reads the headers: on a warm start only
        return runtime_dtype_rule(cls, torch_dtype if torch_dtype is not None else checkpoint_float_dtype(directory))

    return LoadRecipe(
        functools.partial(load_identity, directory, cls, model_config, dtype, inputs, topology),
        ordinary=functools.partial(ordinary_load, directory, torch_dtype, fuse_qkv),
        empty=lambda packed: skeleton(cls, model_config, fuse_qkv),
        runtime_dtype=lambda name, stored: rule()(name, stored),
    )


def load_through_cache(recipe: LoadRecipe, config: OffloadConfig) -> tuple[nn.Module, HostWeightPlan | None]:
    load = found = recipe.identity()
    stream = stream_identity(config)
    if stream is not None and not isinstance(load, Fallback):  # See [Note: fp8 streaming]
        load = {**load, "stream": stream}
    store = EntryStore(config.cache_dir)
    if not isinstance(load, Fallback):
        refusal = root_refusal(store.root, config.cache_allow_any_filesystem)
        load = Fallback("invalid_configuration", refusal) if refusal is not None else load
    if isinstance(load, Fallback):
        # Logged before loading: the ordinary loader may fail on its own (a quantized model
        # needs its quantization backend).
        _log_fallback(load)
        return recipe.ordinary(), None
    verify = CacheVerify(config.cache_verify)
    warm = _warm_start(store, load, recipe, verify, config)
    if warm is not None:
        return warm
    model = recipe.ordinary()
    if recipe.identity() != found:  # a file rewritten or replaced while the loader read it
        _log_fallback(Fallback("cache_operation_failed", "the checkpoint files changed while they were loaded"))
        return model, None
    result = _publish_and_map(model, store, load, config, verify)
    if isinstance(result, Fallback):
        _log_fallback(result)
        return model, None
    return model, result


def _publish_and_map(
    model: nn.Module, store: EntryStore, load: dict, config: OffloadConfig, verify: CacheVerify
) -> HostWeightPlan | Fallback:
    tensors = collect_tensors(model)
    if isinstance(tensors, Fallback):
        return tensors
    float8 = quantized_names(model, config) if "stream" in load else []
    published = quantize_entry(tensors, float8, config) if float8 else tensors
    packed = {name: tensor.quant_type.name for name, tensor in tensors.items() if is_gguf_parameter(tensor)}
    identity, key = build_identity(load, content_digest(published), packed)  # the entry's key proves its identity
    try:
        images = block_images(model, config)  # See [Note: one copy per block]
    except DloError as err:
        return Fallback("cache_operation_failed", f"cannot lay out the entry's blocks: {err}")
    try:
        hold = store.hold(key)  # before publish: eviction refuses entries in use
    except CacheUnavailable as err:
        return Fallback(err.code, err.reason)
    try:
        entry = store.publish(key, published, identity, config.cache_lock_timeout_s, verify=verify, images=images)
        # From here the hold lasts as long as the mapping: closing it or dropping it releases the hold.
        entry.checkpoint.release_with_mapping(functools.partial(os.close, hold))
    except CacheUnavailable as err:
        os.close(hold)
        return Fallback(err.code, err.reason)
    except BaseException:
        os.close(hold)
        raise
    checkpoint = entry.checkpoint
    try:
        problem = _entry_mismatch(entry, load, {n: (list(t.shape), t.dtype) for n, t in published.items()})
    except BaseException:
        checkpoint.close()
        raise
    if problem is not None:
        checkpoint.close()
        return Fallback("cache_operation_failed", problem)
    # Everything is mapped and checked: swap the storage in place. The Parameter objects (and
    # their attributes) stay; no post-load hook runs again. A weight the entry holds as
    # float8 becomes a meta tensor until enable() binds it. Until the plan is made, each
    # swap can be undone: the private tensors are freed only after.
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    replaced: list[tuple[OwnedTensor, torch.Tensor]] = []
    sources = {
        name: entry_source(name, tuple(tensors[name].shape), tensors[name].dtype, config) for name in float8
    }
    try:
        with torch.no_grad():
            for owned in list(owned_tensors(model)):
                if owned.tensor is not tensors.get(owned.name):
                    continue
                if owned.name in sources:
                    replaced.append((owned, owned.tensor))
                    _table(owned)[owned.key] = _meta_like(owned)
                else:
                    swapped.append((owned.tensor, owned.tensor.data))
                    owned.tensor.data = checkpoint.view(owned.name)
        SourceIndex(store.root).record(load, key)
        plan = _plan(model, checkpoint, sources)
    except Exception as err:  # any failure: the model gets its private tensors back
        with torch.no_grad():
            for tensor, private in swapped:
                tensor.data = private
            for owned, original in replaced:
                _table(owned)[owned.key] = original
        checkpoint.close()  # releases the hold
        code = err.code if isinstance(err, CacheUnavailable) else "cache_operation_failed"
        return Fallback(code, f"after mapping {key[:16]}: {type(err).__name__}: {err}")
    del tensors, published, swapped, replaced
    _release_private_memory()
    return plan


def _table(owned: OwnedTensor) -> dict:
    return owned.owner._parameters if owned.is_parameter else owned.owner._buffers


def _meta_like(owned: OwnedTensor) -> torch.Tensor:
    tensor = owned.tensor
    meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return nn.Parameter(meta, requires_grad=tensor.requires_grad) if owned.is_parameter else meta


def _entry_mismatch(entry: Entry, load: Mapping, expected: Mapping[str, tuple[list[int], torch.dtype]]) -> str | None:
    """Why the entry is not one this load would publish, or None: its load identity, and the
    manifest's name, shape and dtype of every tensor (the files match the manifest: validated)."""
    found = without_content(entry.manifest["identity"])
    if found != load:
        fields = sorted(f for f in set(found) | set(load) if found.get(f) != load.get(f))
        return f"the entry was published by another load ({', '.join(fields)} differ)"
    index = {name: meta for name, meta in entry.manifest["tensors"].items() if not name.startswith(PAD_PREFIX)}
    if set(index) != set(expected):
        return f"the entry holds {len(index)} tensors, this load {len(expected)} (names differ)"
    for name, (shape, dtype) in expected.items():
        stored = [index[name]["dtype"], index[name]["shape"]]
        if stored != [str(dtype), shape]:
            return f"{name!r} is {stored[0]} {stored[1]} in the entry, this load makes {dtype} {shape}"
    return None


def _plan(model: nn.Module, checkpoint: Checkpoint, float8: Mapping[str, QuantizedSource]) -> HostWeightPlan:
    """The plan streaming the blocks from the entry; `float8`: the weights it holds as float8."""
    offload_plan = discover(model)
    prefixes = tuple(f"{path}." for path in offload_plan.block_lists)
    bindings: dict[str, MappedTensor] = {
        owned.name: float8.get(owned.name) or TensorSource((owned.name,), tuple(owned.tensor.shape), owned.tensor.dtype)
        for owned in owned_tensors(model)
        if owned.name.startswith(prefixes) and owned.name in checkpoint.tensors
    }
    return HostWeightPlan("host_weight_cache", offload_plan, checkpoint, bindings)


def _own_view(view: torch.Tensor, owned: OwnedTensor) -> torch.Tensor:
    """`view` (of the mapping) as a tensor with a version counter of its own, as the cold
    path's tensors keep theirs when their `.data` is swapped. A view, and nn.Parameter(view)
    (which detaches), shares its base's counter, here the whole mapped file's: a write into
    one weight (load_state_dict opening a block) would bump every weight's `_version`, and
    the check of the stand-ins would refuse the blocks the write never touched. See [Note:
    stand-ins]"""
    tensor = torch.empty(0, dtype=view.dtype)
    tensor.data = view
    if is_gguf_parameter(owned.tensor):  # its module dequantizes by its quant type
        return parameter_like(owned.tensor, tensor)
    return nn.Parameter(tensor, owned.tensor.requires_grad) if owned.is_parameter else tensor


def _persistent(model: nn.Module) -> list[OwnedTensor]:
    return [o for o in owned_tensors(model) if o.is_parameter or o.key not in o.owner._non_persistent_buffers_set]


def _empty_model(recipe: LoadRecipe, entry: Entry) -> nn.Module | str:
    """The recipe's meta model for `entry`, or why there is none: the entry's GGUF tensors
    (name -> quant type, in its identity: untrusted, checked as the manifest is) must be uint8
    tensors of it of a quant type gguf knows. See [Note: GGUF entries]"""
    packed = entry.manifest["identity"].get(PACKED, {})
    tensors = entry.manifest["tensors"]
    if not isinstance(packed, Mapping):
        return "its packed tensors are not an object"
    for name, quant_type in packed.items():
        if not isinstance(quant_type, str) or tensors.get(name, {}).get("dtype") != str(torch.uint8):
            return f"packed tensor {name!r} is not a uint8 tensor of the entry with a quant type"
    try:
        return recipe.empty({name: (tuple(tensors[name]["shape"]), quant_type) for name, quant_type in packed.items()})
    except Exception as err:  # whatever an entry's quant types or shapes make the GGUF skeleton raise
        return f"its packed tensors do not build the model ({type(err).__name__}: {err})"


def _warm_start(
    store: EntryStore, load: dict, recipe: LoadRecipe, verify: CacheVerify, config: OffloadConfig
) -> tuple[nn.Module, HostWeightPlan] | None:
    """The model built empty and bound to the entry this load identity published last time,
    without running the ordinary loader; None (and the cold path) whenever anything does not
    match. See [Note: warm start identity]."""
    key = SourceIndex(store.root).lookup(load)
    if key is None:
        return None
    try:
        hold = store.hold(key)
    except CacheUnavailable as err:
        logger.warning("dlo: host weight cache: not warm-starting from %s: %s; loading cold", key[:16], err)
        return None
    entry = store.validate(key, verify)  # every byte (hashed in parallel threads) or its stamps
    if not isinstance(entry, Entry):
        os.close(hold)
        logger.warning("dlo: host weight cache: not warm-starting from %s: %s; loading cold", key[:16], entry)
        return None
    checkpoint = entry.checkpoint
    checkpoint.release_with_mapping(functools.partial(os.close, hold))
    try:
        model = _empty_model(recipe, entry)
        problem = model if isinstance(model, str) else None
        if problem is None:
            persistent = _persistent(model)
            expected = {o.name: (list(o.tensor.shape), recipe.runtime_dtype(o.name, o.tensor.dtype)) for o in persistent}
            float8 = quantized_names(model, config) if "stream" in load else []
            sources = {name: entry_source(name, tuple(expected[name][0]), expected[name][1], config) for name in float8}
            problem = _entry_mismatch(entry, load, expected_entry(expected, float8, config))
        if problem is not None:
            logger.warning("dlo: host weight cache: not warm-starting from %s: %s; loading cold", key[:16], problem)
            checkpoint.close()
            return None
        made: dict[int, torch.Tensor] = {}
        for owned in persistent:
            if owned.name in sources:  # stays meta: enable() binds it to the float8 entry
                continue
            if id(owned.tensor) not in made:
                made[id(owned.tensor)] = _own_view(checkpoint.view(owned.name), owned)
            table = owned.owner._parameters if owned.is_parameter else owned.owner._buffers
            table[owned.key] = made[id(owned.tensor)]
        plan = _plan(model, checkpoint, sources)
    except Exception:
        checkpoint.close()  # releases the hold; the cold path builds its own model
        raise
    logger.info("dlo: warm start from cache entry %s (loading skipped)", key[:16])
    return model.eval(), plan
