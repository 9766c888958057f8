"""`dlo serve` with 1 and then 2 replicas: aggregate throughput, latency, summed host PSS.

The pipeline is a WanPipeline whose transformer is Wan-14B-shaped (bench_streaming.py's "wan"
shape, docs/benchmarks.md: 40 heads x 128, ffn 13824, 12 of its 40 layers by default, random seeded bf16
weights written as 2 GB safetensors shards) with the tiny UMT5 text encoder, tiny Wan VAE and
tokenizer of dlo.models.tiny_pipelines (so the transformer's text_dim is 32, not 4096: only the
condition embedder's text projection is smaller; the blocks are Wan-14B's). It is written once
under --dir. Then `dlo serve` runs with 1 replica, then 2 (`--devices 0,1` when 2 GPUs exist,
else both on cuda:0), both through the host weight cache (the first run publishes the entry;
its time is the "start" phase). Per run: one warm-up job per replica, then --requests video
jobs posted at once (480x832, --frames, --steps, guidance 1: one forward a step, WebP), polled
every 50 ms. Reported: requests/s (all jobs / wall time from the first post to the last
completion), p50/p95 latency (post -> seen completed), summed Pss (smaps_rollup) of the
replicas after the jobs; the 2-vs-1 throughput ratio (target >= 1.9x on 2 GPUs) and summed
Pss against one copy of the transformer + 2 GiB a replica.

On the GPU machine, from the repository root (diffusers from the wheels in .whl/). The GPU image
has neither FastAPI, uvicorn nor prometheus_client: .whl/ must hold them and their dependencies too,
fetched here with `python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation
cp --platform manylinux2014_x86_64 -d .whl fastapi uvicorn prometheus_client`:

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  python3 benchmarks/bench_serve.py --dir /tmp/bench-serve

CPU check (tiny Wan pipeline, seconds a job): python benchmarks/bench_serve.py --tiny

The markdown table comes last; it and the raw numbers go as JSON to --json (results_json.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serve_process import call, free_port, wait_healthy  # noqa: E402  (HTTP helpers of the serve tests)
from results_json import add_json_flag, write_json  # noqa: E402

GIB = 2**30
# No `dlo` console script on the GPU machine: the CLI's entry point, as `dlo`.
LAUNCH = 'import sys; sys.argv[0] = "dlo"; from dlo.cli.launch import main; sys.exit(main())'


def lap(phase: str, since: float) -> float:
    now = time.perf_counter()
    print(f"[{phase}] {now - since:.1f} s", flush=True)
    return now


def write_pipeline(directory: Path, tiny: bool, layers: int) -> int:
    """The pipeline under `directory` (kept if already there); returns its transformer's bytes."""
    from dlo.models.tiny_pipelines import save_tiny_wan_pipeline

    transformer = directory / "transformer"
    if not (directory / "model_index.json").exists():
        save_tiny_wan_pipeline(directory)
        if not tiny:
            import torch

            import bench_streaming as bench

            shape = bench.SHAPES["wan"]
            config = {**shape.config, "num_layers": layers, "text_dim": 32}  # the tiny UMT5's width
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model = bench.build_model(bench.Shape(shape.name, shape.class_name, config, shape.make_inputs), 0, device)
            shutil.rmtree(transformer)
            model.save_pretrained(transformer, max_shard_size="2GB")
    return sum(path.stat().st_size for path in transformer.glob("*.safetensors"))


@contextlib.contextmanager
def serving(args, directory: Path, replicas: int, gpus: int, *flags: str):
    """`dlo serve directory` with `replicas` replicas and `flags`, through the host weight cache
    under args.dir; yields (its base URL, seconds until it was healthy) and stops it on exit."""
    port = free_port()
    # One replica: cuda:0 (dlo serve refuses listed devices that would get no replica).
    placement = ["--device", "cpu"] if args.tiny else ["--devices", "0,1" if gpus >= 2 and replicas >= 2 else "0"]
    argv = [
        sys.executable, "-c", LAUNCH, "serve", str(directory), "--port", str(port), "--replicas", str(replicas),
        "--cache-dir", str(args.dir / "cache"), "--max-queue", str(args.requests),
        "--cache-allow-any-filesystem", *placement, *flags,  # --dir may be on tmpfs or overlay: the cache lives there
    ]
    started = time.perf_counter()
    log = open(args.dir / f"serve-{replicas}.log", "w")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(server, base, timeout_s=float("inf")):
            raise SystemExit(f"dlo serve exited {server.returncode}: see {log.name}")
        yield base, time.perf_counter() - started
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=120)
        log.close()


def video_request(args) -> dict:
    return {
        "prompt": "a red cube on a table", "size": args.size, "num_frames": args.frames,
        "num_inference_steps": args.steps, "guidance_scale": 1.0, "format": "webp",
    }


def serve_run(args, directory: Path, replicas: int, gpus: int) -> dict:
    import dlo

    with serving(args, directory, replicas, gpus) as (base, start_s):
        clock = lap(f"{replicas} replica(s): start", time.perf_counter() - start_s)
        request = video_request(args)
        run_jobs(base, [request] * replicas)  # warm-up: one job a replica
        clock = lap(f"{replicas} replica(s): warm-up", clock)
        began = time.perf_counter()
        latencies = run_jobs(base, [{**request, "seed": k} for k in range(args.requests)])
        wall_s = time.perf_counter() - began
        clock = lap(f"{replicas} replica(s): {args.requests} jobs", clock)
        pids = call(f"{base}/health")[1]["replica_pids"]
        pss = sum(dlo.read_smaps_rollup(pid).pss for pid in pids)
    latencies.sort()
    return {
        "replicas": replicas, "start_s": start_s, "wall_s": wall_s, "requests_per_s": args.requests / wall_s,
        "p50_s": statistics.median(latencies), "p95_s": latencies[max(0, round(0.95 * len(latencies)) - 1)],
        "summed_pss_bytes": pss,
    }


def run_jobs(base: str, requests: list[dict], poll_s: float = 0.05) -> list[float]:
    """Posts every request at once, polls every `poll_s` until all are done; each job's seconds."""
    posted = {}
    for request in requests:
        status, job, _ = call(f"{base}/v1/videos", request)
        if status != 200:
            raise SystemExit(f"POST /v1/videos answered {status}: {job}")
        posted[job["id"]] = time.perf_counter()
    seconds = {}
    while len(seconds) < len(posted):
        for video_id in posted.keys() - seconds.keys():
            job = call(f"{base}/v1/videos/{video_id}")[1]
            if job["status"] == "completed":
                seconds[video_id] = time.perf_counter() - posted[video_id]
            elif job["status"] != "queued" and job["status"] != "running":
                raise SystemExit(f"job {video_id}: {job}")
        time.sleep(poll_s)
    return list(seconds.values())


def table(rows: list[dict], weight_bytes: int) -> str:
    lines = [
        "| replicas | start s | requests/s | vs 1 replica | p50 s | p95 s | summed PSS GiB | weights + 2 GiB/replica |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        bound = (weight_bytes + 2 * GIB * row["replicas"]) / GIB
        lines.append(
            f"| {row['replicas']} | {row['start_s']:.1f} | {row['requests_per_s']:.3f} | "
            f"{row['requests_per_s'] / rows[0]['requests_per_s']:.2f}x | {row['p50_s']:.2f} | {row['p95_s']:.2f} | "
            f"{row['summed_pss_bytes'] / GIB:.2f} | {bound:.2f} |"
        )
    return "\n".join(lines)


def add_pipeline_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the served pipeline and its video (shared with bench_serve_lora.py)."""
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dlo-bench-serve"))
    parser.add_argument("--tiny", action="store_true", help="the tiny Wan pipeline on the CPU: checks the script")
    parser.add_argument("--layers", type=int, default=12, help="Wan-14B layers in the transformer (default: 12)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--frames", type=int, default=17, help="4k+1 (default: 17)")
    parser.add_argument("--size", default=None, help="WxH (default: 832x480; --tiny: 32x32)")


def settle_pipeline_flags(args: argparse.Namespace) -> Path:
    """Fills the size default, caps --tiny's frames; returns the pipeline's directory (created)."""
    args.size = args.size or ("32x32" if args.tiny else "832x480")
    if args.tiny:
        args.frames = min(args.frames, 5)
    args.dir.mkdir(parents=True, exist_ok=True)
    return args.dir / ("tiny-wan" if args.tiny else f"wan14b-{args.layers}l")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pipeline_flags(parser)
    parser.add_argument("--requests", type=int, default=8, help="jobs posted at once per run (default: 8)")
    add_json_flag(parser, "bench_serve")
    args = parser.parse_args()
    directory = settle_pipeline_flags(args)
    import torch

    import dlo

    gpus = 0 if args.tiny else torch.cuda.device_count()
    environment = {"device": torch.cuda.get_device_name(0) if gpus else "cpu", "gpus": gpus,
                   "torch": torch.__version__, "dlo": dlo.__version__}
    print(" | ".join(f"{k} {v}" for k, v in environment.items()), flush=True)
    clock = time.perf_counter()
    weight_bytes = write_pipeline(directory, args.tiny, args.layers)
    lap(f"pipeline ({weight_bytes / 1e9:.2f} GB of transformer)", clock)
    rows = [serve_run(args, directory, replicas, gpus) for replicas in (1, 2)]
    write_json(
        args.json, "bench_serve", rows, table(rows, weight_bytes),
        environment=environment, transformer_bytes=weight_bytes, size=args.size, frames=args.frames,
        steps=args.steps, requests=args.requests,
        throughput_ratio=rows[1]["requests_per_s"] / rows[0]["requests_per_s"],
    )
    print(table(rows, weight_bytes))


if __name__ == "__main__":
    main()
