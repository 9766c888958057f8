"""Sizes of a plan's blocks and of what stays resident, from shapes alone (works on meta)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dlo.config import OffloadConfig
from dlo.config.offload_config import AUTO
from dlo.planning.adapters import adapter_modules, adapter_tensors
from dlo.planning.block_layout import TensorSpec, plan_block_layout
from dlo.planning.fp8_selection import gemm_linears
from dlo.planning.offload_plan import OffloadPlan, resolve_blocks
from dlo.planning.tensor_walk import unique_tensors


@dataclass(frozen=True)
class BlockSize:
    name: str
    class_name: str
    nbytes: int  # aligned layout size
    on_host: bool = False  # See [Note: token embeddings looked up on the host]

    @property
    def slot_bytes(self) -> int:
        """What one slot must hold for it (and what a call copies): none when it looks up on the host."""
        return 0 if self.on_host else self.nbytes


@dataclass(frozen=True)
class PlanSummary:
    class_name: str
    plan: OffloadPlan
    blocks: tuple[BlockSize, ...]  # execution order
    resident_blocks: int
    non_block_bytes: int  # embeddings, norms, heads: always on the device
    num_slots: int

    @property
    def streamed(self) -> tuple[BlockSize, ...]:
        return self.blocks[self.resident_blocks :]

    @property
    def largest_block(self) -> BlockSize | None:
        """The streamed block the slots are sized for."""
        return max(self.streamed, key=lambda b: b.slot_bytes, default=None)

    @property
    def streamed_bytes(self) -> int:
        """What a call copies to the device."""
        return sum(b.slot_bytes for b in self.streamed)

    @property
    def device_weight_bytes(self) -> int:
        """Non-block parts + resident blocks + slots: the weights dlo keeps on the device."""
        slot = self.largest_block.slot_bytes if self.largest_block else 0
        resident = sum(b.nbytes for b in self.blocks[: self.resident_blocks])
        return self.non_block_bytes + resident + self.num_slots * slot

    @property
    def total_bytes(self) -> int:
        return self.non_block_bytes + sum(b.nbytes for b in self.blocks)


def _layout_bytes(module: nn.Module, gemms: dict[int, nn.Linear]) -> int:
    """A block's slot layout; `gemms` (id(weight) -> Linear): weights held as float8 plus a
    (1, out) fp32 scale row. See [Note: fp8 compute]"""
    specs = []
    for owned in unique_tensors(module, adapter_modules(module)).values():
        tensor = owned.tensor
        linear = gemms.get(id(tensor))
        dtype = tensor.dtype if linear is None else torch.float8_e4m3fn
        specs.append(TensorSpec(owned.name, tuple(tensor.shape), dtype))
        if linear is not None:
            specs.append(TensorSpec(f"{owned.name}_scale", (1, linear.out_features), torch.float32))
    return plan_block_layout(specs).nbytes


def summarize(module: nn.Module, plan: OffloadPlan, config: OffloadConfig | None = None) -> PlanSummary:
    config = config or OffloadConfig()
    refs = resolve_blocks(module, plan)
    in_blocks = frozenset(id(sub) for ref in refs for sub in ref.module.modules())
    # The non-block parts (less those tied to a block's tensor: they stream with it), and the
    # adapters inside the blocks: See [Note: adapters stay resident]
    block_tensors = {id(t) for ref in refs for t in (*ref.module.parameters(), *ref.module.buffers())}
    rest = [
        *(o for o in unique_tensors(module, in_blocks).values() if id(o.tensor) not in block_tensors),
        *(o for r in refs for o in adapter_tensors(r.module)),
    ]
    resident = 0 if config.resident_layers == AUTO else min(config.resident_layers, len(refs))
    gemms = {id(linear.weight): linear for _, linear in gemm_linears(module, refs[resident:], config)}
    return PlanSummary(
        class_name=type(module).__name__,
        plan=plan,
        blocks=tuple(BlockSize(r.name, type(r.module).__name__, _layout_bytes(r.module, gemms), r.on_host) for r in refs),
        resident_blocks=resident,
        non_block_bytes=sum(o.tensor.numel() * o.tensor.element_size() for o in rest),
        num_slots=config.num_slots,
    )
