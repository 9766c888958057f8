"""Peak device memory per phase of a heterogeneous model: dlo vs diffusers group offloading.

Flux streams 19 (here 6) large double blocks, then 38 (here 12) smaller single blocks. This
splits each forward's peak into the double-block phase and the single-block phase, to show
where a variant's peak comes from. Uses bench_streaming.py's shapes and variants.

On the GPU machine, from the repository root (diffusers from the wheels in .whl/):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  python3 benchmarks/investigations/phase_peak.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# The maintained benchmarks' models and helpers, one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_streaming as bench  # noqa: E402

GIB = 2**30


def phase_peaks(variant: str, device: torch.device, forwards: int) -> list[tuple[str, float, float]]:
    shape = bench.SHAPES["flux"]
    inputs = bench.to_device(shape.make_inputs(torch.Generator().manual_seed(1)), device)
    model = bench.build_model(shape, seed=0, device=device)
    session = bench.VARIANTS[variant](model, device)
    marks: list[tuple[str, float, float]] = []

    def entering_single_blocks(module: torch.nn.Module, args: tuple) -> None:
        torch.cuda.synchronize(device)
        marks.append(("double-block phase", torch.cuda.max_memory_allocated(device) / GIB, 0.0))
        torch.cuda.reset_peak_memory_stats(device)

    hook = model.single_transformer_blocks[0].register_forward_pre_hook(entering_single_blocks)
    with torch.inference_mode():
        for _ in range(forwards):  # the last forward is reported: the first ones warm up
            marks.clear()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            at_start = torch.cuda.memory_allocated(device) / GIB
            model(**inputs)
            torch.cuda.synchronize(device)
            marks.append(("single-block phase", torch.cuda.max_memory_allocated(device) / GIB, 0.0))
    hook.remove()
    session.close()
    del model, session
    bench.release(device)
    return [(phase, peak, at_start) for phase, peak, _ in marks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forwards", type=int, default=2, help="forwards per variant; the last is reported")
    args = parser.parse_args()
    device = torch.device("cuda")
    print("| variant | allocated at forward start GiB | double-block phase peak GiB | single-block phase peak GiB |")
    print("|---|---|---|---|")
    for variant in ("dlo", "diffusers"):
        (_, double, start), (_, single, _) = phase_peaks(variant, device, args.forwards)
        print(f"| {variant} | {start:.3f} | {double:.3f} | {single:.3f} |")


if __name__ == "__main__":
    main()
