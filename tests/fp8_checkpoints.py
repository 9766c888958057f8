"""Float8 checkpoints for tests, written as the ecosystem writes them and quantized here,
independently of dlo: tiny Flux with every block Linear weight as float8 plus scales."""

import json
import shutil

import diffusers
import torch
from safetensors.torch import load_file, save_file

from dlo.models.tiny import TINY_MODELS

FP8 = torch.float8_e4m3fn


def write_fp8_checkpoint(tmp_path, scale_name="weight_scale", per_channel=True, edit=None):
    """The tiny Flux in bf16, every block Linear weight stored as float8 with its scales
    (quantized here, independently of dlo). Returns (directory, the dequantized state dict)."""
    plain = tmp_path / "plain"
    TINY_MODELS["flux"].build(seed=3, dtype=torch.bfloat16).save_pretrained(plain)
    state = load_file(plain / "diffusion_pytorch_model.safetensors")
    stored, dequantized = {}, {}
    for name, tensor in state.items():
        is_block_linear = name.startswith(("transformer_blocks.", "single_transformer_blocks.")) and (
            name.endswith(".weight") and tensor.dim() == 2
        )
        if not is_block_linear:
            stored[name] = dequantized[name] = tensor
            continue
        value = tensor.float()
        amax = value.abs().amax(dim=1, keepdim=True) if per_channel else value.abs().amax()
        scale = (amax / 448).clamp_min(1e-12)
        data = (value / scale).clamp(-448, 448).to(FP8)
        stored[name] = data
        stored[name[: -len("weight")] + scale_name] = scale if per_channel else scale.reshape(())
        dequantized[name] = (data.float() * scale).to(torch.bfloat16)
    if edit is not None:
        edit(stored)
    directory = tmp_path / "fp8"
    directory.mkdir()
    shutil.copy(plain / "config.json", directory / "config.json")
    save_file(stored, directory / "diffusion_pytorch_model.safetensors")
    return directory, dequantized


def resident_from(state):
    config = json.loads(json.dumps(TINY_MODELS["flux"].config))
    model = diffusers.FluxTransformer2DModel(**config).to(torch.bfloat16).eval()
    model.load_state_dict(state)
    return model
