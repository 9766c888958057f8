"""A single-file checkpoint in its original key layout (Flux's BFL layout, Wan's...) seen in
diffusers' layout without converting a byte of its blocks.

[Note: single files through diffusers' converter]
diffusers loads such a file by running its class's converter (`checkpoint_mapping_fn`) over
the whole state dict: renames, fused projections split with `chunk`/`split`, a few tensors
rebuilt (`cat`, reshapes of slices). Here the same converter runs on shape-only stand-ins
(meta tensors) of the file's tensors, and each converted tensor is classified by what it is
made of:
- an input as it is (a rename), or a contiguous view of one (a split along the rows, a
  reshape): an entry of the file under its diffusers name, its bytes where they lie. The
  checkpoint then maps, registers and reads it as it does a diffusers file;
- a `cat` along the rows of such ranges in another order (a fused projection's halves
  swapped: SD3's last context norm, Mochi's and MiniMax-H3's gated MLPs): one entry per part
  (`<name>#<i>`), joined by the declared "concat" adapter that fuse_qkv uses, so the block
  still streams from the mapping (each part copied into its rows of the slot, or joined while
  packing) instead of leaving the file to diffusers' loader. A GGUF file's packed parts join
  too when they are of one quant type (its blocks never span rows); parts of float8 tensors or
  of GGUF tensors of different types are computed instead;
- anything else (a transposed or strided view, a cast, a tensor written in place):
  computed. Computed tensors are computed once from the file's own bytes (only the tensors
  they are made of are read), by the same converter, and held in a small private file beside
  it, in the blocks too while they are small next to the file (SD3's swapped last norm); more
  computed block tensors leave the file to diffusers' ordinary loader (fallback
  `checkpoint_plan_incompatible`).
So the conversion is diffusers' own, whatever the class, and a tensor is mapped only where the
converter itself proved it a range of the file's bytes.
Scaled-float8 weights (ComfyUI's `scale_weight`, or `weight_scale`): converters know no scale
(one would cut a scale as it cuts its weight, leave it under its old name or drop it), so they
are never given one. A per-tensor scale follows its weight under every name a part of the
weight took, and to a float8 tensor computed from that weight alone, whose values the private
file keeps as float8 once the converter, run again on the weight dequantized, is seen to have
only moved them (`_check_moved_float8`). A per-row scale follows its weight whole, and a range
of whole rows of it as the same rows of the scale (a fused projection split). Any other tensor
made of float8 values (rows a per-row scale would no longer match, a cast, a mix) is
`unreadable`: the mapping is refused, and so the file (diffusers' loader would drop the scales).
A few converters take options the file cannot tell (MiniMax-H3's `qkv_layout`: its fused
projection's rows stacked or interleaved per head); the caller's `converter_options` reach every
run of the converter, and one it does not take is refused (diffusers would drop it unread).
"""

from __future__ import annotations

import inspect
import math
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dlo.errors import ConfigError
from dlo.host.quantized_layers import FLOAT8, SCALE_SUFFIXES, ignored_key, layer_of, unscaled_float8
from dlo.host.safetensors_file import SafetensorsFile, TensorEntry

NO_OPTIONS: Mapping[str, object] = MappingProxyType({})


@dataclass(frozen=True)
class ConvertedLayout:
    """The file's tensors by their diffusers names."""

    entries: dict[str, TensorEntry]  # where each mapped tensor lies in the file
    computed: dict[str, frozenset[str]]  # converted by arithmetic (not a range of the file) -> the file's keys it is made of
    concatenated: dict[str, tuple[str, ...]]  # a cat of ranges -> its parts' entries, in order (dim 0)
    computed_nbytes: dict[str, int] = field(default_factory=dict)  # what each computed tensor holds
    moved_float8: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # computed float8 -> (weight, scale or 1)
    unreadable: dict[str, str] = field(default_factory=dict)  # float8 values no scale can be found for -> why
    unit_scales: list[str] = field(default_factory=list)  # scales of 1 to add beside an unscaled file's float8 weights

    @property
    def made_from(self) -> frozenset[str]:
        """The file's keys the computed tensors are made of."""
        return frozenset().union(*self.computed.values())


def converted_layout(
    file: SafetensorsFile, model_cls: type, model_config: dict, model_keys: set[str], options: Mapping[str, object] = NO_OPTIONS
) -> ConvertedLayout:
    """The file's tensors under the names of a model whose state dict has `model_keys`, as the
    converter run with `options` names them. See [Note: single files through diffusers' converter]"""
    kept = {key: entry for key, entry in file.entries.items() if not ignored_key(key)}
    unscaled_file = unscaled_float8(kept)  # each float8 weight read whole is given a scale of 1
    if model_keys == {key for key in kept if not key.endswith(SCALE_SUFFIXES)}:  # diffusers' layout already
        unit = [f"{layer_of(k)}{SCALE_SUFFIXES[0]}" for k, e in kept.items() if unscaled_file and e.dtype in FLOAT8]
        return ConvertedLayout(dict(kept), {}, {}, unit_scales=unit)
    inputs = converter_inputs(file)
    # Outside inference mode: views of inference tensors have no `_base` to follow.
    with torch.inference_mode(False):
        stand_ins = {key: torch.empty(entry.shape, dtype=entry.dtype, device="meta") for key, entry in inputs.items()}
        with _Provenance(stand_ins, inputs) as provenance:
            converted = _convert(model_cls, model_config, dict(stand_ins), options)
    layout = ConvertedLayout({}, {}, {})
    entries, computed, concatenated = layout.entries, layout.computed, layout.concatenated
    scaled: dict[str, str] = {}  # a scale's name beside a converted tensor -> the file's weight it scales
    for name, tensor in converted.items():
        where = provenance.range_of(tensor)
        parts = provenance.parts_of(tensor) if where is None else None
        types = {kept[r.key].ggml_type for r, _ in parts or ()}
        if parts is not None and len(types) == 1 and not any(kept[r.key].dtype in FLOAT8 for r, _ in parts):
            concatenated[name] = tuple(f"{name}#{i}" for i in range(len(parts)))
            ggml_type = types.pop()
            for part, (held, shape) in zip(concatenated[name], parts):
                end = held.begin + math.prod(shape) * tensor.element_size()
                entries[part] = TensorEntry(part, tensor.dtype, shape, held.begin, end, ggml_type)
            continue
        made_from = provenance.made_from(tensor) if where is None else frozenset({where.key})
        float8_keys = sorted(key for key in made_from if kept[key].dtype in FLOAT8)
        scale_key = _scale_key(kept, float8_keys[0]) if len(float8_keys) == 1 and tensor.dtype in FLOAT8 else None
        scale = kept.get(scale_key) if scale_key is not None else None
        per_tensor = scale is not None and math.prod(scale.shape) == 1
        # A per-row scale follows its weight whole (its shape checked with the weight's), or a
        # range of whole rows of it as the rows of the scale beside those rows.
        whole_rows = scale is not None and where is not None and tuple(tensor.shape) == kept[where.key].shape
        row_scales = (
            _row_scales(kept[where.key], scale, where, tuple(tensor.shape))
            if scale is not None and not per_tensor and where is not None and not whole_rows else None
        )
        # Bytes read as another float8 format are other values.
        retyped = where is not None and tensor.dtype in FLOAT8 and tensor.dtype != kept[where.key].dtype
        if unscaled_file and len(made_from) == 1 and float8_keys and tensor.dtype == kept[float8_keys[0]].dtype:
            if where is None:  # its values moved (checked as for a scaled weight)
                computed[name] = made_from
                layout.computed_nbytes[name] = _nbytes(tensor)
                layout.moved_float8[name] = (float8_keys[0], None)
            else:
                entries[name] = TensorEntry(name, tensor.dtype, tuple(tensor.shape), where.begin, where.begin + _nbytes(tensor))
            layout.unit_scales.append(f"{layer_of(name)}{SCALE_SUFFIXES[0]}")
            continue
        if float8_keys and not (per_tensor or whole_rows or row_scales) or len(made_from) > 1 and float8_keys or retyped:
            unscaled = [key for key in float8_keys if _scale_key(kept, key) is None and not unscaled_file]
            layout.unreadable[name] = (
                f"{unscaled[0]!r} holds float8 values without a scale beside it (dlo reads float8 weights with their "
                f"{' or '.join(SCALE_SUFFIXES)})" if unscaled else
                f"diffusers' converter makes {name!r} of float8 values of {float8_keys} that no one scale of the file "
                "dequantizes"
            )
            continue
        problem = _scale_problem(kept, converted, scaled, name, float8_keys[0], scale_key) if scale is not None else None
        if problem is not None:
            layout.unreadable[name] = problem
            continue
        if where is None:
            computed[name] = made_from
            layout.computed_nbytes[name] = _nbytes(tensor)
            if scale is not None:
                layout.moved_float8[name] = (float8_keys[0], scale_key)
        else:
            # A part of a GGUF file's packed tensor (rows of it) keeps its ggml type.
            entries[name] = TensorEntry(
                name, tensor.dtype, tuple(tensor.shape), where.begin, where.begin + _nbytes(tensor), kept[where.key].ggml_type
            )
        if scale is not None:  # each part of a weight, or its float8 values moved, keeps its scale
            named = _scale_name(name, float8_keys[0], scale_key)
            entries[named] = row_scales or scale
            scaled[named] = float8_keys[0]
    return layout


def computed_values(
    file: SafetensorsFile, model_cls: type, model_config: dict, layout: ConvertedLayout, options: Mapping[str, object] = NO_OPTIONS
) -> dict[str, torch.Tensor]:
    """The tensors the converter computes, computed from the file's bytes. Only the file's
    tensors they are made of are read (copied: converters may write to their inputs); the
    others enter as stand-ins. See [Note: single files through diffusers' converter]"""
    inputs = {
        key: file.view(key).clone() if key in layout.made_from else torch.empty(entry.shape, dtype=entry.dtype, device="meta")
        for key, entry in converter_inputs(file).items()
    }
    with torch.inference_mode(False):
        converted = _convert(model_cls, model_config, inputs, options)
    values = {name: converted[name].contiguous() for name in layout.computed}
    if layout.moved_float8:
        _check_moved_float8(file, model_cls, model_config, layout, options, values)
    return values


def _check_moved_float8(
    file: SafetensorsFile, model_cls: type, model_config: dict, layout: ConvertedLayout, options: Mapping[str, object],
    values: Mapping[str, torch.Tensor],
) -> None:
    """Raise ValueError unless each float8 tensor the converter computed is its weight's float8
    values moved (a permutation, a concatenation of its parts): run on the weights dequantized,
    the converter must give exactly the computed values dequantized with the weight's scale."""
    scales = {
        key: file.view(scale_key).float().reshape(()) if scale_key is not None else torch.ones(())
        for key, scale_key in layout.moved_float8.values()
    }
    inputs = {
        key: file.view(key).float() * scales[key] if key in scales else
        file.view(key).clone() if key in layout.made_from else torch.empty(entry.shape, dtype=entry.dtype, device="meta")
        for key, entry in converter_inputs(file).items()
    }
    with torch.inference_mode(False):
        converted = _convert(model_cls, model_config, inputs, options)
    for name, (key, _) in layout.moved_float8.items():
        if not torch.equal(converted[name].float(), values[name].float() * scales[key]):
            raise ValueError(f"diffusers' converter computes {name!r} from the float8 values of {key!r}, not only moves them")


def private_file(values: dict[str, torch.Tensor], label: str) -> SafetensorsFile:
    """`values` written to a private unlinked file, mapped like the checkpoint's."""
    from safetensors.torch import save

    handle = tempfile.TemporaryFile()
    try:
        handle.write(save(values))
        handle.flush()
        file = SafetensorsFile(label, handle)
        file.private = True
        return file
    finally:
        handle.close()  # the mapping keeps the unlinked file's pages


def _converter(model_cls: type):
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    return SINGLE_FILE_LOADABLE_CLASSES[model_cls.__name__]["checkpoint_mapping_fn"]


def _convert(model_cls: type, model_config: dict, state_dict: dict, options: Mapping[str, object]) -> dict:
    return _converter(model_cls)(checkpoint=state_dict, config=model_config, **options)


def has_converter(model_cls: type) -> bool:
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    return model_cls.__name__ in SINGLE_FILE_LOADABLE_CLASSES


def _converter_options(model_cls: type) -> dict[str, inspect.Parameter]:
    """The options diffusers' single-file converter of `model_cls` takes by name (none where
    diffusers has no converter for it: loading a single file of it is refused)."""
    if not has_converter(model_cls):
        return {}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = inspect.signature(_converter(model_cls)).parameters.values()
    return {p.name: p for p in parameters if p.kind in named and p.name not in ("checkpoint", "config")}


def checked_converter_options(
    model_cls: type, options: Mapping[str, object], label: str = "converter_options"
) -> dict[str, object]:
    """`options` as the converter of `model_cls` takes them, refused in one line where it takes
    no such option (diffusers passes a converter only the options its signature names: a
    misspelt one would be dropped unread) or where the value is not of the type of the option's
    default; a string (a command line's) is read as that type ("false" as False: the string
    "False" itself would be true). Options equal to their default are left out: the converter
    takes its default (one meaning, one host weight cache entry)."""
    taken = _converter_options(model_cls)
    unknown = sorted(set(options) - set(taken))
    if unknown:
        takes = f"takes {', '.join(taken)}" if taken else "takes no options"
        raise ConfigError(
            f"{label} {unknown[0]!r}: diffusers' single-file converter for {model_cls.__name__} {takes}"
        )
    typed = {key: _option_value(value, taken[key].default, f"{label} {key}={value!r}") for key, value in options.items()}
    return {key: value for key, value in typed.items() if not (type(value) is type(taken[key].default) and value == taken[key].default)}


def _option_value(value: object, default: object, label: str) -> object:
    """`value` as the type of a converter option's `default` (bool, int or float; an option with
    any other default takes any value)."""
    kind = type(default)
    if kind not in (bool, int, float) or type(value) is kind:
        return value
    if kind is float and type(value) is int:
        return float(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if kind is bool and text in ("true", "false"):
            return text == "true"
        if kind is not bool:
            try:
                return kind(text)
            except ValueError:
                pass
    want = "true or false" if kind is bool else f"an {kind.__name__}" if kind is int else f"a {kind.__name__}"
    raise ConfigError(f"{label}: the converter takes {want} there (its default is {default!r})")


def converter_inputs(file: SafetensorsFile) -> dict[str, TensorEntry]:
    """What diffusers' converter is given of `file`: its tensors but the keys no model reads and
    the scales beside its float8 weights (dlo gives each scale to the tensors made of its weight:
    See [Note: single files through diffusers' converter])."""
    kept = {key: entry for key, entry in file.entries.items() if not ignored_key(key)}
    float8_layers = {layer_of(key) for key, entry in kept.items() if entry.dtype in FLOAT8}
    return {key: entry for key, entry in kept.items() if not (key.endswith(SCALE_SUFFIXES) and layer_of(key) in float8_layers)}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _scale_name(name: str, weight_key: str, scale_key: str) -> str:
    """Where the scale `scale_key` of the file's weight `weight_key` goes beside its converted
    tensor `name`: the same suffix after the converted layer's name."""
    return layer_of(name) + scale_key[len(layer_of(weight_key)):]


def _scale_problem(kept: dict, converted: Mapping, scaled: Mapping[str, str], name: str, weight_key: str, scale_key: str) -> str | None:
    """Why the scale `scale_key` cannot be the one the model reads beside `name` (its weight's
    float8 values, from `weight_key`): the file keeps two scales for the weight, or the converter
    made another tensor of that name, or another weight's scale goes there (`scaled`: the scales
    given so far, by name). None when it can."""
    layer = layer_of(weight_key)
    named = _scale_name(name, weight_key, scale_key)
    if sum(layer + suffix in kept for suffix in SCALE_SUFFIXES) > 1:
        return f"{weight_key!r} has two scales beside it ({' and '.join(layer + s for s in SCALE_SUFFIXES)})"
    if named in converted:
        return f"diffusers' converter makes a tensor named {named!r}, the name of {weight_key!r}'s scale beside {name!r}"
    if scaled.get(named, weight_key) != weight_key:
        return f"the scales of {scaled[named]!r} and {weight_key!r} would both be {named!r}"
    return None


def _row_scales(weight: TensorEntry, scale: TensorEntry, where: _Range, shape: tuple[int, ...]) -> TensorEntry | None:
    """The rows of the per-row `scale` of the 2-D `weight` that scale the range at `where` of
    `shape`, where that is whole rows of the weight; else None."""
    rows, columns = weight.shape if len(weight.shape) == 2 else (0, 0)
    if scale.shape not in ((rows,), (rows, 1)) or len(shape) != 2 or shape[1] != columns:
        return None
    first, partial = divmod(where.begin - weight.begin, columns * weight.dtype.itemsize)
    if partial:
        return None
    size = scale.dtype.itemsize
    begin = scale.begin + first * size
    return TensorEntry(scale.key, scale.dtype, (shape[0], *scale.shape[1:]), begin, begin + shape[0] * size)


def _scale_key(kept: dict, weight_key: str) -> str | None:
    """The key of the scale the file keeps beside the weight `weight_key`, if any."""
    layer = layer_of(weight_key)
    return next((layer + suffix for suffix in SCALE_SUFFIXES if layer + suffix in kept), None)


@dataclass(frozen=True)
class _Range:
    key: str  # the file's tensor whose bytes these are
    begin: int  # absolute file offset of the first byte


class _Provenance(TorchDispatchMode):
    """While the converter runs on stand-ins: what each tensor is made of (the file's keys),
    and which tensors hold, in order, a contiguous range of the file's bytes. Views carry a
    range (their base's, moved by their offset), and so do the copies converters make of one
    (`torch.cat([part])`, a clone) or of adjacent ranges concatenated along the rows. A `cat`
    along the rows of ranges that do not follow each other holds its parts' ranges. Anything
    else holds none, and neither does a tensor whose storage was written in place (through it,
    a view, `.detach()` or `.data`: they share it) or swapped (`t.data = ...`, not dispatched:
    seen as another storage than the one it was made with)."""

    _COPIES = (torch.ops.aten.clone.default, torch.ops.aten.cat.default, torch.ops.aten._to_copy.default)

    def __init__(self, stand_ins: dict[str, torch.Tensor], entries: dict[str, TensorEntry]) -> None:
        super().__init__()
        self._ranges = {id(t): _Range(key, entries[key].begin) for key, t in stand_ins.items()}
        self._parts: dict[int, tuple[tuple[_Range, tuple[int, ...]], ...]] = {}
        self._keys = {id(t): frozenset((key,)) for key, t in stand_ins.items()}
        self._storages = {id(t): _storage(t) for t in stand_ins.values()}  # each tensor's, as made
        self._written: set[int] = set()  # storages written in place
        self._alive: list[torch.Tensor] = list(stand_ins.values())  # keeps the ids above from being reused

    def _intact(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` still has the storage it was made with, never written in place."""
        storage = _storage(tensor)
        return self._storages.get(id(tensor)) == storage and storage not in self._written

    def range_of(self, tensor: torch.Tensor) -> _Range | None:
        """The range `tensor` holds, or None."""
        base = tensor if tensor._base is None else tensor._base
        # A view holds its base's bytes only while it shares its base's storage and both keep
        # the one they were made with (`x.data = ...` gives x another, and views made of x
        # after that still name x's old base as theirs).
        intact = self._intact(tensor) and self._intact(base) and _storage(tensor) == _storage(base)
        if not tensor.is_contiguous() or not intact:
            return None
        if id(tensor) in self._ranges:
            return self._ranges[id(tensor)]
        if base is tensor or id(base) not in self._ranges:
            return None
        start = self._ranges[id(base)]
        return _Range(start.key, start.begin + tensor.storage_offset() * tensor.element_size())

    def parts_of(self, tensor: torch.Tensor) -> tuple[tuple[_Range, tuple[int, ...]], ...] | None:
        """The ranges, with their shapes, a `cat` of ranges holds one after another, or None."""
        return self._parts.get(id(tensor)) if self._intact(tensor) else None

    def made_from(self, tensor: torch.Tensor) -> frozenset[str]:
        base = tensor if tensor._base is None else tensor._base
        return self._keys.get(id(tensor), self._keys.get(id(base), frozenset()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        schema = func._schema.arguments
        given = [*zip(schema, args), *((a, kwargs[a.name]) for a in schema if a.name in kwargs)]
        for argument, value in given:
            if argument.alias_info is not None and argument.alias_info.is_write:  # written in place
                self._written.update(_storage(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor))
        keys = frozenset().union(*(self.made_from(t) for t in inputs)) if inputs else frozenset()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._keys[id(t)] = keys | self.made_from(t)
                self._storages.setdefault(id(t), _storage(t))  # an in-place op returns its input
                self._alive.append(t)
        if func in self._COPIES and isinstance(out, torch.Tensor) and out.is_contiguous():
            cat = func is torch.ops.aten.cat.default
            parts = list(args[0]) if cat else [args[0]]
            dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) if cat else 0
            ranges = [self.range_of(part) for part in parts]
            same = all(part.dtype == out.dtype for part in parts) and out.device.type == "meta"
            if same and dim in (0, -out.dim()) and None not in ranges:
                if _adjacent(parts, ranges):
                    self._ranges[id(out)] = ranges[0]
                elif len(parts) > 1:
                    self._parts[id(out)] = tuple((r, tuple(part.shape)) for r, part in zip(ranges, parts))
        return out


def _storage(tensor: torch.Tensor) -> int:
    """The storage `tensor` shares with its views and aliases."""
    return tensor.untyped_storage()._cdata


def _adjacent(parts: list[torch.Tensor], ranges: list[_Range]) -> bool:
    """Whether the parts' ranges follow each other in one tensor of the file."""
    return all(
        later.key == earlier.key and later.begin == earlier.begin + part.numel() * part.element_size()
        for earlier, later, part in zip(ranges, ranges[1:], parts)
    )
