"""One streamed block: its live tensors, where they sit in the flat layout, its host copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dlo.errors import StreamingError
from dlo.host.block_sources import BlockSource, ShardedSource
from dlo.planning.block_layout import BlockLayout
from dlo.planning.wire_layout import WireLayout


@dataclass(frozen=True)
class Binding:
    """`owner._parameters[key]` (or `_buffers`) must stay `tensor` while dlo streams it."""

    owner: nn.Module
    key: str
    is_parameter: bool
    tensor: torch.Tensor

    def is_intact(self) -> bool:
        table = self.owner._parameters if self.is_parameter else self.owner._buffers
        return table.get(self.key) is self.tensor


@dataclass(frozen=True)
class StreamedBlock:
    name: str
    layout: BlockLayout  # in the slot
    wire: WireLayout  # on the host and the link. See [Note: fp8 streaming]
    tensors: tuple[torch.Tensor, ...]  # unique live tensors, in layout order
    bindings: tuple[Binding, ...]  # every (owner, key) that holds one of them
    source: BlockSource
    placeholders: tuple[torch.Tensor, ...]
    on_host: bool = False  # See [Note: token embeddings looked up on the host]

    @property
    def slot_bytes(self) -> int:
        """The slot memory the block needs: its layout, or in all-gather mode, where an
        unquantized block is gathered straight into its slot, all the padded shards (a float8
        block is gathered into a landing buffer and dequantized into the slot); none for a
        block that looks its rows up on the host (a promoted one has memory of its own)."""
        if self.on_host:
            return 0
        if isinstance(self.source, ShardedSource) and not self.wire.quantized:
            return self.source.shards.padded_bytes
        return self.layout.nbytes

    def restore(self) -> None:
        """Give the block ordinary CPU tensors again (disable(), or a failed enable())."""
        self.point_at(self.source.restored(self.layout, self.wire))

    def point_at(self, views: tuple[torch.Tensor, ...]) -> None:
        for tensor, view in zip(self.tensors, views):
            tensor.data = view

    def check_intact(self) -> None:
        for binding in self.bindings:
            if not binding.is_intact():
                kind = "parameter" if binding.is_parameter else "buffer"
                raise StreamingError(
                    f"{kind} {binding.key!r} of streamed block {self.name!r} was replaced after dlo.enable(); "
                    "dlo streams the tensors it packed. Change their values instead (load_state_dict, "
                    "handle.editing()), or call handle.disable(), replace it, then dlo.enable() again."
                )
