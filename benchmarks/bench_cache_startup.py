"""Startup through the host weight cache vs the ordinary load.

A Wan-shaped transformer is saved once: "small" (12 layers, 1024 wide, fp32, ~0.8 GB) or
"wan14b" (bench_streaming.py's Wan-14B-shaped 12 layers, bf16, ~8.5 GB; its random weights
are drawn on the GPU when there is one). Then, page cache hot: the ordinary load (diffusers
from_pretrained, plus fuse_qkv_projections with --fuse-qkv: a loader that transforms weights),
a cold load through the cache (ordinary load + hash + publish + map), and a warm start (source
index -> validate every byte of the entry -> map, no ordinary load). Also the hashing rate of
content_digest.

Run: python benchmarks/bench_cache_startup.py [--model small|wan14b] [--dir /tmp/dlo-cache-bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from functools import partial
from pathlib import Path

import torch

import dlo
from dlo.host.cache.identity import content_digest
from dlo.host.loader import ordinary_load
from dlo.models.tiny import TinyModel, _wan_inputs
from results_json import add_json_flag, write_json

WAN = TinyModel(
    "wan-bench",
    "WanTransformer3DModel",
    dict(
        patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=1024, freq_dim=256, ffn_dim=4096, num_layers=12,
    ),
    _wan_inputs(latent=(1, 16, 1, 8, 8), text=(1, 8, 1024)),
)


def save_model(name: str, directory: Path) -> None:
    if name == "small":
        WAN.build(seed=0).save_pretrained(directory)
        return
    import bench_streaming  # diffusers-heavy: only for the large model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bench_streaming.build_model(bench_streaming.SHAPES["wan"], seed=0, device=device).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dlo-cache-bench"))
    parser.add_argument("--model", choices=["small", "wan14b"], default="small")
    parser.add_argument("--dtype", choices=["as-saved", "bfloat16"], default="as-saved",
                        help="bfloat16: the checkpoint is cast on load (real work for the ordinary path)")
    parser.add_argument("--fuse-qkv", action="store_true", help="the loader fuses the q/k/v projections")
    parser.add_argument("--repeats", type=int, default=3)
    add_json_flag(parser, "bench_cache_startup")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    shutil.rmtree(args.dir, ignore_errors=True)
    model_dir, cache_dir = args.dir / "model", args.dir / "cache"
    save_model(args.model, model_dir)
    nbytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))

    def timed(fn):
        seconds = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            result = fn()
            seconds.append(time.perf_counter() - started)
        return statistics.median(seconds), result

    ordinary_s, model = timed(lambda: ordinary_load(model_dir, dtype, args.fuse_qkv))
    tensors = dict(model.state_dict())
    hashed = sum(t.numel() * t.element_size() for t in tensors.values())
    hash_s, _ = timed(partial(content_digest, tensors))
    del model, tensors
    config = dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(cache_dir))

    def cold():
        shutil.rmtree(cache_dir, ignore_errors=True)
        loaded, plan = dlo.load_transformer(model_dir, config, torch_dtype=dtype, fuse_qkv=args.fuse_qkv)
        plan.take().checkpoint.close()
        return loaded

    def warm():
        loaded, plan = dlo.load_transformer(model_dir, config, torch_dtype=dtype, fuse_qkv=args.fuse_qkv)
        plan.take().checkpoint.close()
        return loaded

    cold_s, _ = timed(cold)
    cold()  # leave an entry and its source record for the warm starts
    warm_s, _ = timed(warm)
    print(f"model {args.model}: {nbytes / 1e9:.2f} GB on disk, load dtype {args.dtype}, fuse_qkv {args.fuse_qkv}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")
    loads = (("ordinary (from_pretrained)", ordinary_s), ("cold: load + hash + publish + map", cold_s),
             ("warm: validate (SHA-256) + map", warm_s))
    lines = ["| load | median s | vs ordinary |", "|---|---|---|"]
    lines += [f"| {name} | {seconds:.3f} | {ordinary_s / seconds:.2f}x |" for name, seconds in loads]
    print("\n".join(lines))
    threads = len(os.sched_getaffinity(0))
    print(f"content hashing: {hashed / hash_s / 1e9:.2f} GB/s on {threads} threads "
          f"({hashed / hash_s / 1e9 / threads:.2f} GB/s per thread)")
    write_json(
        args.json, "bench_cache_startup", [{"load": name, "median_s": seconds} for name, seconds in loads],
        "\n".join(lines), model=args.model, dtype=args.dtype, fuse_qkv=args.fuse_qkv, disk_bytes=nbytes,
        hash_gbps=hashed / hash_s / 1e9, hash_threads=threads,
    )


if __name__ == "__main__":
    main()
