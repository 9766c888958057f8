"""Scaled float8: turning a weight into float8 bytes plus fp32 scales, and back.

Dequantizing is defined as `round(float(q) * scale)` in the weight's dtype. Two steps
compute exactly that on every device: the float8 -> weight-dtype copy is exact (every
float8_e4m3fn and float8_e5m2 value is representable in bfloat16, float16 and float32),
and the in-place multiply by an fp32 scale computes in fp32 and rounds once. So a block
dequantized in its slot equals the same weight dequantized anywhere else on that device.
See [Note: fp8 streaming]
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dlo.errors import EnableError


def quantize_into(weight: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    """Quantize the 2-D `weight` into the float8 view `data` and the fp32 view `scale`
    (shape (rows, 1): per output row; (1, 1): one scale), on the CPU. A weight holding NaN
    or Inf has no scale: refused, naming it."""
    finite_max = torch.finfo(data.dtype).max
    value = weight.detach().to("cpu", torch.float32, copy=True)  # divided in place below
    magnitude = value.abs()
    amax = magnitude.amax(dim=1, keepdim=True) if scale.shape[0] > 1 else magnitude.amax().reshape(1, 1)
    if not bool(torch.isfinite(amax).all()):
        pattern = f"^{re.escape(name)}$"
        raise EnableError(
            f"{name!r} holds NaN or Inf values, which float8 cannot scale; keep it in its dtype with "
            f"OffloadConfig(fp8_skip=({pattern!r},)), or fix the weights"
        )
    computed = amax / finite_max
    scale.copy_(torch.where(computed > 0, computed, torch.ones_like(computed)))  # an all-zero row: any scale
    data.copy_(value.div_(scale).clamp_(-finite_max, finite_max))


def dequantize_into(target: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    """target = round(float(data) * scale), on target's device (all three on it): one
    kernel where `_fused_kernel` runs, else two (the same values)."""
    fused = _fused_kernel(target.device) if target.is_cuda else None
    if fused is not None and target.is_contiguous() and data.is_contiguous() and scale.dtype == torch.float32:
        fused(target, data, scale)
        return
    target.copy_(data)
    target.mul_(scale)


@functools.cache
def _fused_kernel(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    """The one-pass kernel where it runs: Triton installed, an NVIDIA GPU that loads float8
    natively (compute capability 8.9 and up); else None, and the two-kernel path."""
    if torch.version.hip is not None or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    try:
        from dlo.host.fp8_kernel import dequantize_cuda
    except ImportError:
        return None
    return dequantize_cuda


@dataclass(frozen=True)
class DequantizedWeight:
    """What the dequantization kernel is compiled for: Triton specializes it on the weight's
    shape (sizes divisible by 16 or equal to 1) and on per-row or per-tensor scales."""

    stored: torch.dtype
    dtype: torch.dtype
    shape: tuple[int, int]
    scale_shape: tuple[int, int]


def prepare_dequantization(device: torch.device, weights: set[DequantizedWeight]) -> None:
    """Compile the one-pass kernel for every streamed weight's shape now, at enable(), not
    inside the first call's loads (where compiling a 3072 x 3072 weight's variant took 422 ms
    on the H200, holding the copy stream's enqueue lock)."""
    if device.type != "cuda":
        return
    for weight in sorted(weights, key=str):  # one weight of each kind at a time: the largest is the peak
        data = torch.zeros(weight.shape, dtype=weight.stored, device=device)
        dequantize_into(torch.empty(weight.shape, dtype=weight.dtype, device=device), data, torch.ones(weight.scale_shape, device=device))


def dequantized(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor of `dtype` on data's device holding the dequantized weight."""
    target = torch.empty(data.shape, dtype=dtype, device=data.device)
    dequantize_into(target, data, scale)
    return target
