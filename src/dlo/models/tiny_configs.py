"""The built-in tiny models (`dlo demo --model`, `dlo inspect`, the tests): each one's diffusers
class and config, as plain data: the command line lists these names without importing torch
(see [Note: parse before torch] in dlo/cli/main.py); `dlo.models.tiny` builds the models and
their inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TinyConfig:
    class_name: str  # a diffusers model class
    config: dict[str, Any]  # its constructor's arguments


TINY_CONFIGS: dict[str, TinyConfig] = {
    "wan": TinyConfig(
        "WanTransformer3DModel",
        dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
            out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=4, rope_max_seq_len=32,
        ),
    ),
    # The `dlo demo` default: big enough that copies and compute are visible in the table.
    "wan-demo": TinyConfig(
        "WanTransformer3DModel",
        dict(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=16,
            out_channels=16, text_dim=256, freq_dim=64, ffn_dim=1024, num_layers=8, rope_max_seq_len=64,
        ),
    ),
    "flux": TinyConfig(
        "FluxTransformer2DModel",
        dict(
            patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
            axes_dims_rope=(4, 6, 6),
        ),
    ),
    "flux2": TinyConfig(
        "Flux2Transformer2DModel",
        dict(
            patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4),
        ),
    ),
    "sd3": TinyConfig(
        "SD3Transformer2DModel",
        dict(
            sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
            pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16,
        ),
    ),
    "qwenimage": TinyConfig(
        "QwenImageTransformer2DModel",
        dict(
            patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
        ),
    ),
    "hunyuanvideo": TinyConfig(
        "HunyuanVideoTransformer3DModel",
        dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
            num_single_layers=2, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=32,
            pooled_projection_dim=16, rope_axes_dim=(4, 6, 6),
        ),
    ),
    "cogvideox": TinyConfig(
        "CogVideoXTransformer3DModel",
        dict(
            num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=32,
            text_embed_dim=32, num_layers=3, sample_width=8, sample_height=8, sample_frames=5,
            patch_size=2, max_text_seq_length=8,
        ),
    ),
    "ltx": TinyConfig(
        "LTXVideoTransformer3DModel",
        dict(
            in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
            cross_attention_dim=32, num_layers=3, caption_channels=32,
        ),
    ),
}
