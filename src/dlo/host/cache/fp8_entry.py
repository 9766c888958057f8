"""Host weight cache entries that hold float8 weights (See [Note: fp8 streaming]).

With `OffloadConfig(stream_dtype=...)` the first process on a node quantizes the blocks'
Linear weights and publishes them as a float8 checkpoint: `<layer>.weight` in float8 and
`<layer>.weight_scale` in fp32 ((rows, 1) per channel, (1, 1) per tensor), the layout
`dlo.load_transformer` reads from ModelOpt-style files. Every other process maps that entry:
half the host memory per node, and the float8 bytes copied straight from the shared pages.
The stream format is part of the entry's identity. Every block's weights are quantized, the
resident ones too (an entry serves any `resident_layers`); those are dequantized when placed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from dlo.config import OffloadConfig
from dlo.host.fp8_codec import quantize_into
from dlo.host.tensor_source import QuantizedSource
from dlo.planning.fp8_selection import fp8_format, quantized_tensors
from dlo.planning.offload_plan import discover, resolve_blocks
from dlo.planning.tensor_walk import owned_tensors

SCALE_SUFFIX = "weight_scale"


def stream_identity(config: OffloadConfig) -> dict | None:
    """The stream format's part of a load identity (None: the entry holds the weights as loaded)."""
    if config.stream_dtype is None:
        return None
    return {"dtype": config.stream_dtype, "scale": config.fp8_scale, "skip": list(config.fp8_skip)}


def quantized_names(model: nn.Module, config: OffloadConfig) -> list[str]:
    """The weights of `model` (real or meta) an entry stores as float8, by name."""
    chosen: set[int] = set()
    for ref in resolve_blocks(model, discover(model)):
        chosen |= quantized_tensors(model, ref, config)
    return sorted({owned.name for owned in owned_tensors(model) if id(owned.tensor) in chosen})


def scale_name(weight_name: str) -> str:
    return f"{weight_name[: -len('weight')]}{SCALE_SUFFIX}"


def quantize_entry(tensors: Mapping[str, torch.Tensor], names: list[str], config: OffloadConfig) -> dict[str, torch.Tensor]:
    """The entry's tensors: `tensors` with each of `names` as float8 data plus its scales."""
    format_ = fp8_format(config)
    assert format_ is not None
    entry = dict(tensors)
    for name in names:
        weight = tensors[name]
        data = torch.empty(weight.shape, dtype=format_.dtype)
        scale = torch.empty(format_.scale_shape(weight.shape[0]), dtype=torch.float32)
        quantize_into(weight, data, scale, name)
        entry[name] = data
        entry[scale_name(name)] = scale
    return dict(sorted(entry.items()))


def expected_entry(
    expected: Mapping[str, tuple[list[int], torch.dtype]], names: list[str], config: OffloadConfig
) -> dict[str, tuple[list[int], torch.dtype]]:
    """The (shape, dtype) of every tensor of the entry a load with these runtime tensors publishes."""
    if not names:
        return dict(expected)
    format_ = fp8_format(config)
    assert format_ is not None
    entry = dict(expected)
    for name in names:
        shape = entry[name][0]
        entry[name] = (shape, format_.dtype)
        entry[scale_name(name)] = (list(format_.scale_shape(shape[0])), torch.float32)
    return entry


def entry_source(name: str, shape: tuple[int, ...], dtype: torch.dtype, config: OffloadConfig) -> QuantizedSource:
    """Where runtime weight `name` (shape, dtype) comes from in a float8 entry."""
    format_ = fp8_format(config)
    assert format_ is not None
    return QuantizedSource(name, scale_name(name), shape, dtype, format_)
