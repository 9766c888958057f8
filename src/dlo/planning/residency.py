"""Which blocks stay on the device under a memory budget, and how many slots stream the rest.
Pure Python: costs in, a choice out, testable with integers.

[Note: automatic residency]
Streaming costs nothing while a block's copy hides behind the compute before it, and a
resident block costs memory but no copy. So residency pays where copies are exposed, and a
resident block helps most where it gives the copies around it time to land: spread out, not
only the leading blocks (the prefix `resident_layers` keeps).

The model (`simulate`) is the hot path's, on one copy engine and one compute stream:
- blocks run in execution order, call after call, with `between_s` of other compute (the
  model's non-block parts) between two calls;
- a streamed block computes once its copy landed and the block before it finished;
- with k slots, when a streamed block starts the runtime prefetches the streamed block k-1
  places ahead, into the slot of the streamed block before the starting one: that copy
  starts once the copy engine is free and that block finished;
- a copy takes bytes / link rate; on a device whose copies do not overlap compute (the CPU),
  it runs on the compute stream.
It runs a few calls from empty slots and returns the last call's time: the steady state.

`choose_residency` searches per size class (blocks of one size have one measured cost):
how many blocks of each class stay resident, spread evenly through the class, times the
slot counts, within the budget; then, from the best of those, takes single moves (one block
more or fewer, one resident block moved elsewhere) while one helps.
Ties go to the choice with more bytes resident, then fewer slots. tests/test_residency.py checks the choice
against every subset on small cases.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Calls simulated from empty slots; the last is the steady state (the first fills the slots).
_SIMULATED_CALLS = 4
# A move must shorten the predicted call by more than this fraction to be taken.
_IMPROVEMENT = 1e-9


@dataclass(frozen=True)
class BlockCost:
    """One block's device bytes, compute seconds (measured) and the bytes a load moves over
    the link (fewer than `nbytes` for a block streamed as float8; None: `nbytes`)."""

    nbytes: int
    compute_s: float
    link_bytes: int | None = None

    @property
    def load_bytes(self) -> int:
        return self.nbytes if self.link_bytes is None else self.link_bytes


@dataclass(frozen=True)
class ResidencyChoice:
    """`resident`: block indices kept on the device; `num_slots` slots of `slot_bytes` stream
    the rest (0 when nothing streams). `call_s`: the predicted seconds per call
    (blocks and `between_s`). `device_bytes`: resident blocks + slots; `resident_bytes`: the
    resident blocks'."""

    resident: frozenset[int]
    num_slots: int
    slot_bytes: int
    call_s: float
    device_bytes: int
    resident_bytes: int


def slot_bytes_for(costs: Sequence[BlockCost], resident: Iterable[int]) -> int:
    """A slot holds the largest streamed block."""
    kept = set(resident)
    return max((cost.nbytes for i, cost in enumerate(costs) if i not in kept), default=0)


def slots_needed(num_slots: int, streamed: int) -> int:
    """The slots a choice allocates: none when nothing streams, else `num_slots` but no more
    than the streamed blocks, and never fewer than the 2 the slot planner needs."""
    return 0 if streamed == 0 else max(2, min(num_slots, streamed))


def device_bytes(costs: Sequence[BlockCost], resident: Iterable[int], num_slots: int) -> int:
    kept = set(resident)
    slots = slots_needed(num_slots, len(costs) - len(kept))
    return sum(costs[i].nbytes for i in kept) + slots * slot_bytes_for(costs, kept)


def simulate(
    costs: Sequence[BlockCost],
    resident: Iterable[int],
    num_slots: int,
    bytes_per_s: float,
    between_s: float = 0.0,
    overlap: bool = True,
) -> float:
    """Predicted seconds per call in the steady state. See [Note: automatic residency]"""
    kept = set(resident)
    streamed = [i for i in range(len(costs)) if i not in kept]
    compute_s = between_s + sum(cost.compute_s for cost in costs)
    if len(streamed) <= num_slots:  # each streamed block keeps a slot of its own after the first call
        return compute_s
    copy_s = [costs[i].load_bytes / bytes_per_s for i in streamed]
    if not overlap:
        return compute_s + sum(copy_s)
    landed: list[float] = []  # landed[n]: when the n-th load finished (loads in run order, across calls)
    released: list[float] = []  # released[r]: when the r-th streamed run finished, freeing its slot

    def land(load: int) -> float:
        while len(landed) <= load:
            n = len(landed)
            # Load n goes into the slot of run n - num_slots: issued when run n - num_slots + 1
            # starts, ordered after the previous copy and after that slot's release.
            slot_free = released[n - num_slots] if n >= num_slots else 0.0
            landed.append(max(landed[-1] if landed else 0.0, slot_free) + copy_s[n % len(streamed)])
        return landed[load]

    done = call_start = 0.0
    for _ in range(_SIMULATED_CALLS):
        call_start = done
        done += between_s
        for i, cost in enumerate(costs):
            if i not in kept:
                done = max(done, land(len(released)))
            done += cost.compute_s
            if i not in kept:
                released.append(done)
    return done - call_start


def choose_residency(
    costs: Sequence[BlockCost],
    bytes_per_s: float,
    budget_bytes: int,
    between_s: float = 0.0,
    overlap: bool = True,
    slot_counts: Sequence[int] = (2, 3, 4),
    candidates: Iterable[int] | None = None,
) -> ResidencyChoice | None:
    """The fastest (resident set, slot count) whose device bytes fit `budget_bytes`, choosing
    residents among `candidates` (None: every block); None when not even streaming every block
    through the fewest slots fits. See [Note: automatic residency]"""
    allowed = sorted(set(range(len(costs)) if candidates is None else candidates))

    def evaluate(resident: frozenset[int], slots: int) -> ResidencyChoice | None:
        nbytes = device_bytes(costs, resident, slots)
        if nbytes > budget_bytes:
            return None
        slots = slots_needed(slots, len(costs) - len(resident))
        call_s = simulate(costs, resident, slots, bytes_per_s, between_s, overlap)
        kept = sum(costs[i].nbytes for i in resident)
        return ResidencyChoice(resident, slots, slot_bytes_for(costs, resident), call_s, nbytes, kept)

    best: ResidencyChoice | None = None

    def consider(choice: ResidencyChoice | None) -> None:
        nonlocal best
        if choice is not None and (best is None or _better(choice, best)):
            best = choice

    classes: dict[int, list[int]] = {}
    for i in allowed:
        classes.setdefault(costs[i].nbytes, []).append(i)
    members = list(classes.values())
    for counts in itertools.product(*(range(len(m) + 1) for m in members)):
        resident = frozenset(i for m, count in zip(members, counts) for i in spread_evenly(m, count))
        for slots in slot_counts:
            consider(evaluate(resident, slots))
    if best is None:
        return None
    while True:  # local moves from the best so far, while one helps
        current = best
        for resident in _moves(current.resident, allowed):
            for slots in slot_counts:
                consider(evaluate(resident, slots))
        if best is current:
            return best


def _moves(resident: frozenset[int], allowed: list[int]) -> Iterable[frozenset[int]]:
    """One block more or fewer, or one resident block moved to another place."""
    for i in allowed:
        yield resident - {i} if i in resident else resident | {i}
    for i in resident:
        for j in allowed:
            if j not in resident:
                yield resident - {i} | {j}


def _better(a: ResidencyChoice, b: ResidencyChoice) -> bool:
    """Faster; at the same predicted speed, more bytes resident (fewer cross the link each
    call: what the model leaves out, per-block waits and a link shared with other traffic,
    only costs streamed bytes), then fewer slots."""
    if a.call_s < b.call_s * (1 - _IMPROVEMENT):
        return True
    if a.call_s > b.call_s * (1 + _IMPROVEMENT):
        return False
    return (-a.resident_bytes, a.num_slots) < (-b.resident_bytes, b.num_slots)


def spread_evenly(members: Sequence[int], count: int) -> tuple[int, ...]:
    """`count` of `members`, evenly spaced (the middle of each of `count` equal stretches)."""
    n = len(members)
    return tuple(members[(2 * k + 1) * n // (2 * count)] for k in range(count))
