"""GGUF weights as diffusers holds them.

[Note: GGUF streaming]
A model diffusers loaded from a GGUF file holds each quantized weight as a `GGUFParameter`: a
Parameter subclass whose data is the file's packed bytes (uint8, each row the quant type's
blocks) and whose `quant_type` says how to read them; the GGUFLinear owning it dequantizes it in
every forward. To dlo such a weight is a uint8 tensor like any other: its bytes are packed into
the block's host image as they are, copied into the slot, and the same parameter object is
pointed at its slot view (`.data`, which keeps the object, hence its `quant_type`), so the
forward dequantizes exactly the bytes diffusers' resident model does. fp8 streaming leaves it
alone (it quantizes floating-point weights only), and fp8 GEMMs do not take a GGUFLinear (only
plain nn.Linear modules become FP8 GEMMs). Between calls it points at the uint8 stand-in, bytes of 0xFF: every
GGUF block's float16 scale then reads NaN (See [Note: stand-ins]).
"""

from __future__ import annotations

import torch
from torch import nn


def is_gguf_parameter(tensor: torch.Tensor) -> bool:
    """diffusers' GGUFParameter, known by its class (diffusers need not be imported)."""
    cls = type(tensor)
    return cls.__name__ == "GGUFParameter" and cls.__module__.startswith("diffusers.")


def parameter_like(template: torch.Tensor, data: torch.Tensor) -> nn.Parameter:
    """A frozen parameter holding `data` of `template`'s kind: a GGUFParameter keeps its class and
    quant type (its module dequantizes by them), anything else is a plain nn.Parameter."""
    if is_gguf_parameter(template):
        return type(template)(data, requires_grad=False, quant_type=template.quant_type)
    return nn.Parameter(data, requires_grad=False)
