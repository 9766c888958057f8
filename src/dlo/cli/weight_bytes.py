"""The one definition of "weights" the CLI reports: payload bytes."""

from __future__ import annotations

from torch import nn

from dlo.planning.tensor_walk import unique_tensors


def payload_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer, each tensor once (works on meta modules). The
    512-byte alignment of tensors in slots and host buffers is padding on top of this."""
    return sum(o.tensor.numel() * o.tensor.element_size() for o in unique_tensors(module).values())
