"""Do host-to-device copies alone slow a resident Flux-shaped Q8_0 forward? (issue 31: streamed
with 4 slots, the compute stream never waits, yet its blocks take 2.5-2.7 % longer than the
resident model's, which keeps the streamed forward above 1.03x the resident one.)

The resident GGUF model (diffusers' dequantization) runs --iters forwards back to back, alone,
then with a side stream copying a pinned host buffer into a device buffer for the whole time
(copies queued ahead to outlast the forwards, as dlo's copies run beside its blocks: about the
same bytes a second). Rounds alternate the two, so drift falls on both. No dlo code runs: a
slowdown here is the copies' alone.

  PYTHONPATH=$PWD/src python3 benchmarks/investigations/resident_beside_copies.py --tmp /tmp
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gguf import load_gguf, write_gguf  # noqa: E402
from bench_streaming import SHAPES, build_model, to_device  # noqa: E402

CHUNK = 256 << 20  # bytes a copy


def forwards(model, inputs, iters: int, copies: int, host: torch.Tensor, device_buffer: torch.Tensor,
             side: torch.cuda.Stream) -> tuple[float, float]:
    """Seconds a forward of `iters` back to back, and the side stream's copy rate in GB/s while
    they ran: over the copies that ended before the last forward did (0 without copies)."""
    torch.cuda.synchronize()
    copy_start = torch.cuda.Event(enable_timing=True)
    copy_ends = [torch.cuda.Event(enable_timing=True) for _ in range(copies)]
    with torch.cuda.stream(side):
        copy_start.record()
        for copy_end in copy_ends:
            device_buffer.copy_(host, non_blocking=True)
            copy_end.record()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        model(**inputs)
    end.record()
    torch.cuda.synchronize()
    forward_s = begin.elapsed_time(end) / 1e3 / iters
    if not copies:
        return forward_s, 0.0
    forwards_end = copy_start.elapsed_time(end)
    within = [copy_start.elapsed_time(e) for e in copy_ends if copy_start.elapsed_time(e) <= forwards_end]
    if len(within) == copies:
        print(f"  (the copies ended {(forwards_end - within[-1]) / 1e3:.3f} s before the forwards: part of this round ran alone)")
    return forward_s, len(within) * CHUNK / (within[-1] / 1e3) / 1e9 if within else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tmp", default=None)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    shape = SHAPES["flux"]
    directory = Path(tempfile.mkdtemp(prefix="resident_beside_copies_", dir=args.tmp))
    model = build_model(shape, 0, device)
    model.save_config(directory)
    write_gguf(model, directory / "Q8_0.gguf", "Q8_0", 2)
    del model
    model = load_gguf(directory / "Q8_0.gguf", directory, shape.class_name).to(device)
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(1)), device)
    host = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True)
    device_buffer = torch.empty(CHUNK, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    rows = []
    with torch.inference_mode():
        for _ in range(2):
            model(**inputs)
        alone, _ = forwards(model, inputs, args.iters, 0, host, device_buffer, side)
        # 1.5x the forwards' time at 56 GB/s: the copies outlast them
        copies = int(1.5 * alone * args.iters * 56e9 / CHUNK) + 1
        for round_ in range(args.rounds):
            started = time.perf_counter()
            alone, _ = forwards(model, inputs, args.iters, 0, host, device_buffer, side)
            beside, gbps = forwards(model, inputs, args.iters, copies, host, device_buffer, side)
            rows.append((round_, alone, beside, gbps))
            print(f"  round {round_}: {time.perf_counter() - started:.1f} s", flush=True)
    print(f"\nResident Flux-shaped Q8_0, {args.iters} forwards back to back, ms a forward")
    print("| round | alone | beside copies | x alone | copy GB/s beside the forwards |")
    print("|---|---|---|---|---|")
    for round_, alone, beside, gbps in rows:
        print(f"| {round_} | {alone * 1e3:.2f} | {beside * 1e3:.2f} | {beside / alone:.3f} | {gbps:.1f} |")
    ratios = [beside / alone for _, alone, beside, _ in rows]
    print(f"median x alone: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
