"""`dlo serve`'s request bodies and their checks, done before a request is queued.

An image request (OpenAI's images API) and a video request (OpenAI-style `POST /v1/videos`)
share the pipeline's fields; `pipeline_kwargs` turns either into the pipeline's arguments with
the same rules as `dlo generate` (call_rules), or raises a RequestError naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dlo.pipelines.call_rules import MAX_SEED, MOST_LORA_SCALE, CallRequest, CallRuleError, CallRules, validate_call
from dlo.pipelines.lora_adapters import Adapters

_PROMPT_CHARS = 10_000
# max_sequence_length where the pipeline's signature gives no default (which would bound it):
# the largest default of any diffusers pipeline (4096; most take 512 or less).
_MOST_TEXT_TOKENS = 4096
# guidance_scale: finite and far beyond any useful scale (pipelines use 0 to about 20), so the
# guided noise prediction cannot overflow.
_MOST_GUIDANCE = 1000.0
_MOST_LORAS = 16  # adapters one request may run with


class LoraChoice(BaseModel):
    """One of the server's LoRAs (`dlo serve --lora NAME=...`), at `scale` (unset: NAME's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=64)
    scale: float | None = Field(default=None, ge=-MOST_LORA_SCALE, le=MOST_LORA_SCALE, allow_inf_nan=False)


class _PipelineFields(BaseModel):
    """The fields both endpoints pass to the pipeline. Strict: `"n": "2"` or `"n": true` is
    refused naming the field, not coerced (an integer where a number is asked is a number)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, max_length=_PROMPT_CHARS)
    model: str | None = None  # one model per server: accepted, not checked
    size: str | None = None  # "WxH"; unset or "auto": the pipeline's default
    negative_prompt: str | None = Field(default=None, max_length=_PROMPT_CHARS)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)  # as `dlo generate --seed`; image k of a request uses seed + k
    num_inference_steps: int = Field(default=28, ge=1)
    guidance_scale: float | None = Field(default=None, ge=-_MOST_GUIDANCE, le=_MOST_GUIDANCE, allow_inf_nan=False)
    max_sequence_length: int | None = Field(default=None, ge=1, le=_MOST_TEXT_TOKENS)
    lora: list[LoraChoice] = Field(default=[], max_length=_MOST_LORAS)  # none: the base model


class ImageRequest(_PipelineFields):
    """POST /v1/images/generations: OpenAI's fields, and the pipeline's own as extensions."""

    user: str | None = None  # accepted and ignored, as quality and style
    quality: str | None = None
    style: str | None = None
    n: int = Field(default=1, ge=1)
    response_format: Literal["b64_json"] | None = None  # null, as unset: b64_json, the only one


class VideoRequest(_PipelineFields):
    """POST /v1/videos. `format`: the content's container; unset, mp4 where imageio-ffmpeg is
    importable, else webp (animated, lossless)."""

    num_frames: int | None = None  # unset: the pipeline's default
    fps: int = Field(default=16, ge=1, le=120)
    format: Literal["mp4", "webp"] | None = None


@dataclass(frozen=True)
class Limits:
    max_images: int
    max_steps: int
    max_tokens: int
    dtype_bytes: int
    timeout_s: float


class RequestError(Exception):
    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def chosen_adapters(request: ImageRequest | VideoRequest, lora_scales: dict[str, float]) -> Adapters:
    """The adapters the request's job runs with, or a RequestError naming the field.
    `lora_scales`: the server's LoRAs by name, at their --lora scales."""
    names = [choice.name for choice in request.lora]
    for name in names:
        if name not in lora_scales:
            loaded = f"it has {', '.join(lora_scales)}" if lora_scales else "it has none (dlo serve --lora NAME=PATH loads one)"
            raise RequestError("lora", f"lora: no LoRA named {name!r} on this server; {loaded}")
        if names.count(name) > 1:
            raise RequestError("lora", f"lora: {name!r} is given twice; give each LoRA once, with its scale")
    return tuple((c.name, lora_scales[c.name] if c.scale is None else c.scale) for c in request.lora)


_SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")


def pipeline_kwargs(
    request: ImageRequest | VideoRequest, rules: CallRules, limits: Limits, parameters: frozenset[str]
) -> dict:
    """The pipeline's arguments for `request`, or a RequestError naming the field. `parameters`:
    the names the pipeline's __call__ takes; an image request to a video pipeline, or the
    reverse, is refused naming the endpoint to use."""
    video = "num_frames" in parameters
    if isinstance(request, VideoRequest) and not video:
        raise RequestError(None, f"{rules.pipeline} makes images, not videos: use POST /v1/images/generations")
    if isinstance(request, ImageRequest):
        if video:
            raise RequestError(None, f"{rules.pipeline} makes videos, not images: use POST /v1/videos")
        if request.n > limits.max_images:
            raise RequestError("n", f"n={request.n}: at most {limits.max_images} images per request")
        if request.seed + request.n - 1 > MAX_SEED:
            raise RequestError(
                "seed", f"seed={request.seed}: image k of a request uses seed + k, and image {request.n - 1}'s would be "
                f"over {MAX_SEED}; give at most {MAX_SEED - request.n + 1}",
            )
    if request.num_inference_steps > limits.max_steps:
        raise RequestError("num_inference_steps", f"at most {limits.max_steps} steps per request")
    height = width = None
    if request.size not in (None, "auto"):
        match = _SIZE.fullmatch(request.size.lower())
        if match is None:
            raise RequestError("size", f"size={request.size!r}: give WIDTHxHEIGHT in pixels, e.g. 1024x1024")
        width, height = int(match[1]), int(match[2])
    frames = request.num_frames if isinstance(request, VideoRequest) else None
    try:
        call = validate_call(
            rules, CallRequest(height, width, frames, request.max_sequence_length), limits.max_tokens,
            limits.dtype_bytes,
        )
    except CallRuleError as err:
        if err.field in ("height", "width"):  # of the request's WIDTHxHEIGHT: say which
            raise RequestError("size", f"size={request.size}: the {err.field} {err.value}: {err.allowed}") from None
        if err.field == "size":  # the size rules' HxW(xF), which the request's WxH (or none) resolved to
            axes = "height x width" + (" x frames" if err.value.count("x") == 2 else "")
            given = request.size if request.size not in (None, "auto") else "auto"
            raise RequestError("size", f"size={given} ({err.value}, {axes}): {err.allowed}") from None
        raise RequestError(err.field, f"{err.field}={err.value}: {err.allowed}") from None
    wanted = {
        "prompt": request.prompt,
        "negative_prompt": request.negative_prompt,
        "num_inference_steps": request.num_inference_steps,
        "height": call.height,
        "width": call.width,
        "num_frames": call.num_frames,
        "guidance_scale": request.guidance_scale,
        "max_sequence_length": call.max_sequence_length,
    }
    given = {k: v for k, v in wanted.items() if v is not None}
    for name in given:
        if name not in parameters:
            raise RequestError(name, f"{name}: {rules.pipeline} does not take it")
    return given
