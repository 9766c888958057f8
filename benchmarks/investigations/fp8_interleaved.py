"""Flux fp8 streaming ratios measured side by side: every variant enabled at once, timed in
interleaved rounds, so drift over a run (clocks, host state) falls on all of them alike.

(Issue 18: run to run, one variant's median moved by 3-5 %, as much as the targets' margins:
registered fp8 cache within 2 % of pinned fp8, fp8 streaming <= 0.55x bf16 streaming.)

The Flux-shaped checkpoint of bench_host_backings.py is saved once and loaded four ways, all
enabled on the one GPU together: bf16 (private pinned), fp8 per channel (quantized at enable
into private pinned memory), fp8 per tensor (the same), and fp8 per channel from the registered host weight cache
(published by the first load, then mapped); the fp8 ones --enables times each, to see how much
two enables of one configuration differ. Each of --rounds rounds times
every variant's --iters forwards (the order rotated each round) and keeps its median. Printed:
each variant's median over rounds, and each ratio per round (min / median / max). Outputs are
checked: the cache's equal to pinned fp8 per channel's.

On the GPU machine, from the repository root (diffusers from the wheels in .whl/):
  PYTHONPATH=/tmp/site:$PWD/src python3 benchmarks/investigations/fp8_interleaved.py --dir /tmp/flux-ckpt
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

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/flux-ckpt"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--num-slots", type=int, default=2)
    parser.add_argument(
        "--enables", type=int, default=1, help="enable each pinned fp8 variant this many times (per-enable spread)"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    backings.save_checkpoint("flux", args.dir, device)
    cache_dir = str(args.dir / "host-weight-cache")
    slots = dict(num_slots=args.num_slots)
    configs = {"bf16": dlo.OffloadConfig(checkpoint_mmap=False, **slots)}
    ratios = []
    for n in range(1, args.enables + 1):
        suffix = f" #{n}" if args.enables > 1 else ""
        for scale in ("per_channel", "per_tensor"):
            name = f"fp8 {scale.replace('_', ' ')}{suffix}"
            configs[name] = dlo.OffloadConfig(checkpoint_mmap=False, stream_dtype="fp8", fp8_scale=scale, **slots)
            ratios.append((f"{name} / bf16", name, "bf16"))
        cached = f"cache fp8 per channel{suffix}"
        configs[cached] = dlo.OffloadConfig(host_weight_cache=True, cache_dir=cache_dir, stream_dtype="fp8", **slots)
        ratios.append((f"{cached} / fp8 per channel{suffix}", cached, f"fp8 per channel{suffix}"))
    inputs = backings.make_inputs("flux", "1024px", device)
    models, handles = {}, {}
    try:
        for name, config in configs.items():
            model, plan = dlo.load_transformer(args.dir, config=config)
            handles[name] = dlo.enable(model, device, config, plan=plan)
            models[name] = model
            print(f"{name}: backing {handles[name].stats().backing}", flush=True)
        medians: dict[str, list[float]] = {name: [] for name in configs}
        outputs = {}
        names = list(configs)
        with torch.inference_mode():
            for name in names:  # warm-up
                for _ in range(2):
                    models[name](**inputs)
            for round_ in range(args.rounds):
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                    seconds, outputs[name] = bench.timed_forwards(models[name], inputs, device, args.iters)
                    medians[name].append(statistics.median(seconds))
    finally:
        for handle in handles.values():
            handle.disable()
    pinned = "fp8 per channel #1" if args.enables > 1 else "fp8 per channel"
    same = all(torch.equal(outputs[cached].cpu(), outputs[pinned].cpu()) for cached in configs if "cache" in cached)
    print(
        f"\nfp8_interleaved.py --rounds {args.rounds} --iters {args.iters} --num-slots {args.num_slots} "
        f"--enables {args.enables}"
    )
    print(f"cache fp8 outputs equal to {pinned}'s: {same}")
    print("| variant | median over rounds s | min / max of round medians s |")
    print("|---|---|---|")
    for name, values in medians.items():
        print(f"| {name} | {statistics.median(values):.4f} | {min(values):.4f} / {max(values):.4f} |")
    print("| ratio | per round: min / median / max |")
    print("|---|---|")
    for label, numerator, denominator in ratios:
        ratios = sorted(a / b for a, b in zip(medians[numerator], medians[denominator]))
        print(f"| {label} | {ratios[0]:.3f} / {statistics.median(ratios):.3f} / {ratios[-1]:.3f} |")


if __name__ == "__main__":
    main()
