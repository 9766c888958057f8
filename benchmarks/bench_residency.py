"""resident_layers='auto' under memory budgets vs every hand-set resident_layers vs diffusers.

The models, weights, inputs and timing are bench_streaming.py's (the shapes of docs/benchmarks.md, bf16, random
weights from one seed). One model per shape is built on the CPU and enabled again for each run:

  hand-set r   dlo.OffloadConfig(resident_layers=r) for every r from 0 to the block count: the
               first r blocks resident, the rest streamed through 2 slots.
  auto B       dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=B) for each --budgets B:
               two calls (the first warms up, the second is measured and ends with the plan),
               then the timed ones.
  diffusers    enable_group_offload(block_level, one block per group, streams): it has no
               budget; its peak says at which budgets it fits.

Per run: median of --iters timed forwards after the warm-up, peak device memory
(max_memory_allocated since enable), and for auto the chosen residency and the model's
predicted seconds per call. Per budget: the best hand-set r whose peak fits the budget, and
auto's time over it. Every dlo output is compared with torch.equal to the first hand-set run's
(every block streamed), which bench_streaming.py checks against the resident model.

On the GPU machine, from the repository root (diffusers comes from the wheels in .whl/):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  python3 benchmarks/bench_residency.py

CPU smoke test (tiny Wan; on the CPU copies do not overlap compute, and a budget must be given):

  python benchmarks/bench_residency.py --device cpu --shapes tiny --budgets 0.0003,0.0004 --iters 2

The markdown tables come last; they and the raw numbers go to --json as well (results_json.py),
rewritten after each shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

import dlo
from dlo.planning.plan_summary import summarize

# The sibling benchmark's models and helpers (benchmarks/ is sys.path[0] when run as a script).
from bench_streaming import (
    GIB,
    SHAPES,
    DiffusersGroupOffload,
    build_model,
    environment,
    release,
    synchronize,
    timed_forwards,
    to_device,
)
from results_json import add_json_flag, write_json


@dataclass(frozen=True)
class Run:
    shape: str
    variant: str  # "hand-set r", "auto B", "diffusers"
    median_s: float | None
    peak_bytes: int | None
    equal: bool | None  # to the every-block-streamed output
    resident: int | None = None
    num_slots: int | None = None
    predicted_s: float | None = None
    error: str = ""


def peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def run_dlo(model: nn.Module, inputs: dict, device: torch.device, config: dlo.OffloadConfig, args, warmup: int):
    release(device)
    try:
        with dlo.enable(model, device, config) as handle, torch.inference_mode():
            for _ in range(warmup):
                model(**inputs)
            seconds, output = timed_forwards(model, inputs, device, args.iters)
            stats = handle.stats()
    finally:
        model.to("cpu")  # disable() leaves what was on the device there: every run starts from the CPU
    return statistics.median(seconds), stats.peak_device_bytes, output.cpu(), stats


def measure_shape(name: str, device: torch.device, args: argparse.Namespace) -> list[Run]:
    shape = SHAPES[name]
    model = build_model(shape, args.seed, device)
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(args.seed + 1)), device)
    blocks = len(summarize(model, dlo.discover(model)).blocks)
    runs: list[Run] = []
    reference = None
    for count in range(blocks + 1):
        seconds, top, output, _ = run_dlo(model, inputs, device, dlo.OffloadConfig(resident_layers=count), args, 1)
        reference = output if reference is None else reference
        equal = torch.equal(output, reference)
        runs.append(Run(name, f"hand-set {count}", seconds, top, equal, resident=count, num_slots=2))
        print(f"{name} hand-set {count}: {seconds:.4f} s, peak {top / GIB:.2f} GiB", flush=True)
    for budget in args.budgets:
        config = dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=budget)
        try:
            seconds, top, output, stats = run_dlo(model, inputs, device, config, args, 3)
        except dlo.ConfigError as err:
            runs.append(Run(name, f"auto {budget:g}", None, None, None, error=str(err)))
            print(f"{name} auto {budget:g}: refused: {err}", flush=True)
            continue
        residency = stats.residency
        runs.append(
            Run(
                name, f"auto {budget:g}", seconds, top, torch.equal(output, reference),
                resident=len(residency.resident), num_slots=residency.num_slots,
                predicted_s=residency.predicted_call_s, error=residency.note,
            )
        )
        print(f"{name} auto {budget:g}: {seconds:.4f} s, peak {top / GIB:.2f} GiB, {residency}", flush=True)
    if device.type == "cuda" and "diffusers" not in args.skip:
        release(device)
        torch.cuda.reset_peak_memory_stats(device)
        DiffusersGroupOffload(model, device)
        with torch.inference_mode():
            model(**inputs)
            seconds, _ = timed_forwards(model, inputs, device, args.iters)
        runs.append(Run(name, "diffusers", statistics.median(seconds), peak(device), None))
    synchronize(device)
    return runs


def budget_table(runs: list[Run], budgets: list[float]) -> str:
    lines = [
        "| shape | budget GiB | best hand-set r | its s | auto s | auto / best | auto resident, slots | predicted s "
        "| auto peak GiB | peak ≤ budget | diffusers s (fits) | auto output |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in dict.fromkeys(r.shape for r in runs):
        hand = [r for r in runs if r.shape == shape and r.variant.startswith("hand-set")]
        diffusers = next((r for r in runs if r.shape == shape and r.variant == "diffusers"), None)
        for budget in budgets:
            limit = budget * GIB
            fitting = [r for r in hand if r.peak_bytes is None or r.peak_bytes <= limit]
            best = min(fitting, key=lambda r: r.median_s, default=None)
            auto = next(r for r in runs if r.shape == shape and r.variant == f"auto {budget:g}")
            diff = "n/a"
            if diffusers is not None:
                diff = f"{diffusers.median_s:.4f} ({'yes' if diffusers.peak_bytes <= limit else 'no'})"
            hand_set = f"{best.resident} | {best.median_s:.4f}" if best else "none fits | -"
            if auto.median_s is None:  # refused at enable()
                lines.append(f"| {shape} | {budget:g} | {hand_set} | refused | - | - | - | - | - | {diff} | {auto.error} |")
                continue
            ratio = f"{auto.median_s / best.median_s:.3f}" if best else "-"
            fits = "yes" if auto.peak_bytes is None or auto.peak_bytes <= limit else "NO"
            chosen = f"{auto.resident}, {auto.num_slots}" if auto.predicted_s is not None else f"kept: {auto.error}"
            predicted = f"{auto.predicted_s:.4f}" if auto.predicted_s is not None else "-"
            peak_gib = f"{auto.peak_bytes / GIB:.2f}" if auto.peak_bytes is not None else "n/a"
            verdict = "bit-identical" if auto.equal else "DIFFERS"
            lines.append(
                f"| {shape} | {budget:g} | {hand_set} | {auto.median_s:.4f} | {ratio} | {chosen} | {predicted} "
                f"| {peak_gib} | {fits} | {diff} | {verdict} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=lambda text: text.split(","), default=["flux", "wan"])
    parser.add_argument(
        "--budgets", type=lambda text: [float(b) for b in text.split(",")], default=[2, 3, 4, 6, 8, 12],
        help="GiB, comma-separated (default: 2,3,4,6,8,12)",
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    parser.add_argument("--iters", type=int, default=3, help="timed forwards per run (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights; the inputs use seed + 1")
    parser.add_argument("--skip", type=lambda text: text.split(","), default=[], help="'diffusers' to skip it")
    add_json_flag(parser, "bench_residency")
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    print(" | ".join(f"{k} {v}" for k, v in environment(device).items()), flush=True)
    runs: list[Run] = []
    for name in args.shapes:
        runs += measure_shape(name, device, args)
        write_json(
            args.json, "bench_residency", [asdict(r) for r in runs], budget_table(runs, args.budgets),
            environment=environment(device),
        )
    print()
    print(budget_table(runs, args.budgets))


if __name__ == "__main__":
    main()
