"""Real PEFT LoRA files for the tiny models, written by diffusers' `save_lora_weights` from
seeded adapters, and inputs for the transformers of the tiny pipelines.

Adapter "a" covers attention and feed-forward Linears of every block and one non-block
Linear (so fusing touches streamed and resident base weights); "b" another rank and fewer
targets; Flux's "c" has a's shapes (to hot-swap it), Wan's "dora" is a DoRA adapter. Their B matrices are seeded noise, not PEFT's zeros: a LoRA that changed nothing
could not be got wrong.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from dlo.models.tiny import TINY_MODELS

# kind -> (the pipeline class whose save_lora_weights writes the file, {adapter: (rank, targets)})
ADAPTERS = {
    "flux": (
        "FluxPipeline",
        {
            "a": (4, ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "ff.net.2", "proj_out"]),
            "b": (8, ["to_k", "add_q_proj", "proj_out"]),
            "c": (4, ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "ff.net.2", "proj_out"]),  # a's shape: hot-swaps it
        },
    ),
    "wan": (
        "WanPipeline",
        {
            "a": (4, ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.2", "proj_out"]),
            "b": (8, ["to_v", "ffn.net.0.proj"]),
            "dora": (4, ["to_q", "to_v"]),  # DoRA: its magnitudes are adapter tensors too
        },
    ),
    "qwenimage": (
        "QwenImagePipeline",
        {"a": (4, ["to_q", "to_k", "to_v", "to_out.0", "img_mlp.net.2", "proj_out"]), "b": (8, ["add_k_proj"])},
    ),
}


def save_lora(model: torch.nn.Module, kind: str, adapter: str, directory: Path, seed: int) -> Path:
    """Adapter `adapter` of ADAPTERS[kind] added to a copy of `model`, seeded, saved with the
    pipeline's save_lora_weights (as a user's trainer would). Returns the file."""
    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipeline, adapters = ADAPTERS[kind]
    rank, targets = adapters[adapter]
    model = copy.deepcopy(model)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, use_dora=adapter == "dora")
    model.add_adapter(config, adapter_name=adapter)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if f".{adapter}." in name:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
    state = get_peft_model_state_dict(model, adapter_name=adapter)
    getattr(diffusers, pipeline).save_lora_weights(directory / adapter, transformer_lora_layers=state)
    return directory / adapter / "pytorch_lora_weights.safetensors"


def save_loras(model: torch.nn.Module, kind: str, directory: Path) -> dict[str, Path]:
    return {name: save_lora(model, kind, name, directory, seed) for seed, name in enumerate(ADAPTERS[kind][1], 1)}


def pipeline_inputs(kind: str, seed: int, dtype: torch.dtype = torch.float32) -> dict:
    """Inputs for the transformer of the tiny `kind` pipeline (`dlo.models.tiny_pipelines`):
    the tiny model's, widened as that transformer is."""
    inputs = TINY_MODELS[kind].inputs(seed, dtype)
    generator = torch.Generator().manual_seed(seed + 100)
    if kind == "flux":  # 2x2 packed 16-channel latents; CLIP-sized pooled text
        inputs["hidden_states"] = torch.randn(1, 16, 64, generator=generator).to(dtype)
        inputs["pooled_projections"] = torch.randn(1, 32, generator=generator).to(dtype)
    else:  # wan: a 16-channel latent
        inputs["hidden_states"] = torch.randn(1, 16, 2, 8, 8, generator=generator).to(dtype)
    return inputs


def requantize_changed(model: torch.nn.Module, before: dict[str, torch.Tensor], config) -> None:
    """The resident model fp8 streaming equals after a change: each weight `config` streams as
    float8 that the change gave new values is quantized and dequantized again, as dlo
    requantizes a changed weight's host copy; the others keep theirs (`before`: the weights'
    values before the change, by name: `float8_weights`)."""
    from dlo.host.fp8_codec import dequantized, quantize_into
    from dlo.planning.fp8_selection import fp8_format

    fp8 = fp8_format(config)
    with torch.no_grad():
        for name, old in before.items():
            weight = model.get_parameter(name)
            if torch.equal(weight, old):
                continue
            data = torch.empty(weight.shape, dtype=fp8.dtype)
            scale = torch.empty(fp8.scale_shape(weight.shape[0]), dtype=torch.float32)
            quantize_into(weight, data, scale, name)
            weight.data = dequantized(data.to(weight.device), scale.to(weight.device), weight.dtype)


def float8_weights(model: torch.nn.Module, config) -> dict[str, torch.Tensor]:
    """Name -> a copy of each weight of `model` that `config` streams as float8."""
    from dlo.planning.fp8_selection import quantized_tensors
    from dlo.planning.offload_plan import discover, resolve_blocks

    chosen = set().union(*(quantized_tensors(model, ref, config) for ref in resolve_blocks(model, discover(model))))
    return {name: p.detach().clone() for name, p in model.named_parameters() if id(p) in chosen}
