"""`dlo.enable_pipeline`: stream a diffusers pipeline's transformer(s), place the rest."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from dlo.backend.device import resolve_device
from dlo.backend.enable import enable
from dlo.backend.handle import OffloadHandle
from dlo.config import OffloadConfig
from dlo.errors import ConfigError
from dlo.host.host_weight_plan import HostWeightPlan
from dlo.observe.stats import OffloadStats

# Components dlo streams. Wan 2.2 carries a second transformer for the low-noise steps.
STREAMED_COMPONENTS = ("transformer", "transformer_2")


@dataclass
class PipelineHandle:
    """handles: one per streamed transformer. placement: where every other module went
    ("device", or "cpu offload": moved to the device only while it runs)."""

    handles: dict[str, OffloadHandle]
    placement: dict[str, str]
    _offload_hooks: list = field(default_factory=list, repr=False)

    def stats(self) -> dict[str, OffloadStats]:
        return {name: handle.stats() for name, handle in self.handles.items()}

    def disable(self) -> None:
        """Undo dlo on every transformer; idempotent. Other components stay where they are."""
        for hook in self._offload_hooks:
            hook.remove()
        self._offload_hooks.clear()
        for handle in self.handles.values():
            handle.disable()

    def __enter__(self) -> PipelineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disable()


def _module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def enable_pipeline(
    pipe: object,
    device: str | torch.device,
    config: OffloadConfig | None = None,
    plans: Mapping[str, HostWeightPlan | None] | None = None,
    reserve_gib: float = 4.0,
) -> PipelineHandle:
    """Stream `pipe.transformer` (and `pipe.transformer_2`) with dlo; move the other modules
    (text encoders, VAE) to `device` when they fit in its free memory minus `reserve_gib`
    (room for activations), else attach accelerate's CPU offload to them so each visits the
    device only while it runs. `plans` maps a component name to the HostWeightPlan
    `dlo.load_transformer` returned for it."""
    device = resolve_device(device)
    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        raise ConfigError(f"{type(pipe).__name__} is not a diffusers pipeline (no .components)")
    streamed = [name for name in STREAMED_COMPONENTS if isinstance(components.get(name), nn.Module)]
    if not streamed:
        raise ConfigError(
            f"{type(pipe).__name__} has no transformer component; dlo streams diffusion transformers (DiT), "
            "not UNets"
        )
    plans = plans or {}
    handles: dict[str, OffloadHandle] = {}
    placement: dict[str, str] = {}
    hooks = []
    try:
        for name in streamed:
            handles[name] = enable(components[name], device, config, plan=plans.get(name))
        for name, module in components.items():
            if name in streamed or not isinstance(module, nn.Module):
                continue
            if device.type == "cpu":
                placement[name] = "device"
                continue
            free, _ = torch.cuda.mem_get_info(device)
            if _module_bytes(module) < free - reserve_gib * 2**30:
                module.to(device)
                placement[name] = "device"
            else:
                from accelerate import cpu_offload_with_hook

                _, hook = cpu_offload_with_hook(module, device)
                hooks.append(hook)
                placement[name] = "cpu offload"
    except BaseException:
        for hook in hooks:
            hook.remove()
        for handle in handles.values():
            handle.disable()
        raise
    return PipelineHandle(handles, placement, hooks)
