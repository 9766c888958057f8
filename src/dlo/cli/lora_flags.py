"""`--lora` of `dlo generate` (`PATH[:SCALE]`) and `dlo serve` (`NAME=PATH[:SCALE]`): parsed
without torch (see [Note: parse before torch]); the files are found and checked against the
transformer later, before any weight loads (dlo.pipelines.lora_adapters)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from dlo.errors import ConfigError
from dlo.pipelines.call_rules import MOST_LORA_SCALE

# PEFT keeps an adapter's layers in ModuleDicts keyed by its name: no dots.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class LoraFlag:
    """One --lora: `target` a .safetensors file, a directory holding one, or a hub id."""

    name: str | None  # serve's NAME; generate's adapters are named lora0, lora1, ... in flag order
    target: str
    scale: float
    given: str  # the flag's value as the user gave it, for messages

    def text(self) -> str:
        return f"--lora {self.given}"


# A scale as people write one: 0.8, -1, .5, 1e-1 (not float()'s '1_0', ' 2', 'nan').
_SCALE = re.compile(r"[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+)?")


def _target_and_scale(text: str) -> tuple[str, float]:
    """`PATH:SCALE` where what follows the last colon is a number, else `PATH` at scale 1. A
    path that exists is taken whole, colon and all."""
    target, colon, tail = text.rpartition(":")
    if not colon or not _SCALE.fullmatch(tail) or Path(text).expanduser().exists():
        return text, 1.0
    if not target:
        raise argparse.ArgumentTypeError(f"{text!r} names no file: give PATH[:SCALE]")
    scale = float(tail)
    if not abs(scale) <= MOST_LORA_SCALE:
        raise argparse.ArgumentTypeError(f"the scale of {text!r}: give one from -{MOST_LORA_SCALE:g} to {MOST_LORA_SCALE:g}")
    return target, scale


def lora_flag(text: str) -> LoraFlag:
    """An argparse type: `dlo generate --lora PATH[:SCALE]`."""
    target, scale = _target_and_scale(text)
    return LoraFlag(None, target, scale, text)


def named_lora_flag(text: str) -> LoraFlag:
    """An argparse type: `dlo serve --lora NAME=PATH[:SCALE]`."""
    name, equals, rest = text.partition("=")
    if not equals or not rest:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=PATH[:SCALE], e.g. style=style.safetensors:0.8")
    if not _NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"the name {name!r}: use 1 to 64 letters, digits, '_' or '-'")
    target, scale = _target_and_scale(rest)
    return LoraFlag(name, target, scale, text)


lora_flag.__name__ = named_lora_flag.__name__ = "LoRA"  # argparse's "invalid LoRA value: ..."


def check_lora_names(flags: list[LoraFlag] | None) -> None:
    """Each serve --lora NAME once: a request picks adapters by name."""
    names = [f.name for f in flags or ()]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"--lora {repeated[0]}=...: given twice; give each LoRA its own NAME")
