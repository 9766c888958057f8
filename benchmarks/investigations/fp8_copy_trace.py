"""Why float8 loads from the registered cache run slower than from private pinned memory:
every host-to-device copy of a streamed Flux fp8 forward, as the profiler saw it, per backing.

(Issue 18: the registered fp8 cache streams at 52.1 GB/s where pinned fp8 streams at 54.9, while
bare copies from a registered mapping run at the pinned rate; RESULTS.md "fp8 from the
registered cache: copy-rate probes".)

For each backing (cache/registered first, pinned, cache/registered again: the order is a
control; then pinned with per-tensor scales, which streams slower than per channel), the Flux-shaped checkpoint of bench_host_backings.py is loaded with
`stream_dtype="fp8"`, enabled, warmed up, and --iters forwards are profiled. From the trace's
memcpy records (the driver's own per-copy duration and bytes, no event marks): copies, bytes,
the memcpy kind CUPTI names (Pinned/Pageable -> Device), the rate over the summed copy time,
per-copy rates (p10/median/p90), the copy time per forward, the share of copy time that
ran beside a dequantization kernel, and the kernel time per forward (dequantization, all). Then "bare": each streamed block's copy source copied
alone into the landing buffer (the forward's own source tensors), one after another, device
idle; and the median of 10 unprofiled forwards.

On the GPU machine, from the repository root (diffusers from the wheels in .whl/):
  PYTHONPATH=/tmp/site:$PWD/src python3 benchmarks/investigations/fp8_copy_trace.py --dir /tmp/flux-ckpt
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

# The maintained benchmarks' models and helpers, one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_host_backings as backings  # noqa: E402
import bench_streaming as bench  # noqa: E402
import dlo
from dlo.host.block_sources import MappedSource, PackedSource


def traced_copies(model, inputs: dict, iters: int) -> tuple[list[dict], list[dict]]:
    """(memcpy records, kernel records) of `iters` profiled forwards."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            model(**inputs)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as file:
        prof.export_chrome_trace(file.name)
        events = json.loads(Path(file.name).read_text())["traceEvents"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    return copies, kernels


def overlap_share(copies: list[dict], kernels: list[dict]) -> float:
    """The share of copy time during which one of `kernels` ran (kernels of one stream do not overlap)."""
    spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    covered = total = 0.0
    for copy in copies:
        start, end = copy["ts"], copy["ts"] + copy["dur"]
        total += end - start
        for k_start, k_end in spans:
            if k_start >= end:
                break
            covered += max(0.0, min(end, k_end) - max(start, k_start))
    return covered / total if total else 0.0


def bare_rate(handle, device: torch.device) -> tuple[float, int]:
    """GB/s of copying each streamed float8 block's source into the landing buffer, one
    after another with nothing else on the device (the forward's own source tensors)."""
    runtime = handle._runtime
    landing = runtime.executor.landings[0]
    sources = []
    for index, block in enumerate(runtime.blocks):
        if not block.wire.quantized:
            continue
        if isinstance(block.source, PackedSource):
            sources.append(block.source.host.tensor[: block.wire.nbytes])
        elif isinstance(block.source, MappedSource):
            sources += [task.source for task in runtime._land_tasks[0][index]]
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for source in sources:
        landing[: source.numel()].copy_(source, non_blocking=True)
    end.record()
    torch.cuda.synchronize(device)
    return sum(s.numel() for s in sources) / (start.elapsed_time(end) / 1e3) / 1e9, len(sources)


def summarize(
    name: str, median_s: float, copies: list[dict], kernels: list[dict], iters: int, bare: tuple[float, int]
) -> str:
    dequantizing = [k for k in kernels if "_dequantize" in k["name"]]
    rates = sorted(c["args"]["bytes"] / c["dur"] / 1e3 for c in copies)  # bytes/us -> GB/s
    nbytes = sum(c["args"]["bytes"] for c in copies)
    seconds = sum(c["dur"] for c in copies) / 1e6
    kinds = sorted({c["name"] for c in copies})
    q = statistics.quantiles(rates, n=10)
    return (
        f"| {name} | {median_s:.4f} | {len(copies)} | {nbytes / 1e9:.3f} | {'; '.join(kinds)} | {nbytes / seconds / 1e9:.1f} | "
        f"{q[0]:.1f} / {statistics.median(rates):.1f} / {q[-1]:.1f} | "
        f"{seconds / iters * 1e3:.1f} | {overlap_share(copies, dequantizing):.2f} | "
        f"{sum(k['dur'] for k in dequantizing) / iters / 1e3:.2f} | {sum(k['dur'] for k in kernels) / iters / 1e3:.1f} | "
        f"{bare[0]:.1f} ({bare[1]} copies) |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/flux-ckpt"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    backings.save_checkpoint("flux", args.dir, device)
    cache = dlo.OffloadConfig(stream_dtype="fp8", host_weight_cache=True, cache_dir=str(args.dir / "host-weight-cache"))
    pinned = dlo.OffloadConfig(stream_dtype="fp8", checkpoint_mmap=False)
    per_tensor = dlo.OffloadConfig(stream_dtype="fp8", fp8_scale="per_tensor", checkpoint_mmap=False)
    inputs = backings.make_inputs("flux", "1024px", device)
    rows = []
    variants = (
        ("cache/registered", cache),
        ("pinned", pinned),
        ("cache/registered again", cache),
        ("pinned, per tensor", per_tensor),
    )
    for name, config in variants:
        model, plan = dlo.load_transformer(args.dir, config=config)
        handle = dlo.enable(model, device, config, plan=plan)
        try:
            with torch.inference_mode():
                for _ in range(args.warmup):
                    model(**inputs)
                copies, kernels = traced_copies(model, inputs, args.iters)
                median_s = statistics.median(bench.timed_forwards(model, inputs, device, 10)[0])
                rows.append(summarize(name, median_s, copies, kernels, args.iters, bare_rate(handle, device)))
                print(rows[-1], flush=True)
        finally:
            handle.disable()
            del model, handle
            bench.release(device)
    print(f"\nfp8_copy_trace.py --iters {args.iters} (Flux fp8, {args.iters} profiled forwards per backing)")
    print(
        "| backing | median s | H2D copies | GB | memcpy kind | GB/s (bytes / summed copy time) | per-copy GB/s p10 / median / p90 "
        "| copy ms/forward | share beside a dequantization kernel | dequantization kernels ms/forward "
        "| all kernels ms/forward | bare GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
