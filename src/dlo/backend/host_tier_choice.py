"""Under `host_budget_gib`: which blocks stay in host memory, chosen again from one measured
call, and the blocks moved between host memory and disk before the next. See [Note: which
blocks stay in RAM] in dlo.planning.host_tier"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dlo.backend.auto_residency import AutoResidency
from dlo.backend.disk_tier import DiskTier, HostCopies
from dlo.backend.measured_call import WARMUP_CALLS, CallMeasurement, MeasuredCall, class_medians
from dlo.backend.weight_changes import WeightChanges
from dlo.host.block_sources import DiskSource, PackedSource
from dlo.hotpath.interrupts import interrupts_held
from dlo.hotpath.rank_local import RankLocalRuntime
from dlo.observe.stats import HostTierStats
from dlo.planning.host_tier import GIB, TierBlock, TierModel, choose_tier, simulate_tier

logger = logging.getLogger(__name__)


class HostTierChoice:
    def __init__(
        self,
        runtime: RankLocalRuntime,
        disk: DiskTier,
        sources: dict[int, DiskSource],
        pin: bool,
        releases: list[Callable[[], None]],
        changes: WeightChanges,
        residency: AutoResidency | None,
    ) -> None:
        """`sources`: every file block's disk source; `releases`: the handle's host-memory
        releases, which a private copy made here joins (and leaves once moved to disk);
        `changes`: blocks whose host copy a weight change rewrote stay where they are;
        `residency`: measured first, when both are on (its choice changes what streams)."""
        self._runtime = runtime
        self._disk = disk
        self._sources = sources
        self._pin = pin
        self._releases = releases
        self._changes = changes
        self._residency = residency
        # The private copy of each file block's bytes this choice knows (enable()'s kept blocks,
        # and those it read): a block streaming from its disk source or from this copy may
        # move; any other source (a weight change's) stays. A copy no block streams from (a
        # move cut short by a second Ctrl-C) is released at the next choice.
        self._copies: dict[int, PackedSource] = {
            i: runtime.blocks[i].source for i in sources if isinstance(runtime.blocks[i].source, PackedSource)
        }
        self._calls = 0
        self._measurement = CallMeasurement(runtime)
        self.report = HostTierStats(state="measuring")

    def call_starts(self) -> None:
        residency_first = self._residency is not None and self._residency.measuring
        if self.report.state == "measuring" and self._calls >= WARMUP_CALLS and not residency_first:
            self._measurement.begin()

    def call_ends(self) -> None:
        self._calls += 1
        if not self._measurement.running:
            return
        measured = self._measurement.finish(self._streamed())  # the device is idle from here
        self._reconcile()
        if isinstance(measured, str):
            self._keep(measured)
        elif measured is not None:
            self._choose(measured)

    def _streamed(self) -> list[int]:
        runtime = self._runtime
        return [i for i, b in enumerate(runtime.blocks) if i not in runtime.promoted and not b.on_host]

    def _movable(self, index: int) -> bool:
        runtime = self._runtime
        source = runtime.blocks[index].source
        return (
            index in self._sources
            and (source is self._sources[index] or source is self._copies.get(index))
            and index not in runtime.promoted
            and not runtime.blocks[index].on_host
            and index not in self._changes.rewritten
        )

    def _reconcile(self) -> None:
        """What a move cut short (a second Ctrl-C inside it) left behind: a private copy no
        block streams from is released. (The runtime matches its loads and reads to each
        block's source at its next step: See RankLocalRuntime._recover.)"""
        for index, copy in list(self._copies.items()):
            if self._runtime.blocks[index].source is not copy:
                self._release(index)

    def _release(self, index: int) -> None:
        """Block `index`'s private copy is given back (nothing reads it: the device finished
        every copy queued before)."""
        with interrupts_held():
            copy = self._copies.pop(index)
            copy.release()  # first: if it fails, disable() tries again
            if copy.release in self._releases:  # not yet when a move was cut short
                self._releases.remove(copy.release)

    def _choose(self, call: MeasuredCall) -> None:
        runtime, disk = self._runtime, self._disk
        counters = call.counters
        if not counters.bytes_read or counters.read_s <= 0:
            self._keep("no block was read from disk in the measured call")
            return
        streamed = self._streamed()
        # Blocks alike (layout and wire bytes) are one class: the median of their compute, the
        # largest of their host and read bytes (those differ by the file's alignment padding,
        # which would split a class of identical blocks into several).
        kinds = [(b.layout.nbytes, b.wire.nbytes) for b in runtime.blocks]
        medians = class_medians([kinds[i] for i in streamed], [call.block_compute_s[i] for i in streamed])
        compute = dict(zip(streamed, medians))
        movable = {i for i in range(len(runtime.blocks)) if self._movable(i)}
        host_bytes = _class_maxima(kinds, list(disk.host_bytes))
        read_bytes = _class_maxima(kinds, [s.reads.nbytes if (s := self._sources.get(i)) else 0 for i in range(len(kinds))])
        blocks = [
            TierBlock(
                host_bytes=host_bytes[i],
                read_bytes=read_bytes[i] if i in movable else None,
                load_bytes=runtime.loads.link_bytes(i),
                compute_s=compute.get(i, 0.0),
                streamed=i in compute,  # the others' compute is in between_s
            )
            for i in range(len(runtime.blocks))
        ]
        on_disk = [i for i, b in enumerate(runtime.blocks) if isinstance(b.source, DiskSource)]
        staying = sum(disk.host_bytes[i] for i in range(len(blocks)) if i not in movable and i not in on_disk)
        tier = disk.tier
        room = tier.budget_bytes - staying - tier.read_buffers * tier.read_buffer_bytes
        disk_bps = counters.bytes_read / counters.read_s
        now = [i for i in on_disk if i in movable]
        model = TierModel(
            len(runtime.slots), counters.link_bps, disk_bps, tier.read_buffers, call.between_s,
            runtime.executor.overlaps_compute,
        )
        choice = choose_tier(blocks, room, now, model)
        if choice is None:
            self._keep("no choice fits the budget, or too many block classes to search; kept the blocks of enable()")
            return
        predicted_before = simulate_tier(blocks, on_disk, model)
        to_disk = sorted(set(choice.on_disk) & movable - set(now))
        to_ram = sorted(set(now) - set(choice.on_disk))
        reads = runtime.read_ahead
        assert reads is not None
        try:
            for index in to_disk:  # first: what they free makes room for the others
                self._to_disk(index)
            if to_ram:  # read through one of the read buffers: the budget holds nothing more
                with reads.borrowed() as scratch, HostCopies(scratch, self._pin) as copies:
                    for index in to_ram:
                        self._to_ram(index, copies)
        except Exception as failure:  # each move is whole: the blocks moved so far stay moved
            self._reconcile()  # a copy read for a block whose swap failed is released
            self._keep(f"moving blocks between host memory and disk failed ({failure}); kept what was moved")
            return
        self.report = HostTierStats(
            state="chosen",
            predicted_call_s=choice.call_s,
            predicted_before_s=predicted_before,
            measured_call_s=call.call_s,
            disk_gbps=disk_bps / 1e9,
            moved_to_disk=tuple(runtime.blocks[i].name for i in to_disk),
            moved_to_ram=tuple(runtime.blocks[i].name for i in to_ram),
        )
        logger.info(
            "dlo: host_budget_gib=%.3g GiB: measured %.4f s per call (predicted %.4f s; disk %.2f GB/s); %d blocks "
            "moved to disk, %d to host memory; predicted %.4f s per call",
            tier.budget_bytes / GIB, call.call_s, predicted_before, disk_bps / 1e9, len(to_disk), len(to_ram),
            choice.call_s,
        )

    def _to_disk(self, index: int) -> None:
        """Block `index` is read from its files from its next use on; its private copy is
        released (replace_source waited for every copy out of it)."""
        with interrupts_held():
            self._runtime.replace_source(index, self._sources[index])
            self._release(index)

    def _to_ram(self, index: int, copies: HostCopies) -> None:
        """Block `index` streams from a private copy of its file bytes from its next use on."""
        unreleased: list[Callable[[], None]] = []
        try:
            packed = copies.read(self._runtime.blocks[index], self._sources[index], unreleased.append)
            with interrupts_held():
                self._copies[index] = packed  # known before it streams: a cut in between releases it
                self._releases.append(packed.release)
                unreleased.clear()
                self._runtime.replace_source(index, packed)
        except BaseException:
            for release in unreleased:
                release()
            raise

    def _keep(self, note: str) -> None:
        logger.warning("dlo: host_budget_gib: %s", note)
        self.report = HostTierStats(state="kept", note=note)


def _class_maxima(kinds: list[tuple[int, int]], values: list[int]) -> list[int]:
    """Each value replaced by the largest of those of its kind."""
    largest: dict[tuple[int, int], int] = {}
    for kind, value in zip(kinds, values):
        largest[kind] = max(largest.get(kind, 0), value)
    return [largest[kind] for kind in kinds]
