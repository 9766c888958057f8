"""Where each tensor of a streamed block lives inside a flat byte buffer.

[Note: 512-byte alignment]
Every tensor starts at a multiple of ALIGNMENT bytes inside its slot and host buffer, and
buffers themselves start at such an address. CPU and GPU math libraries choose kernels by
pointer alignment: a Flux block whose weight sat at an 8-byte-aligned offset gave outputs
differing in the last bits from the same weight allocated normally. At 512 bytes every
library sees what an ordinary allocation would give it, so streamed runs stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGNMENT = 512


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to place: its name inside the block, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class TensorPlacement:
    spec: TensorSpec
    offset: int


@dataclass(frozen=True)
class BlockLayout:
    """Placements in declaration order; `nbytes` is the aligned size of the whole block."""

    placements: tuple[TensorPlacement, ...]
    nbytes: int

    @property
    def payload_bytes(self) -> int:
        return sum(p.spec.nbytes for p in self.placements)


def plan_block_layout(specs: Sequence[TensorSpec]) -> BlockLayout:
    # See [Note: 512-byte alignment]
    placements = []
    offset = 0
    for spec in specs:
        placements.append(TensorPlacement(spec, offset))
        offset = align_up(offset + spec.nbytes)
    return BlockLayout(tuple(placements), offset)


def view_placement(buffer: torch.Tensor, placement: TensorPlacement) -> torch.Tensor:
    """The typed, shaped view of `placement` inside a flat uint8 `buffer`."""
    spec = placement.spec
    raw = buffer[placement.offset : placement.offset + spec.nbytes]
    return raw.view(spec.dtype).view(spec.shape)
