"""Which tensors of a streamed block stream as float8 (see [Note: fp8 streaming]).

The 2-D weight of every nn.Linear in the block: the attention, feed-forward and modulation
(AdaLayerNorm) projections, which hold nearly all of a DiT block's bytes. Everything else
keeps its dtype: biases and norm weights (1-D, tiny), other layers' parameters, buffers,
weights of modules the model keeps in fp32 (`_keep_in_fp32_modules`), and weights whose
full name matches an `OffloadConfig.fp8_skip` pattern.
"""

from __future__ import annotations

import re
from collections import Counter

import torch
from torch import nn

from dlo.config import OffloadConfig
from dlo.config.offload_config import Fp8Scale
from dlo.planning.adapters import adapter_modules
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
    for owned in owned_tensors(ref.module, adapter_modules(ref.module)):
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


# torch._scaled_mm needs both dimensions of the weight to be multiples of this (elements).
GEMM_DIMENSION_MULTIPLE = 16


def gemm_linears(root: nn.Module, refs: list[BlockRef], config: OffloadConfig) -> list[tuple[str, nn.Linear]]:
    """(full name, module) of each Linear of the blocks `refs` that `fp8_compute` runs as an
    FP8 GEMM (See [Note: fp8 compute]): one `stream_dtype` quantizes, a plain nn.Linear (a
    subclass has its own forward) with no hooks, no forward of its own and no `weight_scale`
    (what the conversion adds), bf16 weight and bias (the row-wise GEMM's output dtype), both
    dimensions multiples of GEMM_DIMENSION_MULTIPLE; not a LoRA adapter's own (PEFT casts
    inputs to its weight's dtype), nor the base layer of a DoRA adapter (which reads the base
    weight, unscaled); used once in the blocks, its weight not tied anywhere in `root`."""
    if not config.fp8_compute:
        return []
    tensor_owners = Counter(id(owned.tensor) for owned in owned_tensors(root))
    module_uses = Counter(id(module) for ref in refs for module in ref.module.modules())
    found = []
    for ref in refs:
        chosen = quantized_tensors(root, ref, config)
        read_whole = {id(base) for base in _dora_base_layers(ref.module)}
        for name, linear in ref.module.named_modules(prefix=ref.name):
            if type(linear) is not nn.Linear or id(linear.weight) not in chosen:
                continue
            bias = linear.bias
            if (
                module_uses[id(linear)] == 1
                and tensor_owners[id(linear.weight)] == 1
                and linear.weight.dtype == torch.bfloat16
                and (bias is None or bias.dtype == torch.bfloat16)
                and linear.in_features % GEMM_DIMENSION_MULTIPLE == 0
                and linear.out_features % GEMM_DIMENSION_MULTIPLE == 0
                and not any(part.startswith("lora_") for part in name.split("."))
                and id(linear) not in read_whole
                and not _claimed(linear)
            ):
                found.append((name, linear))
    return found


def _dora_base_layers(block: nn.Module) -> list[nn.Module]:
    """Base layers of PEFT LoRA layers with DoRA on (their `lora_magnitude_vector` holds an
    adapter): the DoRA forward reads the base weight itself to take its norm."""
    return [
        adapter._modules["base_layer"]
        for adapter in block.modules()
        if adapter._modules.get("lora_magnitude_vector") and "base_layer" in adapter._modules
    ]


def _claimed(linear: nn.Linear) -> bool:
    """Whether something else already attached to this Linear: hooks, a forward of its own
    (accelerate's and diffusers' hooks set one), a `weight_scale` of its own."""
    return bool(
        linear._forward_hooks
        or linear._forward_pre_hooks
        or "forward" in vars(linear)
        or "weight_scale" in vars(linear)
        or "weight_scale" in linear._buffers
        or "weight_scale" in linear._parameters
    )
