"""Startup through the host weight cache vs the ordinary load, on the CPU.

A Wan-shaped transformer (12 layers, 1024 wide, fp32, random weights, ~0.8 GB) is saved once;
then, page cache hot: the ordinary load (diffusers from_pretrained), a cold load through the
cache (ordinary load + hash + publish + map), and a warm start (source index -> validate every
byte of the entry -> map, no ordinary load). Also the hashing rate of content_digest.

Run: python benchmarks/bench_cache_startup.py [--dir /tmp/dlo-cache-bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

import dlo
from dlo.host.cache.identity import content_digest
from dlo.host.loader import ordinary_load
from dlo.models.tiny import TinyModel, _wan_inputs

WAN = TinyModel(
    "wan-bench",
    "WanTransformer3DModel",
    dict(
        patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=1024, freq_dim=256, ffn_dim=4096, num_layers=12,
    ),
    _wan_inputs(latent=(1, 16, 1, 8, 8), text=(1, 8, 1024)),
)


def timed(fn, repeats=3):
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dlo-cache-bench"))
    parser.add_argument("--dtype", choices=["as-saved", "bfloat16"], default="as-saved",
                        help="bfloat16: the fp32 checkpoint is cast on load (real work for the ordinary path)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    shutil.rmtree(args.dir, ignore_errors=True)
    model_dir, cache_dir = args.dir / "model", args.dir / "cache"
    WAN.build(seed=0).save_pretrained(model_dir)
    nbytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))

    ordinary_s, model = timed(lambda: ordinary_load(model_dir, dtype, False))
    tensors = dict(model.state_dict())
    hashed = sum(t.numel() * t.element_size() for t in tensors.values())
    hash_s, _ = timed(lambda: content_digest(tensors))
    del model, tensors
    config = dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(cache_dir))

    def cold():
        shutil.rmtree(cache_dir, ignore_errors=True)
        loaded, plan = dlo.load_transformer(model_dir, config, torch_dtype=dtype)
        plan.take().checkpoint.close()
        return loaded

    def warm():
        loaded, plan = dlo.load_transformer(model_dir, config, torch_dtype=dtype)
        plan.take().checkpoint.close()
        return loaded

    cold_s, _ = timed(cold)
    cold()  # leave an entry and its source record for the warm starts
    warm_s, _ = timed(warm)
    print(f"model {nbytes / 1e9:.2f} GB on disk, load dtype {args.dtype}, {os.cpu_count()} cores, torch {torch.__version__}")
    print("| load | median s | vs ordinary |")
    print("|---|---|---|")
    for name, seconds in (("ordinary (from_pretrained)", ordinary_s), ("cold: load + hash + publish + map", cold_s),
                          ("warm: validate (SHA-256) + map", warm_s)):
        print(f"| {name} | {seconds:.3f} | {ordinary_s / seconds:.2f}x |")
    threads = min(8, os.cpu_count() or 1)
    print(f"content hashing: {hashed / hash_s / 1e9:.2f} GB/s on {threads} threads "
          f"({hashed / hash_s / 1e9 / threads:.2f} GB/s per thread)")


if __name__ == "__main__":
    main()
