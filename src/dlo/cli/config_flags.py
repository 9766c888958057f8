"""CLI flags generated from `OffloadConfig`: one flag per field, same name, same help."""

from __future__ import annotations

import argparse
import dataclasses

from dlo.config import OffloadConfig


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("offload options (dlo.OffloadConfig fields)")
    for spec in dataclasses.fields(OffloadConfig):
        flag = "--" + spec.name.replace("_", "-")
        help_text = f"{spec.metadata['help']} (default: {spec.default})"
        if spec.type in (bool, "bool"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=spec.default, help=help_text)
        else:
            group.add_argument(flag, type=int, default=spec.default, metavar="N", help=help_text)


def config_from_flags(args: argparse.Namespace) -> OffloadConfig:
    return OffloadConfig(**{spec.name: getattr(args, spec.name) for spec in dataclasses.fields(OffloadConfig)})
