"""Why two enables of the same Flux fp8 configuration stream at different speeds: is it the
host buffers or the device buffers an enable gets?

(Issue 18, fp8_interleaved.py --enables 2: two enables of one configuration differed by up to
5.6 % in forward time, steadily over rounds, and fp8_copy_trace.py showed every copy of a slow
enable slower (50.9 against 54.3 GB/s), while the same copies with the device idle ran at
55.4 GB/s for every enable.)

--enables pinned fp8 (per channel) enables of the Flux-shaped checkpoint are made in one process.
For each: its forward median, then copies of its 18 block images beside a bf16 GEMM loop on
another stream (the forward's compute, roughly), into (a) its own landing buffer 0, (b) its
landing buffer 1, (c) one device buffer common to all enables, and (d) from one pinned host
image common to all enables into its landing buffer 0. If (a), (b), (c) follow the forward's
speed and (d) does not, the host buffers decide; if (a), (b), (d) do and (c) does not, the
device buffers do.

On the GPU machine, from the repository root (diffusers from the wheels in .whl/):
  PYTHONPATH=/tmp/site:$PWD/src python3 benchmarks/investigations/fp8_enable_spread.py --dir /tmp/flux-ckpt
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

# The maintained benchmarks' models and helpers, one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_host_backings as backings  # noqa: E402
import bench_streaming as bench  # noqa: E402
import dlo
from dlo.host.pinned_buffer import HostBuffer


class GemmLoad:
    """bf16 matrix products on their own stream, enqueued to outlast the timed copies."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
        self.out = torch.empty_like(self.a)

    def start(self, count: int) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(count):
                torch.matmul(self.a, self.a, out=self.out)


def rate(pairs: list[tuple[torch.Tensor, torch.Tensor]], load: GemmLoad) -> float:
    """GB/s of the (target, source) copies, one after another, beside the GEMM load."""
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    load.start(60)  # ~1.4 ms each on the H200: longer than the copies
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for target, source in pairs:
            target[: source.numel()].copy_(source, non_blocking=True)
        end.record(stream)
    torch.cuda.synchronize()
    return sum(s.numel() for _, s in pairs) / (start.elapsed_time(end) / 1e3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/flux-ckpt"))
    parser.add_argument("--enables", type=int, default=4)
    args = parser.parse_args()
    device = torch.device("cuda")
    backings.save_checkpoint("flux", args.dir, device)
    config = dlo.OffloadConfig(checkpoint_mmap=False, stream_dtype="fp8")
    inputs = backings.make_inputs("flux", "1024px", device)
    load = GemmLoad(device)
    handles, rows = [], []
    common_target = common_source = None
    try:
        for n in range(args.enables):
            model, plan = dlo.load_transformer(args.dir, config=config)
            handle = dlo.enable(model, device, config, plan=plan)
            handles.append(handle)
            runtime = handle._runtime
            images = [b.source.host.tensor[: b.wire.nbytes] for b in runtime.blocks if b.wire.quantized]
            landing = runtime.executor.landings
            if common_target is None:
                common_target = torch.empty_like(landing[0])
                common_source = HostBuffer(max(i.numel() for i in images), pin=True).tensor.zero_()
            with torch.inference_mode():
                for _ in range(2):
                    model(**inputs)
                median = statistics.median(bench.timed_forwards(model, inputs, device, 10)[0])
            row = (
                median,
                rate([(landing[0], i) for i in images], load),
                rate([(landing[1], i) for i in images], load),
                rate([(common_target, i) for i in images], load),
                rate([(landing[0], common_source[: i.numel()]) for i in images], load),
            )
            rows.append(row)
            print(f"enable {n}: {row}", flush=True)
    finally:
        for handle in handles:
            handle.disable()
    print(f"\nfp8_enable_spread.py --enables {args.enables} (Flux fp8 per channel, pinned; GB/s beside a GEMM loop)")
    print("| enable | forward median s | own images -> own landing 0 | -> own landing 1 | -> common device buffer "
          "| common host image -> own landing 0 |")
    print("|---|---|---|---|---|---|")
    for n, (median, *rates) in enumerate(rows):
        print(f"| {n} | {median:.4f} | " + " | ".join(f"{r:.1f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
