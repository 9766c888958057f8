"""`dlo serve --devices 0,1,...`: which CUDA device each replica streams to, checked before
anything loads."""

from __future__ import annotations

import torch

from dlo.errors import ConfigError


def round_robin(indices: list[int], replicas: int) -> list[str]:
    """Replica i's device: the (i mod len(indices))-th listed CUDA device."""
    return [f"cuda:{indices[i % len(indices)]}" for i in range(replicas)]


def replica_devices(devices: str | None, device: str, replicas: int) -> list[str] | None:
    """The `--devices` placement of `replicas` replicas, or None without `--devices` (every
    replica then uses `--device`); a ConfigError naming the flag if it cannot be honoured."""
    if devices is None:
        return None
    if device != "auto":
        raise ConfigError(f"--devices {devices} with --device {device}: give one of them")
    try:
        indices = [int(item) for item in devices.split(",")]
    except ValueError:
        indices = []
    if not indices or min(indices) < 0:
        raise ConfigError(f"--devices {devices!r}: give CUDA device indices separated by commas, e.g. 0,1")
    if replicas < len(indices):
        raise ConfigError(
            f"--devices {devices} with --replicas {replicas}: {len(indices) - replicas} listed device(s) would "
            f"get no replica; give --replicas {len(indices)} or more (replicas go to the devices in turn)"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            f"--devices {devices}: this torch sees no CUDA device; leave --devices out to serve on --device cpu"
        )
    count = torch.cuda.device_count()
    if max(indices) >= count:
        raise ConfigError(f"--devices {devices}: there are {count} CUDA device(s), indices 0 to {count - 1}")
    return round_robin(indices, replicas)
