"""CLI flags generated from `OffloadConfig`: one flag per field, same name, same help."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import TYPE_CHECKING

from dlo.config import OffloadConfig
from dlo.config.offload_config import AUTO
from dlo.errors import ConfigError

if TYPE_CHECKING:
    import torch

# --dtype's choices: names of torch dtypes, torch imported only to resolve them. See [Note:
# parse before torch]
DTYPES = ("bfloat16", "float16", "float32")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def add_device_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="'cuda', 'cuda:N', 'cpu' or 'auto' (default)")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on cuda, float32 on cpu")


def device_and_dtype(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    import torch

    from dlo.backend.device import resolve_device

    try:
        device = resolve_device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    except ConfigError as err:
        raise ConfigError(in_flag_terms(str(err), {"device"})) from None
    return device, torch_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))


def add_config_flags(
    parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None, defaults: dict[str, str] | None = None
) -> None:
    """One flag per OffloadConfig field, or per field named in `only`. `defaults`: boolean
    fields whose flag defaults to None here, the command deciding (the text says how, in the help)."""
    group = parser.add_argument_group("offload options (dlo.OffloadConfig fields)")
    defaults = defaults or {}
    for spec in dataclasses.fields(OffloadConfig):
        if only is not None and spec.name not in only:
            continue
        flags = ["--" + spec.name.replace("_", "-"), *spec.metadata.get("aliases", ())]
        if spec.name in defaults:
            shown = defaults[spec.name]
        elif spec.default is None:
            shown = "unset"
        elif spec.type == "tuple[str, ...]":  # appended to: the flag's own default is None
            shown = "none"
        else:  # filled in when the help is printed: a command's set_defaults (serve's cache) shows
            shown = "%(default)s"
        help_text = f"{spec.metadata['help'].replace('%', '%%')} (default: {shown})"
        if spec.name in defaults:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif spec.type in (bool, "bool"):
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=spec.default, help=help_text)
        elif spec.type == "tuple[str, ...]":  # one item per use of the flag: items may hold commas
            group.add_argument(*flags, action="append", metavar=spec.name.upper(), help=help_text)
        else:
            kind = _FLAG_TYPES[spec.type if isinstance(spec.type, str) else spec.type.__name__]
            group.add_argument(*flags, type=kind, default=spec.default, metavar=spec.name.upper(), help=help_text)


def _int_or_auto(text: str) -> int | str:
    return text if text == AUTO else int(text)


def _float_or_auto(text: str) -> float | str:
    return text if text == AUTO else float(text)


# OffloadConfig field annotations -> how a flag's text is parsed (the config validates the value).
_FLAG_TYPES = {
    "int": int,
    "float": float,
    "str": str,
    "int | str": _int_or_auto,
    "float | None": float,
    "float | str | None": _float_or_auto,
    "str | None": str,
}


def config_from_flags(args: argparse.Namespace, **decided: object) -> OffloadConfig:
    """The config the flags give; fields without a flag on this command keep their defaults,
    those in `decided` (see add_config_flags' `defaults`) take its values."""
    fields = dataclasses.fields(OffloadConfig)
    given = {spec.name: getattr(args, spec.name) for spec in fields if spec.name in vars(args)} | decided
    unused = {spec.name for spec in fields if spec.type == "tuple[str, ...]" and given.get(spec.name) is None}
    try:
        return OffloadConfig(**{name: value for name, value in given.items() if name not in unused})  # defaults
    except ConfigError as err:
        raise ConfigError(in_flag_terms(str(err), {spec.name for spec in fields if spec.name in vars(args)})) from None


# A field named in a library message, as `OffloadConfig.name`, `name=value` or (names with an
# underscore, never a plain word) bare `name`; a value quoted or not.
_NAMED = re.compile(r"(OffloadConfig\.)?\b([a-z][a-z0-9_]*)\b(=('[^']*'|[^\s,;)]+))?")


def in_flag_terms(message: str, names: set[str]) -> str:
    """A library error in this command's terms: the option names among `names` become their flags
    (`OffloadConfig.num_slots` -> `--num-slots`, `use_allgather=False` -> `--no-use-allgather`,
    `device='cuda'` -> `--device cuda`), so the line names what to change on the command line."""

    def flag(match: re.Match) -> str:
        prefix, name, assigned, value = match.groups()
        if name not in names or not (prefix or assigned or "_" in name):
            return match.group(0)
        option = "--" + name.replace("_", "-")
        if value is None:
            return option
        if value in ("True", "False"):
            return option if value == "True" else f"--no-{option[2:]}"
        return option + " " + value.strip("'")

    return _NAMED.sub(flag, message)
