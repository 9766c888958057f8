"""The loader's hand-off to the backend: which runtime tensors come from which host bytes.

[Note: plan hand-off]
A `HostWeightPlan` means the loader *skipped* materializing the planned tensors: they are
meta tensors in the model until `dlo.enable(..., plan=plan)` takes the plan and binds them to
the checkpoint mapping. The plan is taken exactly once (`take()` returns None afterwards),
so two backends can never share or re-consume one mapping. A model whose plan is never
consumed has no weights for those tensors, and every use fails loudly (meta tensors);
nothing ever runs on uninitialized memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dlo.host.checkpoint import Checkpoint
from dlo.host.tensor_source import TensorSource, count_adapters
from dlo.planning.offload_plan import OffloadPlan


@dataclass(frozen=True)
class HostWeights:
    """What `take()` hands over: the open mapping and a source for every planned tensor."""

    checkpoint: Checkpoint
    bindings: Mapping[str, TensorSource]  # runtime name (state_dict key) -> source


class HostWeightPlan:
    """backing: "checkpoint_mmap". source_prefixes: the runtime name prefixes the plan covers
    (the block lists). requires_backend: True when the model cannot run without the backend
    consuming this plan."""

    def __init__(
        self,
        backing: str,
        offload_plan: OffloadPlan,
        checkpoint: Checkpoint,
        bindings: Mapping[str, TensorSource],
    ) -> None:
        self.backing = backing
        self.offload_plan = offload_plan
        self.source_prefixes = tuple(f"{path}." for path in offload_plan.block_lists)
        self.requires_backend = True
        self.bindings = dict(bindings)
        self._weights: HostWeights | None = HostWeights(checkpoint, self.bindings)

    @property
    def taken(self) -> bool:
        return self._weights is None

    def adapter_counts(self) -> dict[str, int]:
        """Tensors per adapter (empty once taken: the mapping belongs to the backend)."""
        weights = self._weights
        return {} if weights is None else count_adapters(self.bindings.values(), weights.checkpoint)

    def peek(self) -> HostWeights | None:
        """The mapping and bindings while the plan is pending, without taking them (to plan
        from before anything is bound); None once taken."""
        return self._weights

    def take(self) -> HostWeights | None:
        """The mapping and bindings, the first time; None ever after. See [Note: plan hand-off]"""
        weights, self._weights = self._weights, None
        return weights

    def __repr__(self) -> str:
        state = "taken" if self.taken else "pending"
        return f"HostWeightPlan({self.backing}, {len(self.bindings)} tensors, {state})"
