"""Walking the tensors a module owns, the way dlo sees them: one entry per (owner, key)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class OwnedTensor:
    name: str  # dotted, relative to the walked module
    owner: nn.Module
    key: str
    is_parameter: bool
    tensor: torch.Tensor


def owned_tensors(module: nn.Module, skip: frozenset[int] = frozenset()) -> Iterator[OwnedTensor]:
    """Every parameter and buffer slot under `module`, not descending into modules whose
    id is in `skip`. A tensor tied under two names appears once per name."""
    seen: set[int] = set()

    def walk(prefix: str, mod: nn.Module) -> Iterator[OwnedTensor]:
        if id(mod) in skip or id(mod) in seen:
            return
        seen.add(id(mod))
        for is_parameter, table in ((True, mod._parameters), (False, mod._buffers)):
            for key, tensor in table.items():
                if tensor is not None:
                    yield OwnedTensor(f"{prefix}{key}", mod, key, is_parameter, tensor)
        for child_name, child in mod._modules.items():
            if child is not None:
                yield from walk(f"{prefix}{child_name}.", child)

    yield from walk("", module)


def unique_tensors(module: nn.Module, skip: frozenset[int] = frozenset()) -> dict[int, OwnedTensor]:
    """id(tensor) -> its first owner, in walk order."""
    found: dict[int, OwnedTensor] = {}
    for owned in owned_tensors(module, skip):
        found.setdefault(id(owned.tensor), owned)
    return found
