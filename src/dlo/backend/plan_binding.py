"""A `HostWeightPlan` as `enable()` consumes it: the mapping taken from the plan, the planned
tensors bound to stand-ins, the registration of the mapping, and how each step is undone."""

from __future__ import annotations

import torch
from torch import nn

from dlo.backend.mapping_registration import (
    NOT_APPLICABLE,
    RegistrationOutcome,
    register_mapping,
    registration_refused,
    release_mapping,
)
from dlo.config import OffloadConfig
from dlo.errors import EnableError
from dlo.host.host_weight_plan import HostWeightPlan, HostWeights
from dlo.host.registration import HostRegistration, RegistrationCleanupError
from dlo.host.tensor_source import TensorSource, count_adapters
from dlo.planning.adapters import tuner_layers
from dlo.planning.gguf_weights import parameter_like
from dlo.planning.tensor_walk import owned_tensors


class BoundPlan:
    """`weights`: the plan's mapping and bindings, taken exactly once (See [Note: plan
    hand-off]). `planned`: id(runtime tensor) -> its source in the mapping, for every tensor
    the plan covers. `registration`: the mapping's registration outcome, once decided."""

    def __init__(self, host_plan: HostWeightPlan) -> None:
        weights = host_plan.take()
        if weights is None:
            raise EnableError(
                "this HostWeightPlan was already taken by an earlier dlo.enable(); a plan is consumed once. "
                "Load the model again with dlo.load_transformer"
            )
        self.weights: HostWeights = weights
        self.backing = host_plan.backing
        self.planned: dict[int, TensorSource] = {}
        self.registration: RegistrationOutcome = NOT_APPLICABLE
        self._stand_ins: dict[int, torch.Tensor] = {}  # id -> stand-in still to be given a value on rollback
        self._cleanup_pending: HostRegistration | None = None  # a rollback that failed: the mapping stays

    @property
    def direct(self) -> bool:
        """The mapping is registered: blocks are copied from it straight into the slots."""
        return self.registration.registration is not None

    def bind(self, module: nn.Module, device: torch.device) -> None:
        """Replace the plan's meta tensors with stand-ins of the runtime shape and dtype (one
        element, broadcast) so they can be repointed. A stand-in's value is never used:
        streamed ones are repointed to slots, the others get their bytes from the mapping
        when they are placed, or in `give_back`."""
        replaced: dict[int, torch.Tensor] = {}  # id(meta tensor) -> stand-in: tied tensors stay tied
        bindings = self.weights.bindings
        for owned in list(owned_tensors(module)):
            source = bindings.get(owned.name)
            if source is None:
                continue
            if id(owned.tensor) not in replaced:
                if owned.tensor.device.type == "meta":
                    data = torch.empty((), dtype=source.dtype, device=device).expand(source.shape)
                    new = parameter_like(owned.tensor, data) if owned.is_parameter else data
                    self._stand_ins[id(new)] = new
                else:  # already a view of the mapping (host weight cache): the same object stays
                    new = owned.tensor
                replaced[id(owned.tensor)] = new
                self.planned[id(new)] = source
            table = owned.owner._parameters if owned.is_parameter else owned.owner._buffers
            table[owned.key] = replaced[id(owned.tensor)]
        missing = set(bindings) - {o.name for o in owned_tensors(module) if id(o.tensor) in self.planned}
        if missing:
            wrapped = next(tuner_layers(module), None) is not None
            raise EnableError(
                f"the HostWeightPlan names tensors this module does not have: {sorted(missing)[:5]}"
                + (
                    "; a PEFT adapter (LoRA) added since dlo.load_transformer() moved them under its layers: load "
                    "LoRAs after dlo.enable(model, device, config, plan=plan) (they stay on the device beside the "
                    "streamed weights)"
                    if wrapped
                    else ""
                )
            )

    def register(self, config: OffloadConfig, device: torch.device) -> None:
        """Register the whole mapping read-only for direct copies, or record why not
        (docs/guides/host-weight-cache.md). Only tensors used in their saved dtype can be
        copied straight from the pages: a mapping with cast adapters is packed on every load
        instead. A concatenation (fused q/k/v, a converter's swapped halves) is copied part by
        part into its rows of the slot. A failed rollback propagates, and `release` then keeps
        the mapping open."""
        casts = count_adapters(self.weights.bindings.values(), self.weights.checkpoint).get("cast", 0)
        if casts:
            self.registration = registration_refused(
                f"{casts} of the {self.backing} tensors are not used in their saved dtype (a cast): each load packs them",
                quiet=True,
            )
            return
        try:
            self.registration = register_mapping(self.weights.checkpoint, config, device)
        except RegistrationCleanupError as err:
            self._cleanup_pending = err.registration
            raise

    def restored_by_blocks(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """These tensors belong to bound blocks, whose own undo gives them their values."""
        for tensor in tensors:
            self._stand_ins.pop(id(tensor), None)

    def give_back(self, module: nn.Module) -> None:
        """Rollback: every planned tensor gets an ordinary private value, so nothing keeps a
        stand-in or a view of the mapping about to close."""
        checkpoint = self.weights.checkpoint
        with torch.no_grad():
            for key, tensor in self._stand_ins.items():
                tensor.data = self.planned[key].materialize(checkpoint)
            for owned in owned_tensors(module):  # a cache plan's tensors view the mapping
                if checkpoint.holds(owned.tensor):
                    owned.tensor.data = owned.tensor.data.clone()

    def release(self) -> list[str]:
        """Unregister, then close the mapping. See [Note: mapping lifetime]"""
        return release_mapping(self.weights.checkpoint, self.registration.registration or self._cleanup_pending)
