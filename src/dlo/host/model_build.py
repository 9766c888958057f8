"""Building a diffusers transformer from its directory: the class its config names, the meta
skeleton a mapped load fills, diffusers' ordinary loader, and the dtype that loader gives
each tensor. Shared by the checkpoint-mmap loader and the host weight cache, below both."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dlo.errors import ConfigError
from dlo.host.checkpoint import Checkpoint, read_model_config


def model_class(class_name: object, where: object) -> type[nn.Module]:
    """The diffusers model class `class_name` names (`where` says who named it, for errors)."""
    import diffusers

    cls = getattr(diffusers, class_name, None) if isinstance(class_name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ConfigError(f"{where}: {class_name!r} is not a diffusers model class")
    return cls


def kept_in_fp32(cls: type[nn.Module]) -> list[str]:
    """The module names diffusers' loaders keep in float32 (its `_keep_in_fp32_modules`)."""
    return list(getattr(cls, "_keep_in_fp32_modules", None) or [])


def in_kept_module(name: str, kept: list[str]) -> bool:
    """Whether tensor `name` lies in one of the `kept` modules, matched as diffusers matches them."""
    return any(module in name.split(".") for module in kept)


def runtime_dtype_rule(
    cls: type[nn.Module], torch_dtype: torch.dtype | None
) -> Callable[[str, torch.dtype], torch.dtype]:
    """The dtype the ordinary loader gives a tensor: the checkpoint's when torch_dtype is
    None, else torch_dtype for floats, except the class's fp32-kept modules in half precision."""
    keep = kept_in_fp32(cls)

    def runtime_dtype(name: str, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if torch_dtype is None or not checkpoint_dtype.is_floating_point:
            return checkpoint_dtype
        if torch_dtype in (torch.float16, torch.bfloat16) and in_kept_module(name, keep):
            return torch.float32
        return torch_dtype

    return runtime_dtype


def skeleton(cls: type[nn.Module], model_config: dict, fuse_qkv: bool) -> nn.Module:
    """The model with meta parameters and real buffers (RoPE tables and other
    non-persistent buffers are computed by the constructor and must survive)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = cls.from_config(model_config)
        if fuse_qkv:
            model.fuse_qkv_projections()
    return model


def checkpoint_float_dtype(directory: Path) -> torch.dtype | None:
    """The most common floating dtype among the checkpoint's tensors: the dtype the ordinary
    loader gives every float tensor when asked for none."""
    checkpoint = Checkpoint(directory)
    try:
        counts = Counter(s.entry.dtype for s in checkpoint.tensors.values() if s.entry.dtype.is_floating_point)
    finally:
        checkpoint.close()
    return counts.most_common(1)[0][0] if counts else None


def ordinary_load(directory: Path, torch_dtype: torch.dtype | None, fuse_qkv: bool) -> nn.Module:
    """diffusers' own loader; torch_dtype=None takes the checkpoint's float dtype."""
    cls = model_class(read_model_config(directory).get("_class_name"), directory)
    dtype = torch_dtype if torch_dtype is not None else checkpoint_float_dtype(directory)
    model = cls.from_pretrained(directory, torch_dtype=dtype)
    if fuse_qkv:
        model.fuse_qkv_projections()
    return model.eval()
