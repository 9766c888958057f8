"""Small real diffusers transformers with random seeded weights, and inputs for them.

Used by `dlo demo`, the tests and `dlo inspect`: nothing is downloaded. Each entry builds
the real diffusers class from a tiny config, so the streamed code paths are the ones large
checkpoints take.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

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


TINY_MODELS: dict[str, TinyModel] = {
    m.name: m
    for m in (
        TinyModel(
            "wan",
            "WanTransformer3DModel",
            dict(
                patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=4, rope_max_seq_len=32,
            ),
            _wan_inputs(latent=(1, 4, 2, 8, 8), text=(1, 12, 32)),
        ),
        # The `dlo demo` default: big enough that copies and compute are visible in the table.
        TinyModel(
            "wan-demo",
            "WanTransformer3DModel",
            dict(
                patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=16,
                out_channels=16, text_dim=256, freq_dim=64, ffn_dim=1024, num_layers=8, rope_max_seq_len=64,
            ),
            _wan_inputs(latent=(1, 16, 4, 16, 16), text=(1, 32, 256)),
        ),
        TinyModel(
            "flux",
            "FluxTransformer2DModel",
            dict(
                patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                axes_dims_rope=(4, 6, 6),
            ),
            _flux_inputs,
        ),
        TinyModel(
            "flux2",
            "Flux2Transformer2DModel",
            dict(
                patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32,
                axes_dims_rope=(4, 4, 4, 4),
            ),
            _flux2_inputs,
        ),
        TinyModel(
            "sd3",
            "SD3Transformer2DModel",
            dict(
                sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16,
            ),
            _sd3_inputs,
        ),
        TinyModel(
            "qwenimage",
            "QwenImageTransformer2DModel",
            dict(
                patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
            ),
            _qwen_inputs,
        ),
        TinyModel(
            "hunyuanvideo",
            "HunyuanVideoTransformer3DModel",
            dict(
                in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                num_single_layers=2, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=32,
                pooled_projection_dim=16, rope_axes_dim=(4, 6, 6),
            ),
            _hunyuan_inputs,
        ),
        TinyModel(
            "cogvideox",
            "CogVideoXTransformer3DModel",
            dict(
                num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=32,
                text_embed_dim=32, num_layers=3, sample_width=8, sample_height=8, sample_frames=5,
                patch_size=2, max_text_seq_length=8,
            ),
            _cogvideox_inputs,
        ),
        TinyModel(
            "ltx",
            "LTXVideoTransformer3DModel",
            dict(
                in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
                cross_attention_dim=32, num_layers=3, caption_channels=32,
            ),
            _ltx_inputs,
        ),
    )
}
