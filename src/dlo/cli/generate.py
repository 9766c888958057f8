"""`dlo generate`: every check before loading, then the call in this process or in `--nproc` ranks."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import torch

from dlo.cli.config_flags import device_and_dtype
from dlo.cli.flag_checks import generate_config
from dlo.cli.generate_job import GenerateJob, call_dims, components_text, generate, render_stats, write_output
from dlo.cli.generate_ranks import run_ranks
from dlo.cli.model_source import check_gguf_kernels, checked_weight_files, resolve_model
from dlo.cli.model_target import build_on_meta, check_config_for_model, checked_components, plan_from_configs
from dlo.cli.parallel_run import parallel_run_from_flags
from dlo.cli.sequence_parallel import check_sequence_split
from dlo.errors import ConfigError
from dlo.pipelines.call_rules import CallRequest, CallRuleError, CallRules, read_call_rules, validate_call
from dlo.pipelines.loading import check_components, pipeline_class
from dlo.pipelines.media_output import check_output_kind

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


def run(args: argparse.Namespace) -> int:
    """After flag_checks.check_generate (main runs it): every further check reads configs and
    headers only; weights load after the last one."""
    parallel = parallel_run_from_flags(args)
    output = Path(args.output).expanduser()
    device, dtype = device_and_dtype(args)
    config = generate_config(args, parallel)
    cache_only = "--offline was given" if args.offline else None
    model_dir = resolve_model(args.model_dir, cache_only)
    cls, index = pipeline_class(model_dir)
    video = "num_frames" in inspect.signature(cls.__call__).parameters
    check_output_kind(output, video)
    rules = read_call_rules(model_dir, cls)
    request = checked_request(rules, args, dtype)
    check_sequence_split(parallel, model_dir, index, rules, request)
    kwargs = call_kwargs(cls, args, request)
    transformer = build_on_meta(str(model_dir))
    check_config_for_model(transformer, config, "the transformer", dtype, device)
    check_components(model_dir, index)
    streamed = checked_components(model_dir, cls, index, dtype, args.components)
    if config.hbm_budget_gib is not None:
        plan_from_configs(model_dir, cls, index, dtype, config, call_dims(kwargs), streamed)  # refuses before any load
    transformer_file, loras = checked_weight_files(
        args.transformer, args.lora, cls, transformer, cache_only, args.converter_option
    )
    if args.gguf_kernels:
        check_gguf_kernels(transformer_file, device)
    job = GenerateJob(
        model_dir, cls, video, dtype, config, kwargs, args.compile, args.steps, args.fps, loras, transformer_file,
        args.gguf_kernels, args.components, tuple(args.converter_option or ()),
    )
    if parallel.mode is not None:
        return run_ranks(job, parallel, device.type, args.seed, output, args.verbose)
    generated = generate(job, device, args.seed)
    write_output(job, generated.media, output)
    print(render_stats(generated.stats, args.steps, generated.seconds, device, generated.before_last_step))
    print("\n" + components_text(job, generated.placement))
    if generated.plan:
        print("\npipeline plan (--hbm-budget-gib):\n  " + "\n  ".join(generated.plan))
    if generated.kernels:
        print(generated.kernels)
    print(f"wrote {output}")
    return 0
