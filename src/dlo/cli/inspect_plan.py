"""`dlo inspect`: the plan dlo would use for a model, and what it costs on device and link."""

from __future__ import annotations

import argparse

import torch

from dlo.cli.config_flags import config_from_flags
from dlo.cli.format import human_bytes, table
from dlo.cli.model_target import build_on_meta
from dlo.planning.offload_plan import discover
from dlo.planning.plan_summary import PlanSummary, summarize

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def render(summary: PlanSummary) -> str:
    rows = []
    for path in summary.plan.block_lists:
        sizes = [b for b in summary.blocks if b.name.rsplit(".", 1)[0] == path]
        classes = sorted({b.class_name for b in sizes})
        per_block = {human_bytes(b.nbytes) for b in sizes}
        rows.append([path, len(sizes), ", ".join(classes), " / ".join(sorted(per_block))])
    largest = summary.largest_block
    lines = [
        f"{summary.class_name}: {len(summary.blocks)} blocks, {human_bytes(summary.total_bytes)} of weights "
        f"(plan: {summary.plan.source})",
        "",
        table(["block list", "blocks", "class", "bytes per block"], rows),
        "",
        f"largest block:        {largest.name} ({human_bytes(largest.nbytes)})" if largest else "largest block: -",
        f"resident blocks:      {summary.resident_blocks}",
        f"always on device:     {human_bytes(summary.non_block_bytes)} (embeddings, norms, heads)",
        f"slots:                {summary.num_slots} x {human_bytes(largest.nbytes if largest else 0)}",
        f"device weight memory: {human_bytes(summary.device_weight_bytes)} "
        f"(resident run: {human_bytes(summary.total_bytes)})",
        f"streamed per call:    {human_bytes(summary.streamed_bytes)}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    module = build_on_meta(args.target)
    if args.dtype:
        module = module.to(DTYPES[args.dtype])
    print(render(summarize(module, discover(module), config_from_flags(args))))
    return 0
