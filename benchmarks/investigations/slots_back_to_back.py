"""Flux-shaped bf16 and fp8 streaming with 2 and 4 slots, forwards run back to back (issue 31:
fp8 streamed at 1.10x its float8 link floor with 2 slots; is it the same alternation as GGUF
Q8_0's, double blocks copy-bound and single blocks compute-bound? See RESULTS.md, "Per-block
timelines and slots").

Per variant, on one model (bench_streaming.py's Flux shape, seed 0): two warm-up forwards, then
the median of --iters forwards each from a synchronized device to its end ("synchronized"), and
--iters forwards back to back between two synchronizations ("back to back", as a sampler runs
them). Streamed outputs are compared (torch.equal) with the resident model of the same dtype.

  PYTHONPATH=$PWD/src python3 benchmarks/investigations/slots_back_to_back.py
  CPU smoke test: ... --shape tiny --device cpu --iters 1
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_streaming import SHAPES, build_model, synchronize, to_device  # noqa: E402

import dlo  # noqa: E402

FP8 = dlo.OffloadConfig(stream_dtype="fp8")


def timed(model, inputs, iters: int, device: torch.device) -> tuple[float, float, torch.Tensor]:
    with torch.inference_mode():
        for _ in range(2):
            out = model(**inputs)[0]
        walls = []
        for _ in range(iters):
            synchronize(device)
            started = time.perf_counter()
            model(**inputs)
            synchronize(device)
            walls.append(time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(iters):
            model(**inputs)
        synchronize(device)
        loop = (time.perf_counter() - started) / iters
    return statistics.median(walls), loop, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--slots", default="2,4", help="one enable per entry: 2,2,2 enables 2 slots three times")
    parser.add_argument("--kinds", default="bf16,fp8")
    parser.add_argument("--shape", default="flux", help="a bench_streaming.py shape (CPU smoke test: tiny)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    weights = build_model(shape, 0, device)
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(1)), device)
    rows, references = [], {}
    for kind, config in ((k, {"bf16": None, "fp8": FP8}[k]) for k in args.kinds.split(",")):
        resident = copy.deepcopy(weights)
        if config is not None:
            dlo.quantize_resident(resident, config)
        wall, loop, references[kind] = timed(resident.to(device), inputs, args.iters, device)
        rows.append((f"resident {kind}", wall, loop, "reference"))
        del resident
        torch.cuda.empty_cache()
        for slots in (int(n) for n in args.slots.split(",")):
            model = copy.deepcopy(weights)
            options = {} if config is None else {"stream_dtype": "fp8"}
            with dlo.enable(model, device, dlo.OffloadConfig(num_slots=slots, **options)):
                wall, loop, out = timed(model, inputs, args.iters, device)
            same = "bit-identical" if torch.equal(out, references[kind]) else "DIFFERENT"
            rows.append((f"dlo {kind}, {slots} slots", wall, loop, same))
            del model
            torch.cuda.empty_cache()
    print(f"\n{args.shape}-shaped, ms a forward (median of {args.iters} synchronized; {args.iters} back to back)")
    print("| variant | synchronized | back to back | output |")
    print("|---|---|---|---|")
    for name, wall, loop, same in rows:
        print(f"| {name} | {wall * 1e3:.1f} | {loop * 1e3:.1f} | {same} |")


if __name__ == "__main__":
    main()
