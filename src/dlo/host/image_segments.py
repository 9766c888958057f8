"""Where each byte of a block's wire image lies before it is packed: in the checkpoint's (or
cache entry's) files, for tensors used as saved, or in the block's own tensors. All-gather
mode uses it to read a rank's shard of a block straight from the files (See [Note: shards
read from disk] in dlo.host.block_sources), and to view a cache entry's image as it is (See
[Note: shards from the shared entry] in dlo.backend.block_binding)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dlo.host.checkpoint import Checkpoint
from dlo.host.safetensors_file import SafetensorsFile
from dlo.host.tensor_source import MappedTensor, QuantizedSource, TensorSource
from dlo.planning.block_layout import BlockLayout
from dlo.planning.wire_layout import WireLayout


@dataclass(frozen=True)
class ImageSegment:
    """Bytes [image_start, image_start + nbytes) of the image: in `file` from `file_start`,
    or, with `file` None, the bytes of `private` (a tensor the checkpoint does not hold)."""

    image_start: int
    nbytes: int
    file: SafetensorsFile | None = None
    file_start: int = 0
    private: torch.Tensor | None = None


def image_segments(
    tensors: Sequence[torch.Tensor],
    sources: Sequence[MappedTensor | None],
    layout: BlockLayout,
    wire: WireLayout,
    checkpoint: Checkpoint,
) -> tuple[ImageSegment, ...] | None:
    """The segments of the block whose tensors are `tensors`, each from `sources` (None: not
    in the checkpoint), in image order; None when a tensor's bytes in the image are not its
    bytes in a file (a cast, or a weight quantized at enable()). A dim-0 concatenation (See
    dlo.host.tensor_source) is its keys' bytes one after another. A private tensor may be on
    the meta device: its segment then gives sizes, not bytes."""
    quantized = {q.index: q for q in wire.quantized}
    segments: list[ImageSegment] = []
    for index, (tensor, source, placement) in enumerate(zip(tensors, sources, layout.placements)):
        q = quantized.get(index)
        if source is None:
            if q is not None:
                return None
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            segments.append(ImageSegment(placement.offset, placement.spec.nbytes, private=raw))
            continue
        if source.adapters(checkpoint) not in ((), ("concat",)):
            return None
        # (checkpoint key, its dtype in the image, where it starts in the image, its bytes there
        # or None: a piece of a concatenation, whose pieces add up to the placement)
        parts: list[tuple[str, torch.dtype, int, int | None]]
        if isinstance(source, QuantizedSource) and q is not None:
            parts = [
                (source.data_key, q.dtype, wire.plain_bytes + q.data_offset, q.data_bytes),
                (source.scale_key, torch.float32, wire.plain_bytes + q.scale_offset, q.scale_bytes),
            ]
        elif isinstance(source, TensorSource) and q is None:
            parts, at = [], placement.offset
            for key in source.keys:
                parts.append((key, placement.spec.dtype, at, None))
                at += checkpoint.tensors[key].entry.nbytes
            if at - placement.offset != placement.spec.nbytes:
                return None
        else:
            return None
        entries = [checkpoint.tensors[key] for key, _, _, _ in parts]
        if any(
            e.entry.dtype != dtype or nbytes not in (None, e.entry.nbytes) for e, (_, dtype, _, nbytes) in zip(entries, parts)
        ):
            return None
        segments += [ImageSegment(at, e.entry.nbytes, e.file, e.entry.begin) for e, (_, _, at, _) in zip(entries, parts)]
    return tuple(sorted(segments, key=lambda s: s.image_start))
