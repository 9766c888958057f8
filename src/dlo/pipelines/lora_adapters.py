"""LoRA files for a diffusers pipeline, as `dlo generate --lora` and `dlo serve --lora` use
them: each file checked against the transformer before any weight loads, loaded with
diffusers' own loader under its adapter name, and the active adapters switched per call.

The check matters: diffusers loads a LoRA made for another model without an error when its
layer names happen to match nothing (a Wan LoRA into Flux: a warning, then the base model's
output), and a LoRA for another size of the model fails only once every weight has loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from dlo.errors import ConfigError, first_line

# The file diffusers' save_lora_weights writes, and what its loader looks for in a directory.
LORA_WEIGHTS_FILE = "pytorch_lora_weights.safetensors"


@dataclass(frozen=True)
class LoraFile:
    name: str  # the adapter's name in the pipeline
    path: Path  # a .safetensors file
    scale: float  # its scale when a call names no other
    flag: str  # how the user gave it, for messages


Adapters = tuple[tuple[str, float], ...]  # (name, scale) of each adapter a call runs with


def lora_weights_file(directory: Path, flag: str) -> Path:
    """The LoRA file of a directory: diffusers' own file name, or its only .safetensors file."""
    if (directory / LORA_WEIGHTS_FILE).is_file():
        return directory / LORA_WEIGHTS_FILE
    found = sorted(p.name for p in directory.glob("*.safetensors"))
    if len(found) != 1:
        held = f"holds {', '.join(found)}" if found else "holds no .safetensors file"
        raise ConfigError(f"{flag}: {directory} {held}; give the LoRA file's path")
    return directory / found[0]


def _layer_and_kind(key: str) -> tuple[str, str] | None:
    """'blocks.0.attn1.to_q.lora_A.weight' -> ('blocks.0.attn1.to_q', 'A'); None for keys that are
    not a LoRA layer's (a control LoRA's full weights, say)."""
    layer, marker, rest = key.partition(".lora_")
    return (layer, rest.split(".", 1)[0]) if marker else None


def check_lora(pipeline: type, transformer: nn.Module, lora: LoraFile) -> None:
    """Refuse, before the pipeline loads, a LoRA whose transformer layers `transformer` (on the
    meta device is enough) does not have, or has in another shape; reads the LoRA file only."""
    if not hasattr(pipeline, "load_lora_weights"):
        raise ConfigError(f"{lora.flag}: {pipeline.__name__} does not load LoRAs (diffusers has no LoRA loader for it)")
    try:
        state = pipeline.lora_state_dict(str(lora.path))
    except Exception as err:  # safetensors and diffusers' key converters raise many kinds
        raise ConfigError(f"{lora.flag}: {lora.path} is not a LoRA diffusers can read ({first_line(err)})") from None
    state = state[0] if isinstance(state, tuple) else state  # some loaders also return the alphas
    prefixes = tuple(f"{m}." for m in getattr(pipeline, "_lora_loadable_modules", ["transformer"]))
    foreign = sorted({key.split(".", 1)[0] for key in state if not key.startswith(prefixes)})
    if foreign:  # diffusers would drop these weights with a warning, and load the rest
        raise ConfigError(
            f"{lora.flag}: it holds weights for {', '.join(foreign)}, which {pipeline.__name__} has no LoRA loader "
            f"for (it loads {', '.join(p[:-1] for p in prefixes)}): a LoRA for another pipeline?"
        )
    owner = f"{getattr(pipeline, 'transformer_name', 'transformer')}."
    modules = dict(transformer.named_modules())
    expands = hasattr(pipeline, "_maybe_expand_transformer_param_shape_or_error_")  # Flux widens x_embedder for control LoRAs
    missing = []
    for key, tensor in state.items():
        parsed = _layer_and_kind(key[len(owner):]) if key.startswith(owner) else None
        if parsed is None:
            continue
        layer, kind = parsed
        module = modules.get(layer)
        if module is None:
            missing.append(layer)
            continue
        if isinstance(module, nn.Linear) and kind in ("A", "B") and tensor.dim() == 2:
            given, expected = (tensor.shape[1], module.in_features) if kind == "A" else (tensor.shape[0], module.out_features)
            if given != expected and not (expands and kind == "A" and given > expected):
                side = "input" if kind == "A" else "output"
                raise ConfigError(
                    f"{lora.flag}: its {layer} has {given} {side} features, the transformer's {expected}: a LoRA "
                    "for another size of the model?"
                )
    if missing:
        raise ConfigError(
            f"{lora.flag}: {len(set(missing))} of its layers are not in the {type(transformer).__name__} (e.g. "
            f"{missing[0]}): a LoRA for another model?"
        )


def load_loras(pipe, loras: Sequence[LoraFile]) -> None:
    """Load each LoRA under its name, then run with all of them at their scales."""
    for lora in loras:
        try:
            pipe.load_lora_weights(str(lora.path), adapter_name=lora.name)
        except Exception as err:  # diffusers and PEFT raise many kinds (IndexError for a layer past the end, ...)
            raise ConfigError(f"{lora.flag}: diffusers could not load it ({first_line(err)})") from None
    if loras:
        use_adapters(pipe, tuple((lora.name, lora.scale) for lora in loras))


def use_adapters(pipe, adapters: Adapters) -> None:
    """The next calls run with exactly `adapters` (none: the base model). Switching moves no
    weight: the adapters stay on the device beside the streamed base weights."""
    if not adapters:
        pipe.disable_lora()
        return
    pipe.enable_lora()
    pipe.set_adapters([name for name, _ in adapters], [scale for _, scale in adapters])
