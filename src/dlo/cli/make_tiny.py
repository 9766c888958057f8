"""`dlo make-tiny {flux,wan} DIR`: a tiny complete pipeline directory to try `dlo generate` on."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from dlo.cli.format import human_bytes
from dlo.errors import ConfigError
from dlo.models.tiny_pipelines import GENERATE_DEFAULTS, TINY_PIPELINES
from dlo.pipelines.library_noise import quiet_loading_bars
from dlo.pipelines.output_path import published_directory


def try_command(kind: str, directory: Path) -> str:
    """A `dlo generate` command line that fits the tiny pipeline."""
    from dlo.cli.generate import FLAG_OF_ARGUMENT  # torch, there by now. See [Note: parse before torch]

    sizes = [f"{FLAG_OF_ARGUMENT[k]} {v}" for k, v in GENERATE_DEFAULTS[kind].items()]
    output = "cube.png" if kind == "flux" else "cat.gif"
    return f"dlo generate {shlex.quote(str(directory))} --prompt 'a red cube' --steps 2 {' '.join(sizes)} --output {output}"


def run(args: argparse.Namespace) -> int:
    directory = Path(args.directory).expanduser()
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigError(f"DIR {directory}: exists and is not an empty directory; give a new one")
    with published_directory(directory, "DIR") as partial:
        quiet_loading_bars()
        TINY_PIPELINES[args.kind](partial)
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    print(f"wrote a tiny {args.kind} pipeline (random weights, {human_bytes(size)}) to {directory}")
    print(f"try: {try_command(args.kind, directory)}")
    return 0
