"""`--compile {none,regional,full}`: torch.compile a transformer the way users do."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dlo.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

COMPILE_CHOICES = ("none", "regional", "full")


def add_compile_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default="none",
        help="torch.compile the transformer: 'regional' compiles each repeated block class once "
        "(diffusers compile_repeated_blocks(fullgraph=True)), 'full' the whole model (module.compile()); "
        "default: none",
    )


def compile_model(model: nn.Module, how: str) -> None:
    """Compile `model` in place (compilation itself happens on the first call)."""
    if how == "regional":
        if not getattr(model, "_repeated_blocks", None):
            raise ConfigError(
                f"--compile regional compiles the block classes a diffusers model lists in _repeated_blocks, and "
                f"{type(model).__name__} lists none; use --compile full"
            )
        model.compile_repeated_blocks(fullgraph=True)
    elif how == "full":
        model.compile()


def compile_resident_like_streamed(model: nn.Module, how: str, resident_layers: int) -> None:
    """Compile a resident reference as `compile_model` compiles a streamed model: for "full",
    first give the blocks dlo would stream the call boundary they have under dlo, so the graphs
    are cut at the same places (see [Note: compiled blocks]). For a reference only: the
    boundaries stay."""
    from dlo.hotpath.compiled_call import isolate  # torch. See [Note: parse before torch]
    from dlo.planning.offload_plan import discover, resolve_blocks

    if how == "full":
        isolate([ref.module for ref in resolve_blocks(model, discover(model))[resident_layers:]])
    compile_model(model, how)
