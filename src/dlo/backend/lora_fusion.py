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
diffusers' own entry points reach this: while enabled, the module's `fuse_lora` /
`unfuse_lora` (which `pipe.fuse_lora()` calls) are the handle's, and each merged layer of a
streamed block has its `unmerge` replaced by one that opens its block first. That covers every
unmerge from outside a call: diffusers' `pipe.unfuse_lora()` (layer by layer: one block
opened per merged layer), and PEFT unmerging before it loads another adapter
(`load_lora_adapter` while a LoRA is fused). Blocks kept resident need none of this: their
device memory is their weight. Two paths are left. A forward with adapters disabled
(`disable_lora()` after a fuse) unmerges the layer inside the block's call, where only the
slot would change: before each call, a merged layer with adapters disabled is unmerged
through its host copy first (the forward then finds nothing to unmerge, and computes what
the resident model computes). And an unmerge past the replacement (PEFT's class method
called directly) pops the adapter from the layer's merged list before its write into the
stand-in fails: dlo keeps, per merged layer, the adapters it merged, and a layer whose list
lost some gets them back, consistent with its weights, and the call is refused.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator, Sequence

from torch import nn

from dlo.backend.weight_changes import WeightChanges
from dlo.errors import StreamingError
from dlo.hotpath.fp8_gemm import Fp8GemmLinear
from dlo.hotpath.interrupts import interrupts_held
from dlo.planning.adapters import tuner_layers
from dlo.planning.gguf_weights import is_gguf_parameter


class LoraFusion:
    def __init__(self, module: nn.Module, changes: WeightChanges) -> None:
        self._module = module
        self._changes = changes
        # id(layer) -> (layer, block index, the adapters merged into its streamed base weight)
        self._merged: dict[int, tuple[nn.Module, int, tuple[str, ...]]] = {}
        self._track(self._streamed_layers())

    def _streamed_layers(self) -> list[tuple[str, nn.Module, int]]:
        """(name, layer, block index) of the PEFT layers inside the streamed blocks."""
        return [
            (f"{ref.name}.{name}", layer, index)
            for index, ref in enumerate(self._changes.refs)
            for name, layer in tuner_layers(ref.module)
        ]

    def install(self) -> None:
        """The module's diffusers `fuse_lora` / `unfuse_lora` are this fuse and unfuse until
        `remove()`. See [Note: fusing LoRA into streamed blocks]"""
        for name, method in (("fuse_lora", self.fuse), ("unfuse_lora", self.unfuse)):
            if callable(getattr(type(self._module), name, None)):  # a diffusers model with PEFT support
                self._module.__dict__[name] = method

    def remove(self) -> None:
        """Undo install() and every merged layer's `unmerge` replacement; also after a partial install."""
        for name in ("fuse_lora", "unfuse_lora"):
            self._module.__dict__.pop(name, None)
        for layer, _, _ in self._merged.values():
            layer.__dict__.pop("unmerge", None)

    def _track(self, layers: Sequence[tuple[str, nn.Module, int]]) -> None:
        for _, layer, index in layers:
            if layer.merged_adapters:
                self._merged[id(layer)] = (layer, index, tuple(layer.merged_adapters))
                # An instance attribute, found before PEFT's method by whoever calls it
                layer.__dict__["unmerge"] = functools.partial(self._unmerge_between_calls, layer)
            else:
                self._merged.pop(id(layer), None)
                layer.__dict__.pop("unmerge", None)

    def _unmerge_between_calls(self, layer: nn.Module) -> None:
        """A merged layer's `unmerge()` called from outside dlo (diffusers' `unfuse_lora`, PEFT
        before it sets an adapter): PEFT's own, with its block open. See [Note: fusing LoRA into
        streamed blocks]"""
        _, index, _ = self._merged[id(layer)]
        # Inside handle.editing() with the block open, its weights are real already.
        with self._changing(index, [("", layer, index)], open_block=not self._changes.is_open(index)):
            _peft_unmerge(layer)

    @contextlib.contextmanager
    def _changing(self, index: int, layers: Sequence[tuple[str, nn.Module, int]], open_block: bool) -> Iterator[None]:
        """One held step: block `index` opened for the body's merges or unmerges of `layers`
        (where `open_block`) and written back, and what the layers hold merged recorded, also
        when the body raised. An interrupt between PEFT's change of a weight and of its merged
        list would leave the two disagreeing."""
        with interrupts_held():
            try:
                with self._changes.editing([index]) if open_block else contextlib.nullcontext():
                    yield
            finally:
                self._track(layers)

    def fuse(self, lora_scale: float = 1.0, safe_fusing: bool = False, adapter_names: list[str] | None = None) -> None:
        """diffusers' `fuse_lora()`, its arguments. See [Note: fusing LoRA into streamed blocks]"""
        streamed = self._streamed_layers()
        inside = {id(layer) for _, layer, _ in streamed}
        others = [(name, layer) for name, layer in tuner_layers(self._module) if id(layer) not in inside]
        from peft.tuners.tuners_utils import check_adapters_to_merge  # PEFT made the layers found

        with warnings.catch_warnings():  # PEFT warns again when it merges
            warnings.simplefilter("ignore")
            to_merge = [(name, layer, index) for name, layer, index in streamed if check_adapters_to_merge(layer, adapter_names)]
            merged_resident = [(name, layer) for name, layer in others if check_adapters_to_merge(layer, adapter_names)]
        for name, layer, _ in to_merge:
            if isinstance(layer.get_base_layer(), Fp8GemmLinear):
                raise StreamingError(
                    f"fuse_lora: the base Linear of {name!r} runs as an FP8 GEMM (OffloadConfig.fp8_compute=True) and "
                    "holds float8 weights, which a LoRA merge cannot add to; nothing was fused. Keep the LoRA "
                    "unfused, or fuse it before dlo.enable()"
                )
        for name, layer in [(name, layer) for name, layer, _ in to_merge] + merged_resident:
            weight = getattr(layer.get_base_layer(), "weight", None)
            if weight is not None and is_gguf_parameter(weight):
                raise StreamingError(
                    f"fuse_lora: the base Linear of {name!r} holds a GGUF weight (packed {weight.quant_type.name} bytes), "
                    "which a LoRA merge cannot add to; nothing was fused. Keep the LoRA unfused (it runs beside the "
                    "GGUF weights), or fuse it into a bf16 model and quantize that"
                )
        for _, layer in others:
            with interrupts_held():  # PEFT changes the weight, then its merged list
                _fuse_layer(layer, lora_scale, safe_fusing, adapter_names)
        opened = {index for _, _, index in to_merge}
        for index in sorted({index for _, _, index in streamed}):
            layers = [entry for entry in streamed if entry[2] == index]
            with self._changing(index, layers, open_block=index in opened):
                for _, layer, _ in layers:
                    _fuse_layer(layer, lora_scale, safe_fusing, adapter_names)

    def unfuse(self) -> None:
        """diffusers' `unfuse_lora()`. See [Note: fusing LoRA into streamed blocks]"""
        streamed = self._streamed_layers()
        inside = {id(layer) for _, layer, _ in streamed}
        for _, layer in tuner_layers(self._module):
            if id(layer) not in inside:
                with interrupts_held():  # PEFT changes its merged list, then the weight
                    layer.unmerge()
        for index in sorted({index for _, _, index in streamed}):
            layers = [entry for entry in streamed if entry[2] == index]
            with self._changing(index, layers, open_block=any(layer.merged for _, layer, _ in layers)):
                for _, layer, _ in layers:
                    _peft_unmerge(layer)

    def before_call(self) -> None:
        """See [Note: fusing LoRA into streamed blocks]"""
        if not self._merged:
            return
        resident = self._changes.runtime.promoted
        lost = []
        for key, (layer, index, adapters) in list(self._merged.items()):
            if index in resident:  # its device memory is its weight: PEFT's own unmerge is real
                del self._merged[key]
                layer.__dict__.pop("unmerge", None)
            elif tuple(layer.merged_adapters) != adapters:
                layer.merged_adapters[:] = list(adapters)
                lost.append(layer)
            elif layer.disable_adapters:
                with self._changing(index, [("", layer, index)], open_block=True):
                    _peft_unmerge(layer)
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
