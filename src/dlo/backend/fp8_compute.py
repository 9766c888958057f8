"""FP8 GEMMs for streamed blocks: `OffloadConfig(fp8_compute=True)`.

[Note: fp8 compute]
With `stream_dtype="fp8"` the float8 weights are normally dequantized into the slot and the
block multiplies in bf16. With `fp8_compute=True`, enable() turns each Linear that
`planning.fp8_selection.gemm_linears` picks into an `Fp8GemmLinear` before anything is
planned: its `weight` becomes the float8_e4m3fn data (quantized on the CPU as for streaming)
and a `weight_scale` buffer holds its fp32 scales as a (1, out) row (a per-tensor scale
repeated). From then on the block is an ordinary one whose tensors happen to be float8, fp32
and bf16: the planner lays them out, the slot holds them as they are (no landing buffer, no
dequantization: about half the slot), and the forward runs `torch._scaled_mm` with the input
quantized per row. The other weights `stream_dtype` picks stream as float8 and are
dequantized, as without `fp8_compute`.
The Linear's class is swapped in place (and back), not the module replaced in its parent: it
keeps its identity, so whatever holds it (an adapter wrapping it as its base layer, the
user's references) sees the float8 weights instead of a detached module that would still hold
the bf16 ones. Linears something else has claimed (hooks, a forward of their own) or reads
the weight of (a DoRA adapter) are left, see `gemm_linears`.
`dlo.quantize_resident` converts the same Linears of the resident model, so the streamed
model equals it bit for bit. disable() gives back nn.Linears holding the dequantized weights,
as fp8 streaming does (repeatable: a disable() cut short and called again ends the same); a
failed enable() gives back the very tensors it found.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dlo.config import OffloadConfig
from dlo.errors import ConfigError, EnableError
from dlo.host.fp8_codec import dequantized, quantize_into
from dlo.hotpath.fp8_gemm import Fp8GemmLinear
from dlo.planning.fp8_selection import GEMM_DIMENSION_MULTIPLE, fp8_format, gemm_linears
from dlo.planning.offload_plan import BlockRef


def check_fp8_gemms(device: torch.device) -> None:
    """Refuse, naming the option, a device without FP8 GEMMs: before anything is quantized."""
    if device.type == "cpu":
        return
    if device.type != "cuda" or torch.version.hip is not None:
        where = "ROCm" if device.type == "cuda" else str(device)
        raise EnableError(
            f"OffloadConfig.fp8_compute=True runs FP8 GEMMs on NVIDIA GPUs (or the CPU), not on {where}; set "
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
    scale: torch.Tensor  # the weight_scale buffer given to it (repointed with the block, like its weight)
    found: torch.Tensor | None  # the weight's tensor before; None once committed


class Fp8GemmConversion:
    """The Linears made `Fp8GemmLinear`s, with what undoes it. See [Note: fp8 compute]"""

    def __init__(self) -> None:
        self._converted: list[_Converted] = []

    def __len__(self) -> int:
        return len(self._converted)

    def convert(self, root: nn.Module, refs: list[BlockRef], config: OffloadConfig) -> None:
        """Each Linear of the blocks `refs` that `gemm_linears` picks, its weight quantized on
        the CPU and placed where the weight was. `rollback()` undoes the ones done, also after
        a failure or an interrupt part way."""
        fp8 = fp8_format(config)
        assert fp8 is not None and fp8.dtype == torch.float8_e4m3fn  # OffloadConfig checked it
        linears = gemm_linears(root, refs, config)
        if refs and not linears:
            raise ConfigError(
                "OffloadConfig.fp8_compute=True found no Linear in the streamed blocks to run as an FP8 GEMM. One "
                "needs bf16 weights and bias (load the model with torch_dtype=torch.bfloat16; --dtype bfloat16), "
                f"both dimensions multiples of {GEMM_DIMENSION_MULTIPLE}, to be a plain nn.Linear without hooks, "
                "not a LoRA adapter's nor a DoRA base, used once, not tied, not matched by fp8_skip; or set "
                "fp8_compute=False"
            )
        with torch.no_grad():
            for name, linear in linears:
                weight = linear.weight
                data = torch.empty(weight.shape, dtype=fp8.dtype)
                scale = torch.empty(fp8.scale_shape(weight.shape[0]), dtype=torch.float32)
                quantize_into(weight, data, scale, name)
                row = scale.reshape(1, -1).expand(1, weight.shape[0]).contiguous().to(weight.device)
                self._converted.append(_Converted(linear, row, weight.data))
                linear.register_buffer("weight_scale", row)
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
        """disable(), once the blocks have their host tensors back: nn.Linears again, each
        holding its dequantized weight. Repeatable: a call cut short and made again (after
        the blocks were restored again) ends the same."""
        with torch.no_grad():
            for converted in self._converted:
                weight = _plain(converted.linear).weight
                if weight.dtype == torch.float8_e4m3fn:
                    weight.data = dequantized(weight.data, converted.scale.reshape(-1, 1), torch.bfloat16)
        self._converted.clear()


def _plain(linear: nn.Linear) -> nn.Linear:
    """`linear` an nn.Linear again, without its scales (done or not)."""
    linear.__class__ = nn.Linear
    linear._buffers.pop("weight_scale", None)
    return linear


def quantize_resident_gemms(root: nn.Module, refs: list[BlockRef], config: OffloadConfig) -> int:
    """The Linears `enable()` would convert, converted for good on a resident model (for
    `dlo.quantize_resident`). Returns how many."""
    conversion = Fp8GemmConversion()
    conversion.convert(root, refs, config)
    conversion.commit()
    return len(conversion)
