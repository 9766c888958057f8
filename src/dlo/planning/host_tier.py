"""Which streamed blocks stay in host memory under `host_budget_gib`, and which are read from
their files on every use (See [Note: the disk tier] in dlo.hotpath.read_ahead).

[Note: which blocks stay in RAM]
The model fits: every block stays (RAM is always preferred). Otherwise the budget first holds
the read buffers the disk blocks are read into (two, so one block's read overlaps the copy
out of the other; one when the budget holds no more), then as many blocks as fit. The blocks
left on disk are spread evenly over the execution order: the read of a disk block then runs
behind the compute of the RAM blocks before it, and with blocks of one size no disk block
has fewer RAM blocks before it than another. A block that is not in a file (a private copy)
always stays, and counts against the budget first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dlo.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class HostTier:
    """`on_disk`: indices of the blocks read from their files per use (execution order);
    `read_buffers` buffers of `read_buffer_bytes` each hold one such read."""

    budget_bytes: int
    on_disk: tuple[int, ...]
    read_buffers: int
    read_buffer_bytes: int

    @property
    def active(self) -> bool:
        return bool(self.on_disk)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.3g} GiB"


def _spread(candidates: Sequence[int], count: int) -> tuple[int, ...]:
    """`count` of `candidates` evenly spaced over them (the middle of each of `count` equal parts)."""
    n = len(candidates)
    return tuple(candidates[(2 * i + 1) * n // (2 * count)] for i in range(count))


def plan_host_tier(
    names: Sequence[str], host_bytes: Sequence[int], read_bytes: Sequence[int | None], budget_bytes: int
) -> HostTier:
    """`host_bytes[i]`: what block i holds in host memory when it stays there; `read_bytes[i]`:
    the read buffer its read needs, None for a block not in a file (it must stay). Refuses a
    budget that cannot hold the blocks that must stay plus one read, naming the least it can."""
    total = sum(host_bytes)
    if total <= budget_bytes:
        return HostTier(budget_bytes, (), 0, 0)
    fixed = sum(b for b, r in zip(host_bytes, read_bytes) if r is None)
    readable = [i for i, r in enumerate(read_bytes) if r is not None]
    buffer = max((read_bytes[i] or 0 for i in readable), default=0)
    least = fixed + buffer
    if not readable or budget_bytes < least:
        private = f"{_gib(fixed)} of blocks that are private copies (not in a file) and " if fixed else ""
        if not readable:
            hint = ("no streamed block is in a file: load the model with dlo.load_transformer (checkpoint_mmap=True "
                    "or host_weight_cache=True) so blocks can be read from disk")
        else:
            largest = names[max(readable, key=lambda i: read_bytes[i] or 0)]
            hint = f"raise it to at least {_gib(least)} ({private}one read of the largest block, {largest!r})"
        raise ConfigError(
            f"OffloadConfig.host_budget_gib={_gib(budget_bytes)} cannot hold the streamed blocks "
            f"({_gib(total)}): {hint}, or leave host_budget_gib unset"
        )
    buffers = 2 if budget_bytes >= fixed + 2 * buffer else 1
    room = budget_bytes - fixed - buffers * buffer
    for count in range(1, len(readable) + 1):
        on_disk = _spread(readable, count)
        kept = sum(host_bytes[i] for i in readable if i not in on_disk)
        if kept <= room:
            return HostTier(budget_bytes, on_disk, buffers, buffer)
    raise AssertionError("every readable block on disk always fits")  # room >= 0 and kept is then 0
