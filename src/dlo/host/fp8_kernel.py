"""Dequantizing float8 weights on a CUDA device in one pass (Triton).

torch has no float8 type promotion, so its dequantization is two kernels (an exact float8 ->
weight-dtype copy, then an in-place multiply by the fp32 scale): 7 bytes of device memory
traffic per weight value. This kernel reads the float8 byte and writes the result: 3 bytes.
It computes the same thing, `round(float(q) * scale)` with one fp32 multiply and a
round-to-nearest-even cast, so its output equals the two-kernel path's bit for bit
(tests/gpu/test_cuda_fp8.py checks it). Imported only where Triton and CUDA are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _dequantize(data, scale, out, count, columns, PER_ROW: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < count
    value = tl.load(data + offsets, mask=inside).to(tl.float32)
    if PER_ROW:
        factor = tl.load(scale + offsets // columns, mask=inside)
    else:
        factor = tl.load(scale)
    tl.store(out + offsets, (value * factor).to(out.dtype.element_ty), mask=inside)


def dequantize_cuda(target: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    """target = round(float(data) * scale) for contiguous 2-D CUDA tensors (scale (rows, 1)
    or (1, 1), fp32), on the current stream."""
    count = data.numel()
    if count == 0:
        return
    per_row = scale.numel() > 1
    _dequantize[(triton.cdiv(count, _BLOCK),)](
        data, scale, target, count, data.shape[1], PER_ROW=per_row, BLOCK=_BLOCK
    )
