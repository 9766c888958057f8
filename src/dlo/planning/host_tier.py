"""Which streamed blocks stay in host memory under `host_budget_gib`, and which are read from
their files on every use (See [Note: the disk tier] in dlo.hotpath.read_ahead).

[Note: which blocks stay in RAM]
The model fits: every block stays (RAM is always preferred). Otherwise the budget first holds
the read buffers the disk blocks are read into (two, so one block's read overlaps the copy
out of the other; one when the budget holds no more), then as many blocks as fit. A block
that is not in a file (a private copy) always stays, and counts against the budget first.

At enable() nothing is measured yet: the blocks left on disk are spread evenly over the
execution order (`plan_host_tier`), so the read of a disk block runs behind the compute of
the RAM blocks before it. Then, as `resident_layers='auto'` does for the device, one call is
measured (dlo.backend.host_tier_choice): each block's compute, the disk's and the link's
rates; and the blocks on disk are chosen again (`choose_tier`) to make the predicted call the
shortest, with a model of the hot path (`simulate_tier`):
- blocks run in execution order, call after call, with `between_s` of other compute between
  two calls; a block kept on the device (promoted) computes and loads nothing;
- one reader reads the disk blocks in their order, call after call, each read taking its
  bytes / the disk rate, into `read_buffers` buffers: a read starts once the reader is free
  and its buffer's last block was copied out of it;
- a load is copied as the device model of [Note: automatic residency] copies it (one copy
  engine, `num_slots` slots), a disk block's copy not before its read ended.
The search takes, per class of blocks alike (bytes and compute), how many of it are on disk,
spread evenly through the class, within the budget; then, from the best of those, single
moves (one block fewer on disk, one disk block swapped with a kept one) while one helps. Ties
go to fewer bytes read from disk. Blocks move only for a predicted gain of more than
`MIN_GAIN` of the call, or else to the split reading the fewest bytes of those predicted as
fast as the one in place: the model is not exact (on the H200 host's virtio disk it predicted
calls 1-28 % longer than they ran, benchmarks/RESULTS.md; it lands copies in load order, where
a RAM block's copy may overtake a disk block's that waits for its read), and a move costs
reads. Blocks kept on the device, and blocks whose host copy a weight change rewrote, are not
moved: they stay where they are and count as such.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dlo.errors import ConfigError
from dlo.planning.residency import spread_evenly

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


@dataclass(frozen=True)
class TierBlock:
    """One block as the measured choice sees it: what it holds in host memory when kept
    there, its read (None: not in a file, it stays), what a load moves over the link, its
    measured compute, and whether it streams (False: kept on the device, never loaded)."""

    host_bytes: int
    read_bytes: int | None
    load_bytes: int
    compute_s: float
    streamed: bool = True


@dataclass(frozen=True)
class TierChoice:
    on_disk: tuple[int, ...]
    call_s: float  # predicted seconds per call
    read_bytes: int  # read from disk per call


# Calls simulated from empty slots and buffers; the last is the steady state.
_SIMULATED_CALLS = 4
# Splits evaluated at most (a 60-block model simulates in about a millisecond each): per-class
# counts beyond it keep the blocks as they are; single moves stop at it.
MAX_CHOICES = 2_000
_IMPROVEMENT = 1e-9  # a choice must be faster by more than this fraction
# Blocks move only for a predicted gain beyond the model's error: more than this fraction of
# the call (or, as fast, fewer bytes read).
MIN_GAIN = 0.05


@dataclass(frozen=True)
class TierModel:
    """The hot path as the model sees it: `num_slots` slots, the link's and the disk's rates
    (bytes a second), `read_buffers` read buffers, `between_s` of compute between two calls
    outside the blocks; `overlap`: copies run beside compute (False on the CPU: each copy runs
    as its block starts)."""

    num_slots: int
    link_bps: float
    disk_bps: float
    read_buffers: int
    between_s: float = 0.0
    overlap: bool = True


def simulate_tier(blocks: Sequence[TierBlock], on_disk: Sequence[int], model: TierModel) -> float:
    """Predicted seconds per call in the steady state. See [Note: which blocks stay in RAM]"""
    num_slots, read_buffers, between_s = model.num_slots, model.read_buffers, model.between_s
    disk = set(on_disk)
    streamed = [i for i, b in enumerate(blocks) if b.streamed]
    compute_s = between_s + sum(b.compute_s for b in blocks)
    if len(streamed) <= num_slots:  # each keeps a slot of its own after the first call
        return compute_s
    copy_s = [blocks[i].load_bytes / model.link_bps for i in streamed]
    on_disk_runs = [n for n, i in enumerate(streamed) if i in disk]  # positions in the streamed order
    read_s = {n: (blocks[streamed[n]].read_bytes or 0) / model.disk_bps for n in on_disk_runs}
    landed: list[float] = []  # landed[n]: when load n (loads in run order, across calls) finished
    released: list[float] = []  # released[n]: when run n finished, freeing its slot
    read_done: list[float] = []  # read_done[m]: when the m-th disk read finished
    disk_loads: list[int] = []  # disk_loads[m]: the load the m-th read serves

    def read(m: int) -> float:
        while len(read_done) <= m:
            k = len(read_done)
            cycle, at = divmod(k, len(on_disk_runs))
            disk_loads.append(cycle * len(streamed) + on_disk_runs[at])
            buffer_free = land(disk_loads[k - read_buffers]) if k >= read_buffers else 0.0
            read_done.append(max(read_done[-1] if read_done else 0.0, buffer_free) + read_s[on_disk_runs[at]])
        return read_done[m]

    def read_of(n: int) -> float:
        """When load n's read ended (0 for a block in host memory)."""
        cycle, at = divmod(n, len(streamed))
        return read(cycle * len(on_disk_runs) + on_disk_runs.index(at)) if at in read_s else 0.0

    def land(load: int) -> float:
        while len(landed) <= load:
            n = len(landed)
            slot_free = released[n - num_slots] if n >= num_slots else 0.0
            landed.append(max(landed[-1] if landed else 0.0, slot_free, read_of(n)) + copy_s[n % len(streamed)])
        return landed[load]

    done = call_start = 0.0
    for _ in range(_SIMULATED_CALLS):
        call_start = done
        done += between_s
        for block in blocks:
            if block.streamed and model.overlap:
                done = max(done, land(len(released)))
            elif block.streamed:  # the copy runs on the compute stream, once its read ended
                n = len(released)
                done = max(done, read_of(n)) + copy_s[n % len(streamed)]
                landed.append(done)
            done += block.compute_s
            if block.streamed:
                released.append(done)
    return done - call_start


def choose_tier(
    blocks: Sequence[TierBlock], room: int, current: Sequence[int], model: TierModel, min_gain: float = MIN_GAIN
) -> TierChoice | None:
    """The blocks to read from disk so the predicted call is the shortest, the others' host
    bytes within `room` (the budget less what must stay and the read buffers). `current`:
    the blocks on disk now, kept unless another choice is predicted faster by more than
    `min_gain` of the call, or as fast reading fewer bytes. None when the classes would take
    more than MAX_CHOICES evaluations, or nothing fits. See [Note: which blocks stay in RAM]"""
    readable = [i for i, b in enumerate(blocks) if b.read_bytes is not None]
    classes: dict[tuple, list[int]] = {}
    for i in readable:
        b = blocks[i]
        classes.setdefault((b.host_bytes, b.read_bytes, b.load_bytes, b.compute_s, b.streamed), []).append(i)
    members = list(classes.values())
    if math.prod(len(m) + 1 for m in members) > MAX_CHOICES:
        return None
    now = tuple(sorted(current))

    def evaluate(on_disk: tuple[int, ...]) -> TierChoice | None:
        kept = sum(blocks[i].host_bytes for i in readable if i not in on_disk)
        if kept > room:
            return None
        call_s = simulate_tier(blocks, on_disk, model)
        read = sum(blocks[i].read_bytes or 0 for i in on_disk if blocks[i].streamed)
        return TierChoice(on_disk, call_s, read)

    in_place = evaluate(now)
    best = in_place
    lightest = in_place  # the fewest bytes read of the splits as fast as the one in place
    evaluations = 1

    def consider(on_disk: tuple[int, ...]) -> None:
        nonlocal best, lightest, evaluations
        evaluations += 1
        choice = evaluate(on_disk)
        if choice is None:
            return
        if best is None or _better(choice, best):
            best = choice
        as_fast = in_place is not None and choice.call_s <= in_place.call_s * (1 + _IMPROVEMENT)
        if as_fast and lightest is not None and choice.read_bytes < lightest.read_bytes:
            lightest = choice

    for counts in itertools.product(*(range(len(m) + 1) for m in members)):
        consider(tuple(sorted(i for m, count in zip(members, counts) for i in spread_evenly(m, count))))
    while best is not None and evaluations < MAX_CHOICES:  # single moves from the best, while one helps
        current_best = best
        for on_disk in _moves(best.on_disk, readable):
            if evaluations >= MAX_CHOICES:
                break
            consider(on_disk)
        if best is current_best:
            break
    if in_place is None or best is None:
        return best
    return best if best.call_s < in_place.call_s * (1 - min_gain) else lightest


def _moves(on_disk: tuple[int, ...], readable: list[int]) -> list[tuple[int, ...]]:
    """One block fewer on disk, or one disk block swapped with a block kept in RAM."""
    disk = set(on_disk)
    fewer = [tuple(sorted(disk - {i})) for i in on_disk]
    return fewer + [tuple(sorted(disk - {i} | {j})) for i in on_disk for j in readable if j not in disk]


def _better(a: TierChoice, b: TierChoice) -> bool:
    """Faster; at the same predicted speed, fewer bytes read from disk (the model leaves out
    a disk shared with other readers and per-read waits: they only cost bytes read)."""
    if a.call_s < b.call_s * (1 - _IMPROVEMENT):
        return True
    if a.call_s > b.call_s * (1 + _IMPROVEMENT):
        return False
    return a.read_bytes < b.read_bytes


NOT_IN_A_FILE = (
    "no streamed block is in a file: load the model with dlo.load_transformer (checkpoint_mmap=True or "
    "host_weight_cache=True) so blocks can be read from disk"
)


def plan_host_tier(
    names: Sequence[str],
    host_bytes: Sequence[int],
    read_bytes: Sequence[int | None],
    budget_bytes: int,
    unreadable: str = NOT_IN_A_FILE,
) -> HostTier:
    """`host_bytes[i]`: what block i holds in host memory when it stays there; `read_bytes[i]`:
    the read buffer its read needs, None for a block that cannot be read from a file (it must
    stay). Refuses a budget that cannot hold the blocks that must stay plus one read, naming
    the least it can, or, when no block can be read, why (`unreadable`)."""
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
            hint = unreadable
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
        on_disk = spread_evenly(readable, count)
        kept = sum(host_bytes[i] for i in readable if i not in on_disk)
        if kept <= room:
            return HostTier(budget_bytes, on_disk, buffers, buffer)
    raise AssertionError("every readable block on disk always fits")  # room >= 0 and kept is then 0
