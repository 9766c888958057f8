"""One `dlo generate` call, in one process or in each rank: the pipeline loaded with its
transformer streamed, run, its output written, its statistics rendered."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

import dlo
from dlo.backend.gather_group import diffusers_sp_group
from dlo.cli.compile_flag import compile_model
from dlo.cli.format import human_bytes, table
from dlo.cli.parallel_run import Parallel, ParallelRun, enable_context_parallel
from dlo.pipelines.loading import load_pipeline
from dlo.pipelines.media_output import write_image, write_video

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 0 to 2**64 - 1 (a negative one wraps onto these)


def render_stats(stats: dict[str, dlo.OffloadStats], steps: int, seconds: float, device: torch.device | str) -> str:
    rows = []
    for name, s in stats.items():
        rows.append(
            [
                name,
                f"{s.streamed_blocks} (+{s.resident_blocks})",
                human_bytes(s.bytes_streamed / max(steps, 1)),
                f"{s.h2d_gbps:.1f} GB/s",
                f"{s.exposed_copy_s / max(steps, 1) * 1e3:.1f} ms",
                human_bytes(s.peak_device_bytes),
                f"{s.backing} (registered)" if s.registered_bytes else s.backing,
            ]
        )
    header = ["component", "blocks (+resident)", "streamed/step", "H2D", "exposed/step", "peak device", "host copy"]
    return f"{steps} steps in {seconds:.2f} s ({seconds / max(steps, 1):.3f} s/step) on {device}\n\n" + table(header, rows)


@dataclass(frozen=True)
class GenerateJob:
    """What `dlo generate` checked before loading anything: what each process runs."""

    model_dir: Path
    pipeline: type
    video: bool
    dtype: torch.dtype
    config: dlo.OffloadConfig
    call: dict  # see call_kwargs
    compile: str
    steps: int
    fps: int


@dataclass(frozen=True)
class Generated:
    media: object  # a PIL image, or a video's frames
    stats: dict[str, dlo.OffloadStats]
    seconds: float
    placement: dict[str, str]
    sequence_ranks: int  # ranks the transformer's sequence was split across (diffusers' SP group)


def generate(
    job: GenerateJob, device: torch.device, seed: int, parallel: ParallelRun = ParallelRun(), progress: bool = True
) -> Generated:
    """Load the pipeline with its transformer streamed by dlo and run the call with `seed`."""
    transformer, plan = dlo.load_transformer(job.model_dir / "transformer", job.config, torch_dtype=job.dtype)
    pipe = load_pipeline(job.model_dir, job.pipeline, job.dtype, transformer=transformer)
    pipe.set_progress_bar_config(disable=not progress)
    if parallel.mode is Parallel.SP:
        enable_context_parallel(pipe, parallel, device)  # first: dlo then gathers over its SP group
    sp_group = diffusers_sp_group(pipe.transformer)
    compile_model(pipe.transformer, job.compile)
    with dlo.enable_pipeline(pipe, device, job.config, plans={"transformer": plan}) as handle:
        started = time.perf_counter()
        with torch.inference_mode():
            result = pipe(**job.call, generator=torch.Generator(device="cpu").manual_seed(seed))
        seconds = time.perf_counter() - started
        stats = handle.stats()
    media = result.frames[0] if job.video else result.images[0]
    sequence_ranks = torch.distributed.get_world_size(sp_group) if sp_group is not None else 1
    return Generated(media, stats, seconds, handle.placement, sequence_ranks)


def write_output(job: GenerateJob, media: object, path: Path) -> None:
    if job.video:
        write_video(media, path, job.fps)
    else:
        write_image(media, path)
