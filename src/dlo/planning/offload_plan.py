"""Which blocks of a module stream: declared plans for known diffusers transformers, and
auto-discovery of repeated blocks for any other module."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from torch import nn

from dlo.errors import DiscoveryError

logger = logging.getLogger(__name__)

_DOUBLE_THEN_SINGLE = ("transformer_blocks", "single_transformer_blocks")

# Class name -> block lists in execution order. Matched along the MRO, so subclasses inherit.
DECLARED_BLOCK_LISTS: dict[str, tuple[str, ...]] = {
    "WanTransformer3DModel": ("blocks",),
    "SkyReelsV2Transformer3DModel": ("blocks",),
    "FluxTransformer2DModel": _DOUBLE_THEN_SINGLE,
    "Flux2Transformer2DModel": _DOUBLE_THEN_SINGLE,
    "ChromaTransformer2DModel": _DOUBLE_THEN_SINGLE,
    "HunyuanVideoTransformer3DModel": _DOUBLE_THEN_SINGLE,
    "HunyuanVideo15Transformer3DModel": ("transformer_blocks",),
    "SD3Transformer2DModel": ("transformer_blocks",),
    "QwenImageTransformer2DModel": ("transformer_blocks",),
    "LTXVideoTransformer3DModel": ("transformer_blocks",),
    "LTX2VideoTransformer3DModel": ("transformer_blocks",),
    "CogVideoXTransformer3DModel": ("transformer_blocks",),
    "MochiTransformer3DModel": ("transformer_blocks",),
    "CosmosTransformer3DModel": ("transformer_blocks",),
    "SanaTransformer2DModel": ("transformer_blocks",),
    "HiDreamImageTransformer2DModel": ("double_stream_blocks", "single_stream_blocks"),
    "AuraFlowTransformer2DModel": ("joint_transformer_blocks", "single_transformer_blocks"),
}


@dataclass(frozen=True)
class OffloadPlan:
    """The blocks to stream, as dotted paths of `nn.ModuleList`s in execution order; a path
    naming a single module (with a forward and parameters of its own, none in submodules)
    streams it as one block.

    resident_eligible: the lists whose blocks `resident_layers` may keep on the device
        (None: all of them). source: "declared", "auto" or "user", for reports. host_lookups:
    single-module blocks (plain `nn.Embedding`s) that never cross the link: they look up their
        rows in their host copy (See [Note: token embeddings looked up on the host]).
    """

    block_lists: tuple[str, ...]
    resident_eligible: tuple[str, ...] | None = None
    source: str = "user"
    host_lookups: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.block_lists, str) or not self.block_lists:
            raise DiscoveryError(
                f"OffloadPlan.block_lists must be a non-empty tuple of dotted paths, got {self.block_lists!r}"
            )
        if len(set(self.block_lists)) != len(self.block_lists):
            raise DiscoveryError(f"OffloadPlan.block_lists names a list twice: {self.block_lists!r}")
        for outer in self.block_lists:
            for inner in self.block_lists:
                if inner.startswith(outer + "."):
                    raise DiscoveryError(f"OffloadPlan.block_lists: {inner!r} lies inside {outer!r}; name one of them")
        for field_name in ("resident_eligible", "host_lookups"):
            unknown = set(getattr(self, field_name) or ()) - set(self.block_lists)
            if unknown:
                raise DiscoveryError(
                    f"OffloadPlan.{field_name} names {sorted(unknown)} which are not in block_lists {self.block_lists!r}"
                )

    def is_resident_eligible(self, list_path: str) -> bool:
        return self.resident_eligible is None or list_path in self.resident_eligible


@dataclass(frozen=True)
class BlockRef:
    """One streamable block: its dotted name in the root module and the list it belongs to.
    `on_host`: it looks its rows up in its host copy (See [Note: token embeddings looked up on
    the host])."""

    name: str
    list_path: str
    module: nn.Module
    on_host: bool = False


def _declared_lists(module: nn.Module) -> tuple[str, tuple[str, ...]] | None:
    for cls in type(module).__mro__:
        if cls.__name__ in DECLARED_BLOCK_LISTS:
            return cls.__name__, DECLARED_BLOCK_LISTS[cls.__name__]
    return None


def _runs_as_a_module(cls: type[nn.Module]) -> bool:
    """Whether calling an instance runs a forward of its own. Containers (ModuleList,
    ModuleDict) have none: their items are unpacked and called one by one, so hooks on the
    container never fire. See [Note: blocks used outside their call]"""
    return cls.forward is not nn.Module.forward


def _is_block_list(candidate: nn.Module) -> bool:
    children = list(candidate.children()) if isinstance(candidate, nn.ModuleList) else []
    return (
        len(children) >= 2
        and len({type(child) for child in children}) == 1
        and _runs_as_a_module(type(children[0]))
        and all(any(True for _ in child.parameters()) for child in children)
    )


def _auto_lists(module: nn.Module) -> tuple[str, ...]:
    found: list[str] = []
    for name, candidate in module.named_modules():
        if name and _is_block_list(candidate) and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return tuple(found)


def discover(module: nn.Module) -> OffloadPlan:
    """The plan dlo would use for `module`: its declared plan, else auto-discovered lists."""
    declared = _declared_lists(module)
    if declared is not None:
        class_name, lists = declared
        present = tuple(p for p in lists if isinstance(_get(module, p), nn.ModuleList))
        if present == lists:
            return OffloadPlan(block_lists=lists, source="declared")
        logger.warning(
            "dlo: %s no longer has the declared block lists %s (found %s); auto-discovering instead",
            class_name, lists, present,
        )
    lists = _auto_lists(module)
    if not lists:
        raise DiscoveryError(
            f"dlo found nothing to stream in {type(module).__name__}: it has no declared plan and no "
            "nn.ModuleList of two or more modules of one class with parameters. "
            "Pass plan=dlo.OffloadPlan(block_lists=('path.to.blocks',)) naming the list of blocks."
        )
    return OffloadPlan(block_lists=lists, source="auto")


def _get(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _is_single_block(candidate: nn.Module) -> bool:
    """A module streamed as one block of its own (a text encoder's token embedding): it runs
    as a module and holds parameters, none of them in a submodule (a stack of layers named by
    mistake would take a slot of its whole size)."""
    return (
        _runs_as_a_module(type(candidate))
        and any(True for _ in candidate.parameters(recurse=False))
        and not any(True for child in candidate.children() for _ in child.parameters())
    )


def looks_up_rows(candidate: nn.Module) -> bool:
    """Whether `candidate` only gathers rows of its weight: a plain `nn.Embedding` (its own
    forward, no `max_norm`, which would rewrite the rows it reads) of a plain float weight (not
    a quantized file's packed bytes)."""
    return (
        isinstance(candidate, nn.Embedding)
        and type(candidate).forward is nn.Embedding.forward
        and candidate.max_norm is None
        and type(candidate.weight) is nn.Parameter
        and candidate.weight.dtype.is_floating_point
    )


def resolve_blocks(module: nn.Module, plan: OffloadPlan) -> list[BlockRef]:
    """The plan's blocks in execution order (list by list, index by index). A path naming a
    module that is not a list is one block of its own."""
    blocks: list[BlockRef] = []
    for path in plan.block_lists:
        block_list = _get(module, path)
        if path in plan.host_lookups and (block_list is None or not looks_up_rows(block_list)):
            found = "nothing" if block_list is None else type(block_list).__name__
            raise DiscoveryError(
                f"OffloadPlan.host_lookups names {path!r}, which is {found} in {type(module).__name__}: only a plain "
                "nn.Embedding without max_norm looks its rows up on the host; leave it out of host_lookups"
            )
        if block_list is not None and not isinstance(block_list, nn.ModuleList) and _is_single_block(block_list):
            blocks.append(BlockRef(path, path, block_list, on_host=path in plan.host_lookups))
            continue
        if not isinstance(block_list, nn.ModuleList):
            found = "nothing" if block_list is None else type(block_list).__name__
            raise DiscoveryError(
                f"OffloadPlan names block list {path!r} but {type(module).__name__} has {found} there; "
                "block_lists must name nn.ModuleList attributes, or single modules with a forward and parameters "
                "of their own and none in submodules (see `dlo inspect`)"
            )
        blocks.extend(BlockRef(f"{path}.{i}", path, block) for i, block in enumerate(block_list))
    if not blocks:
        raise DiscoveryError(f"the block lists {plan.block_lists!r} of {type(module).__name__} are all empty")
    return blocks


def with_single_blocks(module: nn.Module, plan: OffloadPlan, min_bytes: int) -> OffloadPlan:
    """`plan` with every module outside its blocks that holds at least `min_bytes` of parameters
    of its own (a text encoder's token embedding) streamed as one block of its own, first. For a
    component that runs once per call: between its calls it then holds nothing on the device
    but its small parts (See [Note: pipeline budget]). A plain embedding among them looks its
    rows up on the host instead (See [Note: token embeddings looked up on the host]). Of
    modules of one class tied to one weight (T5's `shared` and `encoder.embed_tokens`), the
    last streams: the one inside the stack that runs it; the others are its aliases, which
    promote it if they run (See [Note: blocks used outside their call]). Only modules without
    parameters in submodules qualify."""
    taken = {id(sub) for ref in resolve_blocks(module, plan) for sub in ref.module.modules()}
    holders: dict[int, list[nn.Module]] = {}  # id(parameter) -> the modules holding it as their own
    for sub in module.modules():
        for param in sub.parameters(recurse=False):
            holders.setdefault(id(param), []).append(sub)
    singles: dict[str, frozenset[int]] = {}  # path -> ids of its own parameters
    for name, sub in module.named_modules():
        own = list(sub.parameters(recurse=False))
        if not name or id(sub) in taken or not _is_single_block(sub):
            continue
        tied = {type(holder) for param in own for holder in holders[id(param)]}
        # An embedding tied to a head of another class (a causal LM's `lm_head`) may run in
        # both places: it stays on the device.
        if sum(p.numel() * p.element_size() for p in own) >= min_bytes and len(tied) == 1:
            tensors = frozenset(id(p) for p in own)
            singles = {path: ids for path, ids in singles.items() if not ids & tensors}  # the later alias wins
            singles[name] = tensors
    if not singles:
        return plan
    lookups = tuple(path for path in singles if looks_up_rows(module.get_submodule(path)))
    return replace(plan, block_lists=(*singles, *plan.block_lists), host_lookups=(*lookups, *plan.host_lookups))
