"""One `dlo generate` call, in one process or in each rank: the pipeline loaded with its
transformer streamed, run, its output written, its statistics rendered."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import dlo
from dlo.backend.decode_peak import call_size
from dlo.backend.gather_group import diffusers_sp_group
from dlo.cli.compile_flag import compile_model
from dlo.cli.format import human_bytes, table
from dlo.cli.parallel_run import Parallel, ParallelRun
from dlo.cli.sequence_parallel import enable_context_parallel
from dlo.cli.step_bytes import StepBytes, h2d_text
from dlo.pipelines.loading import load_pipeline
from dlo.pipelines.lora_adapters import LoraFile, load_loras
from dlo.pipelines.media_output import ARRAY_OUTPUT, finite_media, write_image, write_video
from dlo.pipelines.single_file import load_single_file

def render_stats(
    stats: dict[str, dlo.OffloadStats], steps: int, seconds: float, device: torch.device | str,
    before_last_step: dict[str, int],
) -> str:
    """`before_last_step`: each component's bytes streamed when the step before the last ended
    (see step_bytes)."""
    rows = []
    device_type = torch.device(device).type
    for name, s in stats.items():
        rows.append(
            [
                name,
                f"{s.streamed_blocks} (+{s.resident_blocks})",
                StepBytes(before_last_step.get(name), s.bytes_streamed, steps).text(),
                h2d_text(s.h2d_gbps, device_type),
                f"{s.exposed_copy_s / max(steps, 1) * 1e3:.1f} ms",
                human_bytes(s.peak_device_bytes),
                _host_copy(s),
            ]
        )
    header = ["component", "blocks (+resident)", "streamed/step", "H2D", "exposed/step", "peak device", "host copy"]
    return f"{steps} steps in {seconds:.2f} s ({seconds / max(steps, 1):.3f} s/step) on {device}\n\n" + table(header, rows)


def _host_copy(stats: dlo.OffloadStats) -> str:
    """Where the streamed blocks' host copy lies, and under a host budget how many are read
    from disk on every use."""
    text = f"{stats.backing} (registered)" if stats.registered_bytes else stats.backing
    if stats.disk is not None:
        text += f", {len(stats.disk.blocks)} of {stats.streamed_blocks} from disk"
    return text


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
    loras: tuple[LoraFile, ...] = ()  # loaded after enable_pipeline, all active at their scales
    transformer_file: Path | None = None  # --transformer: a .gguf or single-file checkpoint instead of MODEL's
    gguf_kernels: bool = False  # --gguf-kernels: its GGUF weights dequantize with dlo's Triton kernels
    components: tuple[str, ...] | str = ()  # --components: streamed beside the transformer ("auto", or names)
    converter_options: tuple[tuple[str, str], ...] = ()  # --converter-option: for transformer_file's converter


@dataclass(frozen=True)
class Generated:
    media: object  # a PIL image, or a video's frames
    stats: dict[str, dlo.OffloadStats]
    seconds: float
    placement: dict[str, str]
    sequence_ranks: int  # ranks the transformer's sequence was split across (diffusers' SP group)
    before_last_step: dict[str, int]  # bytes streamed by each component when the step before the last ended
    plan: tuple[str, ...] = ()  # under --hbm-budget-gib: the whole pipeline's plan, in lines
    kernels: str = ""  # under --gguf-kernels: what they took


def generate(
    job: GenerateJob, device: torch.device, seed: int, parallel: ParallelRun = ParallelRun(), progress: bool = True
) -> Generated:
    """Load the pipeline with its transformer streamed by dlo and run the call with `seed`; an
    output with non-finite values is refused (NonFiniteOutput) before anything is written."""
    kernels = None
    if job.transformer_file is not None:
        transformer, plan = load_single_file(
            job.transformer_file, job.model_dir, job.dtype, job.config, "--transformer", job.converter_options
        )
        kernels = dlo.use_gguf_kernels(transformer) if job.gguf_kernels else None
    else:
        transformer, plan = dlo.load_transformer(job.model_dir / "transformer", job.config, torch_dtype=job.dtype)
    pipe = load_pipeline(job.model_dir, job.pipeline, job.dtype, transformer=transformer)
    pipe.set_progress_bar_config(disable=not progress)
    if parallel.mode is Parallel.SP:
        enable_context_parallel(pipe, parallel, device)  # first: dlo then gathers over its SP group
    sp_group = diffusers_sp_group(pipe.transformer)
    compile_model(pipe.transformer, job.compile)
    before_last: dict[str, int] = {}
    size = call_size(pipe, *call_dims(job.call)) if job.config.hbm_budget_gib is not None else None
    handle = dlo.enable_pipeline(pipe, device, job.config, plans={"transformer": plan}, components=job.components, size=size)
    try:
        load_loras(pipe, job.loras)  # after enable: the plan names the transformer's tensors as loaded

        def step_end(pipe, step: int, timestep, tensors: dict) -> dict:
            if step == StepBytes.sampled_after(job.steps):  # once: stats() waits for the device
                before_last.update({name: s.bytes_streamed for name, s in handle.stats().items()})
            return {}

        sampled = {"callback_on_step_end": step_end} if "callback_on_step_end" in _parameters(job.pipeline) else {}
        started = time.perf_counter()
        with torch.inference_mode():
            generator = torch.Generator(device="cpu").manual_seed(seed)
            result = pipe(**job.call, **ARRAY_OUTPUT, **sampled, generator=generator)
        seconds = time.perf_counter() - started
        stats = handle.stats()
    finally:
        # The pipeline is dropped after this call: giving the blocks their weights back would
        # copy every mapped block into private memory (more than the host has, with the disk tier).
        handle.disable(restore=False)
    media = finite_media(result, job.video)
    sequence_ranks = torch.distributed.get_world_size(sp_group) if sp_group is not None else 1
    plan_lines = tuple(handle.plan.describe()) if handle.plan is not None else ()
    kernel_line = "" if kernels is None else kernels_text(kernels)
    return Generated(media, stats, seconds, handle.placement, sequence_ranks, before_last, plan_lines, kernel_line)


def kernels_text(kernels: dlo.GGUFKernelHandle) -> str:
    """What --gguf-kernels did: the GGUF Linears on dlo's kernels, and those left to diffusers'."""
    left = "".join(f", {n} ({what}) with diffusers' torch code" for what, n in kernels.left.items())
    return f"--gguf-kernels: {kernels.converted} GGUF Linears dequantize with dlo's Triton kernels{left}"


def call_dims(call: dict) -> tuple[int | None, int | None, int | None]:
    """The call's height, width and frames, None where the pipeline's default applies: what the
    plan under --hbm-budget-gib is made for."""
    return call.get("height"), call.get("width"), call.get("num_frames")


def components_text(job: GenerateJob, placement: dict[str, str]) -> str:
    """Where the other components ran, and the LoRAs the call ran with."""
    lines = ["other components: " + ", ".join(f"{k} on {v}" for k, v in placement.items())]
    lines += [f"LoRA {lora.name}: {lora.path} at scale {lora.scale:g}" for lora in job.loras]
    return "\n".join(lines)


def _parameters(pipeline: type) -> frozenset[str]:
    return frozenset(inspect.signature(pipeline.__call__).parameters)


def write_output(job: GenerateJob, media: object, path: Path) -> None:
    if job.video:
        write_video(media, path, job.fps)
    else:
        write_image(media, path)
