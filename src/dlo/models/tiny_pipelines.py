"""Tiny but complete diffusers pipeline directories with random seeded weights.

For tests and demos of `dlo generate` / `dlo.enable_pipeline` where nothing can be downloaded:
each function builds every component of a real pipeline class (scheduler, VAE, tokenizers, text
encoders, transformer) from a tiny config, built locally, and `save_pretrained`s it, so
`DiffusionPipeline.from_pretrained(directory)` loads it from disk alone. The transformers reuse
the configs of `dlo.models.tiny_configs.TINY_CONFIGS`, widened to match the VAE and text encoders.
`GENERATE_DEFAULTS` holds call arguments that fit these pipelines (sizes the VAEs and patching
divide, a sequence length the tokenizers pad to); a 2-step call takes well under a second on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dlo.models.tiny_configs import TINY_CONFIGS

if TYPE_CHECKING:
    from torch import nn
    from transformers import CLIPTokenizer, PreTrainedConfig, T5Tokenizer

# Words the tokenizers know whole; anything else falls back to bytes (CLIP) or letters (T5).
_WORDS = ("a", "an", "red", "green", "blue", "cube", "sphere", "cat", "dog", "on", "the", "table", "photo", "of")
_TEXT_LENGTH = 32  # CLIP positions and the T5 tokenizers' model_max_length
_TEXT_DIM = 32  # hidden size of every tiny text encoder
_NOISE_STD = 0.02

GENERATE_DEFAULTS: dict[str, dict[str, Any]] = {
    # Flux: height/width multiples of 16 (VAE scale 8 x 2x2 packing); the transformer has no
    # guidance embedding (schnell-style), so guidance_scale 0.0 (the pipeline ignores it).
    "flux": {"height": 64, "width": 64, "max_sequence_length": _TEXT_LENGTH, "guidance_scale": 0.0},
    # Wan: height/width multiples of 16 (VAE scale 8 x patch 2), num_frames = 4k + 1; guidance
    # above 1 runs classifier-free guidance (two transformer passes per step).
    "wan": {"height": 32, "width": 32, "num_frames": 5, "max_sequence_length": _TEXT_LENGTH, "guidance_scale": 5.0},
}

M = TypeVar("M", bound="nn.Module")


def _seeded(seed: int, make: Callable[[], M]) -> M:
    """`make()` under `torch.manual_seed(seed)` (the caller's RNG state is restored), then every
    parameter shifted by seeded noise so that zero-initialised projections and biases carry signal
    too (norm scales stay near 1)."""
    import torch  # See [Note: parse before torch] (dlo/cli/main.py): the CLI lists TINY_PIPELINES

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = make().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in module.parameters():
            tensor.add_(torch.randn(tensor.shape, generator=generator) * _NOISE_STD)
    return module


def _clip_tokenizer() -> CLIPTokenizer:
    """Byte-level BPE over the 256 byte symbols (plus their end-of-word forms), merges that spell
    `_WORDS`, and CLIP's special tokens last, as in the real vocabulary."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    alphabet = sorted(ByteLevel.alphabet())
    merges: dict[tuple[str, str], None] = {}
    for word in _WORDS:
        symbols = [*word[:-1], word[-1] + "</w>"]
        for symbol in symbols[1:]:
            merges[(symbols[0], symbol)] = None
            symbols[0] += symbol
    tokens = [*alphabet, *(c + "</w>" for c in alphabet), *(a + b for a, b in merges)]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=list(merges),
        model_max_length=_TEXT_LENGTH,
    )


def _t5_tokenizer() -> T5Tokenizer:
    """Unigram over `_WORDS` and single letters, T5's `<pad>`=0, `</s>`=1, `<unk>`=2, no sentinels."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in _WORDS] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=_TEXT_LENGTH)


def _t5_config(config_cls: type[PreTrainedConfig], vocab_size: int) -> PreTrainedConfig:
    """A tiny `T5Config` / `UMT5Config` (encoder side; T5's pad 0 / eos 1 ids are the defaults)."""
    return config_cls(
        vocab_size=vocab_size, d_model=_TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
    )


def save_tiny_flux_pipeline(directory: Path, seed: int = 0) -> Path:
    """A `FluxPipeline` (CLIP + T5 text encoders, 16-channel VAE of scale 8, Flux transformer)
    saved to `directory`, which is returned."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
    clip_config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=_TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=_TEXT_LENGTH, projection_dim=_TEXT_DIM,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    latent_channels = 16
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=_seeded(seed, lambda: AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4, latent_channels=latent_channels,
            sample_size=64, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
        )),
        text_encoder=_seeded(seed, lambda: CLIPTextModel(clip_config)),
        tokenizer=tokenizer,
        text_encoder_2=_seeded(seed, lambda: T5EncoderModel(_t5_config(T5Config, len(tokenizer_2)))),
        tokenizer_2=tokenizer_2,
        transformer=_seeded(seed, lambda: FluxTransformer2DModel(**{
            **TINY_CONFIGS["flux"].config,
            "in_channels": latent_channels * 4,  # 2x2 patches of latents, packed
            "joint_attention_dim": _TEXT_DIM,
            "pooled_projection_dim": _TEXT_DIM,
        })),
    )
    pipe.save_pretrained(directory)
    return Path(directory)


def save_tiny_wan_pipeline(directory: Path, seed: int = 0) -> Path:
    """A text-to-video `WanPipeline` (UMT5 text encoder, Wan VAE of scale 8 spatial / 4 temporal,
    Wan transformer, UniPC flow scheduler) saved to `directory`, which is returned."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _t5_tokenizer()
    z_dim = 16
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=_seeded(seed, lambda: UMT5EncoderModel(_t5_config(UMT5Config, len(tokenizer)))),
        vae=_seeded(seed, lambda: AutoencoderKLWan(
            base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        )),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
        transformer=_seeded(seed, lambda: WanTransformer3DModel(**{
            **TINY_CONFIGS["wan"].config, "in_channels": z_dim, "out_channels": z_dim, "text_dim": _TEXT_DIM,
        })),
    )
    pipe.save_pretrained(directory)
    return Path(directory)


# `dlo make-tiny KIND DIR`: the pipelines by kind.
TINY_PIPELINES: dict[str, Callable[[Path], Path]] = {"flux": save_tiny_flux_pipeline, "wan": save_tiny_wan_pipeline}
