"""The `dlo` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from dlo.cli import cache_cmd, demo, generate, inspect_plan
from dlo.cli.compile_flag import add_compile_flag
from dlo.cli.config_flags import DTYPES, add_config_flags, add_device_flags
from dlo.errors import DloError
from dlo.models.tiny import TINY_MODELS


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dlo",
        description="Layerwise offload for diffusion transformers: stream a DiT's blocks from host memory "
        "into rotating device slots, overlapping copies with compute.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo_parser = commands.add_parser(
        "demo",
        help="stream a small built-in DiT (no download) and check it matches the resident run",
        description="Build a small real diffusers transformer with random seeded weights, run a short "
        "denoising loop fully resident and then streamed by dlo, check the outputs are bit-identical and "
        "print time per step, device memory, bytes streamed and the achieved H2D rate. Exit status 1 if "
        "the outputs differ.",
    )
    demo_parser.add_argument("--model", default="wan-demo", choices=sorted(TINY_MODELS), help="built-in model")
    add_device_flags(demo_parser)
    demo_parser.add_argument("--steps", type=positive_int, default=6, help="denoising steps (default: 6)")
    demo_parser.add_argument(
        "--from-checkpoint",
        nargs="?",
        const="",
        metavar="DIR",
        help="load the model with dlo.load_transformer and stream its blocks from the checkpoint's read-only "
        "mapping. DIR (written first if empty or missing) must hold the --model checkpoint; without DIR a "
        "temporary one is written",
    )
    demo_parser.add_argument(
        "--nproc",
        type=positive_int,
        default=1,
        metavar="N",
        help="spawn N ranks (Gloo on cpu, NCCL on cuda: one GPU each) and stream with use_allgather: each rank "
        "holds 1/N of the blocks; prints per-rank host bytes and parity",
    )
    demo_parser.add_argument("--trace", metavar="OUT.json", help="write the per-block copy/compute timeline as Chrome/Perfetto JSON")
    add_compile_flag(demo_parser)
    add_config_flags(demo_parser)
    demo_parser.set_defaults(run=demo.run)

    generate_parser = commands.add_parser(
        "generate",
        help="generate an image or video with a diffusers pipeline directory, its transformer streamed",
        description="Load a diffusers pipeline directory (Flux, Wan, Qwen-Image, SD3, ...), stream its transformer "
        "with dlo (from the checkpoint mapping when the preflight allows), keep the text encoders and VAE on the "
        "device when they fit (else CPU-offload them), run it and write the image (PNG/JPEG/WebP) or video "
        "(MP4, or animated WebP/GIF). Prints the offload statistics.",
    )
    generate_parser.add_argument("model_dir", metavar="MODEL_DIR", help="a diffusers pipeline directory (model_index.json)")
    generate_parser.add_argument("--prompt", required=True)
    generate_parser.add_argument("--negative-prompt")
    generate_parser.add_argument("--steps", type=positive_int, default=28, help="denoising steps (default: 28)")
    generate_parser.add_argument("--height", type=int, help="default: the pipeline's")
    generate_parser.add_argument("--width", type=int, help="default: the pipeline's")
    generate_parser.add_argument("--frames", type=int, help="video pipelines: number of frames")
    generate_parser.add_argument("--guidance", type=float, help="guidance scale (default: the pipeline's)")
    generate_parser.add_argument("--max-sequence-length", type=int, help="text tokens (default: the pipeline's)")
    generate_parser.add_argument("--seed", type=int, default=0)
    generate_parser.add_argument("--fps", type=int, default=16, help="video frame rate (default: 16)")
    generate_parser.add_argument("--output", required=True, help="out.png / .jpg / .webp (images), out.mp4 / .webp / .gif (videos)")
    add_device_flags(generate_parser)
    add_config_flags(generate_parser)
    add_compile_flag(generate_parser)
    generate_parser.set_defaults(run=generate.run)

    cache_cmd.add_parser(commands)

    inspect_parser = commands.add_parser(
        "inspect",
        help="print the blocks dlo would stream for a model and what stays on the device",
        description="Show the offload plan of a model without loading weights: block lists, bytes per block, "
        "the largest block (the slot size), what stays resident and the device memory dlo needs.",
    )
    inspect_parser.add_argument(
        "target",
        metavar="MODEL",
        help="a diffusers model or pipeline directory, a diffusers class name (default config, e.g. "
        f"WanTransformer3DModel) or a built-in model ({', '.join(sorted(TINY_MODELS))})",
    )
    inspect_parser.add_argument("--dtype", choices=sorted(DTYPES), help="size the weights in this dtype")
    add_config_flags(inspect_parser)
    inspect_parser.set_defaults(run=inspect_plan.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # diffusers warns about every dtype cast of a model it did not load itself; the CLI
    # builds its models that way on purpose.
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    args = build_parser().parse_args(argv)
    if getattr(args, "trace", None) and not args.record_timeline:
        args.record_timeline = True  # --trace implies recording the timeline
    try:
        return args.run(args)
    except DloError as err:
        print(f"dlo: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
