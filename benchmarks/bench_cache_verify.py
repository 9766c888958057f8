"""What a full validation of a host weight cache entry costs: `dlo cache verify` on a
Wan-14B-shaped bf16 entry (page cache hot), which hashes the entry's files and then the mapped
tensors for the content digest (docs/guides/host-weight-cache.md).

The checkpoint of bench_host_backings.py is saved, loaded once with the host weight cache (which
publishes the entry), and `dlo -v cache verify` runs twice in fresh processes; its own output
gives the whole validation's time, its log the file-hashing pass alone ("hashed N GB in S s").

On the GPU machine, from the repository root (diffusers from the wheels in .whl/):
  PYTHONPATH=/tmp/site:$PWD/src python3 benchmarks/bench_cache_verify.py --dir /tmp/wan-ckpt
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

import bench_host_backings as backings
import dlo
from results_json import add_json_flag, write_json

VERIFY = "import sys; from dlo.cli.launch import main; sys.exit(main())"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/wan-ckpt"))
    parser.add_argument("--shape", choices=("wan", "flux"), default="wan")
    add_json_flag(parser, "bench_cache_verify")
    args = parser.parse_args()
    backings.save_checkpoint(args.shape, args.dir, torch.device("cuda"))
    cache_dir = str(args.dir / "host-weight-cache")
    started = time.perf_counter()
    dlo.load_transformer(args.dir, config=dlo.OffloadConfig(host_weight_cache=True, cache_dir=cache_dir))
    published_s = time.perf_counter() - started
    print(f"published in {published_s:.1f} s", flush=True)
    rows = []
    for _ in range(2):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", VERIFY, "-v", "cache", "verify", "--cache-dir", cache_dir],
            capture_output=True, text=True,
        )
        lines = [line for line in (done.stdout + done.stderr).splitlines() if "hashed" in line or " ok " in line or "BAD" in line]
        seconds = time.perf_counter() - started
        print(f"exit {done.returncode}, {seconds:.2f} s with start-up: " + " / ".join(lines), flush=True)
        rows.append({"exit": done.returncode, "seconds_with_startup": seconds, "lines": lines})
    write_json(args.json, "bench_cache_verify", rows, shape=args.shape, published_s=published_s)


if __name__ == "__main__":
    main()
