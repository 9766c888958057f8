"""A GGUF file's transformer as diffusers' GGUF loader builds it, on the meta device, so that a
mapped load (dlo.host.single_file_load) streams the file's packed bytes into the same modules.

[Note: GGUF files mapped]
diffusers' GGUF loader (`from_single_file` with a GGUFQuantizationConfig) copies every tensor
out of the file, runs the class's converter, replaces each Linear whose weight the file packs
with a GGUFLinear (computing in the compute dtype; the class's fp32-kept modules are left
alone), gives those Linears their packed bytes as GGUFParameters, dequantizes the packed
tensors of the modules it left alone into float32, and casts plain floats to torch_dtype
(float32 in the fp32-kept modules). dlo builds the same skeleton and maps the same bytes
instead: each packed tensor (or the rows of it the converter splits off) is a range of the
file, shared by every process that maps it. Only what the loader computes is held privately,
converted once at load in a small private file beside the mapping: the dequantized tensors of
fp32-kept modules, and the casts of plain floats when they are small next to the file (biases
and norms of a quantized file; casting a whole F16 file would copy it: its casts are then
adapters, packed on every load).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dlo.host.checkpoint import Checkpoint
from dlo.host.model_build import in_kept_module, kept_in_fp32
from dlo.host.safetensors_file import TensorEntry

# Casts converted once privately only while they add at most this share of the file's bytes.
PRIVATE_CAST_SHARE = 1 / 16


def _quant(ggml_type: str):
    import gguf

    return gguf.GGMLQuantizationType[ggml_type]


def packed_stand_in(shape: tuple[int, ...], ggml_type: str) -> torch.Tensor:
    """A meta GGUFParameter of packed bytes."""
    from diffusers.quantizers.gguf.utils import GGUFParameter

    return GGUFParameter(torch.empty(shape, dtype=torch.uint8, device="meta"), quant_type=_quant(ggml_type))


def dequantized(view: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """A packed tensor dequantized into float32 as diffusers' loader does for a module it does
    not convert (on the CPU, from a private copy)."""
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    return dequantize_gguf_tensor(GGUFParameter(view.clone(), quant_type=_quant(ggml_type))).to(torch.float32)


def as_gguf_skeleton(model: nn.Module, packed: dict[str, tuple[tuple[int, ...], str]], compute_dtype: torch.dtype) -> None:
    """Turn the meta skeleton `model` into diffusers' GGUF model of a file whose packed tensors
    (by diffusers name) are `packed` (packed shape, ggml type): each Linear whose weight is
    packed becomes a GGUFLinear with a meta GGUFParameter weight of the packed shape its quant
    type gives the layer's shape (a file whose bytes disagree fails the preflight; diffusers'
    loader, given it then, refuses it)."""
    import gguf
    from diffusers import GGUFQuantizationConfig
    from diffusers.quantizers import DiffusersAutoQuantizer
    from diffusers.quantizers.gguf.utils import GGUFLinear

    stand_ins = {name: packed_stand_in(shape, ggml_type) for name, (shape, ggml_type) in packed.items()}
    # diffusers' own quantizer, as its loader runs it: the Linears replaced, and the model
    # marked quantized (diffusers then refuses to cast it, as it refuses its own GGUF model).
    quantizer = DiffusersAutoQuantizer.from_config(GGUFQuantizationConfig(compute_dtype=compute_dtype))
    quantizer.preprocess_model(model=model, device_map=None, state_dict=stand_ins, keep_in_fp32_modules=kept_in_fp32(type(model)))
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    for name, module in model.named_modules():
        if isinstance(module, GGUFLinear):
            _, ggml_type = packed[f"{name}.weight"]
            block, type_bytes = gguf.GGML_QUANT_SIZES[_quant(ggml_type)]
            shape = (module.out_features, module.in_features // block * type_bytes)
            module._parameters["weight"] = packed_stand_in(shape, ggml_type)


def private_conversions(
    checkpoint: Checkpoint, model: nn.Module, block_prefixes: tuple[str, ...], runtime_dtype
) -> dict[str, torch.Tensor]:
    """What diffusers' GGUF loader computes from the mapped tensors of `checkpoint`, by name:
    the dequantized packed tensors of the modules it leaves unconverted, and the float casts
    when they are small next to the file. See [Note: GGUF files mapped]"""
    kept = kept_in_fp32(type(model))  # diffusers' GGUF loader leaves these unconverted
    converted: dict[str, torch.Tensor] = {}
    casts: dict[str, tuple[TensorEntry, torch.dtype]] = {}
    for name, source in checkpoint.tensors.items():
        entry = source.entry
        if entry.ggml_type is not None and in_kept_module(name, kept):
            converted[name] = dequantized(checkpoint.view(name), entry.ggml_type)
        elif entry.ggml_type is None and entry.dtype.is_floating_point:
            dtype = runtime_dtype(name, entry.dtype)
            if dtype != entry.dtype and name.startswith(block_prefixes):
                casts[name] = (entry, dtype)
    cast_bytes = sum(math.prod(entry.shape) * dtype.itemsize for entry, dtype in casts.values())
    if cast_bytes <= PRIVATE_CAST_SHARE * checkpoint.nbytes:
        converted.update({name: checkpoint.view(name).to(dtype) for name, (_, dtype) in casts.items()})
    return converted
