"""Small real diffusers transformers with random seeded weights, and inputs for them.

Used by `dlo demo`, the tests and `dlo inspect`: nothing is downloaded. Each entry builds
the real diffusers class from its tiny config (dlo.models.tiny_configs), so the streamed code
paths are the ones large checkpoints take.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dlo.models.tiny_configs import TINY_CONFIGS

Inputs = dict[str, Any]


@dataclass(frozen=True)
class TinyModel:
    name: str
    class_name: str
    config: dict[str, Any]
    make_inputs: Callable[[torch.Generator, torch.dtype, torch.device], Inputs] = field(repr=False)

    def build(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The model with weights drawn from `seed` (not the class's own init, which leaves
        some projections at zero and would hide wrong-weight bugs)."""
        import diffusers

        cls = getattr(diffusers, self.class_name)
        model = cls(**self.config).eval()
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for tensor in model.parameters():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.05)
        return model if dtype == torch.float32 else model.to(dtype)

    def inputs(self, seed: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Inputs:
        return self.make_inputs(torch.Generator().manual_seed(seed), dtype, torch.device(device))


def _rand(g: torch.Generator, dtype: torch.dtype, device: torch.device, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _timestep(g: torch.Generator, device: torch.device, scale: float = 1000.0) -> torch.Tensor:
    return (torch.rand(1, generator=g) * scale).to(device)


def _wan_inputs(latent: tuple[int, ...], text: tuple[int, ...]):
    def make(g, dtype, device):
        return dict(
            hidden_states=_rand(g, dtype, device, *latent),
            timestep=_timestep(g, device),
            encoder_hidden_states=_rand(g, dtype, device, *text),
            return_dict=False,
        )

    return make


def _flux_ids(height: int, width: int, text: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    img = torch.zeros(height, width, 3)
    img[..., 1] = torch.arange(height)[:, None]
    img[..., 2] = torch.arange(width)[None, :]
    return img.reshape(-1, 3).to(device), torch.zeros(text, 3, device=device)


def _flux_inputs(g, dtype, device):
    img_ids, txt_ids = _flux_ids(4, 4, 8, device)
    return dict(
        hidden_states=_rand(g, dtype, device, 1, 16, 16),
        encoder_hidden_states=_rand(g, dtype, device, 1, 8, 32),
        pooled_projections=_rand(g, dtype, device, 1, 16),
        timestep=_timestep(g, device, 1.0),
        img_ids=img_ids,
        txt_ids=txt_ids,
        return_dict=False,
    )


def _flux2_inputs(g, dtype, device):
    img = torch.zeros(4, 4, 4)
    img[..., 1] = torch.arange(4)[:, None]
    img[..., 2] = torch.arange(4)[None, :]
    return dict(
        hidden_states=_rand(g, dtype, device, 1, 16, 16),
        encoder_hidden_states=_rand(g, dtype, device, 1, 8, 32),
        timestep=_timestep(g, device, 1.0),
        img_ids=img.reshape(1, -1, 4).to(device),
        txt_ids=torch.zeros(1, 8, 4, device=device),
        guidance=torch.full((1,), 3.5, device=device),
        return_dict=False,
    )


def _sd3_inputs(g, dtype, device):
    return dict(
        hidden_states=_rand(g, dtype, device, 1, 4, 8, 8),
        encoder_hidden_states=_rand(g, dtype, device, 1, 8, 32),
        pooled_projections=_rand(g, dtype, device, 1, 16),
        timestep=_timestep(g, device),
        return_dict=False,
    )


def _qwen_inputs(g, dtype, device):
    return dict(
        hidden_states=_rand(g, dtype, device, 1, 16, 16),
        encoder_hidden_states=_rand(g, dtype, device, 1, 8, 32),
        encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long, device=device),
        timestep=_timestep(g, device, 1.0),
        img_shapes=[(1, 4, 4)],
        return_dict=False,
    )


def _hunyuan_inputs(g, dtype, device):
    return dict(
        hidden_states=_rand(g, dtype, device, 1, 4, 1, 8, 8),
        timestep=_timestep(g, device),
        encoder_hidden_states=_rand(g, dtype, device, 1, 8, 32),
        encoder_attention_mask=torch.ones(1, 8, dtype=torch.bool, device=device),
        pooled_projections=_rand(g, dtype, device, 1, 16),
        guidance=torch.full((1,), 3500.0, device=device),
        return_dict=False,
    )


def _cogvideox_inputs(g, dtype, device):
    return dict(
        hidden_states=_rand(g, dtype, device, 1, 2, 4, 8, 8),
        encoder_hidden_states=_rand(g, dtype, device, 1, 8, 32),
        timestep=_timestep(g, device).long(),
        return_dict=False,
    )


def _ltx_inputs(g, dtype, device):
    return dict(
        hidden_states=_rand(g, dtype, device, 1, 2 * 4 * 4, 8),
        encoder_hidden_states=_rand(g, dtype, device, 1, 8, 32),
        timestep=_timestep(g, device),
        encoder_attention_mask=torch.ones(1, 8, dtype=torch.long, device=device),
        num_frames=2,
        height=4,
        width=4,
        return_dict=False,
    )


# Inputs of each TINY_CONFIGS model, shaped by its config (channels, text width, patching).
_INPUTS: dict[str, Callable[[torch.Generator, torch.dtype, torch.device], Inputs]] = {
    "wan": _wan_inputs(latent=(1, 4, 2, 8, 8), text=(1, 12, 32)),
    "wan-demo": _wan_inputs(latent=(1, 16, 4, 16, 16), text=(1, 32, 256)),
    "flux": _flux_inputs,
    "flux2": _flux2_inputs,
    "sd3": _sd3_inputs,
    "qwenimage": _qwen_inputs,
    "hunyuanvideo": _hunyuan_inputs,
    "cogvideox": _cogvideox_inputs,
    "ltx": _ltx_inputs,
}

TINY_MODELS: dict[str, TinyModel] = {
    name: TinyModel(name, tiny.class_name, tiny.config, _INPUTS[name]) for name, tiny in TINY_CONFIGS.items()
}
