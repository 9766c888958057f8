"""Streaming from a checkpoint mapping (staged) vs from private pinned memory.

The Wan-14B-shaped model of bench_streaming.py (12 layers, bf16, random weights) is saved as
a sharded safetensors checkpoint, then loaded back two ways and streamed on one GPU:

  pinned      dlo.load_transformer(dir, OffloadConfig(checkpoint_mmap=False)): the ordinary
              load; dlo packs every block into private page-locked memory. One H2D per block.
  mmap/tN     dlo.load_transformer(dir): the blocks stay in the read-only checkpoint mapping
              (page cache, shared by every process mapping the files); each load packs the
              block into a pinned staging buffer with N threads, then copies it.

Two inputs per variant: "480p" (1x16x21x60x104 latents, 512 text tokens: compute-bound, the
copies should hide) and "tiny" (1x16x1x8x8 latents, 16 text tokens: compute is negligible,
so a forward takes as long as streaming the blocks; its effective rate is the throughput).
Effective GB/s = block bytes / forward median. The page cache is hot (the files were just
written). dlo's outputs are checked bit-identical between the variants.

On the GPU machine, from the repository root (diffusers from the wheels in .whl/):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  python3 benchmarks/bench_host_backings.py --dir /tmp/wan-ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import bench_streaming as bench
import dlo

GB = 1e9
INPUTS = {
    "480p": dict(latent=(1, 16, 21, 60, 104), text=512),
    "tiny": dict(latent=(1, 16, 1, 8, 8), text=16),
}


@dataclass(frozen=True)
class Row:
    variant: str
    inputs: str
    setup_s: float
    median_s: float
    effective_gbps: float
    h2d_gbps: float
    pack_gbps: float | None
    exposed_s: float
    host_private_dirty_gib: float
    host_pss_file_gib: float
    identical_to_pinned: bool | None


def make_inputs(kind: str, device: torch.device) -> dict:
    spec = INPUTS[kind]
    generator = torch.Generator().manual_seed(1)
    return bench.to_device(
        dict(
            hidden_states=bench._randn(generator, *spec["latent"]),
            timestep=torch.rand(1, generator=generator) * 1000,
            encoder_hidden_states=bench._randn(generator, 1, spec["text"], 4096),
            return_dict=False,
        ),
        device,
    )


def save_checkpoint(directory: Path, device: torch.device) -> int:
    model = bench.build_model(bench.SHAPES["wan"], seed=0, device=device)
    model.save_pretrained(directory, max_shard_size="2GB")
    block_bytes = sum(t.numel() * t.element_size() for t in model.blocks.parameters())
    del model
    bench.release(device)
    return block_bytes


def run_variant(
    name: str, config: dlo.OffloadConfig, directory: Path, block_bytes: int, device: torch.device, args
) -> tuple[list[Row], dict[str, torch.Tensor]]:
    started = time.perf_counter()
    model, plan = dlo.load_transformer(directory, config=config)
    handle = dlo.enable(model, device, config, plan=plan)
    setup_s = time.perf_counter() - started
    rows, outputs = [], {}
    try:
        with torch.inference_mode():
            for kind in INPUTS:
                inputs = make_inputs(kind, device)
                for _ in range(args.warmup):
                    model(**inputs)
                before = handle.stats()
                seconds, output = bench.timed_forwards(model, inputs, device, args.iters)
                after = handle.stats()
                copied = after.bytes_streamed - before.bytes_streamed
                packed_s = after.pack_s - before.pack_s
                median = statistics.median(seconds)
                memory = after.host_memory
                rows.append(
                    Row(
                        variant=name,
                        inputs=kind,
                        setup_s=setup_s,
                        median_s=median,
                        effective_gbps=block_bytes / median / GB,
                        h2d_gbps=copied / (after.copy_s - before.copy_s) / GB,
                        pack_gbps=copied / packed_s / GB if packed_s > 0 else None,
                        exposed_s=(after.exposed_copy_s - before.exposed_copy_s) / args.iters,
                        host_private_dirty_gib=memory.private_dirty / 2**30 if memory else float("nan"),
                        host_pss_file_gib=memory.pss_file / 2**30 if memory else float("nan"),
                        identical_to_pinned=None,
                    )
                )
                outputs[kind] = output.cpu()
    finally:
        handle.disable()
        del model, handle
        bench.release(device)
    return rows, outputs


def table(rows: list[Row]) -> str:
    lines = [
        "| variant | inputs | setup s | median s | effective GB/s | H2D GB/s | pack GB/s | exposed s/fwd | host Private_Dirty GiB | host Pss_File GiB | output vs pinned |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pack = f"{r.pack_gbps:.1f}" if r.pack_gbps else "-"
        same = "reference" if r.identical_to_pinned is None else ("bit-identical" if r.identical_to_pinned else "DIFFERENT")
        lines.append(
            f"| {r.variant} | {r.inputs} | {r.setup_s:.2f} | {r.median_s:.4f} | {r.effective_gbps:.1f} | "
            f"{r.h2d_gbps:.1f} | {pack} | {r.exposed_s:.4f} | {r.host_private_dirty_gib:.2f} | "
            f"{r.host_pss_file_gib:.2f} | {same} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dlo-wan-checkpoint"), help="where to save the checkpoint")
    parser.add_argument("--threads", default="1,4,8", help="pack_threads values for the mmap variants")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    block_bytes = save_checkpoint(args.dir, device)
    print(f"checkpoint: {args.dir}, block bytes {block_bytes / GB:.2f} GB", flush=True)

    rows, reference = run_variant("pinned", dlo.OffloadConfig(checkpoint_mmap=False), args.dir, block_bytes, device, args)
    for threads in (int(t) for t in args.threads.split(",")):
        config = dlo.OffloadConfig(pack_threads=threads)
        mapped, outputs = run_variant(f"mmap/t{threads}", config, args.dir, block_bytes, device, args)
        rows += [
            Row(**{**asdict(row), "identical_to_pinned": torch.equal(outputs[row.inputs], reference[row.inputs])})
            for row in mapped
        ]
        print(table(rows[-2:]), flush=True)
    report = table(rows)
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_host_backings.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(report)


if __name__ == "__main__":
    main()
