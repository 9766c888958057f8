"""Streaming from shared mappings (checkpoint mmap, host weight cache: staged or registered)
vs from private pinned memory.

A model of bench_streaming.py (Wan-14B-shaped 12 layers, or Flux-shaped 6+12; bf16, random
weights) is saved as a sharded safetensors checkpoint, then loaded back several ways and
streamed on one GPU:

  pinned          dlo.load_transformer(dir, OffloadConfig(checkpoint_mmap=False)): the
                  ordinary load; dlo packs every block into private page-locked memory.
  mmap/registered dlo.load_transformer(dir): blocks stay in the read-only checkpoint mapping,
                  which is registered with the driver (its tensors are used as saved): every
                  tensor is copied straight from the page-cache pages into its slot.
  mmap/tN         the same mapping with registration refused (a tiny pin_limit_gib): each
                  load packs the block into a pinned staging buffer with N threads.
  cache/tN        OffloadConfig(host_weight_cache=True) with registration refused (a tiny
                  pin_limit_gib): the cache entry's mapping, staged like mmap/tN. t1 is the
                  naive staged copy (one host thread).
  cache/registered the cache entry's mapping registered read-only with the driver: every
                  tensor is copied straight from the shared page-cache pages into its slot.

--stream-dtype fp8 gives every variant OffloadConfig(stream_dtype="fp8"): pinned and mmap
quantize at enable() into private pinned memory, the cache variants publish and map a float8
cache entry (issue 18: registered within 2 % of pinned).

Inputs: Wan "480p" (1x16x21x60x104 latents, 512 text tokens: compute-bound) and "tiny"
(1x16x1x8x8 latents, 16 text tokens: a forward takes as long as streaming the blocks); Flux
"1024px" (4096 image + 512 text tokens: transfer-bound on the H200, docs/benchmarks.md). Effective GB/s =
block bytes / forward median. The page cache is hot (the files were just written). Outputs are
checked bit-identical to the pinned variant. Host memory (smaps_rollup) is read while the
variant is enabled: Private_Dirty is this process's private memory, Pss_File its share of the
mapped files.

On the GPU machine, from the repository root (diffusers from the wheels in .whl/):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  python3 benchmarks/bench_host_backings.py --shape wan --dir /tmp/wan-ckpt
  python3 benchmarks/bench_host_backings.py --shape flux --dir /tmp/flux-ckpt --threads ""
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import bench_streaming as bench
import dlo
from results_json import add_json_flag, write_json

GB = 1e9
WAN_INPUTS = {
    "480p": dict(latent=(1, 16, 21, 60, 104), text=512),
    "tiny": dict(latent=(1, 16, 1, 8, 8), text=16),
}
INPUT_KINDS = {"wan": tuple(WAN_INPUTS), "flux": ("1024px",)}


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
    host_pss_gib: float
    host_private_dirty_gib: float
    host_pss_file_gib: float
    registered_gib: float
    identical_to_pinned: bool | None


def make_inputs(shape: str, kind: str, device: torch.device) -> dict:
    generator = torch.Generator().manual_seed(1)
    if shape == "flux":
        return bench.to_device(bench.SHAPES["flux"].make_inputs(generator), device)
    spec = WAN_INPUTS[kind]
    return bench.to_device(
        dict(
            hidden_states=bench._randn(generator, *spec["latent"]),
            timestep=torch.rand(1, generator=generator) * 1000,
            encoder_hidden_states=bench._randn(generator, 1, spec["text"], 4096),
            return_dict=False,
        ),
        device,
    )


def save_checkpoint(shape: str, directory: Path, device: torch.device) -> int:
    model = bench.build_model(bench.SHAPES[shape], seed=0, device=device)
    model.save_pretrained(directory, max_shard_size="2GB")
    del model
    bench.release(device)
    return bench.block_bytes(bench.SHAPES[shape])


def run_variant(
    name: str, config: dlo.OffloadConfig, directory: Path, block_bytes: int, device: torch.device, args
) -> tuple[list[Row], dict[str, torch.Tensor]]:
    """Load, enable and time one variant on every input kind of the shape."""
    started = time.perf_counter()
    model, plan = dlo.load_transformer(directory, config=config)
    handle = dlo.enable(model, device, config, plan=plan)
    setup_s = time.perf_counter() - started
    first = handle.stats()
    print(
        f"{name}: backing {first.backing}, registered {first.registered_bytes / 2**30:.2f} GiB in "
        f"{first.registered_ranges} ranges ({first.register_s:.3f} s), staging {first.staging_bytes / 2**30:.2f} GiB, "
        f"fallback {first.registration_fallback or '-'}",
        flush=True,
    )
    rows, outputs = [], {}
    try:
        with torch.inference_mode():
            for kind in INPUT_KINDS[args.shape]:
                inputs = make_inputs(args.shape, kind, device)
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
                        host_pss_gib=memory.pss / 2**30 if memory else float("nan"),
                        host_private_dirty_gib=memory.private_dirty / 2**30 if memory else float("nan"),
                        host_pss_file_gib=memory.pss_file / 2**30 if memory else float("nan"),
                        registered_gib=after.registered_bytes / 2**30,
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
        "| variant | inputs | setup s | median s | effective GB/s | H2D GB/s | pack GB/s | exposed s/fwd | registered GiB "
        "| host Pss GiB | host Private_Dirty GiB | host Pss_File GiB | output vs pinned |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pack = f"{r.pack_gbps:.1f}" if r.pack_gbps else "-"
        same = "reference" if r.identical_to_pinned is None else ("bit-identical" if r.identical_to_pinned else "DIFFERENT")
        lines.append(
            f"| {r.variant} | {r.inputs} | {r.setup_s:.2f} | {r.median_s:.4f} | {r.effective_gbps:.1f} | "
            f"{r.h2d_gbps:.1f} | {pack} | {r.exposed_s:.4f} | {r.registered_gib:.2f} | {r.host_pss_gib:.2f} | "
            f"{r.host_private_dirty_gib:.2f} | {r.host_pss_file_gib:.2f} | {same} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(INPUT_KINDS), default="wan")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dlo-bench-checkpoint"), help="where to save the checkpoint")
    parser.add_argument("--threads", default="1,4,8", help="pack_threads values for the mmap variants ('' for none)")
    parser.add_argument("--cache-threads", default=f"1,{os.cpu_count()}", help="pack_threads values for the staged cache variants")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--stream-dtype", default=None, help="OffloadConfig.stream_dtype of every variant, e.g. fp8")
    add_json_flag(parser, "bench_host_backings")
    args = parser.parse_args()
    device = torch.device("cuda")
    block_bytes = save_checkpoint(args.shape, args.dir, device)
    cache_dir = str(args.dir / "host-weight-cache")
    print(f"{args.shape}: checkpoint {args.dir}, block bytes {block_bytes / GB:.2f} GB", flush=True)

    streamed = dict(stream_dtype=args.stream_dtype)
    refused = dict(pin_limit_gib=1e-9, **streamed)  # registration refused: the staged path
    variants = [("mmap/registered", dlo.OffloadConfig(**streamed))]
    variants += [(f"mmap/t{t}", dlo.OffloadConfig(pack_threads=int(t), **refused)) for t in args.threads.split(",") if t]
    cache = dict(host_weight_cache=True, cache_dir=cache_dir)
    variants += [
        (f"cache/t{t}", dlo.OffloadConfig(**cache, pack_threads=int(t), **refused))
        for t in args.cache_threads.split(",")
        if t
    ]
    variants.append(("cache/registered", dlo.OffloadConfig(**cache, **streamed)))
    pinned = dlo.OffloadConfig(checkpoint_mmap=False, **streamed)
    rows, reference = run_variant("pinned", pinned, args.dir, block_bytes, device, args)
    for name, config in variants:
        measured, outputs = run_variant(name, config, args.dir, block_bytes, device, args)
        rows += [
            Row(**{**asdict(row), "identical_to_pinned": torch.equal(outputs[row.inputs], reference[row.inputs])})
            for row in measured
        ]
        print(table(rows[-len(measured):]), flush=True)
    report = table(rows)
    write_json(args.json, "bench_host_backings", [asdict(r) for r in rows], report, shape=args.shape, block_bytes=block_bytes)
    print(report)


if __name__ == "__main__":
    main()
