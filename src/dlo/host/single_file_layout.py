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
- anything else (a `cat`, a transposed or strided view, a cast): computed. Computed tensors
  outside the blocks are computed once from the file's own bytes, by the same converter, and
  held in a small private file beside it; a computed block tensor leaves the file to
  diffusers' ordinary loader (fallback `checkpoint_plan_incompatible`).
So the conversion is diffusers' own, whatever the class, and a tensor is mapped only where the
converter itself proved it a range of the file's bytes.
Scaled-float8 weights (ComfyUI's `scale_weight`): converters do not know the scales, so each
scale follows its weight: under every name a part of the weight took, the same scale.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dlo.host.safetensors_file import SafetensorsFile, TensorEntry

SCALE_SUFFIX = "scale_weight"  # ComfyUI's scaled fp8 files: <layer>.scale_weight beside <layer>.weight
# What ComfyUI's scaled fp8 files hold beside the weights and a diffusers model does not read:
# the format marker and the activations' scales of its fp8 matmuls.
IGNORED = ("scaled_fp8",)
IGNORED_SUFFIXES = (".scale_input",)


@dataclass(frozen=True)
class ConvertedLayout:
    """The file's tensors by their diffusers names."""

    entries: dict[str, TensorEntry]  # where each mapped tensor lies in the file
    computed: tuple[str, ...]  # converted by arithmetic: not a range of the file
    mapped_from: frozenset[str]  # the file's keys the entries lie in


def converted_layout(file: SafetensorsFile, model_cls: type, model_config: dict, model_keys: set[str]) -> ConvertedLayout:
    """The file's tensors under the names of a model whose state dict has `model_keys`. See
    [Note: single files through diffusers' converter]"""
    kept = {key: entry for key, entry in file.entries.items() if not _ignored(key)}
    stand_ins = {key: torch.empty(entry.shape, dtype=entry.dtype, device="meta") for key, entry in kept.items()}
    if model_keys == {key for key in kept if not key.endswith(f".{SCALE_SUFFIX}")}:  # diffusers' layout already
        return ConvertedLayout(dict(kept), (), frozenset(kept))
    with _Ranges({id(tensor): _Range(key, entry.begin) for (key, entry), tensor in zip(kept.items(), stand_ins.values())}) as ranges:
        converted = _convert(model_cls, model_config, dict(stand_ins))
    entries: dict[str, TensorEntry] = {}
    computed, mapped_from = [], set()
    for name, tensor in converted.items():
        where = ranges.of(tensor)
        scale = kept.get(_scale_key(where.key)) if where is not None else None
        # A per-row scale of a weight split in parts would need splitting too.
        split_scale = scale is not None and scale.shape not in ((), (1,)) and tuple(tensor.shape) != kept[where.key].shape
        if where is None or split_scale:
            computed.append(name)
            continue
        mapped_from.add(where.key)
        end = where.begin + tensor.numel() * tensor.element_size()
        entries[name] = TensorEntry(name, tensor.dtype, tuple(tensor.shape), where.begin, end)
        if scale is not None and _scale_key(name) not in converted:  # each part of a weight keeps its scale
            entries[_scale_key(name)] = scale
    return ConvertedLayout(entries, tuple(computed), frozenset(mapped_from))


@dataclass(frozen=True)
class _Range:
    key: str  # the file's tensor whose bytes these are
    begin: int  # absolute file offset of the first byte


class _Ranges(TorchDispatchMode):
    """While the converter runs on stand-ins: which tensors hold, in order, a contiguous range
    of the file's bytes. Views carry it (their base's range, moved by their offset), and so do
    the copies converters make of one (`torch.cat([part])`, a clone) or of adjacent ranges
    concatenated along the rows; anything else is computed."""

    _COPIES = (torch.ops.aten.clone.default, torch.ops.aten.cat.default, torch.ops.aten._to_copy.default)

    def __init__(self, inputs: dict[int, _Range]) -> None:
        super().__init__()
        self._ranges = dict(inputs)
        self._alive: list[torch.Tensor] = []  # keeps the ids above from being reused

    def of(self, tensor: torch.Tensor) -> _Range | None:
        """The range `tensor` holds, or None."""
        if not tensor.is_contiguous():
            return None
        if id(tensor) in self._ranges:
            return self._ranges[id(tensor)]
        base = self._ranges.get(id(tensor._base)) if tensor._base is not None else None
        if base is None:
            return None
        return _Range(base.key, base.begin + tensor.storage_offset() * tensor.element_size())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self._COPIES and isinstance(out, torch.Tensor):
            parts = list(args[0]) if func is torch.ops.aten.cat.default else [args[0]]
            dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) if func is torch.ops.aten.cat.default else 0
            ranges = [self.of(part) for part in parts]
            same = all(part.dtype == out.dtype for part in parts) and out.device.type == "meta"
            if same and dim in (0, -out.dim()) and None not in ranges and _adjacent(parts, ranges):
                self._ranges[id(out)] = ranges[0]
                self._alive.append(out)
        return out


def _adjacent(parts: list[torch.Tensor], ranges: list[_Range]) -> bool:
    """Whether the parts' ranges follow each other in one tensor of the file."""
    return all(
        later.key == earlier.key and later.begin == earlier.begin + part.numel() * part.element_size()
        for earlier, later, part in zip(ranges, ranges[1:], parts)
    )


def computed_file(file: SafetensorsFile, model_cls: type, model_config: dict, layout: ConvertedLayout) -> SafetensorsFile:
    """The tensors the converter computes, computed from the file's bytes and written to a
    private unlinked file, mapped like the checkpoint's. Only the file's tensors no entry lies
    in are read (copied: converters may write to their inputs); the others enter as stand-ins,
    so a tensor computed from one of them fails here (the caller refuses those in blocks
    first). See [Note: single files through diffusers' converter]"""
    inputs = {
        key: torch.empty(entry.shape, dtype=entry.dtype, device="meta") if key in layout.mapped_from else file.view(key).clone()
        for key, entry in file.entries.items()
        if not _ignored(key)
    }
    converted = _convert(model_cls, model_config, inputs)
    values = {name: converted[name].contiguous() for name in layout.computed}
    made_from_mapped = sorted(name for name, value in values.items() if value.is_meta)
    if made_from_mapped:
        raise ValueError(f"{made_from_mapped[0]!r} is computed from tensors that stream")
    from safetensors.torch import save

    handle = tempfile.TemporaryFile()
    try:
        handle.write(save(values))
        handle.flush()
        return SafetensorsFile(f"{file.path} (converted by diffusers)", handle)
    finally:
        handle.close()  # the mapping keeps the unlinked file's pages


def _convert(model_cls: type, model_config: dict, state_dict: dict) -> dict:
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    convert = SINGLE_FILE_LOADABLE_CLASSES[model_cls.__name__]["checkpoint_mapping_fn"]
    return convert(checkpoint=state_dict, config=model_config)


def has_converter(model_cls: type) -> bool:
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    return model_cls.__name__ in SINGLE_FILE_LOADABLE_CLASSES


def _ignored(key: str) -> bool:
    return key in IGNORED or key.endswith(IGNORED_SUFFIXES)


def _scale_key(weight_key: str) -> str:
    return weight_key.rsplit(".", 1)[0] + f".{SCALE_SUFFIX}"
