"""Where a cache entry's tensors lie in its files: each streamed block's as its wire image.

[Note: one copy per block]
A registered mapping is copied straight into the slot (or, with float8 weights, the landing
buffer). Copied tensor by tensor, a block costs one copy per tensor, and the small ones
(biases, norms, float8 scales) cost more in per-copy overhead than in bytes. So an entry
stores each block's tensors at exactly the offsets its wire image has (the slot layout, then
the float8 data and scales: See [Note: fp8 streaming]), the block starting 512-aligned, the
gaps padded. `coalesced` then finds that the block's copies lie at the same distances in the
mapping and in the slot, and merges them into one copy. (Gaps are copied too: under 512
bytes, inside the registered pages, and unused in the slot.) The layout's version is part of
the entry's identity (LAYOUT_VERSION): an entry laid out otherwise has another key, and is
never read as laid out so.
Tensors stay named tensors of ordinary safetensors files: warm starts, resident blocks and
the staged path read them by name as before.
"""

from __future__ import annotations

from torch import nn

from dlo.config import OffloadConfig
from dlo.host.cache.fp8_entry import scale_name
from dlo.planning.adapters import adapter_modules
from dlo.planning.block_layout import ALIGNMENT, TensorSpec
from dlo.planning.fp8_selection import fp8_format, quantized_tensors
from dlo.planning.offload_plan import discover, resolve_blocks
from dlo.planning.tensor_walk import unique_tensors
from dlo.planning.wire_layout import plan_wire_layout

# 1: blocks as their wire images; 2: and FILE_TAIL_BYTES of padding closing every file.
# Bump it with any change to where an entry puts its bytes.
LAYOUT_VERSION = 2
# See [Note: shards from the shared entry]
MAX_GATHER_RANKS = 64
FILE_TAIL_BYTES = MAX_GATHER_RANKS * ALIGNMENT


def block_images(model: nn.Module, config: OffloadConfig) -> list[dict[str, int]]:
    """Per block of the model's plan, the byte offset of each of its entry tensors (by name)
    in the block's wire image, as `dlo.enable` lays the block out for this config."""
    fp8 = fp8_format(config)
    images = []
    for ref in resolve_blocks(model, discover(model)):
        owned = list(unique_tensors(ref.module, adapter_modules(ref.module)).values())
        chosen = quantized_tensors(model, ref, config) if fp8 is not None else frozenset()
        formats = [fp8 if id(o.tensor) in chosen else None for o in owned]
        layout, wire = plan_wire_layout([TensorSpec(o.name, tuple(o.tensor.shape), o.tensor.dtype) for o in owned], formats)
        image = {f"{ref.name}.{o.name}": p.offset for o, p, fmt in zip(owned, layout.placements, formats) if fmt is None}
        for q in wire.quantized:
            name = f"{ref.name}.{owned[q.index].name}"
            image[name] = wire.plain_bytes + q.data_offset
            image[scale_name(name)] = wire.plain_bytes + q.scale_offset
        images.append(image)
    return images
