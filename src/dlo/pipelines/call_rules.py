"""What a diffusers pipeline accepts as a call, read from its directory's configs alone.

`read_call_rules` reads `vae/config.json`, `transformer/config.json` and the pipeline class's
`__call__` signature (no weights); `validate_call` is a pure function from those rules and a
request to the request itself or one `CallRuleError` naming the field and the allowed values.
The CLI and any other front end (an HTTP server) validate with the same two functions, before
anything is loaded.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

from dlo.errors import ConfigError

# Pipelines that pack 2x2 latent patches into one token whatever the transformer's patch_size
# (Flux's config says patch_size=1): their sizes are multiples of 2 x the VAE scale.
_PACKS_2X2_LATENTS = ("Flux", "Chroma", "QwenImage")
# Transformers whose positional embedding covers a fixed number of latent patches along each
# axis, and the config field giving that number: a size beyond it is a shape error deep inside
# the call (Wan: "shape '[1, 1, 52, -1]' is invalid"). Wan's RoPE tables cover frames too.
_POSITIONS_PER_SIDE = {
    "WanTransformer3DModel": ("rope_max_seq_len", True),
    "WanVACETransformer3DModel": ("rope_max_seq_len", True),
    "SD3Transformer2DModel": ("pos_embed_max_size", False),  # a learned grid, cropped to the size
}
# Default ceiling on the transformer's sequence (latent patches x latent frames), what its
# attention cost grows with: 2**17 tokens, e.g. Wan 1280x720 at 121 frames (111600), Flux 5792².
DEFAULT_MAX_TOKENS = 2**17
# The largest seed of a call: torch.Generator.manual_seed takes 0 to 2**64 - 1 (a negative one
# wraps onto these).
MAX_SEED = 2**64 - 1
# The largest LoRA scale, either sign: far beyond any useful one (people use about -2 to 2).
MOST_LORA_SCALE = 100.0


class CallRuleError(ConfigError):
    """A requested value the pipeline cannot take. `field` is the pipeline's argument name."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        super().__init__(f"{field} {value}: {allowed}")
        self.field, self.value, self.allowed = field, value, allowed


@dataclass(frozen=True)
class PositionLimit:
    """The transformer places at most `per_side` latent patches along height and width (and,
    with `temporal_patch`, along latent frames in patches of that many): its config's `field`."""

    transformer: str  # the transformer class name, for messages
    field: str
    per_side: int
    temporal_patch: int | None


@dataclass(frozen=True)
class CallRules:
    pipeline: str  # the pipeline class name, for messages
    spatial_multiple: int  # height and width: VAE scale x patch (or 2x2 packing)
    temporal_multiple: int | None  # video: num_frames = k * temporal_multiple + 1
    max_sequence_length: int | None  # the pipeline's default, which is its maximum
    vae_channels: int  # channels of the VAE decoder at full resolution (memory estimate)
    default_size: tuple[int, int, int]  # (height, width, frames) the pipeline takes when not given
    positions: PositionLimit | None = None  # None: sizes limited by tokens alone


@dataclass(frozen=True)
class CallRequest:
    """The sizes of one call; None means the pipeline's default."""

    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    max_sequence_length: int | None = None


def _vae_scales(vae: dict) -> tuple[int, int | None]:
    """(spatial, temporal) downscaling of a VAE config, as the diffusers pipelines compute them."""
    if "scale_factor_spatial" in vae:  # AutoencoderKLWan
        return int(vae["scale_factor_spatial"]), int(vae["scale_factor_temporal"])
    if "spatial_compression_ratio" in vae:  # LTX, HunyuanVideo, Mochi...
        return int(vae["spatial_compression_ratio"]), vae.get("temporal_compression_ratio")
    if "temperal_downsample" in vae:  # AutoencoderKLQwenImage
        return 2 ** len(vae["temperal_downsample"]), None
    if "block_out_channels" in vae:  # AutoencoderKL
        return 2 ** (len(vae["block_out_channels"]) - 1), vae.get("temporal_compression_ratio")
    return 8, None  # what diffusers' pipelines assume without a VAE


def _spatial_patch(transformer: dict) -> int:
    patch = transformer.get("patch_size", 1) or 1
    return int(patch[-1] if isinstance(patch, (list, tuple)) else patch)


def _position_limit(transformer: dict) -> PositionLimit | None:
    class_name = transformer.get("_class_name")
    field, frames_too = _POSITIONS_PER_SIDE.get(class_name, (None, False))
    per_side = transformer.get(field) if field else None
    if not isinstance(per_side, int) or isinstance(per_side, bool):
        return None
    patch = transformer.get("patch_size")
    temporal_patch = int(patch[0]) if frames_too and isinstance(patch, (list, tuple)) and len(patch) == 3 else None
    return PositionLimit(class_name, field, per_side, temporal_patch if frames_too else None)


def read_call_rules(model_dir: Path, pipeline_cls: type) -> CallRules:
    """The rules of `pipeline_cls` loaded from `model_dir`, from configs and signatures only."""
    from dlo.host.checkpoint import read_json_object  # torch. See [Note: parse before torch]

    vae_dir = model_dir / "vae"
    vae = read_json_object(vae_dir / "config.json") if (vae_dir / "config.json").is_file() else {}
    transformer = read_json_object(model_dir / "transformer" / "config.json")
    spatial, temporal = _vae_scales(vae)
    packing = 2 if pipeline_cls.__name__.startswith(_PACKS_2X2_LATENTS) else 1
    parameters = inspect.signature(pipeline_cls.__call__).parameters
    sequence = parameters.get("max_sequence_length")
    takes_frames = "num_frames" in parameters
    channels = vae.get("block_out_channels") or [vae.get("base_dim", 128)]
    # Pipelines without size defaults in their signature (Flux, SD3) take sample_size latents.
    side = transformer.get("sample_size") if isinstance(transformer.get("sample_size"), int) else 128

    def default(name: str, fallback: int) -> int:
        value = parameters[name].default if name in parameters else None
        return value if isinstance(value, int) else fallback

    return CallRules(
        pipeline=pipeline_cls.__name__,
        spatial_multiple=spatial * max(_spatial_patch(transformer), packing),
        temporal_multiple=int(temporal) if takes_frames and temporal else None,
        max_sequence_length=sequence.default if sequence and isinstance(sequence.default, int) else None,
        vae_channels=int(channels[0]),
        default_size=(default("height", side * spatial), default("width", side * spatial), default("num_frames", 1)),
        positions=_position_limit(transformer),
    )


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def tokens(rules: CallRules, height: int, width: int, frames: int) -> int:
    """The transformer's sequence length for a size: latent patches x latent frames."""
    return (height // rules.spatial_multiple) * (width // rules.spatial_multiple) * _latent_frames(rules, frames)


def requested_size(rules: CallRules, request: CallRequest) -> tuple[int, int, int]:
    """(height, width, frames) of a call: the request's, the pipeline's defaults where unset."""
    given = (request.height, request.width, request.num_frames)
    return tuple(g if g is not None else default for g, default in zip(given, rules.default_size))


def size_text(rules: CallRules, height: int, width: int, frames: int) -> str:
    """`HxW`, or `HxWxF` for a video pipeline."""
    return f"{height}x{width}" + (f"x{frames}" if rules.temporal_multiple else "")


def _latent_frames(rules: CallRules, frames: int) -> int:
    return (frames - 1) // rules.temporal_multiple + 1 if rules.temporal_multiple else 1


def _check_positions(rules: CallRules, request: CallRequest) -> None:
    """The size's latent patches along each axis against the transformer's PositionLimit."""
    limit = rules.positions
    if limit is None:
        return
    height, width, frames = requested_size(rules, request)
    multiple, most = rules.spatial_multiple, limit.per_side
    sides = [height // multiple, width // multiple]
    frames_covered = limit.temporal_patch is not None and rules.temporal_multiple is not None
    if frames_covered:
        sides.append(_latent_frames(rules, frames) // limit.temporal_patch)
    if max(sides) <= most:
        return
    allowed = f"height and width up to {most * multiple}"
    if frames_covered:
        allowed += f", frames up to {(most * limit.temporal_patch - 1) * rules.temporal_multiple + 1}"
    default = (request.height, request.width, request.num_frames) == (None, None, None)
    raise CallRuleError(
        "size", size_text(rules, height, width, frames),
        f"{limit.transformer} places at most {most} latent patches per side ({limit.field} {most} in its config): "
        f"{allowed}; ask for a smaller size" + (f" (this is {rules.pipeline}'s default)" if default else ""),
    )


def validate_call(rules: CallRules, request: CallRequest, max_tokens: int, dtype_bytes: int) -> CallRequest:
    """`request` if `rules` allow it, else the first `CallRuleError` (height, width, frames,
    sequence length, the transformer's positional limit, then the size limit with an estimate
    of the memory it would take)."""
    multiple = rules.spatial_multiple
    for name in ("height", "width"):
        value = getattr(request, name)
        if value is not None and (value < multiple or value % multiple):
            raise CallRuleError(name, value, f"{rules.pipeline} takes positive multiples of {multiple} ({multiple}, {2 * multiple}, ...)")
    frames = request.num_frames
    if frames is not None:
        step = rules.temporal_multiple or 1
        if frames < 1 or (frames - 1) % step:
            allowed = f"{rules.pipeline} takes {step}k+1 frames (1, {step + 1}, {2 * step + 1}, ...)" if step > 1 else "at least 1"
            raise CallRuleError("num_frames", frames, allowed)
    length = request.max_sequence_length
    if length is not None:
        most = rules.max_sequence_length
        if length < 1 or (most is not None and length > most):
            raise CallRuleError("max_sequence_length", length, f"{rules.pipeline} takes 1 to {most}" if most else "at least 1")
    _check_positions(rules, request)
    height, width, frame_count = requested_size(rules, request)
    sequence = tokens(rules, height, width, frame_count)
    if sequence > max_tokens:
        # The VAE decoder's last stage holds `vae_channels` values per output pixel (in the
        # run's dtype), and the decoded result 3 float32 values per pixel: a lower bound.
        estimate = height * width * frame_count * (rules.vae_channels * dtype_bytes + 3 * 4)
        raise CallRuleError(
            "size", size_text(rules, height, width, frame_count),
            f"{sequence} transformer tokens, over the limit of {max_tokens} (max_tokens); the VAE alone would need "
            f"at least {_gib(estimate)}: ask for a smaller size or raise the limit",
        )
    return request
