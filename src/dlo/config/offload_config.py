"""User policy for one offloaded module: typed, frozen, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

from dlo.errors import ConfigError


def _require_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; `num_slots=True` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"OffloadConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ConfigError(f"OffloadConfig.{name} must be >= {minimum}, got {value}")


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"OffloadConfig.{name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class OffloadConfig:
    """How dlo streams a module's blocks.

    num_slots: rotating device buffers, each sized for the largest streamed block. Two
        overlap one copy with one block's compute; more let copies run further ahead
        (num_slots - 1 blocks) at the cost of one block of device memory each.
    resident_layers: the first N blocks in execution order stay on the device and are
        never streamed (trade device memory for transfer time).
    pin_memory: page-lock the host copy of the streamed blocks so copies run at link rate
        and asynchronously. Ignored on device "cpu".
    record_timeline: keep a per-block record of copy and compute intervals, exportable
        with `handle.export_trace(path)` (Chrome / Perfetto JSON).
    """

    num_slots: int = 2
    resident_layers: int = 0
    pin_memory: bool = True
    record_timeline: bool = False

    def __post_init__(self) -> None:
        _require_int("num_slots", self.num_slots, minimum=2)
        _require_int("resident_layers", self.resident_layers, minimum=0)
        _require_bool("pin_memory", self.pin_memory)
        _require_bool("record_timeline", self.record_timeline)
