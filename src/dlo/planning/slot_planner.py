"""Which device slot holds which streamed block, and what to copy next. Pure Python.

Blocks are the integers 0..num_blocks-1 in static execution order; slots are 0..num_slots-1.
The planner never touches tensors: the hot path asks it what to do and executes the answer,
so the schedule is testable with integers alone.

[Note: slot ownership]
A slot holds at most one block; the table below is the truth about which. A slot is
*active* from the commit of its block's start to `end(block)`, and an active slot is never
chosen for a copy: its block's kernels may still read it. A copy into a slot is ordered
after the slot's last use by the hot path's "free" event, and a block's first use after its
copy by the "ready" event, so the table may change as soon as the copy is queued.

Decide, then commit: `decide(block)` and `decide_preload(block)` change nothing and return
what to do; the hot path queues the loads and only then commits the decision, so the table is
never ahead of the slots. A decision dropped midway (an error, Ctrl-C) leaves the table as it
was; the slots it may have written are the hot path's to forget (See [Note: one writer per
slot] in dlo.hotpath.slot_queue).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dlo.errors import StreamingError


@dataclass(frozen=True)
class Load:
    """Copy `block` into `slot`."""

    block: int
    slot: int


@dataclass(frozen=True)
class _Table:
    """Which block each slot holds and when each slot was last used: the planner's record,
    or a decision's copy of it."""

    held: tuple[int | None, ...]
    last_use: tuple[int, ...]
    clock: int


@dataclass(frozen=True)
class BlockStart:
    """What the hot path does when a block starts: copy it now if `demand` (it was not
    prefetched), run it from `slot`, then issue the `prefetch` loads."""

    slot: int
    demand: Load | None
    prefetch: tuple[Load, ...]
    block: int = field(default=-1, compare=False)
    after: _Table | None = field(default=None, compare=False, repr=False)  # the record once committed


class SlotPlanner:
    """Ring prefetch over a learned execution order.

    The next block is predicted from the transitions seen so far, starting with the static
    order wrapping to block 0 for the next call. A call that skips or repeats blocks updates
    the prediction; a block that was not predicted is loaded on demand, never served from a
    stale slot. With N slots, up to N - 1 predicted blocks are copied ahead.
    """

    def __init__(
        self, num_blocks: int, num_slots: int, lockstep: bool = False, on_host: frozenset[int] = frozenset()
    ) -> None:
        """lockstep: keep the static order, never learn, never prefetch past the last block
        (all-gather mode, where every load is a collective agreed at call start; see
        [Note: lockstep schedule]). on_host: blocks that run from their host copy unless
        promoted, never loaded (See [Note: token embeddings looked up on the host])."""
        if num_blocks < 0 or num_slots < 2:
            raise ValueError(f"need num_blocks >= 0 and num_slots >= 2, got {num_blocks}, {num_slots}")
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self._lockstep = lockstep
        self._successor: list[int | None] = [
            i + 1 if i + 1 < num_blocks else (None if lockstep else 0) for i in range(num_blocks)
        ]
        self._block_in_slot: list[int | None] = [None] * num_slots
        self._active = [False] * num_slots
        self._last_use = [0] * num_slots
        self._clock = 0
        self._previous: int | None = None
        self._resident: set[int] = set()  # promoted: on the device for good, never loaded
        self._on_host = on_host
        self.demand_loads = 0
        self._calls_apart = False  # See keep_calls_apart()

    def keep_calls_apart(self) -> None:
        """From now on a call prefetches nothing for the next one: the block that ends a call
        has no successor, and the first block of the next is not learned as one (a module whose
        slots are given back between calls, which would drop such loads unread)."""
        self._calls_apart = True

    def call_starts(self) -> None:
        if self._calls_apart:
            self._previous = None

    def call_ends(self) -> None:
        if self._calls_apart and self._previous is not None:
            self._successor[self._previous] = None
            self._previous = None

    def slot_of(self, block: int) -> int | None:
        for slot, held in enumerate(self._block_in_slot):
            if held == block:
                return slot
        return None

    def is_running(self, block: int) -> bool:
        slot = self.slot_of(block)
        return slot is not None and self._active[slot]

    def is_resident(self, block: int) -> bool:
        return block in self._resident

    def runs_on_host(self, block: int) -> bool:
        return block in self._on_host and block not in self._resident

    def promote(self, block: int) -> None:
        """`block` stays on the device from now on: it is never loaded again, and prefetch
        passes over it. Only an idle block can be promoted."""
        if self._lockstep:
            raise StreamingError("blocks cannot be promoted in all-gather mode: every load there is a collective")
        if self.is_running(block):
            raise StreamingError(f"streamed block {block} is running and cannot be promoted")
        slot = self.slot_of(block)
        if slot is not None:
            self._block_in_slot[slot] = None
        self._resident.add(block)

    def set_resident(self, blocks: Iterable[int]) -> None:
        """Exactly `blocks` are resident (a runtime making its record agree with its memory)."""
        self._resident = set(blocks)

    def demote(self, block: int) -> None:
        """`block` is streamed again from its next use (loaded on demand or prefetched)."""
        self._resident.discard(block)

    def resize(self, num_slots: int) -> None:
        """A new set of `num_slots` empty slots (between calls: nothing may be running).
        Residency, the learned order and the counters stay."""
        if self._lockstep:
            raise StreamingError("the slots cannot be replaced in all-gather mode: every load there is a collective")
        if num_slots == 1 or num_slots < 0:
            raise ValueError(f"need num_slots >= 2, or 0 when every block is to be resident, got {num_slots}")
        if any(self._active):
            raise StreamingError("the slots cannot be replaced while a streamed block is running")
        self.num_slots = num_slots
        self._block_in_slot = [None] * num_slots
        self._active = [False] * num_slots
        self._last_use = [0] * num_slots

    def decide(self, block: int) -> BlockStart:
        """What starting `block` takes; nothing changes until `commit()`."""
        slot = self.slot_of(block)
        if slot is not None and self._active[slot]:
            raise StreamingError(f"streamed block {block} was entered again while it is still running")
        table = _Scratch(self)
        demand = None
        if slot is None:
            if self.num_slots == 0:
                raise StreamingError(f"streamed block {block} is not resident and the slots were dropped")
            slot = table.victim(keep=())
            if slot is None:
                raise StreamingError(
                    f"all {self.num_slots} slots hold running blocks; raise OffloadConfig.num_slots "
                    "above the number of streamed blocks that run nested inside each other"
                )
            demand = table.assign(block, slot)
        table.touch(slot)
        prefetch = self._chain(table, [block], self._next_after(block, block), starting=block)
        return BlockStart(slot, demand, prefetch, block, table.frozen())

    def commit(self, start: BlockStart) -> None:
        """`start`'s loads are queued: record them, and its block as running."""
        assert start.after is not None
        if self._previous is not None and not self._lockstep:
            self._successor[self._previous] = start.block
        self._previous = start.block
        self._install(start.after)
        self._active[start.slot] = True
        if start.demand is not None:
            self.demand_loads += 1

    def started_on_host(self, block: int) -> None:
        """`block`, which runs on the host, started: learned as the successor of the block
        before it, and the block after it as its own."""
        if self._previous is not None and not self._lockstep:
            self._successor[self._previous] = block
        self._previous = block

    def decide_preload(self, block: int) -> tuple[tuple[Load, ...], _Table]:
        """Loads that put `block` and the blocks after it into the slots (a call's start), and
        the record once they are queued (for `record()`)."""
        table = _Scratch(self)
        return self._chain(table, [], block, starting=None), table.frozen()

    def record(self, after: _Table) -> None:
        """Preloads decided by `decide_preload` are queued."""
        self._install(after)

    def end(self, block: int) -> int | None:
        """Mark `block` finished; returns its slot, or None if it was not running."""
        slot = self.slot_of(block)
        if slot is None or not self._active[slot]:
            return None
        self._active[slot] = False
        self._touch(slot)
        return slot

    def release_running(self) -> list[tuple[int, int]]:
        """Mark every running block finished; returns their (block, slot). For a call that
        starts while blocks still count as running: a BaseException (Ctrl-C) skipped their end."""
        stale = []
        for slot, running in enumerate(self._active):
            if running:
                self._active[slot] = False
                stale.append((self._block_in_slot[slot], slot))
        return stale

    def forget(self, *slots: int) -> None:
        """The copies into `slots` may not have happened: hold nothing there (a failed load)."""
        for slot in slots:
            self._block_in_slot[slot] = None
            self._active[slot] = False

    def _next_after(self, block: int, starting: int | None) -> int | None:
        """The predicted successor of `block`, once `starting` (a block about to start) is
        learned as the successor of the block that ran before it."""
        if starting is not None and block == self._previous and not self._lockstep:
            return starting
        return self._successor[block]

    def _chain(self, table: _Scratch, wanted: list[int], nxt: int | None, starting: int | None) -> tuple[Load, ...]:
        loads: list[Load] = []
        for _ in range(self.num_blocks):  # bounded: every block may be resident
            if len(wanted) >= self.num_slots or nxt is None or nxt in wanted:
                break
            if nxt in self._resident or nxt in self._on_host:
                nxt = self._next_after(nxt, starting)
                continue
            wanted.append(nxt)
            if table.slot_of(nxt) is None:
                slot = table.victim(keep=wanted)
                if slot is None:
                    break
                loads.append(table.assign(nxt, slot))
            nxt = self._next_after(nxt, starting)
        return tuple(loads)

    def _install(self, table: _Table) -> None:
        self._block_in_slot = list(table.held)
        self._last_use = list(table.last_use)
        self._clock = table.clock

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self._last_use[slot] = self._clock


class _Scratch:
    """A decision's working copy of the planner's table."""

    def __init__(self, planner: SlotPlanner) -> None:
        self.held = list(planner._block_in_slot)
        self.last_use = list(planner._last_use)
        self.clock = planner._clock
        self._active = planner._active

    def slot_of(self, block: int) -> int | None:
        return self.held.index(block) if block in self.held else None

    def victim(self, keep: list[int] | tuple[int, ...]) -> int | None:
        """An empty slot, else the least recently used one that is idle and not kept."""
        free = [slot for slot in range(len(self.held)) if not self._active[slot] and self.held[slot] not in keep]
        if not free:
            return None
        return min(free, key=lambda slot: (self.held[slot] is not None, self.last_use[slot]))

    def assign(self, block: int, slot: int) -> Load:
        self.held[slot] = block
        self.touch(slot)
        return Load(block, slot)

    def touch(self, slot: int) -> None:
        self.clock += 1
        self.last_use[slot] = self.clock

    def frozen(self) -> _Table:
        return _Table(tuple(self.held), tuple(self.last_use), self.clock)
