"""A Linear that multiplies in float8: its weight stays float8 in the slot, each call
quantizes the input per row and runs one scaled FP8 GEMM (See [Note: fp8 compute])."""

from __future__ import annotations

import torch
from torch import nn

from dlo.errors import StreamingError


def quantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 data, fp32 scales of shape (rows, 1)) of a contiguous 2-D tensor, one scale per
    row, by the weights' rule (`host/fp8_codec.py quantize_into`): amax / the float8 maximum,
    1 where that is 0. A row holding Inf or NaN comes out NaN (a bf16 Linear gives Inf or NaN)."""
    finite_max = torch.finfo(dtype).max
    computed = rows.abs().amax(dim=1, keepdim=True).float() / finite_max  # amax is exact in the input's dtype
    scale = torch.where(computed > 0, computed, torch.ones_like(computed))
    data = torch.div(rows, scale).clamp_(-finite_max, finite_max).to(dtype)  # fp32 division, then saturated
    return data, scale


class Fp8GemmLinear(nn.Linear):
    """An nn.Linear whose `weight` is float8_e4m3fn (out, in) and `weight_scale` its fp32
    scales, shape (1, out). Never constructed: `backend/fp8_compute.py` swaps the class of an
    nn.Linear in place and back (See [Note: fp8 compute])."""

    weight_scale: torch.Tensor
    # What PEFT casts an adapter wrapping this Linear to (it reads `compute_dtype`, else the
    # weight's dtype, which would make a LoRA added after enable() float8): the GEMM's bf16.
    compute_dtype = torch.bfloat16

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dtype != torch.bfloat16:  # the row-wise FP8 GEMM's only output dtype
            raise StreamingError(
                f"OffloadConfig(fp8_compute=True) runs this Linear as an FP8 GEMM, which takes bf16 inputs; it got "
                f"{input.dtype} (autocast to another dtype?): run the model in bf16, or set fp8_compute=False"
            )
        rows = input.reshape(-1, input.shape[-1]).contiguous()  # the GEMM's first operand must be row-major
        data, scale = quantize_rows(rows, self.weight.dtype)
        output = torch._scaled_mm(
            data, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, bias=self.bias, out_dtype=input.dtype
        )
        return output.reshape(*input.shape[:-1], output.shape[-1])
