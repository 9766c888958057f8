"""PEFT adapters inside a streamed block: which of its tensors are the base weights dlo
streams and which belong to adapters (LoRA's lora_A / lora_B, DoRA's magnitudes...).

[Note: adapters stay resident]
An adapter's tensors are small (a rank-64 LoRA on every Linear of a Flux block is about 3 % of
its bytes) and change in ways the base weights do not: diffusers adds, hot-swaps in place,
rescales and deletes them between calls, and PEFT places a new one on the device and in the
dtype of the base weight it wraps. So they never stream: enable() places the adapters it finds
inside the blocks on the device with the other non-streamed parts, and one loaded after
enable() lands there by itself (PEFT reads the device and dtype of the base weight's stand-in,
which has both). A block's layout, host copy and slot hold its base weights only, whatever the
adapters do, and the base weights' host copy is never duplicated per adapter. The tensors
under a PEFT layer's `adapter_layer_names` are the adapter's; the base layer's are the
block's.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace

from torch import nn

from dlo.planning.tensor_walk import OwnedTensor, owned_tensors


def tuner_layers(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of each PEFT tuner layer (a LoRA layer wrapping a base layer...) under
    `module`; none while PEFT is not imported (no module can be one then)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:
        return
    for name, sub in module.named_modules():
        if isinstance(sub, tuners.BaseTunerLayer):
            yield name, sub


def adapter_modules(block: nn.Module) -> frozenset[int]:
    """id() of the modules under `block` holding adapters' tensors: pass it as the `skip` of
    `owned_tensors` / `unique_tensors` to walk the tensors that stream with the block. See
    [Note: adapters stay resident]"""
    return frozenset(
        id(holder)
        for _, layer in tuner_layers(block)
        for attribute in layer.adapter_layer_names
        if (holder := layer._modules.get(attribute)) is not None
    )


def adapter_tensors(block: nn.Module) -> Iterator[OwnedTensor]:
    """The adapters' tensors inside `block`, named from `block`. See [Note: adapters stay resident]"""
    holders = adapter_modules(block)
    for name, holder in block.named_modules():
        if id(holder) in holders:
            for owned in owned_tensors(holder):
                yield replace(owned, name=f"{name}.{owned.name}")
