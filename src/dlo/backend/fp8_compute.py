"""FP8 GEMMs for streamed blocks: `OffloadConfig(fp8_compute=True)`.

[Note: fp8 compute]
With `stream_dtype="fp8"` the float8 weights are normally dequantized into the slot and the
block multiplies in bf16. With `fp8_compute=True`, enable() turns each eligible Linear of a
streamed block into an `Fp8GemmLinear` before anything is planned: its `weight` becomes the
float8_e4m3fn data (quantized on the CPU as for streaming) and a `weight_scale` buffer holds
its fp32 scales as a (1, out) row (a per-tensor scale repeated). From then on the block is an
ordinary one whose tensors happen to be float8, fp32 and bf16: the planner lays them out, the
slot holds them as they are (no landing buffer, no dequantization: about half the slot), and
the forward runs `torch._scaled_mm` with the input quantized per row. Eligible: a plain
nn.Linear (not a subclass, whose forward would be lost) that `stream_dtype` would quantize,
with a bf16 weight and bias (the row-wise FP8 GEMM's output dtype) and both dimensions
multiples of 16 (its alignment), and not sharing its weight with another module. Any other
chosen weight streams as float8 and is dequantized, as without `fp8_compute`.
`dlo.quantize_resident` makes the same Linears on the resident model, so the streamed model
equals it bit for bit. disable() gives back bf16 Linears holding the dequantized weights, as
fp8 streaming does; a failed enable() gives back the weights it found.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from dlo.config import OffloadConfig
from dlo.errors import ConfigError, EnableError
from dlo.host.fp8_codec import dequantized, quantize_into
from dlo.hotpath.fp8_gemm import Fp8GemmLinear
from dlo.planning.fp8_selection import fp8_format, quantized_tensors
from dlo.planning.offload_plan import BlockRef
from dlo.planning.tensor_walk import owned_tensors

ALIGNMENT = 16  # elements: torch._scaled_mm's requirement on both dimensions


def check_fp8_gemms(device: torch.device) -> None:
    """Refuse, naming the option, a device without FP8 GEMMs: before anything is quantized."""
    if device.type == "cpu":
        return
    if device.type != "cuda" or torch.version.hip is not None:
        raise EnableError(
            f"OffloadConfig.fp8_compute=True runs FP8 GEMMs on NVIDIA GPUs (or the CPU), not on {device}; set "
            "fp8_compute=False to dequantize the float8 weights instead"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise EnableError(
            f"OffloadConfig.fp8_compute=True needs FP8 GEMMs, which {torch.cuda.get_device_name(device)} "
            f"(compute capability {major}.{minor}) lacks (8.9 and up: Ada, Hopper, Blackwell); set "
            "fp8_compute=False to dequantize the float8 weights instead"
        )


@dataclass
class _Converted:
    linear: nn.Linear
    found: torch.Tensor | None  # the weight's tensor before; None once committed


class Fp8GemmLinears:
    """The Linears made `Fp8GemmLinear`s, with what undoes it."""

    def __init__(self) -> None:
        self._converted: list[_Converted] = []

    def __len__(self) -> int:
        return len(self._converted)

    def convert(self, root: nn.Module, refs: list[BlockRef], config: OffloadConfig) -> None:
        """Each eligible Linear of the blocks `refs`, its weight quantized on the CPU and
        placed where the weight was. `rollback()` undoes the ones done, also after a failure."""
        fp8 = fp8_format(config)
        assert fp8 is not None and fp8.dtype == torch.float8_e4m3fn  # OffloadConfig checked it
        eligible = [found for ref in refs for found in _eligible(root, ref, config)]
        if refs and not eligible:
            raise ConfigError(
                "OffloadConfig.fp8_compute=True found no Linear in the streamed blocks to run as an FP8 GEMM: they "
                "need bf16 weights (load the model with torch_dtype=torch.bfloat16; --dtype bfloat16) and both "
                f"dimensions multiples of {ALIGNMENT}; or set fp8_compute=False"
            )
        with torch.no_grad():
            for name, linear in eligible:
                weight = linear.weight
                data = torch.empty(weight.shape, dtype=fp8.dtype)
                scale = torch.empty(fp8.scale_shape(weight.shape[0]), dtype=torch.float32)
                quantize_into(weight, data, scale, name)
                row = scale.reshape(1, -1).expand(1, weight.shape[0]).contiguous()
                self._converted.append(_Converted(linear, weight.data))
                linear.register_buffer("weight_scale", row.to(weight.device))
                weight.data = data.to(weight.device)
                linear.__class__ = Fp8GemmLinear

    def commit(self) -> None:
        """enable() succeeded: the weights found are no longer held."""
        for converted in self._converted:
            converted.found = None

    def rollback(self) -> None:
        """A failed enable(): every converted Linear gets the weight it had back."""
        for converted in reversed(self._converted):
            assert converted.found is not None, "rollback after commit"
            _plain(converted.linear).weight.data = converted.found
        self._converted.clear()

    def dequantize_back(self) -> None:
        """disable(), once the blocks have their host tensors back: bf16 Linears again, each
        holding its dequantized weight."""
        with torch.no_grad():
            for converted in self._converted:
                linear = converted.linear
                weight, scale = linear.weight, linear.weight_scale
                _plain(linear).weight.data = dequantized(weight.data, scale.reshape(-1, 1), torch.bfloat16)
        self._converted.clear()


def _plain(linear: nn.Linear) -> nn.Linear:
    """`linear` an nn.Linear again, without its scales (done or not)."""
    linear.__class__ = nn.Linear
    linear._buffers.pop("weight_scale", None)
    return linear


def _eligible(root: nn.Module, ref: BlockRef, config: OffloadConfig) -> list[tuple[str, nn.Linear]]:
    chosen = quantized_tensors(root, ref, config)
    owners = Counter(id(owned.tensor) for owned in owned_tensors(ref.module))
    found = []
    for owned in owned_tensors(ref.module):
        linear = owned.owner
        if owned.key != "weight" or id(owned.tensor) not in chosen or type(linear) is not nn.Linear:
            continue
        bias = linear.bias
        if (
            owned.tensor.dtype == torch.bfloat16
            and (bias is None or bias.dtype == torch.bfloat16)
            and linear.in_features % ALIGNMENT == 0
            and linear.out_features % ALIGNMENT == 0
            and owners[id(owned.tensor)] == 1
        ):
            found.append((f"{ref.name}.{owned.name}", linear))
    return found


def quantize_resident_gemms(root: nn.Module, refs: list[BlockRef], config: OffloadConfig) -> int:
    """The Linears `enable()` would convert, converted for good on a resident model (for
    `dlo.quantize_resident`). Returns how many."""
    linears = Fp8GemmLinears()
    linears.convert(root, refs, config)
    linears.commit()
    return len(linears)
