"""torch.compile with streaming: compiled resident vs compiled + dlo vs diffusers group offloading + compile.

The models, weights, inputs and timing are bench_streaming.py's (the shapes of docs/benchmarks.md: Wan-14B-shaped
12 layers at 480p/81 frames, Flux-shaped 6+12 at 1024², bf16, random weights from one seed).
Variants, one at a time, each freed before the next (so every peak belongs to one variant):

  resident+regional   the model moved to the device, compile_repeated_blocks(fullgraph=True):
                      the reference of the regional rows and of "x compiled resident".
  resident+regional/again  the same, compiled a second time: a control that shows whether two
                      compilations of one resident model give equal outputs (inductor picks
                      some kernel configurations by timing them, see --inductor-cache and
                      --inductor-deterministic).
  dlo+regional        compile_repeated_blocks(fullgraph=True), then dlo.enable(model, device).
  resident+full       the blocks dlo would stream given dlo's call boundary (isolate(), no
                      streaming), then model.compile(): the reference of dlo+full, whose graphs
                      are cut at the same places (see [Note: compiled blocks]).
  dlo+full            dlo.enable(model, device), then model.compile() (whole model).
  diffusers+regional  enable_group_offload(block_level, one block per group, streams), then
                      compile_repeated_blocks(fullgraph=False) (fullgraph=True raises there).

Per variant: first call (compile and one forward, cold: torch._inductor.utils.fresh_inductor_cache
empties inductor's and Triton's caches for each variant, and one small compile before the
first variant starts the compile workers; with --inductor-cache shared the variants of a shape
share one cache, so a later compilation reuses the kernel configurations an earlier one chose
by timing, and its first call is warm), median and min of --iters timed
forwards after --warmup more untimed ones, peak device memory (reset before setup), and
dynamo's counters over the variant (graphs compiled, recompiles, graph breaks: see
dlo.hotpath.compiled_call.CompileWatch). "x resident" is the median over resident+regional's;
"first call x" is the first call over the resident first call of the same compilation kind
(resident+regional for regional rows and diffusers, resident+full for dlo+full). Outputs are
compared with torch.equal to the reference named above.

On the GPU machine, from the repository root (diffusers comes from the wheels in .whl/):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  python3 benchmarks/bench_compile.py

CPU smoke test (tiny Wan, no diffusers variant):

  python benchmarks/bench_compile.py --device cpu --shapes tiny --warmup 1 --iters 2

The markdown table comes last; it and the raw numbers go to --json as well (results_json.py),
rewritten after each shape.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch._dynamo
from torch import nn
from torch._inductor.utils import fresh_inductor_cache

# The sibling benchmark's models and helpers (benchmarks/ is sys.path[0] when run as a script).
from bench_streaming import (
    GIB,
    SHAPES,
    DiffusersGroupOffload,
    DloStreaming,
    Resident,
    Session,
    Shape,
    build_model,
    check_run_args,
    environment,
    release,
    timed_forwards,
    to_device,
)
from results_json import add_json_flag, write_json

import dlo
from dlo.hotpath.compiled_call import CompileWatch, isolate
from dlo.planning.offload_plan import resolve_blocks


def _regional(model: nn.Module, mode: str) -> None:
    model.compile_repeated_blocks(fullgraph=True, mode=mode)


def _full(model: nn.Module, mode: str) -> None:
    model.compile(mode=mode)


def _resident_full(model: nn.Module, mode: str) -> None:
    isolate([ref.module for ref in resolve_blocks(model, dlo.discover(model))])
    model.compile(mode=mode)


def _diffusers_regional(model: nn.Module, mode: str) -> None:
    model.compile_repeated_blocks(fullgraph=False, mode=mode)  # fullgraph=True raises with group offloading


@dataclass(frozen=True)
class Variant:
    session: Callable[[nn.Module, torch.device], Session]
    compile: Callable[[nn.Module, str], None]  # (model, torch.compile mode)
    compile_first: bool  # compile before the session is set up (else after)
    reference: str  # the variant whose output this one must equal, and whose first call it is compared to


VARIANTS: dict[str, Variant] = {
    "resident+regional": Variant(Resident, _regional, False, "resident+regional"),
    "resident+regional/again": Variant(Resident, _regional, False, "resident+regional"),
    "dlo+regional": Variant(DloStreaming, _regional, True, "resident+regional"),
    "resident+full": Variant(Resident, _resident_full, False, "resident+full"),
    "dlo+full": Variant(DloStreaming, _full, False, "resident+full"),
    "diffusers+regional": Variant(DiffusersGroupOffload, _diffusers_regional, False, "resident+regional"),
}
SKIPPED_ON_CPU = {"diffusers+regional": "group offloading with use_stream=True needs CUDA streams"}


@dataclass(frozen=True)
class Measured:
    first_call_s: float
    forward_s: tuple[float, ...]
    peak_hbm_bytes: int | None
    graphs: int
    recompiles: int
    graph_breaks: int
    output: torch.Tensor  # of the last timed forward, on the CPU


def measure(shape: Shape, name: str, device: torch.device, args: argparse.Namespace) -> Measured:
    variant = VARIANTS[name]
    model = build_model(shape, args.seed, device)
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(args.seed + 1)), device)
    torch._dynamo.reset()
    release(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    watch = CompileWatch()
    # fresh: every variant compiles cold (empty inductor and Triton caches); shared: main() holds one
    # cache for the shape's variants
    cache = fresh_inductor_cache() if args.inductor_cache == "fresh" else contextlib.nullcontext()
    with cache:
        if variant.compile_first:
            variant.compile(model, args.mode)
        session = variant.session(model, device)
        if not variant.compile_first:
            variant.compile(session.model, args.mode)
        try:
            with torch.inference_mode():
                first, _ = timed_forwards(session.model, inputs, device, 1)
                for _ in range(args.warmup):
                    session.model(**inputs)
                watch.poll()
                seconds, output = timed_forwards(session.model, inputs, device, args.iters)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        finally:
            session.close()
    watch.poll()
    return Measured(
        first[0], tuple(seconds), peak, watch.graphs, watch.recompiles, watch.graph_breaks, output.cpu()
    )


@dataclass(frozen=True)
class Row:
    shape: str
    variant: str
    first_call_s: float
    first_call_x: float
    median_s: float
    min_s: float
    x_resident: float
    forward_s: tuple[float, ...]
    peak_hbm_bytes: int | None
    graphs: int
    recompiles: int
    graph_breaks: int
    reference: str
    equal_to_reference: bool | None  # None for a reference itself
    max_abs_diff: float | None


def make_rows(shape: str, runs: dict[str, Measured]) -> list[Row]:
    resident_median = statistics.median(runs["resident+regional"].forward_s)
    rows = []
    for name, run in runs.items():
        reference = VARIANTS[name].reference
        base = runs.get(reference)
        is_reference = reference == name or base is None
        median = statistics.median(run.forward_s)
        rows.append(
            Row(
                shape=shape,
                variant=name,
                first_call_s=run.first_call_s,
                first_call_x=run.first_call_s / base.first_call_s if base is not None else float("nan"),
                median_s=median,
                min_s=min(run.forward_s),
                x_resident=median / resident_median,
                forward_s=run.forward_s,
                peak_hbm_bytes=run.peak_hbm_bytes,
                graphs=run.graphs,
                recompiles=run.recompiles,
                graph_breaks=run.graph_breaks,
                reference=reference,
                equal_to_reference=None if is_reference else torch.equal(run.output, base.output),
                max_abs_diff=None if is_reference else (run.output.float() - base.output.float()).abs().max().item(),
            )
        )
    return rows


def _verdict(row: Row) -> str:
    if row.equal_to_reference is None:
        return "reference"
    if row.equal_to_reference:
        return f"bit-identical to {row.reference}"
    return f"max abs diff {row.max_abs_diff:.3g} vs {row.reference}"


def markdown_table(rows: list[Row]) -> str:
    header = (
        "| shape | variant | first call s | first call x | median s | min s | x resident | peak HBM GiB "
        "| graphs | recompiles | graph breaks | output |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        peak = "n/a" if r.peak_hbm_bytes is None else f"{r.peak_hbm_bytes / GIB:.2f}"
        cells = [
            r.shape, r.variant, f"{r.first_call_s:.1f}", f"{r.first_call_x:.2f}", f"{r.median_s:.4f}",
            f"{r.min_s:.4f}", f"{r.x_resident:.3f}", peak, str(r.graphs), str(r.recompiles), str(r.graph_breaks),
            _verdict(r),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes", type=lambda text: text.split(","), default=["wan", "flux"],
        help=f"comma-separated, from {', '.join(SHAPES)} (default: wan,flux; tiny is the smoke-test Wan)",
    )
    parser.add_argument(
        "--variants", type=lambda text: text.split(","), default=list(VARIANTS),
        help=f"comma-separated, from {', '.join(VARIANTS)} (default: all; resident+regional always runs)",
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed forwards after the first call (default: 1)")
    parser.add_argument("--iters", type=int, default=3, help="timed forwards per variant (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights; the inputs use seed + 1")
    parser.add_argument(
        "--mode", default="default", choices=("default", "max-autotune-no-cudagraphs"),
        help="torch.compile mode of every variant (default: default)",
    )
    parser.add_argument(
        "--inductor-cache", default="fresh", choices=("fresh", "shared"),
        help="fresh: each variant compiles with empty inductor/Triton caches; shared: one cache per shape, "
        "so later variants reuse the kernel configurations earlier ones picked by timing (default: fresh)",
    )
    parser.add_argument(
        "--inductor-deterministic", action="store_true",
        help="torch._inductor.config.deterministic: no kernel configuration chosen by timing where it changes "
        "numerics (reduction block sizes), so two compilations of one model pick the same kernels",
    )
    parser.add_argument(
        "--deterministic-algorithms", action="store_true",
        help="torch.use_deterministic_algorithms(True) too (it also filters inductor's reduction configurations)",
    )
    add_json_flag(parser, "bench_compile")
    args = parser.parse_args(argv)
    check_run_args(parser, args)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    return args


def measure_all(
    shape: str, variants: list[str], device: torch.device, args: argparse.Namespace, notes: list[str]
) -> dict[str, Measured]:
    runs: dict[str, Measured] = {}
    for variant in variants:
        started = time.perf_counter()
        try:
            run = runs[variant] = measure(SHAPES[shape], variant, device, args)
        except Exception as err:  # one failing variant still leaves the others' rows
            if variant == "resident+regional":
                raise
            notes.append(f"{shape}/{variant} failed: {type(err).__name__}: {str(err)[:300]}")
            print(f"{shape}/{variant}: FAILED: {notes[-1]}", flush=True)
            continue
        finally:
            release(device)
        median = statistics.median(run.forward_s)
        print(
            f"{shape}/{variant}: first call {run.first_call_s:.1f} s, median {median:.4f} s, "
            f"{run.graphs} graphs, {run.recompiles} recompiles, {run.graph_breaks} graph breaks "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    return runs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch._inductor.config.deterministic = args.inductor_deterministic
    torch.use_deterministic_algorithms(args.deterministic_algorithms)
    print(" | ".join(f"{k} {v}" for k, v in environment(device).items()), flush=True)
    chosen = ["resident+regional", *(v for v in args.variants if v != "resident+regional")]
    variants = [v for v in chosen if device.type == "cuda" or v not in SKIPPED_ON_CPU]
    skipped = [v for v in chosen if v not in variants]
    notes = [f"{v} skipped on {device.type}: {SKIPPED_ON_CPU[v]}" for v in skipped]
    with torch.inference_mode():  # start inductor's compile workers before any variant is timed
        torch.compile(lambda x: (x * 2).sum())(torch.ones(8, device=device))
    rows: list[Row] = []
    for name in args.shapes:
        shape_cache = fresh_inductor_cache() if args.inductor_cache == "shared" else contextlib.nullcontext()
        with shape_cache:
            runs = measure_all(name, variants, device, args, notes)
        rows += make_rows(name, runs)
        write_json(
            args.json, "bench_compile", [asdict(r) for r in rows], markdown_table(rows),
            environment=environment(device),
            settings={
                "warmup": args.warmup, "iters": args.iters, "seed": args.seed, "mode": args.mode,
                "inductor_cache": args.inductor_cache, "inductor_deterministic": args.inductor_deterministic,
                "deterministic_algorithms": args.deterministic_algorithms,
            },
            notes=notes,
        )
    print()
    for note in notes:
        print(f"note: {note}")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
