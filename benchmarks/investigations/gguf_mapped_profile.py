"""Where a mapped GGUF forward spends its time against the same file streamed from a private
copy (issue 31: "dlo mapped + kernels" 0.0919 s against "dlo + kernels" 0.0800 s on Flux-shaped
Q8_0). torch.profiler over --iters forwards of each, after two warm-ups; printed per forward:
wall time, host-to-device copies (count, device time), device kernel time, and the host ops
that took the most self CPU time.

  python3 benchmarks/investigations/gguf_mapped_profile.py --tmp /tmp/bench_gguf
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dlo  # noqa: E402
from bench_gguf import load_gguf, write_gguf  # noqa: E402
from bench_streaming import SHAPES, build_model, to_device  # noqa: E402


def profile(name: str, model, plan, inputs, iters: int) -> None:
    kernels = dlo.use_gguf_kernels(model)
    handle = dlo.enable(model, "cuda", dlo.OffloadConfig(), plan=plan)
    try:
        with torch.inference_mode():
            for _ in range(2):
                model(**inputs)
            torch.cuda.synchronize()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                started = time.perf_counter()
                for _ in range(iters):
                    model(**inputs)
                torch.cuda.synchronize()
                wall = (time.perf_counter() - started) / iters
    finally:
        handle.disable()
        kernels.restore()
    events = prof.key_averages()
    copies = [e for e in events if "Memcpy HtoD" in e.key]
    device = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))  # noqa: E731
    copy_count = sum(e.count for e in copies) / iters
    copy_us = sum(device(e) for e in copies) / iters
    kernel_us = sum(device(e) for e in events if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.key) / iters
    print(f"\n== {name}: {wall * 1e3:.1f} ms a forward; H2D copies {copy_count:.0f} a forward, {copy_us / 1e3:.1f} ms "
          f"device time; kernels {kernel_us / 1e3:.1f} ms device time")
    top = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    for e in top:
        print(f"  {e.key[:60]:60s} calls/fwd {e.count / iters:7.0f}  self CPU ms/fwd {e.self_cpu_time_total / iters / 1e3:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tmp", default=None)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    shape = SHAPES["flux"]
    directory = Path(tempfile.mkdtemp(prefix="gguf_profile_", dir=args.tmp))
    model = build_model(shape, 0, torch.device("cuda"))
    model.save_config(directory)
    path = directory / "Q8_0.gguf"
    write_gguf(model, path, "Q8_0", 2)
    del model
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(1)), torch.device("cuda"))
    profile("private (diffusers' loader)", load_gguf(path, directory, shape.class_name), None, inputs, args.iters)
    mapped, plan = dlo.load_transformer(path, torch_dtype=torch.bfloat16, model_config=directory)
    profile("mapped (dlo.load_transformer)", mapped, plan, inputs, args.iters)


if __name__ == "__main__":
    main()
