"""End-to-end Wan text-to-video at 480p: a Wan-14B-shaped transformer (12 layers, bf16, random
weights) with a tiny UMT5 text encoder and a tiny Wan VAE, resident vs streamed by
dlo.enable_pipeline, side by side in one process. Reports seconds per denoising step (with
classifier-free guidance: two transformer passes per step), peak HBM, and whether the videos
are bit-identical.

On the GPU machine, from the repository root (diffusers from the wheels in .whl/):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  cd benchmarks && python3 bench_generate.py --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import bench_streaming as bench
import dlo
from results_json import add_json_flag, write_json
from dlo.models.tiny_pipelines import _seeded, _t5_tokenizer


def make_pipeline(device: torch.device):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _t5_tokenizer()
    text_config = UMT5Config(
        vocab_size=len(tokenizer), d_model=4096, d_kv=64, d_ff=256, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=_seeded(0, lambda: UMT5EncoderModel(text_config)).to(torch.bfloat16),
        vae=_seeded(0, lambda: AutoencoderKLWan(
            base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )).to(torch.float32),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
        transformer=bench.build_model(bench.SHAPES["wan"], seed=0, device=device),
    )


def generate(pipe, steps: int, device: torch.device) -> tuple[np.ndarray, list[float]]:
    marks: list[float] = []

    def on_step_end(pipeline, step, timestep, callback_kwargs):
        torch.cuda.synchronize(device)
        marks.append(time.perf_counter())
        return callback_kwargs

    torch.cuda.synchronize(device)
    marks.append(time.perf_counter())
    with torch.inference_mode():
        video = pipe(
            "a cat surfing a wave", height=480, width=832, num_frames=81, num_inference_steps=steps,
            guidance_scale=5.0, max_sequence_length=512, generator=torch.Generator().manual_seed(0),
            callback_on_step_end=on_step_end, output_type="np",
        ).frames[0]
    return video, [b - a for a, b in zip(marks, marks[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    add_json_flag(parser, "bench_generate")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []

    pipe = make_pipeline(device).to(device)
    torch.cuda.reset_peak_memory_stats(device)
    resident, resident_steps = generate(pipe, args.steps, device)
    rows.append(("resident", resident_steps, torch.cuda.max_memory_allocated(device)))
    del pipe
    bench.release(device)

    pipe = make_pipeline(device)
    with dlo.enable_pipeline(pipe, device, dlo.OffloadConfig()) as handle:
        torch.cuda.reset_peak_memory_stats(device)
        streamed, streamed_steps = generate(pipe, args.steps, device)
        rows.append(("dlo", streamed_steps, torch.cuda.max_memory_allocated(device)))
        stats = handle.stats()["transformer"]
    same = np.array_equal(resident, streamed)

    print(f"Wan-14B-shaped (12 layers) text-to-video, 480x832, 81 frames, {args.steps} steps, CFG (2 passes/step)")
    print(f"dlo: {stats.bytes_streamed / 1e9:.1f} GB streamed at {stats.h2d_gbps:.1f} GB/s, "
          f"exposed {stats.exposed_copy_s:.3f} s, videos bit-identical: {same}")
    lines = ["| variant | s/step (median, steps 2..n) | first step s | peak HBM GiB |", "|---|---|---|---|"]
    lines += [
        f"| {name} | {statistics.median(steps[1:] or steps):.3f} | {steps[0]:.3f} | {peak / 2**30:.2f} |"
        for name, steps, peak in rows
    ]
    print("\n".join(lines))
    write_json(
        args.json, "bench_generate",
        [{"variant": name, "step_s": steps, "peak_hbm_bytes": peak} for name, steps, peak in rows], "\n".join(lines),
        bytes_streamed=stats.bytes_streamed, h2d_gbps=stats.h2d_gbps, exposed_copy_s=stats.exposed_copy_s,
        bit_identical=bool(same),
    )


if __name__ == "__main__":
    main()
