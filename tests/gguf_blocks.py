"""GGUF quant blocks and models for the kernel tests (dlo.use_gguf_kernels).

`random_blocks` fills whole quant blocks with seeded random bytes, every bit of them in use,
except the float16 fields (d, dmin, m), which get finite random values of many magnitudes: the
kernels' rounding is then exercised at every step, as real files do. gguf_files.write_gguf
crafts K-quant blocks from bytes below 0x10 instead (small finite outputs for whole models),
which leaves the high nibbles at zero: fine for a model's output, too weak for a kernel test.
"""

from __future__ import annotations

import torch

# Byte offsets of each quant type's float16 fields in one block (ggml's layouts).
HALVES = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
KERNEL_QUANTS = tuple(HALVES)

# A Flux transformer whose Linears are wide enough for the K-quants' 256-value blocks (inner
# width 256, MLP 1024), with the inputs of dlo.models.tiny's "flux".
WIDE_FLUX = dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=128, num_attention_heads=2,
    joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(16, 56, 56),
)


def random_blocks(quant: str, rows: int, columns: int, seed: int, finite: bool = True) -> torch.Tensor:
    """(rows, bytes per row) uint8 of `quant` blocks holding rows x columns values. `finite`:
    the float16 fields finite (|x| from 1e-5 to about 30), else as random as the rest."""
    import gguf

    values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[quant]]
    generator = torch.Generator().manual_seed(seed)
    count = rows * columns // values
    blocks = torch.randint(0, 256, (count, nbytes), generator=generator, dtype=torch.uint8)
    if finite:
        for offset in HALVES[quant]:
            magnitude = torch.pow(10.0, torch.empty(count).uniform_(-5, 1, generator=generator))
            half = (torch.randn(count, generator=generator) * magnitude).half()
            blocks[:, offset : offset + 2] = half.view(torch.uint8).reshape(count, 2)
    return blocks.reshape(rows, -1)


def gguf_parameter(packed: torch.Tensor, quant: str):
    """diffusers' GGUFParameter holding `packed`."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter

    return GGUFParameter(packed, quant_type=gguf.GGMLQuantizationType[quant])


def same_values(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """torch.equal, with NaN equal to NaN at the same places (random float16 fields hold NaN)."""
    nan = torch.isnan(expected)
    return torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], expected[~nan])
