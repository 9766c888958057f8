"""What `dlo generate`, `dlo demo` and `dlo serve` refuse from their flags alone: main runs
these checks before it imports the command's module, and torch with it (see [Note: parse
before torch]); the commands then derive their config with the same functions."""

from __future__ import annotations

import argparse
from pathlib import Path

from dlo.cli.config_flags import config_from_flags
from dlo.cli.lora_flags import check_lora_names
from dlo.cli.parallel_run import ParallelRun, parallel_run_from_flags
from dlo.config import OffloadConfig
from dlo.errors import ConfigError
from dlo.pipelines.call_rules import MAX_SEED
from dlo.pipelines.media_output import check_output_suffix
from dlo.pipelines.output_path import check_publishable


def check_seed(seed: int, parallel: ParallelRun) -> None:
    """--seed is 0 to MAX_SEED (the parser's type); in DP the last rank's seed + rank too."""
    last = parallel.seed(seed, parallel.nproc - 1)
    if last > MAX_SEED:
        raise ConfigError(
            f"--seed {seed}: with --parallel dp rank r uses --seed + r, and rank {parallel.nproc - 1}'s would be over "
            f"{MAX_SEED}; give at most {MAX_SEED - (parallel.nproc - 1)}"
        )


def generate_config(args: argparse.Namespace, parallel: ParallelRun) -> OffloadConfig:
    """--use-allgather defaults to on with --nproc (the ranks then hold 1/N of the blocks each)."""
    use_allgather = args.use_allgather if args.use_allgather is not None else parallel.mode is not None
    return config_from_flags(args, use_allgather=use_allgather)


def check_generate(args: argparse.Namespace) -> None:
    """The ranks' flags, the seed, the output's suffix and that it (each rank's) can be
    written, and the offload config. Before a hub id is looked up too: that may download tens of GB."""
    parallel = parallel_run_from_flags(args)
    check_seed(args.seed, parallel)
    output = Path(args.output).expanduser()
    check_output_suffix(output)
    for path in parallel.outputs(output):
        check_publishable(path, "--output")
    if parallel.mode is not None and ":" in args.device:
        kind = args.device.split(":", 1)[0]
        raise ConfigError(
            f"--device {args.device}: with --nproc each rank takes its own device (rank r: cuda:r); pass --device {kind}"
        )


def inspect_config(args: argparse.Namespace) -> OffloadConfig:
    """--use-allgather defaults to on with --nproc (the host budget's split is then a rank's)."""
    use_allgather = args.use_allgather if args.use_allgather is not None else args.nproc > 1
    return config_from_flags(args, use_allgather=use_allgather)


def check_inspect(args: argparse.Namespace) -> None:
    if args.hbm_budget_gib is not None and Path(args.target).suffix in (".gguf", ".safetensors"):  # single files
        raise ConfigError(f"--hbm-budget-gib plans a pipeline directory's components; {args.target} is a single file")
    config = inspect_config(args)
    if args.nproc > 1 and config.host_budget_gib is None:
        raise ConfigError(
            f"--nproc {args.nproc} shows the split of --host-budget-gib each all-gather rank makes; give --host-budget-gib"
        )
    if args.nproc > 1 and not config.use_allgather:
        raise ConfigError(
            f"--nproc {args.nproc} with --no-use-allgather: a rank-local rank makes the split one process makes; drop --nproc"
        )


def demo_config(args: argparse.Namespace) -> OffloadConfig:
    """--nproc N > 1 runs the all-gather demo."""
    return config_from_flags(args, **({"use_allgather": True} if args.nproc > 1 else {}))


def check_demo(args: argparse.Namespace) -> None:
    demo_config(args)
    for flag, path in (("--trace", args.trace), ("--save-outputs", args.save_outputs)):
        if path:
            check_publishable(Path(path).expanduser(), flag)
    if args.nproc > 1:
        if args.trace or args.from_checkpoint is not None:
            raise ConfigError("--nproc runs the all-gather demo; it does not take --trace or --from-checkpoint")
        if args.compile != "none":
            raise ConfigError("--nproc runs the all-gather demo; it does not take --compile")


def check_serve_extra() -> None:
    """The `[serve]` extra's libraries import, or one line naming the one that does not and the
    extra to install."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            f"dlo serve needs the [serve] extra ({err.name or err} does not import): pip install 'dlo[serve]'"
        ) from None


def serve_config(args: argparse.Namespace) -> OffloadConfig:
    """--host-weight-cache defaults to on: the replicas share one host copy of the transformer
    (a --transformer FILE that streams from its own mapping shares that instead); off with
    --fp8-compute, whose weights are quantized at enable() and are not streamed from the cache."""
    cache = args.host_weight_cache if args.host_weight_cache is not None else not args.fp8_compute
    return config_from_flags(args, host_weight_cache=cache)


def check_serve(args: argparse.Namespace) -> None:
    check_serve_extra()  # before torch: a missing extra is one line at once
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue {args.max_queue}: give 0 or more")
    if not args.timeout_s > 0 or args.timeout_s == float("inf"):
        raise ConfigError(f"--timeout-s {args.timeout_s}: give a number of seconds > 0")
    if not args.keep_videos_s > 0:
        raise ConfigError(f"--keep-videos-s {args.keep_videos_s}: give a number of seconds > 0")
    if not 0 <= args.stall_timeout_s < float("inf"):
        raise ConfigError(f"--stall-timeout-s {args.stall_timeout_s}: give a number of seconds > 0, or 0 for never")
    check_lora_names(args.lora)
