"""Which device slot holds which streamed block, and what to copy next. Pure Python.

Blocks are the integers 0..num_blocks-1 in static execution order; slots are 0..num_slots-1.
The planner never touches tensors: the hot path asks it what to do and executes the answer,
so the schedule is testable with integers alone.

[Note: slot ownership]
A slot holds at most one block; the table below is the truth about which. A slot is
*active* from `begin(block)` to `end(block)`, and an active slot is never chosen for a
copy: its block's kernels may still read it. A copy into a slot is ordered after the slot's
last use by the hot path's "free" event, and a block's first use after its copy by the
"ready" event, so the table may change as soon as the copy is enqueued.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo.errors import StreamingError


@dataclass(frozen=True)
class Load:
    """Copy `block` into `slot`."""

    block: int
    slot: int


@dataclass(frozen=True)
class BlockStart:
    """What the hot path does when `block` starts: copy it now if `demand` (it was not
    prefetched), run it from `slot`, then issue the `prefetch` loads."""

    slot: int
    demand: Load | None
    prefetch: tuple[Load, ...]


class SlotPlanner:
    """Ring prefetch over a learned execution order.

    The next block is predicted from the transitions seen so far, starting with the static
    order wrapping to block 0 for the next call. A call that skips or repeats blocks updates
    the prediction; a block that was not predicted is loaded on demand, never served from a
    stale slot. With N slots, up to N - 1 predicted blocks are copied ahead.
    """

    def __init__(self, num_blocks: int, num_slots: int, lockstep: bool = False) -> None:
        """lockstep: keep the static order, never learn, never prefetch past the last block
        (all-gather mode, where every load is a collective agreed at call start; see
        [Note: lockstep schedule])."""
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
        self.demand_loads = 0

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

    def begin(self, block: int) -> BlockStart:
        if self._previous is not None and not self._lockstep:
            self._successor[self._previous] = block
        self._previous = block

        slot = self.slot_of(block)
        demand = None
        if slot is not None and self._active[slot]:
            raise StreamingError(f"streamed block {block} was entered again while it is still running")
        if slot is None:
            if self.num_slots == 0:
                raise StreamingError(f"streamed block {block} is not resident and the slots were dropped")
            slot = self._victim(keep=())
            if slot is None:
                raise StreamingError(
                    f"all {self.num_slots} slots hold running blocks; raise OffloadConfig.num_slots "
                    "above the number of streamed blocks that run nested inside each other"
                )
            demand = self._assign(block, slot)
            self.demand_loads += 1
        self._active[slot] = True
        self._touch(slot)
        return BlockStart(slot, demand, self._prefetch_after(block))

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

    def preload(self, block: int) -> tuple[Load, ...]:
        """Loads that put `block` and the blocks after it into the slots (a call's start)."""
        return self._chain(wanted=[], nxt=block)

    def _prefetch_after(self, block: int) -> tuple[Load, ...]:
        return self._chain(wanted=[block], nxt=self._successor[block])

    def _chain(self, wanted: list[int], nxt: int | None) -> tuple[Load, ...]:
        loads: list[Load] = []
        for _ in range(self.num_blocks):  # bounded: every block may be resident
            if len(wanted) >= self.num_slots or nxt is None or nxt in wanted:
                break
            if nxt in self._resident:
                nxt = self._successor[nxt]
                continue
            wanted.append(nxt)
            if self.slot_of(nxt) is None:
                slot = self._victim(keep=wanted)
                if slot is None:
                    break
                loads.append(self._assign(nxt, slot))
            nxt = self._successor[nxt]
        return tuple(loads)

    def _victim(self, keep: list[int] | tuple[int, ...]) -> int | None:
        """An empty slot, else the least recently used one that is idle and not kept."""
        free = [
            slot
            for slot in range(self.num_slots)
            if not self._active[slot] and self._block_in_slot[slot] not in keep
        ]
        if not free:
            return None
        return min(free, key=lambda slot: (self._block_in_slot[slot] is not None, self._last_use[slot]))

    def _assign(self, block: int, slot: int) -> Load:
        self._block_in_slot[slot] = block
        self._touch(slot)
        return Load(block, slot)

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self._last_use[slot] = self._clock
