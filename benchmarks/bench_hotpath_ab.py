"""Forward time of dlo streaming at two revisions of the code, side by side on one machine.

Each process imports the `dlo` found first on PYTHONPATH (one revision), builds the Flux- and
Wan-shaped models of bench_streaming.py once, and times dlo's forwards for each variant:

  bf16       dlo.OffloadConfig()
  fp8        dlo.OffloadConfig(stream_dtype="fp8")
  compiled   OffloadConfig() + diffusers' compile_repeated_blocks(fullgraph=True)

It appends one JSON line per (shape, variant) to --json (label, the median forward of each of
--enables enables and their mean, and whether the output equals the output of the same variant at the first revision run: saved
under --outputs). Run the revisions in turn, twice each, so both see the same machine state:

  for round in 1 2; do for rev in old new; do
    PYTHONPATH=/tmp/site:$rev/src python3 benchmarks/bench_hotpath_ab.py --label $rev \\
        --json $OUT/ab.jsonl --outputs /tmp/ab-outputs
  done; done
  python3 benchmarks/bench_hotpath_ab.py --table $OUT/ab.jsonl

The last call prints, per shape and variant, each label's mean over all its enables, and the
ratio of the last label's to the first's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

VARIANTS = ("bf16", "fp8", "compiled")


def run(shape_name: str, variant: str, device: torch.device, args: argparse.Namespace) -> dict:
    """`args.enables` enables of one model in turn (two enables of one configuration differ
    by a few percent: benchmarks/RESULTS.md), each timed over `args.iters` forwards."""
    import dlo
    from bench_streaming import SHAPES, build_model, release, timed_forwards, to_device

    shape = SHAPES[shape_name]
    model = build_model(shape, args.seed, device)
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(args.seed + 1)), device)
    config = dlo.OffloadConfig(stream_dtype="fp8") if variant == "fp8" else dlo.OffloadConfig()
    medians = []
    for _ in range(args.enables):
        handle = dlo.enable(model, device, config)
        if variant == "compiled":
            model.compile_repeated_blocks(fullgraph=True)
        with torch.inference_mode():
            timed_forwards(model, inputs, device, args.warmup)
            seconds, output = timed_forwards(model, inputs, device, args.iters)
        handle.disable()
        medians.append(statistics.median(seconds))
    saved = args.outputs / f"{shape_name}-{variant}.pt"
    if saved.exists():
        equal = torch.equal(torch.load(saved), output.cpu())
    else:
        saved.parent.mkdir(parents=True, exist_ok=True)
        torch.save(output.cpu(), saved)
        equal = None
    del model, handle, output
    release(device)
    torch._dynamo.reset()
    return dict(
        label=args.label, shape=shape_name, variant=variant, median_s=statistics.mean(medians),
        enable_medians_s=medians, equal_to_first=equal,
    )


def table(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    keys = list(dict.fromkeys((r["shape"], r["variant"]) for r in rows))
    lines = [
        "| shape | variant | " + " | ".join(f"{label}: mean of enables' medians, s (per process)" for label in labels)
        + " | ratio | equal |",
        "|---|---|" + "---|" * (len(labels) + 2),
    ]
    for shape, variant in keys:
        mine = [r for r in rows if (r["shape"], r["variant"]) == (shape, variant)]
        best = {
            label: statistics.mean(m for r in mine if r["label"] == label for m in r["enable_medians_s"])
            for label in labels
            if any(r["label"] == label for r in mine)
        }
        runs = {label: ", ".join(f"{r['median_s']:.4f}" for r in mine if r["label"] == label) for label in best}
        ratio = best[labels[-1]] / best[labels[0]] if len(best) == len(labels) > 1 else float("nan")
        equal = all(r["equal_to_first"] in (True, None) for r in mine)
        lines.append(
            f"| {shape} | {variant} | " + " | ".join(f"{best[l]:.4f} ({runs[l]})" for l in best) + f" | {ratio:.3f} | {equal} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", help="name of the revision this process imports")
    parser.add_argument("--shapes", type=lambda t: t.split(","), default=["flux", "wan"])
    parser.add_argument("--variants", type=lambda t: t.split(","), default=list(VARIANTS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--enables", type=int, default=3, help="enables per variant, timed in turn (default: 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="JSON lines file the results are appended to")
    parser.add_argument("--outputs", type=Path, default=Path("/tmp/ab-outputs"), help="outputs of the first revision run")
    parser.add_argument("--table", type=Path, help="print the table of a JSON lines file and exit")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(table(args.table))
        return
    if args.label is None or args.json is None:
        parser.error("--label and --json are needed to measure")
    from bench_streaming import SHAPES

    unknown = [v for v in args.variants if v not in VARIANTS] + [s for s in args.shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes or variants: {unknown}")
    device = torch.device(args.device)
    for shape in args.shapes:
        for variant in args.variants:
            if variant == "compiled" and shape == "flux":
                continue  # compiled is timed for Wan
            result = run(shape, variant, device, args)
            print(json.dumps(result), flush=True)
            with args.json.open("a") as out:
                out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
