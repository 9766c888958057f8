"""The VAE decode's activation peak, predicted before anything runs: the decode is run on a twin
of the VAE on the meta device (shapes only, no data) while every storage it allocates is counted.

[Note: predicted decode peak]
On the meta device every operator computes its outputs' shapes and allocates nothing, so a
decode there costs a fraction of a second, yet it allocates the same tensors in the same order
as on the device: counting each new storage's bytes until it is freed gives the peak of live
activations. Two exceptions: attention, which meta would run as its math path (the whole score
matrix), is counted as a fused kernel allocates it (the output and its log-sum-exp); and the
device adds what meta cannot see (convolution workspaces, the allocator's rounding), which the
budget's headroom covers. benchmarks/bench_pipeline_budget.py prints the prediction beside the
device's measured peak. Three ways to decode:
- whole: the decode as the pipeline calls it;
- sliced (a batch of several): one sample's decode plus every sample's output twice (the
  slices' outputs and their concatenation);
- tiled: one tile's decode (the VAE's tile size, every frame) plus five times the output
  (the tiles' overlapping outputs, held until they are blended, the blended rows, their
  concatenation and the clamped copy). Running
  the tiled decode itself on meta would count exactly, but it runs the decoder once per tile:
  tens of seconds for a video.
Each adds what the pipeline's post-processing holds beside the output (two float32 copies).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dlo.errors import ConfigError, first_line
from dlo.planning.pipeline_budget import DecodeCost, DecodeMode

# tiled: the overlapping tiles' outputs (under 2x the output for overlaps <= 1/4 of a tile), the
# blended rows, their concatenation and the clamped copy: counted exactly on meta, a Wan decode at
# 720x1280, 81 frames, holds 4.7x the output at its peak.
_OUTPUT_COPIES = 5
_POSTPROCESS_COPIES = 2  # float32 copies of the output made by the pipeline's image/video processor


@dataclass(frozen=True)
class OutputSize:
    """The size of what a pipeline call makes: the VAE decode's plan is made for it."""

    height: int
    width: int
    frames: int = 1  # video pipelines
    batch: int = 1  # images or videos per call

    def __post_init__(self) -> None:
        for name in ("height", "width", "frames", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"OutputSize.{name} must be an int >= 1, got {value!r}")


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages the operators under it create, while they live; those
    of `existing` tensors (a module's weights) and of views of them are not counted."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: weakref.WeakSet = weakref.WeakSet(t.untyped_storage() for t in existing)

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage not in self._seen:  # a view shares its base's storage
                    self._seen.add(storage)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._freed, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


class _FusedAttention(TorchFunctionMode):
    """`F.scaled_dot_product_attention` as a fused kernel allocates it: the output and one
    float32 log-sum-exp per query row. On meta it would run the math path, which materializes
    the whole query x key score matrix (a 1024² Flux VAE decode counted 48 % more that way)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        query, value = args[0], args[2] if len(args) > 2 else (kwargs or {})["value"]
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)  # the log-sum-exp, freed at once
        return out


def meta_peak(run: Callable[[], object], existing: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the largest set of storages alive at once while `run()` runs on the meta device:
    what it allocates (the inputs it makes too), `existing` tensors (the weights) excluded."""
    with torch.no_grad(), _FusedAttention(), _LiveBytes(existing) as counter:
        run()
    return counter.peak


def latent_shape(pipe: object, size: OutputSize) -> tuple[int, ...]:
    """The latents the pipeline hands its VAE for `size`: (batch, channels, [frames,] h, w)."""
    vae = pipe.vae
    channels = getattr(vae.config, "z_dim", None) or getattr(vae.config, "latent_channels", None)
    spatial = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None)
    if not channels or not spatial:
        raise ConfigError(
            f"OffloadConfig.hbm_budget_gib plans the VAE decode from its latents' shape, which dlo cannot tell for "
            f"{type(pipe).__name__} with {type(vae).__name__}; leave hbm_budget_gib unset for this pipeline"
        )
    spatial_shape = (size.height // spatial, size.width // spatial)
    downsample = getattr(vae.config, "temperal_downsample", None)  # (sic) the video-VAE family: 5-D latents
    if downsample is None:
        return (size.batch, channels, *spatial_shape)
    temporal = getattr(pipe, "vae_scale_factor_temporal", None) or 2 ** sum(downsample)
    return (size.batch, channels, (size.frames - 1) // temporal + 1, *spatial_shape)


def call_size(pipe: object, height: int | None, width: int | None, frames: int | None) -> OutputSize:
    """The size a call makes: what it names, the pipeline's defaults for the rest."""
    default = default_size(pipe)
    return OutputSize(height or default.height, width or default.width, frames or default.frames)


def default_size(pipe: object) -> OutputSize:
    """What the pipeline makes when the call names no size: its __call__'s defaults, or (Flux,
    SD3...) its default sample size times the VAE's scale."""
    params = inspect.signature(type(pipe).__call__).parameters
    defaults = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    sample = getattr(pipe, "default_sample_size", None)
    scale = getattr(pipe, "vae_scale_factor", None)
    fallback = sample * scale if sample and scale else None
    height, width = defaults.get("height") or fallback, defaults.get("width") or fallback
    if not height or not width:
        raise ConfigError(
            f"{type(pipe).__name__} has no default output size to plan the VAE decode for: give the call's size "
            "(enable_pipeline's size=OutputSize(height, width); dlo generate's --height and --width)"
        )
    return OutputSize(height, width, defaults.get("num_frames") or 1)


def _meta_twin(vae: nn.Module) -> nn.Module:
    """A VAE of the same class and config on the meta device, each tensor of its dtype."""
    with torch.device("meta"):
        twin = type(vae).from_config(vae.config)
    shapes = {name: torch.empty_like(tensor, device="meta") for name, tensor in vae.state_dict().items()}
    twin.load_state_dict(shapes, assign=True)
    return twin.eval()


def _tile_latent(vae: nn.Module, spatial: int) -> tuple[int, int] | None:
    """The latent size of one tile of the VAE's tiled decode, where its attributes say it."""
    if hasattr(vae, "tile_latent_min_size"):  # AutoencoderKL and its kin
        return vae.tile_latent_min_size, vae.tile_latent_min_size
    if hasattr(vae, "tile_sample_min_height"):  # the video VAEs (Wan, Qwen-Image, HunyuanVideo...)
        return vae.tile_sample_min_height // spatial, vae.tile_sample_min_width // spatial
    return None


def decode_costs(pipe: object, size: OutputSize) -> list[DecodeCost]:
    """The ways `pipe.vae` can decode `size`, most faithful first (whole, sliced, tiled), each
    with its predicted activation peak. See [Note: predicted decode peak]"""
    vae = getattr(pipe, "vae", None)
    if not isinstance(vae, nn.Module):
        return [DecodeCost(DecodeMode.WHOLE, 0)]
    shape = latent_shape(pipe, size)
    twin = _meta_twin(vae)
    dtype = vae.dtype  # the latents' dtype: the pipelines decode in the VAE's
    element = torch.empty((), dtype=dtype).element_size()
    one_output = 3 * size.frames * size.height * size.width * element
    post = _POSTPROCESS_COPIES * size.batch * one_output * 4 // element

    def decode(latent: tuple[int, ...]) -> int:
        try:
            return meta_peak(lambda: twin.decode(torch.empty(latent, dtype=dtype, device="meta")), twin.state_dict().values())
        except Exception as err:  # the VAE's own shape checks: one line, before anything moved
            raise ConfigError(
                f"OffloadConfig.hbm_budget_gib: {type(vae).__name__} cannot decode latents of shape {latent} for a "
                f"{size.height}x{size.width} output ({first_line(err)}); give a size the VAE takes, or leave "
                "hbm_budget_gib unset"
            ) from None

    costs = [DecodeCost(DecodeMode.WHOLE, decode(shape) + post)]
    one = (1, *shape[1:])
    if size.batch > 1 and hasattr(vae, "enable_slicing"):
        costs.append(DecodeCost(DecodeMode.SLICED, decode(one) + 2 * size.batch * one_output + post))
    spatial = size.height // shape[-2]
    tile = _tile_latent(vae, spatial) if hasattr(vae, "enable_tiling") else None
    if tile is not None and (tile[0] < shape[-2] or tile[1] < shape[-1]):  # else one tile: the whole decode
        tiled = (1, *shape[1:-2], min(tile[0], shape[-2]), min(tile[1], shape[-1]))
        outputs = _OUTPUT_COPIES * size.batch * one_output
        costs.append(DecodeCost(DecodeMode.TILED, decode(tiled) + outputs + post))
    return costs


def apply_decode(vae: nn.Module | None, mode: DecodeMode, batch: int, undo: list[Callable[[], None]]) -> None:
    """Set the VAE to decode the planned way; what gives back its previous tiling and slicing is
    put on `undo` first, so that a failure halfway is undone too."""
    if vae is None or mode is DecodeMode.WHOLE:
        return
    tiling, slicing = getattr(vae, "use_tiling", False), getattr(vae, "use_slicing", False)

    def restore() -> None:
        if not tiling and getattr(vae, "use_tiling", False):
            vae.disable_tiling()
        if not slicing and getattr(vae, "use_slicing", False):
            vae.disable_slicing()

    undo.append(restore)
    if mode is DecodeMode.TILED:
        vae.enable_tiling()
    if mode is DecodeMode.SLICED or (mode is DecodeMode.TILED and batch > 1):
        vae.enable_slicing()
