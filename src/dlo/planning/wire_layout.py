"""How a block's bytes cross the link: as laid out in the slot, or with some weights as
scaled float8 that the device dequantizes into the slot.

[Note: fp8 streaming]
With `OffloadConfig(stream_dtype=...)` the 2-D weights of a block's nn.Linear layers are
kept on the host as float8 plus fp32 scales (per output row, or one per weight). The block's
host image (its "wire" bytes) is two regions:

    [ plain region: every other tensor, byte for byte as in the slot ][ landing region ]

The slot layout puts the plain tensors first, so the plain region is laid out exactly like
the slot's first `plain_bytes`. The landing region holds each quantized weight's float8 bytes
and its scales, 512-aligned. A load copies the whole image into a device landing buffer, and
a second stream writes the block into the slot from there: the plain region as it is, each
weight dequantized, before the slot's "ready" event (See [Note: fp8 landing]): the compute
stream sees an ordinary slot. Dequantizing is defined as `round(float(q) * scale)` to the
weight's dtype (`host/fp8_codec.py`), so a streamed model equals the same quantized model
run resident on that device.
An unquantized block is all plain region: its wire image is its slot image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dlo.planning.block_layout import (
    BlockLayout,
    TensorPlacement,
    TensorSpec,
    align_up,
    plan_block_layout,
    view_placement,
)


@dataclass(frozen=True)
class Fp8Format:
    """How quantized weights are stored: the float8 dtype, and one fp32 scale per output
    row (per_channel) or per weight."""

    dtype: torch.dtype
    per_channel: bool

    def scale_shape(self, rows: int) -> tuple[int, int]:
        """Of the scales of a weight with `rows` output rows: (rows, 1), or (1, 1)."""
        return (rows, 1) if self.per_channel else (1, 1)


@dataclass(frozen=True)
class QuantizedPlacement:
    """Placement `index` of the slot layout arrives as float8 `data` plus fp32 `scale`
    (offsets inside the landing region)."""

    index: int
    shape: tuple[int, int]  # the weight's (rows, columns)
    dtype: torch.dtype  # the float8 dtype
    data_offset: int
    scale_offset: int
    scale_shape: tuple[int, int]  # (rows, 1) per channel, (1, 1) per tensor

    @property
    def data_bytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize

    @property
    def scale_bytes(self) -> int:
        return self.scale_shape[0] * 4


@dataclass(frozen=True)
class WireLayout:
    """A block's host image: `plain_bytes` copied to the slot as they are, then
    `landing_bytes` of quantized weights. See [Note: fp8 streaming]"""

    plain_bytes: int
    landing_bytes: int
    quantized: tuple[QuantizedPlacement, ...]

    @property
    def nbytes(self) -> int:
        return self.plain_bytes + self.landing_bytes


def plan_wire_layout(
    specs: Sequence[TensorSpec], formats: Sequence[Fp8Format | None]
) -> tuple[BlockLayout, WireLayout]:
    """The slot layout (plain tensors first, placements in `specs` order) and the wire layout
    of a block whose tensors with a format (2-D weights) stream as float8."""
    plain = [i for i, fmt in enumerate(formats) if fmt is None]
    weights = [i for i, fmt in enumerate(formats) if fmt is not None]
    ordered = plan_block_layout([specs[i] for i in plain + weights])  # plain tensors first
    offsets = {i: placement.offset for i, placement in zip(plain + weights, ordered.placements)}
    plain_bytes = ordered.placements[len(plain)].offset if weights else ordered.nbytes
    layout = BlockLayout(tuple(TensorPlacement(spec, offsets[i]) for i, spec in enumerate(specs)), ordered.nbytes)
    quantized = []
    landing = 0
    for i in weights:
        fmt = formats[i]
        assert fmt is not None
        rows, columns = specs[i].shape
        placement = QuantizedPlacement(
            index=i,
            shape=(rows, columns),
            dtype=fmt.dtype,
            data_offset=landing,
            scale_offset=align_up(landing + rows * columns * fmt.dtype.itemsize),
            scale_shape=fmt.scale_shape(rows),
        )
        landing = align_up(placement.scale_offset + placement.scale_bytes)
        quantized.append(placement)
    return layout, WireLayout(plain_bytes, landing, tuple(quantized))


def landing_views(landing: torch.Tensor, wire: WireLayout) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """(float8 data, fp32 scale) views of each quantized placement inside a flat uint8
    buffer holding the landing region."""
    return tuple(
        (
            landing[q.data_offset : q.data_offset + q.data_bytes].view(q.dtype).view(q.shape),
            landing[q.scale_offset : q.scale_offset + q.scale_bytes].view(torch.float32).view(q.scale_shape),
        )
        for q in wire.quantized
    )


def wire_targets(
    layout: BlockLayout, wire: WireLayout, plain: torch.Tensor, landing: torch.Tensor
) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], ...]:
    """Where each placement's bytes go, in placement order: a view of `plain` (laid out like
    the slot) for a plain tensor, (float8 data, fp32 scale) views of `landing` (holding the
    landing region) for a quantized one."""
    landed = dict(zip((q.index for q in wire.quantized), landing_views(landing, wire)))
    return tuple(landed[i] if i in landed else view_placement(plain, p) for i, p in enumerate(layout.placements))


def bytes_by_dtype(layout: BlockLayout, wire: WireLayout) -> dict[str, int]:
    """The block's host image by dtype name (payload, without alignment padding)."""
    found: dict[str, int] = {}

    def add(dtype: torch.dtype, nbytes: int) -> None:
        name = str(dtype).removeprefix("torch.")
        found[name] = found.get(name, 0) + nbytes

    quantized = {q.index for q in wire.quantized}
    for i, placement in enumerate(layout.placements):
        if i not in quantized:
            add(placement.spec.dtype, placement.spec.nbytes)
    for q in wire.quantized:
        add(q.dtype, q.data_bytes)
        add(torch.float32, q.scale_bytes)
    return found
