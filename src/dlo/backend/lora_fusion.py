"""LoRA fused into and unfused from streamed base weights: diffusers' `fuse_lora` /
`unfuse_lora`, through the blocks' host copies.

[Note: fusing LoRA into streamed blocks]
PEFT merges a LoRA layer by adding its delta to the base weight in place (`weight.data +=
delta`), and unmerges by subtracting it; a streamed base weight between calls is a stand-in
that refuses the write (See [Note: stand-ins]). So `handle.fuse_lora()` does what diffusers'
`fuse_lora()` does, layer by layer (scale each layer by `lora_scale`, then let PEFT merge it),
with each streamed block that has something to merge opened on the device first (See [Note:
editing a streamed block]): PEFT computes the delta where the adapter lives and adds it to
the base weight there, as on the resident model, and the block's host copy is rewritten
(float8 weights requantized, a mapping copied on write). Layers outside the streamed blocks
are merged where they are. `unfuse_lora()` likewise: PEFT subtracts the same delta, so the
weights are what resident diffusers gives back (not the bytes before the fuse: w + d - d is
not always w). Float8 GEMM base layers (`fp8_compute`) hold float8 weights, which no merge
can add to: refused before anything changed.
Two PEFT paths change a merged layer's weights without dlo: a forward with adapters disabled
(`disable_lora()` after a fuse) unmerges the layer in its forward, inside the block's call,
where only the slot would change; and diffusers' own `unfuse_lora()` pops the adapter from
the layer's merged list before its write into the stand-in fails. So dlo keeps, per merged
layer of a streamed block, the adapters it merged, and before each call: a merged layer with
adapters disabled is unmerged through its host copy first (the forward then finds nothing to
unmerge, and computes what the resident model computes); a layer whose merged list lost
adapters gets them back, consistent with its weights, and the call is refused, pointing to
`handle.unfuse_lora()`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import nn

from dlo.backend.weight_changes import WeightChanges
from dlo.errors import StreamingError
from dlo.hotpath.fp8_gemm import Fp8GemmLinear
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

    def _track(self, layers: Sequence[tuple[str, nn.Module, int]]) -> None:
        for _, layer, index in layers:
            if layer.merged_adapters:
                self._merged[id(layer)] = (layer, index, tuple(layer.merged_adapters))
            else:
                self._merged.pop(id(layer), None)

    def fuse(self, lora_scale: float, safe_fusing: bool, adapter_names: list[str] | None) -> None:
        """See [Note: fusing LoRA into streamed blocks]"""
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
            _fuse_layer(layer, lora_scale, safe_fusing, adapter_names)
        opened = {index for _, _, index in to_merge}
        try:
            for index in sorted({index for _, _, index in streamed}):
                with self._changes.editing([index] if index in opened else []):
                    for _, layer, at in streamed:
                        if at == index:
                            _fuse_layer(layer, lora_scale, safe_fusing, adapter_names)
        finally:
            self._track(streamed)

    def unfuse(self) -> None:
        """See [Note: fusing LoRA into streamed blocks]"""
        streamed = self._streamed_layers()
        inside = {id(layer) for _, layer, _ in streamed}
        for _, layer in tuner_layers(self._module):
            if id(layer) not in inside:
                layer.unmerge()
        try:
            for index in sorted({index for _, _, index in streamed}):
                layers = [layer for _, layer, at in streamed if at == index]
                with self._changes.editing([index] if any(layer.merged for layer in layers) else []):
                    for layer in layers:
                        layer.unmerge()
        finally:
            self._track(streamed)

    def before_call(self) -> None:
        """See [Note: fusing LoRA into streamed blocks]"""
        if not self._merged:
            return
        resident = self._changes.runtime.promoted
        lost = []
        for key, (layer, index, adapters) in list(self._merged.items()):
            if index in resident:  # its device memory is its weight: PEFT's own unmerge is real
                del self._merged[key]
            elif tuple(layer.merged_adapters) != adapters:
                layer.merged_adapters[:] = list(adapters)
                lost.append(layer)
            elif layer.disable_adapters:
                with self._changes.editing([index]):
                    layer.unmerge()
                self._track([("", layer, index)])
        if lost:
            names = [name for name, layer in self._module.named_modules() if any(layer is x for x in lost)]
            raise StreamingError(
                f"the PEFT layer {names[0]!r}{f' (and {len(names) - 1} more)' if len(names) > 1 else ''} dropped "
                "merged adapters without its streamed base weight changing (diffusers' unfuse_lora() cannot write a "
                "streamed weight: it stopped there); they are marked merged again, as the weights are. Unfuse with "
                "handle.unfuse_lora() (a pipeline's: dlo.enable_pipeline(...).unfuse_lora())"
            )


def _fuse_layer(layer: nn.Module, lora_scale: float, safe_fusing: bool, adapter_names: list[str] | None) -> None:
    """What diffusers' fuse_lora does to each PEFT layer."""
    if lora_scale != 1.0:
        layer.scale_layer(lora_scale)
    layer.merge(safe_merge=safe_fusing, adapter_names=adapter_names)
