"""Turning a CLI model argument into a module: a built-in tiny model, a diffusers class name
or a diffusers model directory. Class names and directories are built on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dlo.errors import ConfigError
from dlo.host.checkpoint import find_transformer_dir
from dlo.models.tiny import TINY_MODELS


def _diffusers_class(name: str) -> type[nn.Module]:
    import diffusers

    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ConfigError(f"{name!r} is not a diffusers model class")
    return cls


def build_on_meta(target: str) -> nn.Module:
    """The module `target` names, with meta tensors (shapes and dtypes only, no memory)."""
    path = Path(target).expanduser()
    if path.is_dir():
        directory = find_transformer_dir(path)
        config = json.loads((directory / "config.json").read_text())
        class_name = config.get("_class_name")
        if not class_name:
            raise ConfigError(f"{directory / 'config.json'} has no _class_name")
        cls = _diffusers_class(class_name)
        with torch.device("meta"):
            return cls.from_config(config)
    if target in TINY_MODELS:
        entry = TINY_MODELS[target]
        with torch.device("meta"):
            return _diffusers_class(entry.class_name)(**entry.config)
    try:
        cls = _diffusers_class(target)
    except ConfigError:
        raise ConfigError(
            f"{target!r} is neither a directory, a built-in model ({', '.join(TINY_MODELS)}) nor a diffusers "
            "model class (e.g. WanTransformer3DModel)"
        ) from None
    with torch.device("meta"):
        return cls()
