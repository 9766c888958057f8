"""The `dlo` command line."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

import dlo
from dlo.cli import cache_flags
from dlo.cli.compile_flag import add_compile_flag
from dlo.cli.config_flags import DTYPES, add_config_flags, add_device_flags
from dlo.cli.exit_status import INTERRUPTED_STATUS
from dlo.cli.flag_checks import check_demo, check_generate, check_inspect, check_serve
from dlo.cli.lora_flags import lora_flag, named_lora_flag
from dlo.cli.parallel_run import Parallel
from dlo.errors import DloError
from dlo.models.tiny_configs import TINY_CONFIGS
from dlo.models.tiny_pipelines import TINY_PIPELINES
from dlo.pipelines.call_rules import DEFAULT_MAX_TOKENS, MAX_SEED
from dlo.pipelines.library_noise import quiet_other_libraries
from dlo.pipelines.media_output import NonFiniteOutput

# [Note: parse before torch]
# This module and everything it imports parse and check the flags without torch, diffusers or
# the cache's hashing: `dlo --help`, `--version`, every subcommand's --help and every refusal
# of the flags alone answer at once. A command names its module (`command`, imported after
# parsing, with torch: seconds) and a `check` of its flags alone, run before that import.


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line, like every other refusal: `dlo: error: ...`, status 2, naming
    the help of the (sub)command the wrong argument was given to."""

    def error(self, message: str) -> None:
        self.exit(2, f"dlo: error: {message} (see `{self.prog} --help`)\n")

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:  # the innermost subcommand's parser returns first: its name stays
            vars(parsed).setdefault(_TAKEN_BY, self.prog)
        return parsed, extras

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # argparse's own parse_args would name the top-level help
            help_of = vars(parsed).pop(_TAKEN_BY)
            self.exit(2, f"dlo: error: unrecognized arguments: {' '.join(extras)} (see `{help_of} --help`)\n")
        vars(parsed).pop(_TAKEN_BY, None)
        return parsed


_TAKEN_BY = "_dlo_parser_of_extras"  # the namespace attribute naming the parser left with unknown arguments


def bounded_int(low: int, high: int | None = None):
    """An argparse type: an integer from `low` (to `high`), refused in one line naming the range."""

    def parse(text: str) -> int:
        value = int(text)
        if high is None and value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse's "invalid integer value: 'x'"
    return parse


positive_int = bounded_int(1)


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


finite_float.__name__ = "number"


def _add_verbose(parser: argparse.ArgumentParser, top_level: bool = False) -> None:
    # On a subcommand the flag must not reset what `dlo -v COMMAND` set: no default there.
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=False if top_level else argparse.SUPPRESS,
        help="also show other libraries' warnings and notices (diffusers, transformers, torch)",
    )


def _add_demo(commands) -> None:
    parser = commands.add_parser(
        "demo",
        help="stream a small built-in DiT (no download) and check it matches the resident run",
        description="Build a small real diffusers transformer with random seeded weights, run a short "
        "denoising loop fully resident and then streamed by dlo, check the outputs are bit-identical and "
        "print time per step, device memory, bytes streamed and the achieved H2D rate. Exit status 1 if "
        "the outputs differ.",
    )
    parser.add_argument("--model", default="wan-demo", choices=sorted(TINY_CONFIGS), help="built-in model")
    add_device_flags(parser)
    parser.add_argument("--steps", type=positive_int, default=6, help="denoising steps (default: 6)")
    parser.add_argument(
        "--from-checkpoint",
        nargs="?",
        const="",
        metavar="DIR",
        help="load the model with dlo.load_transformer and stream its blocks from the checkpoint's read-only "
        "mapping. DIR (written first if empty or missing) must hold the --model checkpoint; without DIR a "
        "temporary one is written",
    )
    parser.add_argument(
        "--nproc",
        type=positive_int,
        default=1,
        metavar="N",
        help="spawn N ranks (Gloo on cpu, NCCL on cuda: one GPU each) and stream with use_allgather: each rank "
        "holds 1/N of the blocks; prints per-rank host bytes and parity",
    )
    parser.add_argument("--trace", metavar="OUT.json", help="write the per-block copy/compute timeline as Chrome/Perfetto JSON")
    parser.add_argument(
        "--save-outputs", metavar="OUT.pt",
        help="save both runs' per-step outputs ({'resident': [...], 'streamed': [...]}) with torch.save",
    )
    _add_verbose(parser)
    add_compile_flag(parser)
    add_config_flags(parser)
    parser.set_defaults(command="dlo.cli.demo", check=check_demo)


def _add_weight_files(parser: argparse.ArgumentParser, lora_type, lora_metavar: str, transformer: str, lora: str) -> None:
    """--transformer FILE and --lora (generate's and serve's forms); `transformer`: its help's ending."""
    parser.add_argument(
        "--transformer", metavar="FILE",
        help="the transformer from this file instead of MODEL's: a .gguf file (its packed weights streamed as they "
        f"are) or a single-file .safetensors checkpoint{transformer}",
    )
    parser.add_argument(
        "--gguf-kernels", action="store_true",
        help="dequantize the --transformer .gguf file's weights with dlo's Triton kernels (the same values as "
        "diffusers' torch dequantization, bit for bit, in one kernel launch per weight; needs Triton and CUDA)",
    )
    _add_converter_option(parser, "the --transformer file")
    parser.add_argument("--lora", action="append", type=lora_type, metavar=lora_metavar, help=lora)


def _add_converter_option(parser: argparse.ArgumentParser, of: str) -> None:
    parser.add_argument(
        "--converter-option", action="append", type=converter_option, metavar="KEY=VALUE",
        help=f"pass an option to diffusers' single-file converter of {of}, one the file cannot tell (e.g. "
        "qkv_layout=interleaved for a MiniMax-H3 file merged from its original shards); VALUE is read as the "
        "type of the option's default (true or false, a number, else a string); repeat for several",
    )


def converter_option(text: str) -> tuple[str, str]:
    """--converter-option KEY=VALUE."""
    key, equals, value = text.partition("=")
    if not equals or not key.isidentifier() or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY=VALUE, e.g. qkv_layout=interleaved")
    return key, value


def components_flag(text: str) -> str | tuple[str, ...]:
    """--components: "auto", or component names separated by commas."""
    if text == "auto":
        return text
    names = tuple(text.split(","))
    if not all(name.isidentifier() for name in names):
        raise argparse.ArgumentTypeError(f"{text!r} is not auto nor component names separated by commas (text_encoder,vae)")
    return names


def _add_components(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--components", type=components_flag, default=(), metavar="auto|NAME[,NAME...]",
        help="other pipeline components dlo streams block by block too (text encoders, any with repeated blocks), "
        "or auto: those that do not fit the device, instead of CPU-offloading them; checked on the pipeline's "
        "configs before anything loads. Under --hbm-budget-gib the plan streams the others that do not fit too "
        "(default: none)",
    )


def _add_generate(commands) -> None:
    parser = commands.add_parser(
        "generate",
        help="generate an image or video with a diffusers pipeline, its transformer streamed",
        description="Load a diffusers pipeline (a directory, or a Hugging Face hub id found in or downloaded to "
        "the hub cache: Flux, Wan, Qwen-Image, SD3, ...), stream its transformer with dlo (from the checkpoint "
        "mapping when the preflight allows), keep the text encoders and VAE on the device when they fit (else "
        "CPU-offload them), run it and write the image (PNG/JPEG/WebP) or video (MP4, or animated WebP/GIF). "
        "Every size is checked against the pipeline's configs before anything loads. Prints the offload "
        "statistics.",
    )
    parser.add_argument(
        "model_dir", metavar="MODEL",
        help="a diffusers pipeline directory (model_index.json), or a Hugging Face hub id (org/name)",
    )
    parser.add_argument("--prompt", required=True, help="the text describing the image or video to generate")
    parser.add_argument("--negative-prompt", help="what to steer away from (pipelines with guidance)")
    parser.add_argument("--steps", type=positive_int, default=28, help="denoising steps (default: 28)")
    parser.add_argument("--height", type=int, help="pixels; a multiple the pipeline sets (default: the pipeline's)")
    parser.add_argument("--width", type=int, help="pixels; a multiple the pipeline sets (default: the pipeline's)")
    parser.add_argument("--frames", type=int, help="video pipelines: number of frames, e.g. 4k+1 for Wan")
    parser.add_argument("--guidance", type=finite_float, help="guidance scale (default: the pipeline's)")
    parser.add_argument("--max-sequence-length", type=int, help="text tokens (default and maximum: the pipeline's)")
    parser.add_argument(
        "--seed", type=bounded_int(0, MAX_SEED), default=0,
        help=f"seed of the initial noise, 0 to {MAX_SEED}; same seed, same output (default: 0)",
    )
    parser.add_argument("--fps", type=positive_int, default=16, help="video frame rate (default: 16)")
    parser.add_argument(
        "--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS, metavar="N",
        help="refuse, before loading, a size whose transformer sequence (latent patches x latent frames) is over "
        f"N tokens: attention time and memory grow with it (default: {DEFAULT_MAX_TOKENS} = 2**17)",
    )
    _add_weight_files(
        parser, lora_flag, "PATH[:SCALE]",
        transformer="; MODEL gives the other components and the transformer's config. It streams from its own "
        "mapping where diffusers' converter allows; with --host-weight-cache, a file that cannot is converted once "
        "into the cache",
        lora="a LoRA to run with, at SCALE (default: 1): a .safetensors file, a directory holding one, or a hub id; "
        "repeat for several. Checked against the transformer before anything loads",
    )
    parser.add_argument(
        "--offline", action="store_true",
        help="use only models (and LoRAs) already in the Hugging Face cache, never download (also: HF_HUB_OFFLINE=1)",
    )
    parser.add_argument(
        "--output", required=True,
        help="out.png / .jpg / .webp (images), out.mp4 / .webp / .gif (videos); with --parallel dp rank r writes "
        "out.rankR.png (for out.png)",
    )
    _add_components(parser)
    _add_generate_ranks(parser)
    add_device_flags(parser)
    _add_verbose(parser)
    add_config_flags(parser, defaults={"use_allgather": "on with --nproc, else off"})
    add_compile_flag(parser)
    parser.set_defaults(command="dlo.cli.generate", check=check_generate)


def _add_generate_ranks(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("several ranks (one GPU each on cuda, Gloo processes on cpu)")
    group.add_argument(
        "--nproc", type=positive_int, default=1, metavar="N",
        help="spawn N ranks (NCCL with one GPU each on cuda, Gloo on cpu); needs --parallel. The blocks are "
        "all-gathered across them (each holds 1/N) unless --no-use-allgather",
    )
    group.add_argument(
        "--parallel", choices=[p.value for p in Parallel],
        help="dp: each rank generates with seed + rank and writes its own output; sp: one output, every rank "
        "runs the call on its slice of the sequence (diffusers' context parallelism), rank 0 writes",
    )
    group.add_argument(
        "--ulysses", type=positive_int, metavar="N",
        help="--parallel sp: Ulysses attention over N ranks (default: over all --nproc, without --ring)",
    )
    group.add_argument(
        "--ring", type=positive_int, metavar="N",
        help="--parallel sp: ring attention over N ranks; with --ulysses, ulysses x ring must equal --nproc. Needs "
        "an attention backend with log-sum-exp (DIFFUSERS_ATTN_BACKEND=_native_cudnn, flash...)",
    )


def _add_serve(commands) -> None:
    parser = commands.add_parser(
        "serve",
        help="serve a diffusers image or video pipeline over HTTP (OpenAI-style API), its transformer streamed",
        description="Start REPLICAS worker processes, each holding the pipeline with its transformer streamed "
        "by dlo (through the host weight cache by default: one copy of the blocks per node), and serve "
        "POST /v1/images/generations (image pipelines) or the /v1/videos jobs (video pipelines), GET /v1/models, "
        "GET /health and GET /metrics. Requests are checked before they are queued; a full queue answers 429. "
        "SIGTERM drains: new requests get 503, the ones held finish, then the server exits.",
    )
    parser.add_argument("model_dir", metavar="MODEL", help="a diffusers pipeline directory, or a cached hub id")
    parser.add_argument("--replicas", type=positive_int, default=1, help="worker processes (default: 1)")
    parser.add_argument(
        "--devices", metavar="I,J,...",
        help="CUDA device indices; replica k streams to the (k mod count)-th listed (default: every replica on --device)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=bounded_int(1, 65535), default=8000, help="port (default: 8000)")
    parser.add_argument(
        "--max-queue", type=int, default=8, metavar="N",
        help="requests waiting beyond one per replica; more get 429 (default: 8)",
    )
    parser.add_argument("--max-images", type=positive_int, default=4, help="most images per request (default: 4)")
    parser.add_argument("--max-steps", type=positive_int, default=100, help="most steps per request (default: 100)")
    parser.add_argument(
        "--timeout-s", type=float, default=600.0, help="seconds a request waits for its result (default: 600)"
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS, metavar="N",
        help=f"refuse a size whose transformer sequence is over N tokens (default: {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument(
        "--keep-videos", type=positive_int, default=16, metavar="N",
        help="finished video jobs kept (with their files) for GET; beyond, the oldest goes (default: 16)",
    )
    parser.add_argument(
        "--keep-videos-s", type=float, default=3600.0, metavar="S",
        help="seconds a finished video job is kept (default: 3600)",
    )
    _add_weight_files(
        parser, named_lora_flag, "NAME=PATH[:SCALE]",
        transformer=" (streamed from its own mapping, shared by the replicas, where diffusers' converter allows; "
        "else converted once into the host weight cache)",
        lora="a LoRA every replica loads at its start, as adapter NAME (a .safetensors file, a directory holding one, "
        "or a cached hub id); repeat for several. A request runs with those its \"lora\" field names "
        '([{"name": NAME, "scale": S}], S defaulting to SCALE, itself to 1), the base model without it',
    )
    parser.add_argument(
        "--stall-timeout-s", type=float, default=600.0, metavar="S",
        help="a replica whose job made no denoising step for S seconds is killed and restarted, its job "
        "failed; 0: never (default: 600)",
    )
    _add_components(parser)
    add_device_flags(parser)
    parser.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), default="info",
        help="dlo serve's own lines (one per request, the replicas' starts, deaths and restarts, the drain) and "
        "uvicorn's, from this level up; other libraries' warnings only with -v (default: info)",
    )
    _add_verbose(parser)
    add_config_flags(parser, defaults={"host_weight_cache": "on, off with --fp8-compute"})
    parser.set_defaults(command="dlo.cli.serve", check=check_serve)


# The OffloadConfig fields that change what inspect prints (its only config flags).
INSPECT_CONFIG_FIELDS = (
    "num_slots", "resident_layers", "hbm_budget_gib", "host_budget_gib", "use_allgather", "gather_chunk_mib"
)


def _add_inspect(commands) -> None:
    parser = commands.add_parser(
        "inspect",
        help="print the blocks dlo would stream for a model and what stays on the device",
        description="Show the offload plan of a model without loading weights: block lists, bytes per block, "
        "the largest block (the slot size), what stays resident and the device memory dlo needs.",
    )
    parser.add_argument(
        "target",
        metavar="MODEL",
        help="a diffusers model or pipeline directory, a Hugging Face hub id in the hub cache (org/name), a "
        f"diffusers class name (default config, e.g. WanTransformer3DModel), a built-in model "
        f"({', '.join(sorted(TINY_CONFIGS))}), or a .gguf or single-file .safetensors file (its tensor types "
        "and bytes per block)",
    )
    parser.add_argument("--dtype", choices=DTYPES, help="size the weights in this dtype")
    parser.add_argument(
        "--nproc", type=positive_int, default=1, metavar="N",
        help="with --host-budget-gib: the split each of N all-gather ranks makes (a rank's budget holds its "
        "shard of each block kept, 1/N of it) (default: 1)",
    )
    parser.add_argument(
        "--model-config", metavar="DIR",
        help="for a .gguf or single-file .safetensors MODEL: the transformer's config (its directory, its "
        "pipeline's, or a hub id in the Hugging Face cache); inspect then also says whether the file streams "
        "from its mapping (and with which adapters) or which fallback applies, and, with --host-budget-gib, "
        "which blocks are read from disk",
    )
    _add_converter_option(parser, "a single-file MODEL (with --model-config)")
    _add_verbose(parser)
    add_config_flags(parser, only=INSPECT_CONFIG_FIELDS, defaults={"use_allgather": "on with --nproc, else off"})
    parser.set_defaults(command="dlo.cli.inspect_plan", check=check_inspect)


def _add_make_tiny(commands) -> None:
    parser = commands.add_parser(
        "make-tiny",
        help="write a tiny random-weight pipeline directory to try `dlo generate` with (no download)",
        description="Write a complete diffusers pipeline (scheduler, VAE, tokenizers, text encoders, transformer) "
        "with tiny configs and random seeded weights to DIR: a few MiB, generating in about a second on a CPU. "
        "Its images are noise; it is for trying the commands, not for pictures.",
    )
    parser.add_argument("kind", choices=sorted(TINY_PIPELINES), help="flux (image) or wan (video)")
    parser.add_argument("directory", metavar="DIR", help="where to write it (must not exist, or be empty)")
    _add_verbose(parser)
    parser.set_defaults(command="dlo.cli.make_tiny")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="dlo",
        description="Layerwise offload for diffusion transformers: stream a DiT's blocks from host memory "
        "into rotating device slots, overlapping copies with compute.",
    )
    parser.add_argument("--version", action="version", version=f"dlo {dlo.__version__}")
    _add_verbose(parser, top_level=True)
    parser.set_defaults(check=None)  # See [Note: parse before torch]
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    _add_demo(commands)
    _add_generate(commands)
    _add_serve(commands)
    cache_flags.add_parser(commands)
    _add_inspect(commands)
    _add_make_tiny(commands)
    return parser


# [Note: allocator under a budget]
# A device budget (--hbm-budget-gib) plans the bytes allocated; PyTorch's caching allocator
# reserves more: segments cut for one size that later requests of other sizes cannot use. On a
# device of the budget's size that gap is an out-of-memory: the Wan-14B-shaped pipeline under
# 8 GiB failed at 6.84 GiB allocated with the allocator capped at 8 GiB, and ran within the cap
# with expandable segments (benchmarks/RESULTS.md, "issue 33, on a device of the budget's size").
# So a command given a budget turns them on, unless the allocator is configured already
# (PYTORCH_CUDA_ALLOC_CONF, or PYTORCH_ALLOC_CONF, which newer torch reads first): the user's
# settings stay as they are. CUDA reads the variable when it first allocates, after this.
ALLOCATOR_UNDER_A_BUDGET = "expandable_segments:True"


def allocator_for_budget(args: argparse.Namespace) -> None:
    """See [Note: allocator under a budget]"""
    configured = "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ
    if getattr(args, "hbm_budget_gib", None) is not None and not configured:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_UNDER_A_BUDGET


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    quiet_other_libraries(args.verbose)
    if getattr(args, "trace", None) and not args.record_timeline:
        args.record_timeline = True  # --trace implies recording the timeline
    try:
        if args.check is not None:
            args.check(args)
        allocator_for_budget(args)
        return importlib.import_module(args.command).run(args)
    except NonFiniteOutput as err:  # the work ran and its result is refused: status 1, not a usage error
        print(f"dlo: error: {err}", file=sys.stderr)
        return 1
    except DloError as err:
        print(f"dlo: error: {err}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except KeyboardInterrupt:
        # Whatever was running unwound through its `with` blocks and `finally`s on the way here.
        print("dlo: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    except BrokenPipeError:  # `dlo inspect ... | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 1


if __name__ == "__main__":
    sys.exit(main())
