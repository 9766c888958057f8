"""Which tensors of a streamed block stream as float8 (see [Note: fp8 streaming]).

The 2-D weight of every nn.Linear in the block: the attention, feed-forward and modulation
(AdaLayerNorm) projections, which hold nearly all of a DiT block's bytes. Everything else
keeps its dtype: biases and norm weights (1-D, tiny), other layers' parameters, buffers,
weights of modules the model keeps in fp32 (`_keep_in_fp32_modules`), and weights whose
full name matches an `OffloadConfig.fp8_skip` pattern.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dlo.config import OffloadConfig
from dlo.config.offload_config import Fp8Scale
from dlo.planning.offload_plan import BlockRef
from dlo.planning.tensor_walk import owned_tensors
from dlo.planning.wire_layout import Fp8Format

QUANTIZABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_format(config: OffloadConfig) -> Fp8Format | None:
    if config.stream_dtype is None:
        return None
    return Fp8Format(getattr(torch, config.stream_dtype), config.fp8_scale == Fp8Scale.PER_CHANNEL.value)


def quantized_tensors(root: nn.Module, ref: BlockRef, config: OffloadConfig) -> frozenset[int]:
    """id() of every tensor of block `ref` that streams as float8 under `config`."""
    if config.stream_dtype is None:
        return frozenset()
    skip = [re.compile(pattern) for pattern in config.fp8_skip]
    keep_fp32 = set(getattr(root, "_keep_in_fp32_modules", None) or ())
    chosen: set[int] = set()
    excluded: set[int] = set()  # a tensor tied under a name that must keep its dtype
    for owned in owned_tensors(ref.module):
        name = f"{ref.name}.{owned.name}"
        tensor = owned.tensor
        if (
            isinstance(owned.owner, nn.Linear)
            and owned.key == "weight"
            and tensor.dim() == 2
            and tensor.dtype in QUANTIZABLE_DTYPES
            and not any(pattern.search(name) for pattern in skip)
            and not keep_fp32.intersection(name.split("."))
        ):
            chosen.add(id(tensor))
        else:
            excluded.add(id(tensor))
    return frozenset(chosen - excluded)
