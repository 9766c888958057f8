"""`dlo serve --lora`: what switching LoRAs between two requests costs, against one denoising step.

bench_serve.py's pipeline (a Wan-14B-shaped transformer, --layers of its 40, with the tiny text
encoder and VAE) and two rank-R LoRAs on every attention and MLP Linear of its blocks, written
under --dir with diffusers' WanPipeline.save_lora_weights (seeded noise, A and B). One replica,
`dlo serve DIR --lora a=... --lora b=...`; jobs go one at a time (each posted when the last is
done, polled every 10 ms), after one warm-up job with each LoRA, in --rounds rounds of:

  same         --jobs jobs with LoRA a, --steps steps each: no switch.
  alternating  --jobs jobs with b, a, b, a, ...: every job switches (the first, from a, too).
  one step     --jobs jobs with a, 1 step each.

step = (median same - median one step) / (steps - 1); switch = median alternating - median same.
Target (issue 30): switch <= step.

On the GPU machine, from the repository root, with .whl/ as bench_serve.py's docstring says:

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  python3 benchmarks/bench_serve_lora.py --dir /tmp/bench-serve

CPU check (tiny Wan pipeline): python benchmarks/bench_serve_lora.py --tiny --rank 4 --jobs 2

The table comes last; it and the raw numbers go as JSON to --json (results_json.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench_serve import (
    add_pipeline_flags,
    lap,
    run_jobs,
    serving,
    settle_pipeline_flags,
    video_request,
    write_pipeline,
)
from results_json import add_json_flag, write_json


def write_loras(directory: Path, rank: int) -> dict[str, Path]:
    """LoRAs "a" and "b" for the transformer under `directory`: rank `rank` on every Linear of its
    blocks but the modulation ones (kept if already there)."""
    import diffusers
    import torch

    config = diffusers.WanTransformer3DModel.load_config(directory / "transformer")
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel.from_config(config)
    linears = [(f"blocks.{i}.{name}", module) for i, block in enumerate(model.blocks)
               for name, module in block.named_modules() if isinstance(module, torch.nn.Linear)]
    files = {}
    for seed, name in enumerate("ab"):
        folder = directory.parent / f"{directory.name}-lora-{name}-r{rank}"
        files[name] = folder / "pytorch_lora_weights.safetensors"
        if files[name].exists():
            continue
        generator = torch.Generator().manual_seed(seed)
        layers = {}
        for path, linear in linears:
            layers[f"{path}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=generator).mul_(0.01).bfloat16()
            layers[f"{path}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=generator).mul_(0.01).bfloat16()
        diffusers.WanPipeline.save_lora_weights(folder, transformer_lora_layers=layers)
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pipeline_flags(parser)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--jobs", type=int, default=6, help="jobs per series and round (default: 6)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three series, interleaved (default: 3)")
    add_json_flag(parser, "bench_serve_lora")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (one step is measured apart)")
    directory = settle_pipeline_flags(args)
    args.requests = 1  # bench_serve's queue length: one job at a time here
    clock = time.perf_counter()
    write_pipeline(directory, args.tiny, args.layers)
    loras = write_loras(directory, args.rank)
    clock = lap("pipeline and LoRAs", clock)
    flags = [item for name, path in loras.items() for item in ("--lora", f"{name}={path}")]

    def series(adapters: list[str], steps: int) -> list[float]:
        request = {**video_request(args), "num_inference_steps": steps}
        return [run_jobs(base, [{**request, "seed": k, "lora": [{"name": name}]}], poll_s=0.01)[0]
                for k, name in enumerate(adapters)]

    with serving(args, directory, 1, 0 if args.tiny else 1, *flags) as (base, start_s):
        clock = lap("start", clock)
        series(["a", "b"], args.steps)
        clock = lap("warm-up", clock)
        seconds: dict[str, list[float]] = {"same": [], "alternating": [], "one step": []}
        for _ in range(args.rounds):  # the series interleaved, so that drift falls on each alike
            seconds["same"] += series(["a"] * args.jobs, args.steps)
            seconds["alternating"] += series(["b", "a"] * (args.jobs // 2) + ["b"] * (args.jobs % 2), args.steps)
            seconds["one step"] += series(["a"] * args.jobs, 1)
        lap("jobs", clock)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    step_s = (median["same"] - median["one step"]) / (args.steps - 1)
    switch_s = median["alternating"] - median["same"]
    table = "\n".join([
        "| series | jobs | median s | min s | max s |", "|---|---|---|---|---|",
        *(f"| {name} | {len(v)} | {median[name]:.3f} | {min(v):.3f} | {max(v):.3f} |" for name, v in seconds.items()),
        "", f"one denoising step: {step_s:.3f} s; a switch costs {switch_s:+.3f} s ({switch_s / step_s:+.2f} steps)",
    ])
    write_json(args.json, "bench_serve_lora", [{"series": k, "seconds": v} for k, v in seconds.items()], table,
               step_s=step_s, switch_s=switch_s, rank=args.rank, layers=args.layers, size=args.size,
               frames=args.frames, steps=args.steps)
    print(table)


if __name__ == "__main__":
    sys.exit(main())
