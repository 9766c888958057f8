"""Collecting the final tensors of a loaded transformer for the cache, failing closed.

Only a layout dlo can prove it maps back exactly is accepted: every parameter and persistent
buffer a plain, contiguous, whole-storage CPU tensor of a supported dtype (or a GGUF model's
packed bytes: See [Note: GGUF entries]), owned under one name. Anything else returns a fallback code before a byte is written (docs/guides/host-weight-cache.md).
"""

from __future__ import annotations

import torch
from torch import nn

from dlo.host.preflight import Fallback
from dlo.host.safetensors_file import DTYPES
from dlo.planning.gguf_weights import is_gguf_parameter
from dlo.planning.tensor_walk import owned_tensors

_SUPPORTED = set(DTYPES.values())


def collect_tensors(model: nn.Module) -> dict[str, torch.Tensor] | Fallback:
    """name -> tensor for every parameter and persistent buffer, sorted by name."""
    found: dict[str, torch.Tensor] = {}
    storages: dict[int, str] = {}
    for owned in owned_tensors(model):
        if not owned.is_parameter and owned.key in owned.owner._non_persistent_buffers_set:
            continue
        name, tensor = owned.name, owned.tensor  # names are unique: they are paths in one tree
        plain = type(tensor) in (torch.Tensor, nn.Parameter) or is_gguf_parameter(tensor)
        if not plain or tensor.is_quantized or tensor.layout != torch.strided:
            return Fallback("unsupported_tensor", f"{name!r} is a {type(tensor).__name__} ({tensor.layout})")
        if tensor.device.type != "cpu":
            return Fallback("unsupported_tensor", f"{name!r} is on {tensor.device}, not on the cpu")
        if tensor.dtype not in _SUPPORTED:
            return Fallback("unsupported_tensor", f"{name!r} has dtype {tensor.dtype}")
        if not tensor.is_contiguous():
            return Fallback("unsupported_tensor", f"{name!r} is not contiguous")
        storage = tensor.untyped_storage()
        if tensor.storage_offset() != 0 or storage.nbytes() != tensor.numel() * tensor.element_size():
            return Fallback("unsupported_alias", f"{name!r} is a view of a larger storage")
        if storage.data_ptr() in storages:
            return Fallback("unsupported_alias", f"{name!r} shares its storage with {storages[storage.data_ptr()]!r}")
        storages[storage.data_ptr()] = name
        found[name] = tensor
    if not found:
        return Fallback("unsupported_tensor", "the model has no parameters or persistent buffers")
    return dict(sorted(found.items()))
