"""`dlo generate`: run a diffusers pipeline directory end to end with its transformer streamed."""

from __future__ import annotations

import argparse
import inspect
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import dlo
from dlo.backend.pipeline import STREAMED_COMPONENTS
from dlo.cli.call_rules import CallRequest, CallRuleError, CallRules, read_call_rules, validate_call
from dlo.cli.compile_flag import compile_model
from dlo.cli.config_flags import config_from_flags, device_and_dtype
from dlo.cli.format import human_bytes, table
from dlo.cli.media_output import check_output_kind, write_image, write_video
from dlo.cli.model_source import resolve_model
from dlo.cli.model_target import build_on_meta, check_resident_layers
from dlo.cli.output_path import check_writable
from dlo.cli.parallel_run import Parallel, ParallelRun, check_sequence_split, enable_context_parallel, parallel_run_from_flags
from dlo.cli.pipeline_loading import check_components, load_pipeline
from dlo.errors import ConfigError
from dlo.host.checkpoint import read_json_object

# The pipeline's argument names (and call_rules' fields) -> this command's flags.
FLAG_OF_ARGUMENT = {
    "negative_prompt": "--negative-prompt",
    "guidance_scale": "--guidance",
    "height": "--height",
    "width": "--width",
    "num_frames": "--frames",
    "max_sequence_length": "--max-sequence-length",
    "size": "--height/--width/--frames",
}


def pipeline_class(model_dir: Path) -> tuple[type, dict]:
    """The pipeline class named by model_index.json, and the index; clear errors otherwise."""
    index_path = model_dir / "model_index.json"
    if not index_path.is_file():
        raise ConfigError(f"{model_dir} has no model_index.json: not a diffusers pipeline directory")
    index = read_json_object(index_path)
    import diffusers

    cls = getattr(diffusers, str(index.get("_class_name")), None)
    if not isinstance(cls, type) or not issubclass(cls, diffusers.DiffusionPipeline):
        raise ConfigError(
            f"{index_path}: unknown pipeline {index.get('_class_name')!r} (not a pipeline class of diffusers "
            f"{diffusers.__version__})"
        )
    if not any(index.get(name) and index[name][0] is not None for name in STREAMED_COMPONENTS):
        raise ConfigError(
            f"{index.get('_class_name')} in {model_dir} has no transformer component; dlo streams diffusion "
            "transformers (DiT), not UNets"
        )
    return cls, index


def checked_request(rules: CallRules, args: argparse.Namespace, dtype: torch.dtype) -> CallRequest:
    """The sizes asked for, checked against the pipeline's rules (see call_rules)."""
    request = CallRequest(args.height, args.width, args.frames, args.max_sequence_length)
    try:
        dtype_bytes = torch.empty((), dtype=dtype).element_size()
        return validate_call(rules, request, args.max_tokens, dtype_bytes)
    except CallRuleError as err:
        raise ConfigError(f"{FLAG_OF_ARGUMENT[err.field]} {err.value}: {err.allowed}") from None


def call_kwargs(cls: type, args: argparse.Namespace, request: CallRequest) -> dict:
    """The pipeline's own arguments for what the user asked, where its __call__ takes them
    (the generator aside: each process seeds its own)."""
    accepted = inspect.signature(cls.__call__).parameters
    wanted = {
        "prompt": args.prompt,
        "negative_prompt": args.negative_prompt,
        "num_inference_steps": args.steps,
        "height": request.height,
        "width": request.width,
        "num_frames": request.num_frames,
        "guidance_scale": args.guidance,
        "max_sequence_length": request.max_sequence_length,
    }
    given = {k: v for k, v in wanted.items() if v is not None}
    unsupported = [k for k in given if k not in accepted]
    if unsupported:
        raise ConfigError(f"{', '.join(FLAG_OF_ARGUMENT.get(k, k) for k in unsupported)}: {cls.__name__} does not take it")
    return given


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


def generate(
    job: GenerateJob, device: torch.device, seed: int, parallel: ParallelRun = ParallelRun(), progress: bool = True
) -> Generated:
    """Load the pipeline with its transformer streamed by dlo and run the call with `seed`."""
    transformer, plan = dlo.load_transformer(job.model_dir / "transformer", job.config, torch_dtype=job.dtype)
    pipe = load_pipeline(job.model_dir, job.pipeline, job.dtype, transformer=transformer)
    pipe.set_progress_bar_config(disable=not progress)
    if parallel.mode is Parallel.SP:
        enable_context_parallel(pipe, parallel, device)  # first: dlo then gathers over its SP group
    compile_model(pipe.transformer, job.compile)
    with dlo.enable_pipeline(pipe, device, job.config, plans={"transformer": plan}) as handle:
        started = time.perf_counter()
        with torch.inference_mode():
            result = pipe(**job.call, generator=torch.Generator(device="cpu").manual_seed(seed))
        seconds = time.perf_counter() - started
        stats = handle.stats()
    media = result.frames[0] if job.video else result.images[0]
    return Generated(media, stats, seconds, handle.placement)


def write_output(job: GenerateJob, media: object, path: Path) -> None:
    if job.video:
        write_video(media, path, job.fps)
    else:
        write_image(media, path)


def run(args: argparse.Namespace) -> int:
    # Every check reads flags, configs and headers only; weights load after the last one.
    parallel = parallel_run_from_flags(args)
    output = Path(args.output).expanduser()
    for path in parallel.outputs(output):
        check_writable(path, "--output")  # before a hub id's download too
    model_dir = resolve_model(args.model_dir, "--offline was given" if args.offline else None)
    cls, index = pipeline_class(model_dir)
    video = "num_frames" in inspect.signature(cls.__call__).parameters
    check_output_kind(output, video)
    device, dtype = device_and_dtype(args)
    if parallel.mode is not None and ":" in args.device:
        raise ConfigError(
            f"--device {args.device}: with --nproc each rank takes its own device (rank r: cuda:r); pass --device "
            f"{device.type}"
        )
    use_allgather = args.use_allgather if args.use_allgather is not None else parallel.mode is not None
    config = config_from_flags(args, use_allgather=use_allgather)
    rules = read_call_rules(model_dir, cls)
    request = checked_request(rules, args, dtype)
    check_sequence_split(parallel, model_dir, index, rules, request)
    kwargs = call_kwargs(cls, args, request)
    check_resident_layers(build_on_meta(str(model_dir)), config, "the transformer", dtype, device)
    check_components(model_dir, index)
    job = GenerateJob(model_dir, cls, video, dtype, config, kwargs, args.compile, args.steps, args.fps)
    if parallel.mode is not None:
        from dlo.cli.generate_ranks import run_ranks

        return run_ranks(job, parallel, device.type, args.seed, output, args.verbose)
    generated = generate(job, device, args.seed)
    write_output(job, generated.media, output)
    print(render_stats(generated.stats, args.steps, generated.seconds, device))
    print("\nother components: " + ", ".join(f"{k} on {v}" for k, v in generated.placement.items()))
    print(f"wrote {output}")
    return 0
