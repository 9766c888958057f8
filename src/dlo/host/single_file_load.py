"""`dlo.load_transformer(FILE, model_config=...)`: a single-file `.safetensors` checkpoint
(original key layout, or diffusers') or a `.gguf` file streamed straight from its mapping where
diffusers' own converter proves each block tensor a range of the file. See [Note: single files
through diffusers' converter] in dlo.host.single_file_layout and [Note: GGUF files mapped] in
dlo.host.gguf_model."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from dlo.config import Topology
from dlo.errors import ConfigError, first_line
from dlo.host.cache.consume import LoadRecipe
from dlo.host.cache.identity import load_identity
from dlo.host.checkpoint import Checkpoint, find_transformer_dir, read_model_config
from dlo.host.model_build import model_class, runtime_dtype_rule, skeleton
from dlo.host.gguf_file import GgufFile, check_diffusers_reads, diffusers_gguf_types, read_gguf_index
from dlo.host.gguf_model import as_gguf_skeleton, private_conversions
from dlo.host.preflight import Fallback, MappedLoad, mapped_load
from dlo.host.quantized_layers import (
    FLOAT8, ignored_key, quantization_problem, shared_comfy_prefix, unquantized_float_dtype, unscaled_float8,
)
from dlo.host.safetensors_file import SafetensorsFile, read_entries
from dlo.host.single_file_layout import computed_values, converted_layout, converter_inputs, has_converter, private_file
from dlo.planning.offload_plan import discover

GGUF_SUFFIX = ".gguf"
# Block tensors diffusers' converter computes are held privately (not shared between the
# processes mapping the file) only while they are made of at most this share of the file.
COMPUTED_BLOCK_SHARE = 1 / 16
SINGLE_FILE_SUFFIXES = (".safetensors", GGUF_SUFFIX)


def config_directory(model_config: str | Path | None, path: Path) -> Path:
    """The transformer config `model_config` names: a transformer or pipeline directory, or a
    hub id found in the Hugging Face cache (never downloaded)."""
    if model_config is None:
        raise ConfigError(
            f"{path} is a single file: give model_config= (the transformer's config.json directory, its pipeline's "
            "directory or a hub id in the Hugging Face cache)"
        )
    local = Path(model_config).expanduser()
    if local.exists():
        return find_transformer_dir(local)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(
            str(model_config), allow_patterns=["config.json", "model_index.json", "transformer/config.json"],
            local_files_only=True,
        )
    except (LocalEntryNotFoundError, HFValidationError) as err:
        raise ConfigError(
            f"model_config={str(model_config)!r} is neither a directory nor a hub id in the Hugging Face cache "
            f"({first_line(err)}); give the transformer's config directory"
        ) from None
    return find_transformer_dir(snapshot)


def single_file_class(path: Path, directory: Path) -> tuple[type[nn.Module], dict]:
    """The model class and config for `path`, refused in one line where diffusers has no
    single-file converter for it or the file is neither a .safetensors nor a .gguf file."""
    if path.suffix not in SINGLE_FILE_SUFFIXES:
        raise ConfigError(f"{path}: dlo.load_transformer reads single .safetensors and .gguf files (or model directories)")
    config = read_model_config(directory)
    cls = model_class(config.get("_class_name"), directory / "config.json")
    if not has_converter(cls):
        raise ConfigError(
            f"{path}: diffusers has no single-file loader for {cls.__name__}; give a diffusers model directory of it"
        )
    return cls, config


def check_gguf_file(path: Path) -> None:
    """Refuse, reading its header only, a GGUF file that is damaged (`CheckpointError`) or
    holds a type diffusers' GGUF loader cannot read."""
    try:
        import gguf  # noqa: F401  (the index reader's quant tables)
    except ImportError:
        raise ConfigError(f"{path}: GGUF files need the [gguf] extra: pip install 'dlo[gguf]'") from None
    check_diffusers_reads(read_gguf_index(path), str(path))


def checked_single_file(
    path: Path, model_config: str | Path | None, torch_dtype: torch.dtype | None
) -> tuple[Path, type[nn.Module], torch.dtype | None]:
    """(config directory, model class, torch_dtype) of a load of the single file `path`, refusing
    a suffix or class dlo cannot load, a damaged header and a quantization format dlo cannot read
    before anything is mapped. A GGUF file's torch_dtype is its compute dtype: None means
    float32, GGUFQuantizationConfig's default."""
    directory = config_directory(model_config, path)
    cls, _ = single_file_class(path, directory)
    if path.suffix == GGUF_SUFFIX:
        check_gguf_file(path)
        return directory, cls, torch.float32 if torch_dtype is None else torch_dtype
    file = SafetensorsFile(path)
    try:
        problem = quantization_problem(file)
    finally:
        file.close()
    if problem is not None:  # diffusers' loader would read such weights as numbers, or fail
        raise ConfigError(f"{path}: {problem}")
    return directory, cls, torch_dtype


def open_single_file(path: Path) -> SafetensorsFile:
    """The file mapped, its header validated."""
    return GgufFile(path) if path.suffix == GGUF_SUFFIX else SafetensorsFile(path)


def single_file_preflight(
    path: Path, directory: Path, torch_dtype: torch.dtype | None, fuse_qkv: bool, options: Mapping[str, object]
) -> MappedLoad | Fallback:
    """Like loader.preflight for a single file: a MappedLoad or the Fallback that says why
    not. The caller owns (and must close) the mapping of a MappedLoad. A GGUF file's model is
    built as diffusers' GGUF loader builds it (See [Note: GGUF files mapped])."""
    cls, model_config = single_file_class(path, directory)
    is_gguf = path.suffix == GGUF_SUFFIX
    file = open_single_file(path)
    files = [file]
    try:
        names = set(skeleton(cls, model_config, False).state_dict())
        model = loaded_skeleton(path, cls, model_config, fuse_qkv, torch_dtype)
        try:
            layout = converted_layout(file, cls, model_config, names, options)
        except Exception as err:  # diffusers' converters raise many kinds
            prefix = shared_comfy_prefix(converter_inputs(file))
            check = f"are converter_options={dict(options)} right for it, and " if options else ""
            why = (
                f"every key of the file is under {prefix!r}, which that converter does not strip (diffusers' "
                "from_single_file fails on it too): use the file saved without the prefix"
                if prefix else f"{check}is {directory} the config of the model this file holds?"
            )
            raise ConfigError(
                f"{path}: diffusers' single-file converter for {cls.__name__} cannot read it ({first_line(err)}); {why}"
            ) from None
        offload_plan = discover(model)
        prefixes = tuple(f"{block}." for block in offload_plan.block_lists)
        if layout.unreadable:
            file.close()
            return Fallback("checkpoint_plan_incompatible", next(iter(layout.unreadable.values())))
        in_blocks = [name for name in layout.computed if name.startswith(prefixes)]
        held = sum(layout.computed_nbytes[name] for name in in_blocks)
        if held > COMPUTED_BLOCK_SHARE * file.size:
            file.close()
            return Fallback(
                "checkpoint_plan_incompatible",
                f"diffusers' converter computes {in_blocks[0]!r} ({len(in_blocks)} block tensors, "
                f"{held / file.size:.0%} of {path.name}'s bytes): not ranges of it",
            )
        groups = [(file, layout.entries)]
        if layout.computed or layout.unit_scales:
            try:
                values = computed_values(file, cls, model_config, layout, options) if layout.computed else {}
            except Exception as err:  # diffusers' converters raise many kinds; float8 arithmetic has no CPU kernel
                file.close()
                return Fallback("checkpoint_plan_incompatible", f"{first_line(err)} (computing {path.name}'s converted tensors)")
            values.update({name: torch.ones((), dtype=torch.float32) for name in layout.unit_scales})
            extra = private_file(values, f"{path} (converted by diffusers)")
            files.append(extra)
            types = {name: {file.entries[key].ggml_type for key in layout.computed.get(name, ())} for name in values}
            mixed = [name for name, found in types.items() if len(found) > 1]
            if mixed:
                for opened in files:
                    opened.close()
                return Fallback(
                    "checkpoint_plan_incompatible",
                    f"diffusers' converter makes {mixed[0]!r} of tensors of different ggml types",
                )
            # A tensor made of no file tensor (a converter's fresh constant) is a plain one.
            groups.append((extra, {n: replace(e, ggml_type=next(iter(types[n]), None)) for n, e in extra.entries.items()}))
        runtime_dtype = loaded_dtype_rule(path, cls, torch_dtype)
        checkpoint = Checkpoint.of_entries(path.parent, groups)
        if is_gguf:
            as_gguf_skeleton(model, _packed_tensors(checkpoint, layout.concatenated), torch_dtype)
            conversions = private_conversions(checkpoint, model, prefixes, runtime_dtype)
            if conversions:
                converted = private_file(conversions, f"{path} (converted as diffusers' GGUF loader does)")
                files.append(converted)
                kept = [(f, {n: e for n, e in entries.items() if n not in conversions}) for f, entries in groups]
                checkpoint = Checkpoint.of_entries(path.parent, [*kept, (converted, dict(converted.entries))])
    except BaseException:
        for opened in files:
            opened.close()
        raise
    return mapped_load(directory, model, offload_plan, checkpoint, runtime_dtype, layout.concatenated)


def _packed_tensors(checkpoint: Checkpoint, concatenated: dict[str, tuple[str, ...]]) -> dict[str, tuple[tuple[int, ...], str]]:
    """A GGUF checkpoint's packed tensors by diffusers name: (packed shape, ggml type); a
    concatenation's parts joined along their rows."""
    packed = {name: (s.entry.shape, s.entry.ggml_type) for name, s in checkpoint.tensors.items() if s.entry.ggml_type}
    for name, parts in concatenated.items():
        entries = [packed.pop(part) for part in parts if part in packed]
        if entries:
            packed[name] = ((sum(shape[0] for shape, _ in entries), *entries[0][0][1:]), entries[0][1])
    return packed


def loaded_dtype(path: Path, torch_dtype: torch.dtype | None) -> torch.dtype | None:
    """What dlo gives diffusers' `from_single_file` as torch_dtype for a non-GGUF file: torch_dtype,
    or the file's most common float dtype."""
    return torch_dtype if torch_dtype is not None else unquantized_float_dtype(read_entries(path))


def loaded_dtype_rule(path: Path, cls: type[nn.Module], torch_dtype: torch.dtype | None) -> Callable[[str, torch.dtype], torch.dtype]:
    """The dtype each float of `path`'s model has once diffusers' `from_single_file` loaded it: a
    GGUF model's as its quantizer leaves them (the class's fp32-kept modules in float32); any
    other model is cast whole (`model.to(loaded_dtype)`, fp32-kept modules included)."""
    if path.suffix == GGUF_SUFFIX:
        return runtime_dtype_rule(cls, torch_dtype)
    dtype = loaded_dtype(path, torch_dtype)
    return lambda name, stored: dtype if dtype is not None and stored.is_floating_point else stored


def loaded_skeleton(
    path: Path, cls: type[nn.Module], model_config: dict, fuse_qkv: bool, torch_dtype: torch.dtype | None
) -> nn.Module:
    """The meta skeleton of `path`'s model with its buffers as `from_single_file` leaves them: a
    non-GGUF model's float buffers (RoPE tables its constructor makes in float32) cast with it."""
    model = skeleton(cls, model_config, fuse_qkv)
    dtype = None if path.suffix == GGUF_SUFFIX else loaded_dtype(path, torch_dtype)
    if dtype is not None:
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    module._buffers[key] = buffer.to(dtype)
    return model


def float8_refused(path: Path, fallback: Fallback) -> ConfigError:
    """Why a float8 file whose mapping was refused cannot be loaded at all: diffusers' loader
    would cast its float8 values and drop their scales."""
    return ConfigError(
        f"{path} holds float8 weights, which dlo reads only from the checkpoint mapping, and the mapping was "
        f"refused ({fallback.code}: {fallback.reason})"
    )


def holds_float8(path: Path) -> bool:
    """Whether `path` holds float8 weights with scales, which only dlo's mapped load reads (an
    unscaled float8 file's values diffusers' loader casts exactly: it may fall back)."""
    if path.suffix == GGUF_SUFFIX:
        return False
    file = SafetensorsFile(path)
    try:
        kept = {key: entry for key, entry in file.entries.items() if not ignored_key(key)}
        return any(entry.dtype in FLOAT8 for entry in kept.values()) and not unscaled_float8(kept)
    finally:
        file.close()


def single_file_recipe(
    path: Path, directory: Path, torch_dtype: torch.dtype | None, fuse_qkv: bool, options: Mapping[str, object],
    topology: Topology, loader_inputs: Mapping[str, object] | None,
) -> LoadRecipe:
    """The host weight cache's recipe of a single file the mapping cannot stream: diffusers'
    single-file loader, its converter given `options` (part of the entry's identity); an
    entry of a GGUF file is rebuilt as diffusers' GGUF model (See [Note: GGUF entries])."""
    cls, model_config = single_file_class(path, directory)
    dtype = str(torch_dtype) if torch_dtype is not None else "checkpoint"
    inputs = {"fuse_qkv": fuse_qkv, "converter_options": dict(options), **(loader_inputs or {})}

    def empty(packed: Mapping[str, tuple[tuple[int, ...], str]]) -> nn.Module:
        model = loaded_skeleton(path, cls, model_config, fuse_qkv, torch_dtype)
        if path.suffix == GGUF_SUFFIX:
            # F32 and F16 tensors diffusers' loader keeps as plain tensors, never GGUFParameters.
            unknown = sorted({quant for _, quant in packed.values()} - (diffusers_gguf_types() - {"F32", "F16"}))
            if unknown:
                raise ValueError(f"diffusers' GGUF loader packs no {unknown}")
            as_gguf_skeleton(model, dict(packed), torch_dtype)
        return model

    return LoadRecipe(
        functools.partial(load_identity, path, cls, model_config, dtype, inputs, topology),
        ordinary=functools.partial(ordinary_single_file_load, path, directory, torch_dtype, fuse_qkv, options),
        empty=empty,
        runtime_dtype=loaded_dtype_rule(path, cls, torch_dtype),
    )


def ordinary_single_file_load(
    path: Path, directory: Path, torch_dtype: torch.dtype | None, fuse_qkv: bool, options: Mapping[str, object]
) -> nn.Module:
    """diffusers' own single-file loader with the config of `directory` (a GGUF file's
    GGUFQuantizationConfig computing in torch_dtype), its converter given `options`."""
    import diffusers

    cls, _ = single_file_class(path, directory)
    load = {"torch_dtype": loaded_dtype(path, torch_dtype)}
    if path.suffix == GGUF_SUFFIX:
        load["quantization_config"] = diffusers.GGUFQuantizationConfig(compute_dtype=torch_dtype)
    try:
        model = cls.from_single_file(str(path), config=str(directory), **load, **options)
    except Exception as err:  # diffusers' converters raise many kinds
        raise ConfigError(f"{path}: diffusers could not load it as a {cls.__name__} ({first_line(err)})") from None
    if fuse_qkv:
        model.fuse_qkv_projections()
    return model
