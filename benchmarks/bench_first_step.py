"""Time to the first step, end to end: imports, then load -> enable -> first forward done.

The Wan-14B-shaped transformer of bench_streaming.py (12 layers, bf16, random weights, ~9 GB)
is saved once as a sharded safetensors checkpoint (2 GB shards). Then every variant runs in a
fresh process, page cache hot (the files were just read) and cold (every file of the
checkpoint and of the cache dropped with posix_fadvise(POSIX_FADV_DONTNEED) first):

  pinned         diffusers' from_pretrained(dir), then dlo.enable(model, "cuda"): the ordinary
                 load and a private pinned copy of the blocks (what a user writes today).
  mmap/staged    dlo.load_transformer(dir, OffloadConfig(pin_limit_gib=1e-9)) + enable: the
                 blocks stay in the checkpoint mapping and are packed into pinned staging buffers.
  mmap/registered dlo.load_transformer(dir) + enable: the mapping registered with the driver.
  cache/cold     OffloadConfig(host_weight_cache=True) with an empty cache: ordinary load, hash,
                 publish, map (once per node).
  cache/full     the entry exists: source index -> SHA-256 of every byte -> map (cache_verify="full").
  cache/stamp    the entry exists and was validated before: stamps match, no hashing
                 (cache_verify="stamp", the default).

Per process: the import times of torch, diffusers (with its transformer class: diffusers imports
model modules on first use) and dlo (with the modules load and enable need), in that order,
CUDA initialisation and the inputs (480p, 81 frames: outside
the timed path, the same for every variant), then the load call, enable() and the first forward
(device synchronized). "to first step" is load + enable + forward.

On the GPU machine, from the repository root (diffusers from the wheels in .whl/):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  cd benchmarks && python3 bench_first_step.py --dir /tmp/first-step
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from results_json import add_json_flag, write_json

VARIANTS = ("pinned", "mmap/staged", "mmap/registered", "cache/cold", "cache/full", "cache/stamp")
PAGE_CACHE = ("hot", "cold")
MARK = "FIRST-STEP "


@dataclass(frozen=True)
class Timing:
    variant: str
    page_cache: str
    import_torch_s: float
    import_diffusers_s: float
    import_dlo_s: float
    cuda_and_inputs_s: float
    load_s: float
    enable_s: float
    forward_s: float
    steady_forward_s: float  # a second forward, after the timed path: what the first forward adds is start-up
    register_s: float  # host registration inside enable (0 where nothing was registered)
    backing: str

    @property
    def to_first_step_s(self) -> float:
        return self.load_s + self.enable_s + self.forward_s


def warm_up_libraries(device) -> None:  # a torch.device (torch is imported in the child only)
    """A bf16 GEMM and an attention call on `device`: cuBLAS and the attention kernels start up here."""
    import torch
    import torch.nn.functional as F

    a = torch.randn(4096, 5120, device=device, dtype=torch.bfloat16)
    (a @ a.T).sum().item()
    q = torch.randn(1, 40, 4096, 128, device=device, dtype=torch.bfloat16)
    F.scaled_dot_product_attention(q, q, q).sum().item()


def child(variant: str, page_cache: str, directory: Path, warm_libraries: bool) -> None:
    """One variant in this fresh process; prints one MARK line of JSON."""
    clock = time.perf_counter()

    def lap() -> float:
        nonlocal clock
        now = time.perf_counter()
        seconds, clock = now - clock, now
        return seconds

    import torch

    import_torch = lap()
    import diffusers

    diffusers.WanTransformer3DModel  # diffusers imports its model modules on first use: here, not in the load
    import_diffusers = lap()
    import dlo

    dlo.load_transformer, dlo.enable  # dlo's modules load on first use too
    import_dlo = lap()
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_streaming as bench

    device = torch.device("cuda")
    inputs = bench.to_device(bench.SHAPES["wan"].make_inputs(torch.Generator().manual_seed(1)), device)
    if warm_libraries:
        warm_up_libraries(device)
    torch.cuda.synchronize(device)
    cuda_and_inputs = lap()

    cache = dict(host_weight_cache=True, cache_dir=str(directory / "cache"))
    configs = {
        "pinned": dlo.OffloadConfig(),
        "mmap/staged": dlo.OffloadConfig(pin_limit_gib=1e-9),
        "mmap/registered": dlo.OffloadConfig(),
        "cache/cold": dlo.OffloadConfig(**cache),
        "cache/full": dlo.OffloadConfig(**cache, cache_verify="full"),
        "cache/stamp": dlo.OffloadConfig(**cache, cache_verify="stamp"),
    }
    config = configs[variant]
    if variant == "pinned":
        model = diffusers.WanTransformer3DModel.from_pretrained(directory / "model", torch_dtype=torch.bfloat16)
        plan = None
    else:
        model, plan = dlo.load_transformer(directory / "model", config)
    load = lap()
    handle = dlo.enable(model, device, config, plan=plan)
    enable = lap()
    with torch.inference_mode():
        model(**inputs)
    torch.cuda.synchronize(device)
    forward = lap()
    with torch.inference_mode():
        model(**inputs)
    torch.cuda.synchronize(device)
    steady_forward = lap()
    stats = handle.stats()
    timing = Timing(
        variant, page_cache, import_torch, import_diffusers, import_dlo, cuda_and_inputs, load, enable, forward,
        steady_forward, stats.register_s, stats.backing,
    )
    print(MARK + json.dumps(asdict(timing)), flush=True)


def drop_page_cache(root: Path) -> None:
    os.sync()  # dirty pages cannot be dropped
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_through(root: Path) -> None:
    """Bring every file under `root` into the page cache."""
    for path in root.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        with open(path, "rb") as file:
            while file.read(64 << 20):
                pass


def run_child(variant: str, page_cache: str, directory: Path, warm_libraries: bool) -> Timing:
    if page_cache == "cold":
        drop_page_cache(directory)
    else:
        read_through(directory)
    command = [sys.executable, __file__, "--child", variant, "--page-cache", page_cache, "--dir", str(directory)]
    command += ["--warm-up-libraries"] if warm_libraries else []
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{variant} ({page_cache}) failed with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return Timing(**json.loads(lines[-1][len(MARK):]))


def save_checkpoint(directory: Path) -> None:
    import torch

    import bench_streaming as bench

    model_dir = directory / "model"
    if (model_dir / "config.json").exists():
        return
    model = bench.build_model(bench.SHAPES["wan"], seed=0, device=torch.device("cuda"))
    model.save_pretrained(model_dir, max_shard_size="2GB")


def table(rows: list[Timing]) -> str:
    pinned = {r.page_cache: r.to_first_step_s for r in rows if r.variant == "pinned"}
    lines = [
        "| page cache | variant | backing | import torch s | import diffusers s | import dlo s | load s | enable s "
        "| register s | first forward s | steady forward s | to first step s | sooner than pinned |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.page_cache} | {r.variant} | {r.backing} | {r.import_torch_s:.2f} | {r.import_diffusers_s:.2f} | "
            f"{r.import_dlo_s:.3f} | {r.load_s:.2f} | {r.enable_s:.2f} | {r.register_s:.2f} | {r.forward_s:.2f} | "
            f"{r.steady_forward_s:.2f} | "
            f"{r.to_first_step_s:.2f} | {pinned[r.page_cache] / r.to_first_step_s:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dlo-first-step"))
    parser.add_argument("--page-cache", default=",".join(PAGE_CACHE), help="comma-separated from hot,cold")
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per variant; the median is kept")
    parser.add_argument(
        "--variants", type=lambda text: text.split(","), default=list(VARIANTS),
        help="comma-separated, from " + ", ".join(VARIANTS) + " (default: all; cache/full and cache/stamp map the "
        "entry cache/cold publishes: with cache/cold left out they need the entry of an earlier run under --dir)",
    )
    add_json_flag(parser, "bench_first_step")
    parser.add_argument(
        "--warm-up-libraries", action="store_true",
        help="diagnostic: one bf16 GEMM and one attention call before the load call, outside the timed path; "
        "what the first forward loses with it is library start-up",
    )
    parser.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if args.child is not None:
        child(args.child, args.page_cache, args.dir, args.warm_up_libraries)
        return
    save_checkpoint(args.dir)
    rows = []
    for page_cache in args.page_cache.split(","):
        if "cache/cold" in args.variants:  # it publishes; the warm cache variants map its entry
            shutil.rmtree(args.dir / "cache", ignore_errors=True)
        for variant in [v for v in VARIANTS if v in args.variants]:
            repeats = 1 if variant == "cache/cold" else args.repeats
            runs = [run_child(variant, page_cache, args.dir, args.warm_up_libraries) for _ in range(repeats)]
            middle = statistics.median_low([r.to_first_step_s for r in runs])
            row = next(r for r in runs if r.to_first_step_s == middle)
            rows.append(row)
            print(table(rows).splitlines()[-1], flush=True)
    report = table(rows)
    write_json(args.json, "bench_first_step", [asdict(r) for r in rows], report)
    print(f"\n{Path(sys.executable).name} {' '.join(sys.argv)}\n{report}")


if __name__ == "__main__":
    main()
