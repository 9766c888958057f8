"""LoRA fused into and unfused from streamed base weights: diffusers' `fuse_lora` /
`unfuse_lora`, through the blocks' host copies.

[Note: fusing LoRA into streamed blocks]
PEFT merges a LoRA layer by adding its delta to the base weight in place (`weight.data +=
delta`), and unmerges by subtracting it; a streamed base weight between calls is a stand-in
that refuses the write (See [Note: stand-ins]). So a fuse does what diffusers' `fuse_lora()`
does, layer by layer (scale each layer by `lora_scale`, then let PEFT merge it), with each
streamed block that has something to merge opened on the device first (See [Note: editing a
streamed block]): PEFT computes the delta where the adapter lives and adds it to the base
weight there, as on the resident model, and the block's host copy is rewritten (float8
weights requantized, a mapping copied on write). Layers outside the streamed blocks are
merged where they are. An unfuse likewise: PEFT subtracts the same delta, so the weights are
what resident diffusers gives back (not the bytes before the fuse: w + d - d is not always w).
Float8 GEMM base layers (`fp8_compute`) and GGUF weights hold bytes no merge can add to:
refused before anything changed.
diffusers' own entry points reach this: while enabled, the module's `fuse_lora` / `unfuse_lora`
are the handle's (and under enable_pipeline the pipeline's own are the pipeline handle's: a
text encoder, a transformers model, has none to take over), and each merged layer of a streamed
block has its `unmerge` replaced by one that opens its block first. That covers every unmerge
from outside a call: diffusers' `unfuse_lora()` on a pipeline it does not route (layer by
layer: one block opened per merged layer), and PEFT unmerging before it loads another adapter.
Layers are merged in module order, as diffusers does, each block's layers and the record of
what they hold merged as one held step. A block kept resident is already open: PEFT's own
changes to it are real (its layers, and those of a block open for an edit, are recorded as they
are before each call), and an unmerge through dlo rewrites its host copy at once (float8
weights requantized on the device too). Inside handle.editing() a change runs on the blocks it
opened and opens any other on its own; PEFT's own merges made there are recorded as the edit
ends. A block whose write-back fails is left as it was (See [Note: editing a streamed block]),
and so are its layers' lists of what they hold merged. Two paths are left. A forward with
adapters disabled (`disable_lora()` after a fuse) unmerges the layer inside the block's call,
where only the slot would change: before each call, a merged layer with adapters disabled is
unmerged through its host copy first (the forward then finds nothing to unmerge, and computes
what the resident model computes). And an unmerge past the replacement (PEFT's class method
called directly) pops the adapter from the layer's merged list before its write into the
stand-in fails: dlo keeps, per merged layer, the adapters it merged, and a layer whose list
lost some gets them back, consistent with its weights, and the next call (or disable()) is
refused.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Iterator, Sequence

from torch import nn

from dlo.backend.weight_changes import WeightChanges
from dlo.errors import StreamingError
from dlo.hotpath.fp8_gemm import Fp8GemmLinear
from dlo.hotpath.interrupts import interrupts_held
from dlo.planning.adapters import tuner_layers
from dlo.planning.gguf_weights import is_gguf_parameter

# (name, PEFT layer, index of the streamed block holding it; None outside them)
Layer = tuple[str, nn.Module, int | None]


class LoraFusion:
    def __init__(self, module: nn.Module, changes: WeightChanges) -> None:
        self._module = module
        self._changes = changes
        # id(layer) -> (the layer, its block's index, the adapters merged into its streamed base
        # weight). Weak: a layer diffusers unloads (unload_lora_weights) goes with its adapters.
        self._merged: dict[int, tuple[weakref.ref[nn.Module], int, tuple[str, ...]]] = {}
        self._installed = False  # the layers' `unmerge` replacements are in place (install())
        self._track(self._streamed_layers())

    def _streamed_layers(self) -> list[Layer]:
        """(name, layer, block index) of the PEFT layers inside the streamed blocks."""
        return [
            (f"{ref.name}.{name}", layer, index)
            for index, ref in enumerate(self._changes.refs)
            for name, layer in tuner_layers(ref.module)
        ]

    def _runs(self) -> list[tuple[int | None, list[Layer]]]:
        """The module's PEFT layers in the order diffusers fuses them (module order), in runs:
        (block index, the layers of that streamed block), or (None, [a layer outside them])."""
        block_of = {id(layer): index for _, layer, index in self._streamed_layers()}
        runs: list[tuple[int | None, list[Layer]]] = []
        for name, layer in tuner_layers(self._module):
            index = block_of.get(id(layer))
            if index is not None and runs and runs[-1][0] == index:
                runs[-1][1].append((name, layer, index))
            else:
                runs.append((index, [(name, layer, index)]))
        return runs

    def install(self) -> None:
        """The module's diffusers `fuse_lora` / `unfuse_lora` are this fuse and unfuse, and each
        merged layer of a streamed block unmerges through it, until `remove()`. See [Note: fusing
        LoRA into streamed blocks]"""
        for name, method in (("fuse_lora", self.fuse), ("unfuse_lora", self.unfuse)):
            if callable(getattr(type(self._module), name, None)):  # a diffusers model with PEFT support
                self._module.__dict__[name] = method
        self._installed = True
        for layer_ref, _, _ in self._merged.values():
            if (layer := layer_ref()) is not None:
                self._replace_unmerge(layer)

    def remove(self) -> None:
        """Undo install(); also after a partial one."""
        self._installed = False
        for name in ("fuse_lora", "unfuse_lora"):
            self._module.__dict__.pop(name, None)
        for layer_ref, _, _ in self._merged.values():
            if (layer := layer_ref()) is not None:
                layer.__dict__.pop("unmerge", None)

    def _replace_unmerge(self, layer: nn.Module) -> None:
        # An instance attribute, found before PEFT's method by whoever calls it
        layer.__dict__["unmerge"] = functools.partial(self._unmerge_between_calls, layer)

    def _track(self, layers: Sequence[Layer]) -> None:
        for _, layer, index in layers:
            if index is None:
                continue
            if layer.merged_adapters:
                self._merged[id(layer)] = (weakref.ref(layer), index, tuple(layer.merged_adapters))
                if self._installed:
                    self._replace_unmerge(layer)
            else:
                self._merged.pop(id(layer), None)
                layer.__dict__.pop("unmerge", None)

    def _unmerge_between_calls(self, layer: nn.Module) -> None:
        """A merged layer's `unmerge()` called from outside dlo (diffusers' `unfuse_lora`, PEFT
        before it sets an adapter): PEFT's own, with its block open. See [Note: fusing LoRA into
        streamed blocks]"""
        _, index, _ = self._merged[id(layer)]
        # Also a kept-resident block (no copy to make): its host copy is rewritten at once, and
        # float8 weights requantized on the device too, as a streamed block's load would give.
        with self._changing(index, [("", layer, index)], needs_open=True):
            _peft_unmerge(layer)

    @contextlib.contextmanager
    def _changing(self, index: int | None, layers: Sequence[Layer], needs_open: bool) -> Iterator[None]:
        """One held step: streamed block `index` opened for the body's merges or unmerges of
        `layers` (where `needs_open`; one an edit holds open stays so) and written back, and what
        the layers hold merged recorded, also when the body raised. An interrupt between PEFT's
        change of a weight and of its merged list would leave the two disagreeing."""
        opens = index is not None and needs_open
        with interrupts_held():
            before = self._merged_lists(layers)
            self._changes.dropped.discard(index)
            try:
                with self._changes.opened(index) if opens else contextlib.nullcontext():
                    yield
            finally:
                self._settle(layers, before)

    def fuse(self, lora_scale: float = 1.0, safe_fusing: bool = False, adapter_names: list[str] | None = None) -> None:
        """diffusers' `fuse_lora()`, its arguments. See [Note: fusing LoRA into streamed blocks]"""
        from peft.tuners.tuners_utils import check_adapters_to_merge  # PEFT made the layers found

        runs = self._runs()
        with warnings.catch_warnings():  # PEFT warns again when it merges
            warnings.simplefilter("ignore")
            to_merge = [entry for _, run in runs for entry in run if check_adapters_to_merge(entry[1], adapter_names)]
        for name, layer, _ in to_merge:
            if isinstance(layer.get_base_layer(), Fp8GemmLinear):
                raise StreamingError(
                    f"fuse_lora: the base Linear of {name!r} runs as an FP8 GEMM (OffloadConfig.fp8_compute=True) and "
                    "holds float8 weights, which a LoRA merge cannot add to; nothing was fused. Keep the LoRA "
                    "unfused, or fuse it before dlo.enable()"
                )
            weight = getattr(layer.get_base_layer(), "weight", None)
            if weight is not None and is_gguf_parameter(weight):
                raise StreamingError(
                    f"fuse_lora: the base Linear of {name!r} holds a GGUF weight (packed {weight.quant_type.name} bytes), "
                    "which a LoRA merge cannot add to; nothing was fused. Keep the LoRA unfused (it runs beside the "
                    "GGUF weights), or fuse it into a bf16 model and quantize that"
                )
        opened = {index for _, _, index in to_merge if index is not None}
        for index, run in runs:
            with self._changing(index, run, needs_open=index in opened):
                for _, layer, _ in run:
                    _fuse_layer(layer, lora_scale, safe_fusing, adapter_names)

    def unfuse(self) -> None:
        """diffusers' `unfuse_lora()`. See [Note: fusing LoRA into streamed blocks]"""
        runs = self._runs()
        opened = {index for index, run in runs if index is not None and any(layer.merged for _, layer, _ in run)}
        for index, run in runs:
            with self._changing(index, run, needs_open=index in opened):
                for _, layer, _ in run:
                    _peft_unmerge(layer)

    def layers_of(self, indices: Sequence[int]) -> list[Layer]:
        wanted = set(indices)
        return [entry for entry in self._streamed_layers() if entry[2] in wanted]

    @staticmethod
    def _merged_lists(layers: Sequence[Layer]) -> dict[int, list[str]]:
        return {id(layer): list(layer.merged_adapters) for _, layer, _ in layers}

    @contextlib.contextmanager
    def editing(self, indices: Sequence[int]) -> Iterator[None]:
        """Around handle.editing() of blocks `indices`: what their layers hold merged after it
        (PEFT's own merges in it) is recorded, or, for a block whose change was dropped, put
        back as it was."""
        layers = self.layers_of(indices)
        before = self._merged_lists(layers)
        self._changes.dropped.difference_update(indices)
        try:
            yield
        finally:
            with interrupts_held():
                self._settle(self.layers_of(indices), before)

    def _settle(self, layers: Sequence[Layer], before: dict[int, list[str]]) -> None:
        """Record what `layers` hold merged; a layer of a block whose change was dropped gets
        back its list of before the change, as its weights are."""
        for _, layer, index in layers:
            if index in self._changes.dropped:
                layer.merged_adapters[:] = before.get(id(layer), [])
        self._track(layers)

    def before_call(self) -> None:
        """See [Note: fusing LoRA into streamed blocks]"""
        self.restore_lost()
        for layer_ref, index, _ in list(self._merged.values()):
            layer = layer_ref()
            if layer is not None and layer.disable_adapters and not self._changes.kept_resident(index):
                with self._changing(index, [("", layer, index)], needs_open=True):
                    _peft_unmerge(layer)

    def restore_lost(self) -> None:
        """A merged layer of a streamed block whose merged list lost adapters while its weight
        could not change gets them back, and StreamingError says so; the layers of a block kept
        resident or open for an edit are recorded as they are (PEFT's own changes to them are
        real). See [Note: fusing LoRA into streamed blocks]"""
        lost = []
        for key, (layer_ref, index, adapters) in list(self._merged.items()):
            layer = layer_ref()
            if layer is None:
                del self._merged[key]
            elif self._changes.kept_resident(index) or self._changes.is_open(index):  # PEFT's changes are real there
                self._track([("", layer, index)])
            elif tuple(layer.merged_adapters) != adapters:
                layer.merged_adapters[:] = list(adapters)
                lost.append(layer)
        if lost:
            names = [name for name, layer in self._module.named_modules() if any(layer is x for x in lost)]
            raise StreamingError(
                f"the PEFT layer {names[0]!r}{f' (and {len(names) - 1} more)' if len(names) > 1 else ''} dropped "
                "merged adapters without its streamed base weight changing (an unmerge past the layer's own "
                "unmerge(), which cannot write a streamed weight: it stopped there); they are marked merged again, as "
                "the weights are. Unfuse with the model's or the pipeline's unfuse_lora()"
            )


def _peft_unmerge(layer: nn.Module) -> None:
    """PEFT's own unmerge, past a replacement of the layer's (See [Note: fusing LoRA into streamed blocks])."""
    type(layer).unmerge(layer)


def _fuse_layer(layer: nn.Module, lora_scale: float, safe_fusing: bool, adapter_names: list[str] | None) -> None:
    """What diffusers' fuse_lora does to each PEFT layer."""
    if lora_scale != 1.0:
        layer.scale_layer(lora_scale)
    layer.merge(safe_merge=safe_fusing, adapter_names=adapter_names)
