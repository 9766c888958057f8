"""`dlo.enable_pipeline`: stream a diffusers pipeline's transformer(s) (and, asked, other
components with repeated blocks), place the rest."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from torch import nn

from dlo.backend.decode_peak import OutputSize, apply_decode, decode_costs, default_size
from dlo.backend.device import resolve_device
from dlo.backend.enable import enable
from dlo.backend.handle import HandleState, OffloadHandle
from dlo.config import OffloadConfig
from dlo.errors import ConfigError, DiscoveryError
from dlo.host.host_weight_plan import HostWeightPlan
from dlo.observe.stats import OffloadStats
from dlo.planning.adapters import tuner_layers
from dlo.planning.offload_plan import OffloadPlan, discover, with_single_blocks
from dlo.planning.pipeline_budget import GIB, ComponentCost, PipelinePlan, Placement, plan_pipeline
from dlo.planning.plan_summary import summarize

# Components dlo streams. Wan 2.2 carries a second transformer for the low-noise steps.
STREAMED_COMPONENTS = ("transformer", "transformer_2")
# Under a pipeline budget, a streamed encoder's non-block modules of this size or more stream as
# blocks of their own; a token embedding (UMT5-XXL's is 2.1 GB) looks its rows up on the host.
# See [Note: pipeline budget]
SINGLE_BLOCK_BYTES = 64 * 2**20


@dataclass
class PipelineHandle:
    """handles: one per streamed component (the transformers, and those named in
    `components`). placement: where every other module went ("device", "streamed" by dlo, or
    "cpu offload": moved to the device only while it runs). plan: under `hbm_budget_gib`, the
    whole pipeline's plan (See [Note: pipeline budget])."""

    handles: dict[str, OffloadHandle]
    placement: dict[str, str]
    _offload_hooks: list = field(default_factory=list, repr=False)
    _pipe: object = field(default=None, repr=False)
    plan: PipelinePlan | None = None
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def stats(self) -> dict[str, OffloadStats]:
        return {name: handle.stats() for name, handle in self.handles.items()}

    def fuse_lora(
        self,
        components: Sequence[str] | None = None,
        lora_scale: float = 1.0,
        safe_fusing: bool = False,
        adapter_names: list[str] | None = None,
    ) -> None:
        """diffusers' `pipe.fuse_lora()` for a pipeline under dlo: the streamed components fuse
        through their handles (`OffloadHandle.fuse_lora`), any other component named in
        `components` (default: the streamed ones) through diffusers; `pipe.fused_loras`
        follows. While enabled, `pipe.fuse_lora()` is this, with diffusers' defaults. See
        [Note: fusing LoRA into streamed blocks]"""
        streamed, others = self._split(components)
        if others or not streamed:  # an empty list: diffusers' own refusal
            type(self._pipe).fuse_lora(
                self._pipe, components=others, lora_scale=lora_scale, safe_fusing=safe_fusing, adapter_names=adapter_names
            )
        for name in streamed:
            self.handles[name].fuse_lora(lora_scale, safe_fusing, adapter_names)
        self._pipe._merged_adapters = self._pipe._merged_adapters | _merged(self.handles[name].module for name in streamed)

    def unfuse_lora(self, components: Sequence[str] | None = None) -> None:
        """diffusers' `pipe.unfuse_lora()` for a pipeline under dlo (see `fuse_lora`). The
        streamed components unfuse through their handles first, one block at a time; then
        diffusers' own runs for every component it loads LoRAs into (it finds them unmerged, and
        does what else its pipeline does: Flux's puts back the norm layers a control LoRA
        replaced)."""
        streamed, others = self._split(components)
        for name in streamed:
            self.handles[name].unfuse_lora()
        loadable = getattr(self._pipe, "_lora_loadable_modules", ())
        names = [n for n in streamed if n in loadable] + others
        if names or not streamed:
            type(self._pipe).unfuse_lora(self._pipe, components=names)
        loaded = (m for m in self._pipe.components.values() if isinstance(m, nn.Module))
        self._pipe._merged_adapters = self._pipe._merged_adapters & _merged(loaded)

    def _route_lora_fusion(self) -> None:
        """Until disable(), the pipeline's own `fuse_lora()` / `unfuse_lora()` are this handle's,
        with diffusers' arguments and defaults: diffusers merges a text encoder's layers (a
        transformers model, with no fuse_lora of its own for dlo to take over) in place, which
        a streamed one's stand-ins refuse. See [Note: fusing LoRA into streamed blocks]"""
        pipe = self._pipe
        for name, route in (("fuse_lora", self.fuse_lora), ("unfuse_lora", self.unfuse_lora)):
            original = getattr(type(pipe), name, None)
            if not callable(original):  # a pipeline without LoRA support
                continue
            parameters = inspect.signature(original).parameters
            wanted = [p for p in inspect.signature(route).parameters if p in parameters]
            self._undo.append(partial(pipe.__dict__.pop, name, None))  # first: disable() undoes a partial route
            pipe.__dict__[name] = partial(_with_defaults, route, original, pipe, tuple(wanted))

    def _route_saves(self) -> None:
        """Until disable(), the pipeline's own `save_pretrained()` first checks every streamed
        component's save (what it would refuse), so none is refused after the others were
        written. See [Note: saving a streamed model]"""
        self._undo.append(partial(self._pipe.__dict__.pop, "save_pretrained", None))
        self._check_saves()

    def _route_norm_loads(self) -> None:
        """Until disable(), diffusers' loading of a Flux control LoRA's norm layers (which keeps
        copies of the transformer's `state_dict()` values, to put back on unfuse or unload) reads
        the streamed blocks' values. See [Note: saving a streamed model]"""
        pipe = self._pipe
        original = getattr(type(pipe), "_load_norm_into_transformer", None)
        if callable(original):
            self._undo.append(partial(pipe.__dict__.pop, "_load_norm_into_transformer", None))
            pipe.__dict__["_load_norm_into_transformer"] = partial(_norms_with_real_values, self.handles, original)

    def _check_saves(self) -> None:
        pipe = self._pipe
        original = getattr(type(pipe), "save_pretrained", None)
        if callable(original):
            checked = partial(_checked_save, list(self.handles.values()), original, pipe)
            checked.__signature__ = inspect.signature(original.__get__(pipe))  # type: ignore[attr-defined]
            pipe.__dict__["save_pretrained"] = checked

    def _split(self, components: Sequence[str] | None) -> tuple[list[str], list[str]]:
        names = list(self.handles) if components is None else list(components)
        return [n for n in names if n in self.handles], [n for n in names if n not in self.handles]

    def disable(self, restore: bool = True) -> None:
        """Undo dlo on every streamed component; idempotent. Other components stay where they
        are. `restore=False`: the streamed components get no weights back (see
        OffloadHandle.disable)."""
        for hook in self._offload_hooks:
            hook.remove()
        self._offload_hooks.clear()
        while self._undo:
            self._undo.pop()()
        for handle in self.handles.values():
            handle.disable(restore)
        if not restore:  # the streamed components hold no weights: the pipeline's save is refused whole
            self._check_saves()

    def __enter__(self) -> PipelineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disable()


def _with_defaults(route: Callable, original: Callable, pipe: object, wanted: tuple[str, ...], *args, **kwargs) -> None:
    """`route` called with the arguments named `wanted` of a call of diffusers' `original`, its
    defaults filled in; any other keyword (diffusers' deprecated ones, which it only warns about)
    is dropped."""
    bound = inspect.signature(original).bind(pipe, *args, **kwargs)
    bound.apply_defaults()
    route(**{name: bound.arguments[name] for name in wanted})


def _norms_with_real_values(handles: dict[str, OffloadHandle], original: Callable, state_dict: dict, transformer: nn.Module,
                            *args, **kwargs) -> object:
    handle = next((h for h in handles.values() if h.module is transformer), None)
    with handle.real_state_dict() if handle is not None else contextlib.nullcontext():
        return original(state_dict, transformer, *args, **kwargs)


def _checked_save(handles: list[OffloadHandle], original: Callable, pipe: object, *args, **kwargs) -> object:
    for handle in handles:
        handle.check_save()
    return original(pipe, *args, **kwargs)


def _merged(modules: Iterable[nn.Module]) -> set[str]:
    """The adapters merged into some PEFT layer of `modules` (what diffusers' pipeline reports
    as `fused_loras`)."""
    return {name for module in modules for _, layer in tuner_layers(module) for name in layer.merged_adapters}


def _module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


AUTO = "auto"  # components: stream the other components that do not fit and have repeated blocks


def _streamable(module: nn.Module) -> bool:
    try:
        discover(module)
    except DiscoveryError:
        return False
    return True


def named_components(pipe: object, components: Sequence[str] | str) -> list[str]:
    """The components `components` names to stream beside the transformers (none for "auto"),
    each checked: on `pipe` itself, or on its twin built on the meta device before any weight
    loads (dlo generate and serve)."""
    found = getattr(pipe, "components", None) or {}
    others = {n: m for n, m in found.items() if n not in STREAMED_COMPONENTS and isinstance(m, nn.Module)}
    return [] if components == AUTO else _named_components(components, others)


def _named_components(components: Sequence[str] | str, others: Mapping[str, nn.Module]) -> list[str]:
    """The explicitly named components to stream, each checked before anything is enabled."""
    if isinstance(components, str):
        raise ConfigError(f"components must be a list of component names or {AUTO!r}, got {components!r}")
    named = list(components)
    for name in named:
        if name not in others:
            raise ConfigError(
                f"components names {name!r}, which is not a module component of this pipeline besides its "
                f"transformer(s); its other components: {sorted(others)}"
            )
        if not _streamable(others[name]):
            raise ConfigError(
                f"component {name!r} ({type(others[name]).__name__}) has no repeated blocks for dlo to stream; "
                "leave it out of components (it is then placed on the device or CPU-offloaded)"
            )
    return named


def _component_config(config: OffloadConfig | None) -> OffloadConfig:
    """What a streamed text encoder (or other non-transformer component) streams with: the
    transport options of `config` (slots, pinning, pack threads), nothing that plans the
    transformer (fp8, residency, the host budget)."""
    config = config or OffloadConfig()
    return OffloadConfig(num_slots=config.num_slots, pin_memory=config.pin_memory, pack_threads=config.pack_threads)


def enable_pipeline(
    pipe: object,
    device: str | torch.device,
    config: OffloadConfig | None = None,
    plans: Mapping[str, HostWeightPlan | None] | None = None,
    reserve_gib: float = 4.0,
    components: Sequence[str] | str = (),
    size: OutputSize | None = None,
) -> PipelineHandle:
    """Stream `pipe.transformer` (and `pipe.transformer_2`) with dlo; move the other modules
    (text encoders, VAE) to `device` while they fit, in component order, else attach
    accelerate's CPU offload to them so each visits the device only while it runs. They fit in
    the device's free memory minus `reserve_gib` (room for activations); with
    `resident_layers="auto"`, in the same budget as the transformers' (see [Note: residency
    budget]) minus what streaming them needs and `reserve_gib`: the blocks then get what the
    other components leave, since their plan measures the whole process's peak. `plans` maps a
    component name to the HostWeightPlan `dlo.load_transformer` returned for it.

    `components`: other components dlo streams block by block too (text encoders: T5, UMT5,
    CLIP...; any module with repeated blocks), with `config`'s slots and pinning only; or
    "auto": those of them that do not fit, instead of accelerate's CPU offload (a component
    without repeated blocks is still CPU-offloaded). Their handles and stats sit beside the
    transformers' (placement "streamed").

    With `config.hbm_budget_gib` (and `resident_layers="auto"`), one plan for the whole call
    within that budget, made before anything moves (See [Note: pipeline budget]): every
    component on the device when all fit, else the transformers and every other component with
    repeated blocks streamed, the VAE decoding whole, sliced or tiled as its predicted peak for
    `size` (default: the pipeline's default output size) allows, and the transformers' residency
    within what is left. `reserve_gib` then stands for the transformers' and encoders'
    activations when deciding whether everything fits. `handle.plan` holds the plan."""
    device = resolve_device(device)
    found = getattr(pipe, "components", None)
    if not isinstance(found, dict):
        raise ConfigError(f"{type(pipe).__name__} is not a diffusers pipeline (no .components)")
    transformers = [name for name in STREAMED_COMPONENTS if isinstance(found.get(name), nn.Module)]
    if not transformers:
        raise ConfigError(
            f"{type(pipe).__name__} has no transformer component; dlo streams diffusion transformers (DiT), "
            "not UNets"
        )
    plans = plans or {}
    others = {name: m for name, m in found.items() if name not in transformers and isinstance(m, nn.Module)}
    named = named_components(pipe, components)
    handle = PipelineHandle({}, {}, _pipe=pipe)
    if config is not None and config.hbm_budget_gib is not None:
        size = size or default_size(pipe)
        handle.plan = pipeline_plan(pipe, config, size, plans, reserve_gib, named)
    moved: list[Callable[[], object]] = []  # under a plan: what moves the components placed on the device back
    try:
        if handle.plan is None:
            _place_by_room(handle, found, transformers, others, named, device, config, plans, reserve_gib, components)
        else:
            _place_by_plan(handle, handle.plan, found, transformers, device, config, plans, size, moved)
        handle._route_lora_fusion()
        handle._route_saves()
        handle._route_norm_loads()
    except BaseException:
        handle.disable()
        while moved:
            moved.pop()()
        raise
    return handle


def _place_by_room(
    handle: PipelineHandle,
    found: Mapping[str, nn.Module],
    transformers: list[str],
    others: Mapping[str, nn.Module],
    named: list[str],
    device: torch.device,
    config: OffloadConfig | None,
    plans: Mapping[str, HostWeightPlan | None],
    reserve_gib: float,
    components: Sequence[str] | str,
) -> None:
    """Without a pipeline budget: the transformers (and `named`) streamed, the others on the
    device while they fit the room left, else streamed ("auto") or CPU-offloaded."""
    handles = handle.handles
    for name in transformers:
        handles[name] = enable(found[name], device, config, plan=plans.get(name))
    for name in named:
        handles[name] = enable(others[name], device, _component_config(config))
    rest = {name: m for name, m in others.items() if name not in named}
    if device.type == "cpu":
        placement = dict.fromkeys(rest, "device")
    else:
        room = _room(handles, device) - int(reserve_gib * GIB)
        placement = place_within({name: _module_bytes(m) for name, m in rest.items()}, room)
    handle.placement = placement
    for name, where in placement.items():
        if where == "device":
            rest[name].to(device)
        elif components == AUTO and _streamable(rest[name]):
            handles[name] = enable(rest[name], device, _component_config(config))
            placement[name] = "streamed"
        else:
            from accelerate import cpu_offload_with_hook

            _, hook = cpu_offload_with_hook(rest[name], device)
            handle._offload_hooks.append(hook)
    placement |= dict.fromkeys(named, "streamed")


def _encoder_plan(module: nn.Module) -> OffloadPlan:
    """How a component that runs once per call streams under a pipeline budget: its blocks, and
    its large non-block modules as blocks of their own. See [Note: pipeline budget]"""
    return with_single_blocks(module, discover(module), SINGLE_BLOCK_BYTES)


def _streamed_bytes(module: nn.Module, config: OffloadConfig, once_per_call: bool = False) -> int | None:
    """What streaming `module` keeps on the device (non-block parts + slots), from shapes alone;
    None without repeated blocks."""
    try:
        offload_plan = _encoder_plan(module) if once_per_call else discover(module)
    except DiscoveryError:
        return None
    summary = summarize(module, offload_plan, config)
    if not once_per_call:
        return summary.device_weight_bytes
    # Its slots are given back after enable() and taken per block size (See [Note: slots per
    # size class]): at once they hold at most its `num_slots` largest blocks.
    largest = sorted((block.slot_bytes for block in summary.streamed), reverse=True)[: summary.num_slots]
    return summary.non_block_bytes + sum(largest)


def pipeline_plan(
    pipe: object,
    config: OffloadConfig,
    size: OutputSize | None = None,
    plans: Mapping[str, HostWeightPlan | None] | None = None,
    reserve_gib: float = 4.0,
    named: Sequence[str] = (),
) -> PipelinePlan:
    """The whole pipeline's plan under config.hbm_budget_gib (See [Note: pipeline budget]), from
    shapes alone: `pipe` may hold meta modules (dlo inspect, dlo generate before loading).
    `named`: components (or transformers) to stream whatever the plan would choose."""
    found = pipe.components
    transformers = [name for name in STREAMED_COMPONENTS if isinstance(found.get(name), nn.Module)]
    others = {name: m for name, m in found.items() if name not in transformers and isinstance(m, nn.Module)}
    plans = plans or {}
    costs = [
        ComponentCost(name, _module_bytes(found[name]), _streamed_bytes(found[name], config), every_step=True)
        for name in transformers
    ]
    component_config = _component_config(config)
    # The VAE's decoder runs its blocks once per latent frame and per tile: streamed, it would copy
    # them that many times per decode. Its weights are small next to the decode's activations. It
    # streams when `components` names it.
    costs += [
        ComponentCost(
            name,
            _module_bytes(m),
            None if name == "vae" and name not in named else _streamed_bytes(m, component_config, once_per_call=name != "vae"),
            before_steps=name != "vae",
        )
        for name, m in others.items()
    ]
    # A transformer mapped from its checkpoint has no private weights to move: it streams.
    must_stream = frozenset(named) | {name for name in transformers if plans.get(name) is not None}
    budget = int(config.hbm_budget_gib * GIB)
    return plan_pipeline(budget, costs, decode_costs(pipe, size or default_size(pipe)), int(reserve_gib * GIB), must_stream)


def _place_by_plan(
    handle: PipelineHandle,
    plan: PipelinePlan,
    found: Mapping[str, nn.Module],
    transformers: list[str],
    device: torch.device,
    config: OffloadConfig,
    plans: Mapping[str, HostWeightPlan | None],
    size: OutputSize,
    moved: list[Callable[[], object]],
) -> None:
    # The transformers streamed are reported by their handles, as without a budget.
    handle.placement = {
        name: where.value
        for name, where in plan.placement.items()
        if not (name in transformers and where is Placement.STREAMED)
    }
    planned_transformers = sum(
        _streamed_bytes(found[name], config) or 0 for name in transformers if plan.placement[name] is Placement.STREAMED
    )
    for name, where in plan.placement.items():
        module = found[name]
        if where is Placement.DEVICE:
            parameter = next(module.parameters(), None)
            if parameter is not None:  # back where it was if a later component fails
                moved.append(partial(module.to, parameter.device))
            module.to(device)
        elif name in transformers:
            residency = replace(config, hbm_budget_gib=plan.transformer_budget_bytes / GIB)
            streamed = handle.handles[name] = enable(module, device, residency, plan=plans.get(name))
            streamed.hold_beside(partial(_beside, plan, handle.handles, streamed, planned_transformers))
        else:
            encoder_plan = _encoder_plan(module) if name in plan.released else None
            handle.handles[name] = enable(module, device, _component_config(config), plan=encoder_plan)
    released = [handle.handles[name] for name in plan.released]
    if released:  # their slots go back now and when a transformer starts: See [Note: pipeline budget]
        give_back = torch.compiler.disable(partial(_release_slots, released))
        for name in transformers:
            handle._offload_hooks.append(found[name].register_forward_pre_hook(give_back))
        give_back(None, ())
    apply_decode(found.get("vae"), plan.decode.mode, size.batch, handle._undo)


def _beside(plan: PipelinePlan, handles: Mapping[str, OffloadHandle], own: OffloadHandle, planned: int) -> int:
    """What the decode's or the encoders' phase holds beside `own`'s non-block parts, asked when
    its residency is planned: the plan's figure with the streamed transformers' planned bytes
    replaced by what they hold then (another's resident blocks, landing buffers), less `own`'s
    slots, which its residency chooses."""
    held = sum(
        h.device_bytes() for name, h in handles.items() if name in STREAMED_COMPONENTS and h.state is HandleState.ENABLED
    )  # one disabled by hand holds its weights as a plain module, which the plan did not count: a caller's choice
    return plan.other_phase_bytes - planned + held - own._runtime.slot_bytes


def _release_slots(handles: list[OffloadHandle], module: nn.Module | None, args: tuple) -> None:
    for released in handles:
        if released.state is HandleState.ENABLED:  # one disabled by hand stays as it is
            released.release_slots()


def place_within(sizes: Mapping[str, int], room: int) -> dict[str, str]:
    """"device" for each component that fits in what the ones placed before it left of
    `room` bytes, else "cpu offload"."""
    placement = {}
    for name, nbytes in sizes.items():
        placement[name] = "device" if nbytes < room else "cpu offload"
        room -= nbytes if placement[name] == "device" else 0
    return placement


def _room(handles: Mapping[str, OffloadHandle], device: torch.device) -> int:
    """Bytes the other components may take: the residency budget less what streaming the
    transformers takes now (they were enabled first), or else the device's free memory."""
    budgets = [h.residency_budget for h in handles.values() if h.residency_budget is not None]
    if not budgets:
        return torch.cuda.mem_get_info(device)[0]
    return min(budgets) - torch.cuda.memory_allocated(device)
