"""GGUF dequantization of one weight: diffusers' torch code (`dequantize_gguf_tensor(w).to(dtype)`)
against dlo's one-launch Triton kernel (dlo.backend.gguf_kernels), per quant type, on Flux-shaped
weights, with the matmul of the same weight (a 1024² image's tokens) beside them for scale.

Each weight is seeded random quant blocks (finite float16 scales) on the device. Times are the
median of --iters runs between CUDA events, after --warmup; GB/s counts the packed bytes read and
the dequantized bytes written once (the least any dequantization moves). Every kernel output is
checked against diffusers' (torch.equal) before it is timed.

On the GPU machine, from the repository root (diffusers and gguf from the wheels in .whl/):

  python3 benchmarks/bench_gguf_kernels.py --quants Q8_0,Q4_0,Q4_K,Q6_K
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from results_json import add_json_flag, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_blocks import KERNEL_QUANTS, gguf_parameter, random_blocks  # noqa: E402

# Flux-dev's block Linears: (out, in) of attention (3072 x 3072), MLP in and out, and the
# single blocks' fused output projection.
SHAPES = [(3072, 3072), (12288, 3072), (3072, 12288), (3072, 15360)]
TOKENS = 4608  # a 1024x1024 image's 4096 tokens + 512 text tokens


@dataclass(frozen=True)
class Row:
    quant: str
    shape: tuple[int, int]
    diffusers_ms: float
    kernel_ms: float
    speedup: float
    kernel_gbps: float
    matmul_ms: float  # F.linear of TOKENS rows (in --dtype) with the dequantized weight


def timed(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of fn() on the current stream."""
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end))
    return statistics.median(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quants", type=lambda t: t.split(","), default=list(KERNEL_QUANTS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    add_json_flag(parser, "bench_gguf_kernels")
    args = parser.parse_args()
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    from dlo.backend.gguf_kernels import dequantize

    dtype = getattr(torch, args.dtype)
    rows: list[Row] = []
    for quant in args.quants:
        for out_features, in_features in SHAPES:
            packed = random_blocks(quant, out_features, in_features, seed=0).cuda()
            weight = gguf_parameter(packed, quant)
            expected = dequantize_gguf_tensor(weight).to(dtype)
            got = dequantize(packed, quant, dtype)
            nan = torch.isnan(expected)
            if not (torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], expected[~nan])):
                print(f"{quant} {out_features}x{in_features}: kernel output differs from diffusers'", flush=True)
                return 1
            diffusers_ms = timed(lambda: dequantize_gguf_tensor(weight).to(dtype), args.warmup, args.iters)
            kernel_ms = timed(lambda: dequantize(packed, quant, dtype), args.warmup, args.iters)
            inputs = torch.randn(TOKENS, in_features, device="cuda", dtype=dtype)
            matmul_ms = timed(lambda: torch.nn.functional.linear(inputs, expected), args.warmup, args.iters)
            moved = packed.numel() + expected.numel() * expected.element_size()
            rows.append(Row(quant, (out_features, in_features), diffusers_ms, kernel_ms, diffusers_ms / kernel_ms,
                            moved / kernel_ms / 1e6, matmul_ms))
            r = rows[-1]
            print(f"{quant} {out_features}x{in_features}: diffusers {r.diffusers_ms:.3f} ms, kernel "
                  f"{r.kernel_ms:.3f} ms ({r.kernel_gbps:.0f} GB/s), matmul {r.matmul_ms:.3f} ms", flush=True)
    lines = ["| quant | weight (out x in) | diffusers ms | kernel ms | x faster | kernel GB/s | matmul ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.quant} | {r.shape[0]} x {r.shape[1]} | {r.diffusers_ms:.3f} | {r.kernel_ms:.3f} | "
                     f"{r.speedup:.1f} | {r.kernel_gbps:.0f} | {r.matmul_ms:.3f} |")
    table = "\n".join(lines)
    write_json(args.json, "bench_gguf_kernels", [asdict(r) for r in rows], table,
               settings={k: v for k, v in vars(args).items() if k != "json"}, tokens=TOKENS)
    print()
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
