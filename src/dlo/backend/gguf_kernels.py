"""Dequantizing a GGUF weight's packed bytes on the device in one kernel launch (Triton).

[Note: GGUF kernels]
diffusers dequantizes a GGUF weight in torch with a dozen kernels (splits, shifts, masks, casts,
multiplies), each reading and writing the whole weight, and then casts the float16 result to
the compute dtype: for a Flux-shaped model that costs more than the matmuls. Each kernel here
reads a quant type's blocks once and writes the weight in the compute dtype (bf16, f16 or f32).

The values equal diffusers' `dequantize_gguf_tensor(w).to(dtype)` bit for bit, because the
kernels round where torch rounds: diffusers multiplies and adds float16 tensors, so every
intermediate result is rounded to float16 (torch computes a float16 op in float32 and rounds
once; float32 holds the exact result of an op on two float16 values, or one within half a
float16 ulp that rounds the same way, since 24 >= 2 x 11 + 2 bits), and the kernels compute
each step in float32 and round it to float16 (`_f16`) before the next. The roundings also keep
the compiler from fusing a multiply and an add into one FMA. The float16 result goes to bf16
by round-to-nearest-even done on the bits (`_store`), the same as torch's cast; Triton's own
float32 -> bf16 cast is right on the GPU but truncates in its CPU interpreter, which the CPU
tests run.

Block layouts (ggml's, as diffusers' `dequantize_blocks_*` and `gguf.quants` read them): a
weight of shape (rows, columns) is rows x columns / VALUES quant blocks of BYTES bytes, one
after another; value j of a block is the j-th weight value in its row. Per type below: the
fields by byte offset, and how value j is formed. d, dmin, m are float16 (little-endian).
Imported only where Triton is (See [Note: GGUF kernel Linears] for who calls it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _half(src, offsets, mask):
    """The little-endian float16 at byte `offsets` of `src`, as float32."""
    low = tl.load(src + offsets, mask=mask, other=0).to(tl.uint16)
    high = tl.load(src + offsets + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(src, offsets, mask):
    return tl.load(src + offsets, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(value):
    """`value` rounded to float16, as torch rounds a float16 op's result (held in float32)."""
    return value.to(tl.float16).to(tl.float32)


@triton.jit
def _store(out, offsets, value, mask):
    """Store `value` (float32 holding a float16) in out's dtype, rounded to nearest even."""
    if out.dtype.element_ty == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(value != value, 0x7FC0, rounded)  # NaN stays NaN (torch's bits)
        tl.store(out + offsets, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(out + offsets, value.to(out.dtype.element_ty), mask=mask)


# Each kernel: one program dequantizes BLOCKS quant blocks as a (BLOCKS, VALUES) tile; `rows`
# are the block indices, `j` the value index inside a block (a row vector).


@triton.jit
def _q8_0(src, out, n_blocks, BLOCKS: tl.constexpr):
    """34 bytes: d @0, qs[32] int8 @2. value j = d * qs[j]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 32)[None, :]
    inside = (rows < n_blocks)[:, None]
    base = rows[:, None] * 34
    d = _half(src, base, inside)
    q = tl.load(src + base + 2 + j, mask=inside, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    _store(out, rows[:, None] * 32 + j, _f16(d * q), inside)


@triton.jit
def _q4_0(src, out, n_blocks, BLOCKS: tl.constexpr):
    """18 bytes: d @0, qs[16] @2. q = nibble j % 16 of qs (low for j < 16, high after);
    value j = d * (q - 8)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 32)[None, :]
    inside = (rows < n_blocks)[:, None]
    base = rows[:, None] * 18
    d = _half(src, base, inside)
    q = (_byte(src, base + 2 + j % 16, inside) >> (j // 16 * 4)) & 0xF
    _store(out, rows[:, None] * 32 + j, _f16(d * (q - 8).to(tl.float32)), inside)


@triton.jit
def _q4_1(src, out, n_blocks, BLOCKS: tl.constexpr):
    """20 bytes: d @0, m @2, qs[16] @4. q as Q4_0's; value j = d * q + m."""
    rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 32)[None, :]
    inside = (rows < n_blocks)[:, None]
    base = rows[:, None] * 20
    d = _half(src, base, inside)
    m = _half(src, base + 2, inside)
    q = (_byte(src, base + 4 + j % 16, inside) >> (j // 16 * 4)) & 0xF
    _store(out, rows[:, None] * 32 + j, _f16(_f16(d * q.to(tl.float32)) + m), inside)


@triton.jit
def _q5_0(src, out, n_blocks, BLOCKS: tl.constexpr):
    """22 bytes: d @0, qh[4] @2 (bit j: value j's fifth bit), qs[16] @6. q = nibble as Q4_0's
    | bit j of qh << 4; value j = d * (q - 16)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 32)[None, :]
    inside = (rows < n_blocks)[:, None]
    base = rows[:, None] * 22
    d = _half(src, base, inside)
    high = (_byte(src, base + 2 + j // 8, inside) >> (j % 8)) & 1
    q = ((_byte(src, base + 6 + j % 16, inside) >> (j // 16 * 4)) & 0xF) | (high << 4)
    _store(out, rows[:, None] * 32 + j, _f16(d * (q - 16).to(tl.float32)), inside)


@triton.jit
def _q5_1(src, out, n_blocks, BLOCKS: tl.constexpr):
    """24 bytes: d @0, m @2, qh[4] @4, qs[16] @8. q as Q5_0's; value j = d * q + m."""
    rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 32)[None, :]
    inside = (rows < n_blocks)[:, None]
    base = rows[:, None] * 24
    d = _half(src, base, inside)
    m = _half(src, base + 2, inside)
    high = (_byte(src, base + 4 + j // 8, inside) >> (j % 8)) & 1
    q = ((_byte(src, base + 8 + j % 16, inside) >> (j // 16 * 4)) & 0xF) | (high << 4)
    _store(out, rows[:, None] * 32 + j, _f16(_f16(d * q.to(tl.float32)) + m), inside)


@triton.jit
def _crumb(src, base, j, inside):
    """The 2-bit value j of 64 bytes at `base` holding 256 of them: two halves of 128 values,
    each 32 bytes read four times (shifts 0, 2, 4, 6)."""
    return (_byte(src, base + j // 128 * 32 + j % 32, inside) >> (j % 128 // 32 * 2)) & 3


@triton.jit
def _q2_k(src, out, n_blocks, BLOCKS: tl.constexpr):
    """84 bytes: scales[16] @0 (per 16 values: low nibble scale, high nibble min), qs[64] @16
    (2-bit q, see _crumb), d @80, dmin @82. value j = d * scale * q - dmin * min."""
    rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 256)[None, :]
    inside = (rows < n_blocks)[:, None]
    base = rows[:, None] * 84
    d = _half(src, base + 80, inside)
    dmin = _half(src, base + 82, inside)
    packed = _byte(src, base + j // 16, inside)
    scale = _f16(d * (packed & 0xF).to(tl.float32))
    low = _f16(dmin * (packed >> 4).to(tl.float32))
    q = _crumb(src, base + 16, j, inside)
    _store(out, rows[:, None] * 256 + j, _f16(_f16(scale * q.to(tl.float32)) - low), inside)


@triton.jit
def _q3_k(src, out, n_blocks, BLOCKS: tl.constexpr):
    """110 bytes: hmask[32] @0 (bit j // 32 of byte j % 32: value j's high bit, inverted),
    qs[64] @32 (low 2 bits, see _crumb), scales[12] @96 (16 six-bit scales: low 4 bits in the
    nibbles of bytes 0-7, scale g's in byte g % 8, high nibble for g >= 8; high 2 bits in bytes
    8-11, scale g's at shift 2 * (g // 4) of byte 8 + g % 4), d @108.
    value j = d * (scale - 32) * (low - 4 * (1 - high))."""
    rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 256)[None, :]
    inside = (rows < n_blocks)[:, None]
    base = rows[:, None] * 110
    d = _half(src, base + 108, inside)
    g = j // 16
    scale_low = (_byte(src, base + 96 + g % 8, inside) >> (g // 8 * 4)) & 0xF
    scale_high = (_byte(src, base + 104 + g % 4, inside) >> (g // 4 * 2)) & 3
    scale = _f16(d * ((scale_low | (scale_high << 4)) - 32).to(tl.float32))
    high = ((_byte(src, base + j % 32, inside) >> (j // 32)) & 1) ^ 1
    q = _crumb(src, base + 32, j, inside) - (high << 2)
    _store(out, rows[:, None] * 256 + j, _f16(scale * q.to(tl.float32)), inside)


@triton.jit
def _scale_min_k4(src, scales, s, inside):
    """(scale, min) of sub-block s (0-7) from the 12 bytes at `scales` (Q4_K, Q5_K): six bits
    each; for s < 4 the low six bits of bytes s and s + 4, for s >= 4 the nibbles of byte s + 4
    with the top two bits of bytes s - 4 and s."""
    first = s < 4
    scale_a = _byte(src, scales + tl.where(first, s, s + 4), inside)
    scale_b = _byte(src, scales + tl.where(first, s, s - 4), inside)
    min_a = _byte(src, scales + s + 4, inside)
    min_b = _byte(src, scales + s, inside)
    scale = tl.where(first, scale_a & 63, (scale_a & 0xF) | ((scale_b >> 2) & 0x30))
    low = tl.where(first, min_a & 63, (min_a >> 4) | ((min_b >> 2) & 0x30))
    return scale, low


@triton.jit
def _q4_k(src, out, n_blocks, BLOCKS: tl.constexpr):
    """144 bytes: d @0, dmin @2, scales[12] @4 (see _scale_min_k4; sub-block s = j // 32),
    qs[128] @16 (value j: nibble j // 32 % 2 of byte j // 64 * 32 + j % 32).
    value j = d * scale * q - dmin * min."""
    rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 256)[None, :]
    inside = (rows < n_blocks)[:, None]
    base = rows[:, None] * 144
    d = _half(src, base, inside)
    dmin = _half(src, base + 2, inside)
    scale, low = _scale_min_k4(src, base + 4, j // 32, inside)
    q = (_byte(src, base + 16 + j // 64 * 32 + j % 32, inside) >> (j // 32 % 2 * 4)) & 0xF
    value = _f16(_f16(_f16(d * scale.to(tl.float32)) * q.to(tl.float32)) - _f16(dmin * low.to(tl.float32)))
    _store(out, rows[:, None] * 256 + j, value, inside)


@triton.jit
def _q5_k(src, out, n_blocks, BLOCKS: tl.constexpr):
    """176 bytes: d @0, dmin @2, scales[12] @4, qh[32] @16 (bit j // 32 of byte j % 32: value
    j's fifth bit), qs[128] @48 (as Q4_K's). value j = d * scale * q - dmin * min."""
    rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 256)[None, :]
    inside = (rows < n_blocks)[:, None]
    base = rows[:, None] * 176
    d = _half(src, base, inside)
    dmin = _half(src, base + 2, inside)
    scale, low = _scale_min_k4(src, base + 4, j // 32, inside)
    high = (_byte(src, base + 16 + j % 32, inside) >> (j // 32)) & 1
    q = ((_byte(src, base + 48 + j // 64 * 32 + j % 32, inside) >> (j // 32 % 2 * 4)) & 0xF) | (high << 4)
    value = _f16(_f16(_f16(d * scale.to(tl.float32)) * q.to(tl.float32)) - _f16(dmin * low.to(tl.float32)))
    _store(out, rows[:, None] * 256 + j, value, inside)


@triton.jit
def _q6_k(src, out, n_blocks, BLOCKS: tl.constexpr):
    """210 bytes: ql[128] @0 (value j: nibble j % 128 // 64 of byte j // 128 * 64 + j % 64),
    qh[64] @128 (2 bits of value j at shift j % 128 // 32 * 2 of byte j // 128 * 32 + j % 32),
    scales[16] int8 @192 (per 16 values), d @208. value j = d * scale * ((qh << 4 | ql) - 32)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 256)[None, :]
    inside = (rows < n_blocks)[:, None]
    base = rows[:, None] * 210
    d = _half(src, base + 208, inside)
    scale = tl.load(src + base + 192 + j // 16, mask=inside, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    low = (_byte(src, base + j // 128 * 64 + j % 64, inside) >> (j % 128 // 64 * 4)) & 0xF
    high = (_byte(src, base + 128 + j // 128 * 32 + j % 32, inside) >> (j % 128 // 32 * 2)) & 3
    q = (low | (high << 4)) - 32
    _store(out, rows[:, None] * 256 + j, _f16(_f16(d * scale) * q.to(tl.float32)), inside)


@dataclass(frozen=True)
class QuantKernel:
    """One quant type's kernel: VALUES values in BYTES bytes a block, `blocks` blocks a program
    (a tile of 2048 values)."""

    kernel: object
    values: int
    bytes: int
    blocks: int


# By GGML quant type name (gguf.GGMLQuantizationType.name); sizes as gguf.GGML_QUANT_SIZES has them.
KERNELS: dict[str, QuantKernel] = {
    "Q8_0": QuantKernel(_q8_0, 32, 34, 64),
    "Q4_0": QuantKernel(_q4_0, 32, 18, 64),
    "Q4_1": QuantKernel(_q4_1, 32, 20, 64),
    "Q5_0": QuantKernel(_q5_0, 32, 22, 64),
    "Q5_1": QuantKernel(_q5_1, 32, 24, 64),
    "Q2_K": QuantKernel(_q2_k, 256, 84, 8),
    "Q3_K": QuantKernel(_q3_k, 256, 110, 8),
    "Q4_K": QuantKernel(_q4_k, 256, 144, 8),
    "Q5_K": QuantKernel(_q5_k, 256, 176, 8),
    "Q6_K": QuantKernel(_q6_k, 256, 210, 8),
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Built for Triton's CPU interpreter (TRITON_INTERPRET=1 when this was imported): CPU tensors.
INTERPRETED = not isinstance(_q8_0, triton.runtime.JITFunction)
# The interpreter runs each program as numpy calls: there, programs of 16 times the tile (the
# same values, each computed on its own), for tests 10 times faster.
_TILES_PER_PROGRAM = 16 if INTERPRETED else 1


def dequantize(packed: torch.Tensor, quant: str, dtype: torch.dtype) -> torch.Tensor:
    """A new (rows, columns) tensor of `dtype` on packed's device: the weight whose GGUF
    blocks `packed` holds, a plain uint8 tensor (rows, bytes per row) of type `quant` (a key
    of KERNELS), with `dtype` in DTYPES. One kernel launch, on the current stream."""
    spec = KERNELS[quant]
    packed = packed.contiguous()
    rows, row_bytes = packed.shape
    out = torch.empty((rows, row_bytes // spec.bytes * spec.values), dtype=dtype, device=packed.device)
    n_blocks = packed.numel() // spec.bytes
    if n_blocks:
        blocks = spec.blocks * _TILES_PER_PROGRAM
        spec.kernel[(triton.cdiv(n_blocks, blocks),)](packed, out, n_blocks, BLOCKS=blocks)
    return out
