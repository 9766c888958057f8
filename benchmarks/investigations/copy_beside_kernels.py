"""Which device work slows an H2D copy? (issue 31: in a streamed fp8 or GGUF forward the block
copies run at 50-54 GB/s, bare at 55.2-55.4, and beside a bf16 GEMM loop at 54.7-55.3:
fp8_enable_spread.py. The forward's other kernels are memory-bound: attention, norms, the
dequantization. Do they take the copies' share of HBM, and does it depend on where the copy lands?)

A pinned host buffer of --mib is copied into each of --targets device buffers (allocated apart,
so at different addresses), 8 copies a timing, median of --iters timings, on a copy stream while
another stream runs one of these loads, enqueued to outlast the copies:
  idle       nothing;
  gemm       bf16 8192^3 matrix products (compute-bound);
  hbm copy   device-to-device copies of 1 GiB (HBM-bound: read and write at full rate);
  dequant    float8 -> bf16 times a per-row scale over a 15360 x 3072 weight (what dlo's fp8
             dequantization does per Linear);
  attention  scaled_dot_product_attention at Flux's 1024^2 shape (24 heads x 4608 tokens x 128);
  q8_0 dequant  a GGUF Q8_0 weight of 15360 x 3072 dequantized in torch as diffusers does
             (float16 scale times int8 values, then bf16).
Two timings per pair: the copies' rate with the load queued to outlast them, and the load's ms
per call with copies queued to outlast it (beside the load's ms alone): does the load slow the
copies, do the copies slow the load?

  PYTHONPATH=$PWD/src python3 benchmarks/investigations/copy_beside_kernels.py
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch


def loads(device: torch.device) -> dict[str, Callable[[], None] | None]:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    product = torch.empty_like(a)
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    weight = torch.randn(15360, 3072, device=device).to(torch.float8_e4m3fn)
    scale = torch.rand(15360, 1, dtype=torch.bfloat16, device=device)
    dequantized = torch.empty(15360, 3072, dtype=torch.bfloat16, device=device)
    packed = torch.randint(0, 16, (15360 * 3072 // 32, 34), dtype=torch.uint8, device=device)
    q8_scales, q8_values = packed[:, :2].contiguous().view(torch.float16), packed[:, 2:].view(torch.int8)
    q, k, v = (torch.randn(1, 24, 4608, 128, dtype=torch.bfloat16, device=device) for _ in range(3))
    return {
        "idle": None,
        "gemm": lambda: torch.matmul(a, a, out=product),
        "hbm copy": lambda: target.copy_(source),
        "dequant": lambda: torch.mul(weight.to(torch.bfloat16), scale, out=dequantized),
        "attention": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
        "q8_0 dequant": lambda: torch.mul(q8_values.to(torch.float16), q8_scales).to(torch.bfloat16),
    }


def kernel_ms(load: Callable[[], None], stream: torch.cuda.Stream, count: int) -> float:
    """Mean device ms of one call of `load`, `count` of them queued back to back on `stream`."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        begin.record(stream)
        for _ in range(count):
            load()
        end.record(stream)
    end.synchronize()
    return begin.elapsed_time(end) / count


def overlapped(host: torch.Tensor, target: torch.Tensor, load, streams, load_count: int, copies: int) -> tuple[float, float]:
    """GB/s of `copies` copies of `host` into `target` and ms per call of `load_count` calls of
    `load` on another stream, both queued behind a device sleep so that they start together."""
    load_stream, copy_stream = streams
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s: the host queues both streams before either starts
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    load_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(load_stream):
        events[0].record(load_stream)
        for _ in range(load_count):
            load()
        events[1].record(load_stream)
    copy_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy_stream):
        events[2].record(copy_stream)
        for _ in range(copies):
            target.copy_(host, non_blocking=True)
        events[3].record(copy_stream)
    torch.cuda.synchronize()
    rate = copies * host.numel() / (events[2].elapsed_time(events[3]) / 1e3) / 1e9
    return rate, events[0].elapsed_time(events[1]) / max(load_count, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=360, help="bytes a copy (default: a Flux Q8_0 double block)")
    parser.add_argument("--targets", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    host = torch.empty(args.mib << 20, dtype=torch.uint8).pin_memory()
    targets = []
    spacers = []
    for _ in range(args.targets):  # spacers keep the targets at different, distant addresses
        targets.append(torch.empty(args.mib << 20, dtype=torch.uint8, device=device))
        spacers.append(torch.empty(977 << 20, dtype=torch.uint8, device=device))
    streams = torch.cuda.Stream(device), torch.cuda.Stream(device)
    copy_ms = (args.mib << 20) / 50e6  # one copy at about 50 GB/s
    rows = []
    for name, load in loads(device).items():
        if load is not None:
            kernel_ms(load, streams[0], 3)  # warm-up: the first calls include library setup
        alone = kernel_ms(load, streams[0], 20) if load is not None else float("nan")
        load_count = max(1, int(3 * 8 * copy_ms / alone)) if load is not None else 0
        for index, target in enumerate(targets):
            rates = [overlapped(host, target, load, streams, load_count, 8)[0] for _ in range(args.iters)]
            beside = float("nan")
            if load is not None:  # copies outlast 20 calls of the load
                beside = statistics.median(
                    overlapped(host, target, load, streams, 20, max(2, int(3 * 20 * alone / copy_ms)))[1]
                    for _ in range(args.iters)
                )
            rows.append((name, index, min(rates), statistics.median(rates), max(rates), alone, beside))
    print(f"\nH2D copies of {args.mib} MiB from pinned memory, 8 a timing, {args.iters} timings")
    print("| load | target | GB/s min | median | max | load ms alone | load ms beside the copies |")
    print("|---|---|---|---|---|---|---|")
    for name, index, low, median, high, alone, beside in rows:
        print(f"| {name} | {index} | {low:.1f} | {median:.1f} | {high:.1f} | {alone:.3f} | {beside:.3f} |")


if __name__ == "__main__":
    main()
