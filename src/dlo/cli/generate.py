"""`dlo generate`: every check before loading, then the call in this process or in `--nproc` ranks."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import torch

from dlo.cli.config_flags import config_from_flags, device_and_dtype
from dlo.cli.generate_job import MAX_SEED, GenerateJob, generate, render_stats, write_output
from dlo.cli.generate_ranks import run_ranks
from dlo.cli.model_source import resolve_model
from dlo.cli.model_target import build_on_meta, check_config_for_model
from dlo.cli.parallel_run import ParallelRun, check_sequence_split, parallel_run_from_flags
from dlo.errors import ConfigError
from dlo.host.checkpoint import read_json_object
from dlo.pipelines.call_rules import CallRequest, CallRuleError, CallRules, read_call_rules, validate_call
from dlo.pipelines.loading import check_components, pipeline_class
from dlo.pipelines.media_output import check_output_kind, check_output_suffix
from dlo.pipelines.output_path import check_publishable

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


def check_seed(seed: int, parallel: ParallelRun) -> None:
    """--seed is 0 to MAX_SEED (the parser's type); in DP the last rank's seed + rank too."""
    last = parallel.seed(seed, parallel.nproc - 1)
    if last > MAX_SEED:
        raise ConfigError(
            f"--seed {seed}: with --parallel dp rank r uses --seed + r, and rank {parallel.nproc - 1}'s would be over "
            f"{MAX_SEED}; give at most {MAX_SEED - (parallel.nproc - 1)}"
        )


def run(args: argparse.Namespace) -> int:
    # Every check reads flags, configs and headers only; weights load after the last one. Those of
    # the flags alone come first: a hub id's lookup may download tens of GB.
    parallel = parallel_run_from_flags(args)
    check_seed(args.seed, parallel)
    output = Path(args.output).expanduser()
    check_output_suffix(output)
    for path in parallel.outputs(output):
        check_publishable(path, "--output")
    device, dtype = device_and_dtype(args)
    if parallel.mode is not None and ":" in args.device:
        raise ConfigError(
            f"--device {args.device}: with --nproc each rank takes its own device (rank r: cuda:r); pass --device "
            f"{device.type}"
        )
    use_allgather = args.use_allgather if args.use_allgather is not None else parallel.mode is not None
    config = config_from_flags(args, use_allgather=use_allgather)
    model_dir = resolve_model(args.model_dir, "--offline was given" if args.offline else None)
    cls, index = pipeline_class(model_dir)
    video = "num_frames" in inspect.signature(cls.__call__).parameters
    check_output_kind(output, video)
    rules = read_call_rules(model_dir, cls)
    request = checked_request(rules, args, dtype)
    check_sequence_split(parallel, model_dir, index, rules, request)
    kwargs = call_kwargs(cls, args, request)
    check_config_for_model(build_on_meta(str(model_dir)), config, "the transformer", dtype, device)
    check_components(model_dir, index)
    job = GenerateJob(model_dir, cls, video, dtype, config, kwargs, args.compile, args.steps, args.fps)
    if parallel.mode is not None:
        return run_ranks(job, parallel, device.type, args.seed, output, args.verbose)
    generated = generate(job, device, args.seed)
    write_output(job, generated.media, output)
    print(render_stats(generated.stats, args.steps, generated.seconds, device))
    print("\nother components: " + ", ".join(f"{k} on {v}" for k, v in generated.placement.items()))
    print(f"wrote {output}")
    return 0
