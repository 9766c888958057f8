"""A Linear that multiplies in float8: its weight stays float8 in the slot, each call
quantizes the input per row and runs one scaled FP8 GEMM (See [Note: fp8 compute])."""

from __future__ import annotations

import torch
from torch import nn


def quantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 data, fp32 scales of shape (rows, 1)) of a 2-D tensor, one scale per row, by
    the weights' rule (`host/fp8_codec.py`): amax / the float8 maximum, 1 for an all-zero row."""
    finite_max = torch.finfo(dtype).max
    amax = rows.abs().amax(dim=1, keepdim=True).float()  # exact in the input's dtype; only (rows, 1) is cast
    scale = torch.where(amax > 0, amax / finite_max, torch.ones_like(amax))
    data = torch.div(rows, scale).clamp_(-finite_max, finite_max).to(dtype)  # fp32 division, then saturated
    return data, scale


class Fp8GemmLinear(nn.Linear):
    """An nn.Linear whose `weight` is float8_e4m3fn (out, in) and `weight_scale` its fp32
    scales, shape (1, out). Never constructed: `backend/fp8_compute.py` swaps the class of an
    nn.Linear in place and back, so the module keeps its name, hooks and parameters."""

    weight_scale: torch.Tensor

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = input.reshape(-1, input.shape[-1])
        data, scale = quantize_rows(rows, self.weight.dtype)
        output = torch._scaled_mm(
            data, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, bias=self.bias, out_dtype=input.dtype
        )
        return output.reshape(*input.shape[:-1], output.shape[-1])
