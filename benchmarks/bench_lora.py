"""LoRA while streaming: forward time with a rank-R LoRA on every attention and MLP Linear of
every block, resident against dlo, unfused and fused; the time `handle.fuse_lora()` takes; and
on a mapped checkpoint, the host bytes a fuse copies on write.

Per shape (the Flux- and Wan-shaped models of bench_streaming.py, random bf16 weights from one
seed), one variant at a time, each freed before the next:

  resident lora       the model on the device, the LoRA added there (PEFT, unfused).
  resident fused      the same after diffusers' fuse_lora(): the LoRA in the base weights.
  dlo lora            dlo.enable(model, device) on the CPU model, the LoRA added after it (its
                      adapters stay on the device beside the streamed base weights).
  dlo fused           handle.fuse_lora() on that: the base weights' pinned host copies rewritten.
  resident unfused,   then diffusers' pipe.unfuse_lora() as it runs outside enable_pipeline: each
  dlo unfused         PEFT layer's own unmerge(), which dlo makes open the layer's block (one block
                      load and host rewrite per merged layer, where handle.unfuse_lora() opens
                      each block once); "fuse s" is that unfuse's wall time.
  dlo mapped fused    --mapped: the model saved to --tmp, loaded with dlo.load_transformer (the
                      blocks stream from the checkpoint mapping), a LoRA on the first half of the
                      blocks only, fused: the fused blocks are copied on write, the rest stays
                      mapped (copied_on_write_bytes against those blocks' bytes).

The LoRA's A and B are seeded noise (not PEFT's zero B). Every dlo output is compared with the
resident variant's (torch.equal), the fused ones with the resident fused model.
floor = max(resident lora median, block bytes / --link-gbps): "x floor" (Flux target <= 1.03)
and "x resident" (Wan target <= 1.02) are the dlo medians over those. fuse_s: wall time of
handle.fuse_lora() (Wan target <= 2 s on the 12-block model), and of resident fuse_lora().

On the GPU machine, from the repository root (diffusers and peft from the wheels in .whl/):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  python3 benchmarks/bench_lora.py --shapes flux,wan --mapped --tmp /tmp/bench_lora

CPU smoke test: python benchmarks/bench_lora.py --device cpu --shapes tiny --warmup 0 --iters 1 --rank 4 --mapped

The table comes last; it and the raw numbers go to --json (default $OUT/bench_lora.json when OUT
is set), rewritten after each shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

import dlo

# The sibling benchmark's models and helpers (benchmarks/ is sys.path[0] when run as a script).
from bench_streaming import GB, SHAPES, block_bytes, build_model, release, synchronize, timed_forwards, to_device


@dataclass(frozen=True)
class Row:
    shape: str
    variant: str
    median_s: float | None
    equal_to: str | None = None
    identical: bool | None = None
    fuse_s: float | None = None
    host_bytes: int | None = None
    copied_on_write_bytes: int | None = None
    fused_block_bytes: int | None = None


def lora_targets(model: nn.Module, blocks: slice = slice(None)) -> list[str]:
    """Full names of the attention and MLP Linears of the blocks (`blocks` of each list): every
    nn.Linear in them but the modulation ones (AdaLayerNorm's `norm*.linear`)."""
    names = []
    for path in dlo.discover(model).block_lists:
        for index, block in list(enumerate(model.get_submodule(path)))[blocks]:
            for name, module in block.named_modules():
                if isinstance(module, nn.Linear) and not name.startswith("norm"):
                    names.append(f"{path}.{index}.{name}")
    return names


def add_lora(model: nn.Module, targets: list[str], rank: int, seed: int) -> None:
    """A rank-`rank` LoRA on `targets`, its A and B seeded noise, where the base weights' stand-ins
    or values are (the device: PEFT places an adapter beside its base weight)."""
    from peft import LoraConfig

    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets), adapter_name="bench")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if ".bench." in name:
                tensor.copy_(torch.randn(tensor.shape, generator=generator).mul_(0.01).to(tensor))


def timed(model: nn.Module, inputs: dict, device: torch.device, args: argparse.Namespace) -> tuple[float, torch.Tensor]:
    with torch.inference_mode():
        if args.warmup:
            timed_forwards(model, inputs, device, args.warmup)
        seconds, output = timed_forwards(model, inputs, device, args.iters)
    return statistics.median(seconds), output.cpu()


def unmerge_each_layer(model: nn.Module) -> None:
    """What diffusers' pipe.unfuse_lora() does to a component: each PEFT layer's own unmerge()."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for layer in [m for m in model.modules() if isinstance(m, BaseTunerLayer)]:
        layer.unmerge()


def timed_fuse(fuse, device: torch.device) -> float:
    synchronize(device)
    started = time.perf_counter()
    fuse()
    synchronize(device)
    return time.perf_counter() - started


def run_shape(name: str, device: torch.device, args: argparse.Namespace) -> list[Row]:
    shape = SHAPES[name]
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(args.seed + 1)), device)
    rows: list[Row] = []
    outputs: dict[str, torch.Tensor] = {}

    # resident
    model = build_model(shape, args.seed, device).to(device)
    targets = lora_targets(model)
    add_lora(model, targets, args.rank, args.seed + 2)
    median, outputs["resident lora"] = timed(model, inputs, device, args)
    rows.append(Row(name, "resident lora", median))
    fuse_s = timed_fuse(model.fuse_lora, device)
    median, outputs["resident fused"] = timed(model, inputs, device, args)
    rows.append(Row(name, "resident fused", median, fuse_s=fuse_s))
    unfuse_s = timed_fuse(lambda: unmerge_each_layer(model), device)
    median, outputs["resident unfused"] = timed(model, inputs, device, args)
    rows.append(Row(name, "resident unfused", median, fuse_s=unfuse_s))
    del model
    release(device)

    # dlo, private pinned host copies
    model = build_model(shape, args.seed, device)
    handle = dlo.enable(model, device, dlo.OffloadConfig())
    add_lora(model, targets, args.rank, args.seed + 2)
    median, output = timed(model, inputs, device, args)
    rows.append(Row(name, "dlo lora", median, "resident lora", torch.equal(output, outputs["resident lora"])))
    fuse_s = timed_fuse(handle.fuse_lora, device)
    median, output = timed(model, inputs, device, args)
    stats = handle.stats()
    rows.append(
        Row(name, "dlo fused", median, "resident fused", torch.equal(output, outputs["resident fused"]), fuse_s, stats.host_bytes, 0)
    )
    unfuse_s = timed_fuse(lambda: unmerge_each_layer(model), device)
    median, output = timed(model, inputs, device, args)
    rows.append(Row(name, "dlo unfused", median, "resident unfused", torch.equal(output, outputs["resident unfused"]), unfuse_s))
    handle.disable()
    del model, handle
    release(device)

    if args.mapped:
        rows.append(_mapped(name, device, args))
    return rows


def _mapped(name: str, device: torch.device, args: argparse.Namespace) -> Row:
    """The fused blocks of a mapped checkpoint are copied on write; the others stay mapped."""
    shape = SHAPES[name]
    if args.tmp:
        Path(args.tmp).mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix=f"bench_lora_{name}_", dir=args.tmp))
    build_model(shape, args.seed, device).save_pretrained(directory)
    release(device)
    model, plan = dlo.load_transformer(directory)
    handle = dlo.enable(model, device, dlo.OffloadConfig(), plan=plan)
    half = slice(None, max(1, len(handle._runtime.blocks) // 2))
    add_lora(model, lora_targets(model, half), args.rank, args.seed + 2)
    fused = {f"{path}.{i}" for path in dlo.discover(model).block_lists for i, _ in list(enumerate(model.get_submodule(path)))[half]}
    fused_bytes = sum(b.wire.nbytes for b in handle._runtime.blocks if b.name in fused)
    fuse_s = timed_fuse(handle.fuse_lora, device)
    stats = handle.stats()
    handle.disable()
    return Row(name, "dlo mapped fused", None, fuse_s=fuse_s, host_bytes=stats.host_bytes,
               copied_on_write_bytes=stats.copied_on_write_bytes, fused_block_bytes=fused_bytes)


def table(rows: list[Row], args: argparse.Namespace) -> str:
    lines = ["| shape | variant | median s | x floor | x resident | equal | fuse s | host MiB | copied MiB (fused blocks MiB) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        resident = next(r.median_s for r in rows if r.shape == row.shape and r.variant == "resident lora")
        floor = max(resident, block_bytes(SHAPES[row.shape]) / (args.link_gbps * GB))
        ratio = (lambda x: f"{row.median_s / x:.3f}") if row.median_s is not None else (lambda x: "")
        copied = (f"{row.copied_on_write_bytes / 2**20:.1f} ({row.fused_block_bytes / 2**20:.1f})"
                  if row.fused_block_bytes is not None else "")
        lines.append(
            f"| {row.shape} | {row.variant} | {'' if row.median_s is None else f'{row.median_s:.4f}'} | {ratio(floor)} | "
            f"{ratio(resident)} | {'' if row.identical is None else row.identical} | "
            f"{'' if row.fuse_s is None else f'{row.fuse_s:.2f}'} | "
            f"{'' if row.host_bytes is None else f'{row.host_bytes / 2**20:.1f}'} | {copied} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="flux,wan")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--link-gbps", type=float, default=55.3)
    parser.add_argument("--mapped", action="store_true", help="also fuse into a checkpoint mapping (writes the model to --tmp)")
    parser.add_argument("--tmp", default=None, help="where --mapped saves the models (default: the system's temp dir)")
    parser.add_argument("--json", default=os.path.join(os.environ["OUT"], "bench_lora.json") if "OUT" in os.environ else None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # PEFT's and diffusers' notices
    device = torch.device(args.device)
    rows: list[Row] = []
    for name in args.shapes.split(","):
        rows.extend(run_shape(name, device, args))
        if args.json:
            Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(table(rows, args))
    return 0 if all(r.identical is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
