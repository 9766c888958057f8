"""fp8 streaming against bf16 streaming, the quantized model resident, and diffusers' unscaled
layerwise casting with group offloading: speed, bytes, bit identity and quantization error.

Per shape (docs/benchmarks.md, random bf16 weights from one seed, as bench_streaming.py builds them), one
variant at a time, each freed before the next:

  resident            the bf16 model on the device: the reference output for the error.
  resident fp8/S      dlo.quantize_resident(model, OffloadConfig(stream_dtype="fp8", fp8_scale=S))
                      on the device: the model fp8 streaming must equal bit for bit.
  dlo                 dlo.enable(model, device): bf16 blocks streamed from pinned memory.
  dlo fp8/S           dlo.enable(model, device, OffloadConfig(stream_dtype="fp8", fp8_scale=S)).
  resident fp8 gemm   dlo.quantize_resident(model, OffloadConfig(stream_dtype="fp8", fp8_compute=True))
                      on the device: Linears as FP8 GEMMs (per-channel weight scales, activations
                      quantized per row); the model the next variant must equal.
  dlo fp8 gemm        dlo.enable(model, device, OffloadConfig(stream_dtype="fp8", fp8_compute=True)).
  diffusers cast      model.enable_layerwise_casting(storage_dtype=float8_e4m3fn,
                      compute_dtype=bfloat16), then block-level group offloading with streams
                      (unscaled fp8, cast per layer on the compute stream).

Error vs the bf16 resident output of the same inputs: relative L2 and cosine of one forward.
Worst block (resident fp8 variants): every block is fed the inputs it got in the bf16 run
(teacher forcing) and its outputs are compared with the bf16 run's; the largest relative L2
and the block's name are reported, so one block's error is not hidden by the others'.

On the GPU machine, from the repository root (diffusers from the wheels in .whl/):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  python3 benchmarks/bench_fp8.py --shapes flux,wan

CPU smoke test: python benchmarks/bench_fp8.py --device cpu --shapes tiny --warmup 0 --iters 1
A subset: --variants dlo,dlo-fp8 --num-slots 3
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dlo

# The sibling benchmark's models and helpers (benchmarks/ is sys.path[0] when run as a script).
from bench_streaming import (
    GB,
    GIB,
    SHAPES,
    DiffusersGroupOffload,
    build_model,
    check_run_args,
    environment,
    release,
    timed_forwards,
    to_device,
)
from results_json import add_json_flag, write_json

SCALES = ("per_channel", "per_tensor")


@dataclass(frozen=True)
class Row:
    shape: str
    variant: str
    setup_s: float
    median_s: float
    peak_hbm_gib: float | None
    bytes_per_forward: int | None
    host_bytes_by_dtype: dict[str, int] | None
    rel_l2: float | None  # vs the bf16 resident output
    cosine: float | None
    worst_block: str | None
    worst_block_rel_l2: float | None
    equal_to: str | None  # the variant whose output this one must equal
    equal: bool | None


def error(output: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    a, b = output.double().flatten(), reference.double().flatten()
    return float((a - b).norm() / b.norm()), float(nn.functional.cosine_similarity(a, b, dim=0))


def tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_of(item)]
    return []


def blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    plan = dlo.discover(model)
    return [(f"{path}.{i}", block) for path in plan.block_lists for i, block in enumerate(model.get_submodule(path))]


def forward_with_block_hooks(model: nn.Module, inputs: dict, before, after) -> None:
    """One forward with `before(name, args, kwargs)` (may return replacement (args, kwargs))
    and `after(name, output)` hooked on every block."""
    handles = []
    for name, block in blocks_of(model):
        handles.append(block.register_forward_pre_hook(partial(_pre, before, name), with_kwargs=True))
        handles.append(block.register_forward_hook(partial(_post, after, name), with_kwargs=True))
    try:
        with torch.inference_mode():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()


def _pre(before, name, module, args, kwargs):
    return before(name, args, kwargs)


def _post(after, name, module, args, kwargs, output):
    after(name, output)


def capture_blocks(model: nn.Module, inputs: dict) -> dict[str, tuple[tuple, dict, list[torch.Tensor]]]:
    """Each block's (args, kwargs, outputs) in one forward."""
    seen: dict[str, tuple[tuple, dict, list[torch.Tensor]]] = {}

    def before(name, args, kwargs):
        seen[name] = (args, kwargs, [])

    def after(name, output):
        seen[name][2].extend(tensors_of(output))

    forward_with_block_hooks(model, inputs, before, after)
    return seen


def worst_block(model: nn.Module, inputs: dict, bf16: dict) -> tuple[str, float]:
    """Teacher-forced per-block error: each block gets its bf16-run inputs."""
    errors: dict[str, float] = {}

    def before(name, args, kwargs):
        return bf16[name][0], bf16[name][1]

    def after(name, output):
        got, expected = tensors_of(output), bf16[name][2]
        diff = sum(float((g.double() - e.double()).norm() ** 2) for g, e in zip(got, expected))
        ref = sum(float(e.double().norm() ** 2) for e in expected)
        errors[name] = (diff / ref) ** 0.5

    forward_with_block_hooks(model, inputs, before, after)
    name = max(errors, key=errors.get)
    return name, errors[name]


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def timed(model: nn.Module, inputs: dict, device: torch.device, args: argparse.Namespace) -> tuple[float, torch.Tensor]:
    with torch.inference_mode():
        for _ in range(args.warmup):
            model(**inputs)
        seconds, output = timed_forwards(model, inputs, device, args.iters)
    return statistics.median(seconds), output.cpu()


def run_shape(name: str, device: torch.device, args: argparse.Namespace) -> list[Row]:
    shape = SHAPES[name]
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(args.seed + 1)), device)
    rows: list[Row] = []
    outputs: dict[str, torch.Tensor] = {}

    def add(variant: str, setup_s: float, median_s: float, output: torch.Tensor, equal_to: str | None = None,
            stats: dlo.OffloadStats | None = None, worst: tuple[str, float] | None = None, nbytes: int | None = None):
        outputs[variant] = output
        rel, cos = error(output, outputs["resident"]) if variant != "resident" else (None, None)
        row = Row(
            shape=name, variant=variant, setup_s=setup_s, median_s=median_s, peak_hbm_gib=peak_gib(device),
            bytes_per_forward=nbytes, host_bytes_by_dtype=stats.host_bytes_by_dtype if stats else None,
            rel_l2=rel, cosine=cos, worst_block=worst[0] if worst else None,
            worst_block_rel_l2=worst[1] if worst else None, equal_to=equal_to,
            equal=torch.equal(output, outputs[equal_to]) if equal_to else None,
        )
        rows.append(row)
        print(json.dumps(asdict(row)), flush=True)

    def fresh() -> nn.Module:
        release(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        return build_model(shape, args.seed, device)

    # Resident: bf16, then each quantized model (its per-block error against bf16's captures).
    resident = fresh().to(device)
    median_s, output = timed(resident, inputs, device, args)
    add("resident", 0.0, median_s, output)
    quantized_resident = []
    if "resident-fp8" in args.variants:
        quantized_resident += [(f"resident fp8/{s}", dlo.OffloadConfig(stream_dtype="fp8", fp8_scale=s)) for s in SCALES]
    if "resident-fp8-gemm" in args.variants:
        quantized_resident.append(("resident fp8 gemm/per_channel", dlo.OffloadConfig(stream_dtype="fp8", fp8_compute=True)))
    captured = capture_blocks(resident, inputs) if quantized_resident else None
    for variant, config in quantized_resident:
        quantized = copy.deepcopy(resident)
        started = _now(device)
        dlo.quantize_resident(quantized, config)
        setup_s = _now(device) - started
        median_s, output = timed(quantized, inputs, device, args)
        add(variant, setup_s, median_s, output, worst=worst_block(quantized, inputs, captured))
        del quantized
    del resident, captured

    # Streamed: bf16, then fp8 per scale (each must equal its resident fp8 model).
    slots = args.num_slots
    streamed = [("dlo", dlo.OffloadConfig(num_slots=slots))] if "dlo" in args.variants else []
    if "dlo-fp8" in args.variants:
        streamed += [
            (f"dlo fp8/{scale}", dlo.OffloadConfig(stream_dtype="fp8", fp8_scale=scale, num_slots=slots))
            for scale in SCALES
        ]
    if "dlo-fp8-gemm" in args.variants:
        gemm = dlo.OffloadConfig(stream_dtype="fp8", fp8_compute=True, num_slots=slots)
        streamed.append(("dlo fp8 gemm/per_channel", gemm))
    for variant, config in streamed:
        model = fresh()
        started = _now(device)
        handle = dlo.enable(model, device, config)
        setup_s = _now(device) - started
        before = handle.stats().bytes_streamed
        median_s, output = timed(model, inputs, device, args)
        stats = handle.stats()
        per_forward = (stats.bytes_streamed - before) // (args.warmup + args.iters)
        reference = "resident" if config.stream_dtype is None else variant.replace("dlo", "resident")
        equal_to = reference if reference in outputs else None
        add(variant, setup_s, median_s, output, equal_to, stats, nbytes=per_forward)
        handle.disable()
        del model, handle

    if device.type == "cuda" and "diffusers-cast" in args.variants:
        model = fresh()
        started = _now(device)
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        session = DiffusersGroupOffload(model, device)
        setup_s = _now(device) - started
        median_s, output = timed(session.model, inputs, device, args)
        add("diffusers cast", setup_s, median_s, output)
        del model, session
    release(device)
    return rows


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| shape | variant | setup s | median s | peak HBM GiB | GB/forward | rel L2 vs bf16 | cosine "
        "| worst block (rel L2) | output |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        worst = f"{r.worst_block} ({r.worst_block_rel_l2:.2e})" if r.worst_block else "-"
        verdict = "-" if r.equal is None else (f"= {r.equal_to}" if r.equal else f"DIFFERENT from {r.equal_to}")
        cells = [
            r.shape, r.variant, f"{r.setup_s:.2f}", f"{r.median_s:.4f}",
            "n/a" if r.peak_hbm_gib is None else f"{r.peak_hbm_gib:.2f}",
            "-" if r.bytes_per_forward is None else f"{r.bytes_per_forward / GB:.3f}",
            "-" if r.rel_l2 is None else f"{r.rel_l2:.2e}", "-" if r.cosine is None else f"{r.cosine:.6f}",
            worst, verdict,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=lambda text: text.split(","), default=["flux", "wan"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-slots", type=int, default=2, help="OffloadConfig.num_slots of the dlo variants")
    variants = ("resident-fp8", "dlo", "dlo-fp8", "resident-fp8-gemm", "dlo-fp8-gemm", "diffusers-cast")
    parser.add_argument(
        "--variants", type=lambda text: text.split(","), default=list(variants),
        help=f"comma-separated from {', '.join(variants)} (the bf16 resident run, the error reference, always runs)",
    )
    add_json_flag(parser, "bench_fp8")
    args = parser.parse_args(argv)
    check_run_args(parser, args)
    unknown = sorted(set(args.variants) - set(variants))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(variants)}")
    device = torch.device(args.device)
    print(" | ".join(f"{k} {v}" for k, v in environment(device).items()), flush=True)
    rows: list[Row] = []
    for name in args.shapes:
        rows += run_shape(name, device, args)
        write_json(args.json, "bench_fp8", [asdict(r) for r in rows], markdown_table(rows), environment=environment(device))
    print()
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
