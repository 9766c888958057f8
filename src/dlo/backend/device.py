"""Turning the user's `device` argument into a device dlo can stream to, or a clear error."""

from __future__ import annotations

import torch

from dlo.errors import ConfigError


def resolve_device(device: object) -> torch.device:
    try:
        resolved = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"device={device!r} is not a device ({err}); use 'cuda', 'cuda:N' or 'cpu'") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ConfigError(
            f"device={device!r}: dlo streams to 'cuda' devices (and runs on 'cpu' for testing); "
            f"{resolved.type!r} is not supported"
        )
    if not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but this torch has no usable CUDA device; use device='cpu'")
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", index)
