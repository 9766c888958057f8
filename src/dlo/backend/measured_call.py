"""One call measured for a plan made between calls (`resident_layers='auto'`, the disk tier's
choice): the runtime's counters around it, each streamed block's compute, and whether it was
a step's call at all (one that raised, skipped a block or compiled something is not)."""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from dlo.hotpath.compiled_call import CompileWatch
from dlo.hotpath.rank_local import RankLocalRuntime

WARMUP_CALLS = 1  # calls before the measured one (compilation, library workspaces)
ATTEMPTS = 3  # calls measured at most before a plan gives up


@dataclass(frozen=True)
class Counters:
    """The runtime's cumulative counters (or their change over a call)."""

    bytes_streamed: int
    copy_s: float
    exposed_copy_s: float
    pack_s: float
    bytes_read: int  # from disk (the disk tier)
    read_s: float

    @classmethod
    def of(cls, runtime: RankLocalRuntime) -> Counters:
        ledger, reads = runtime.ledger, runtime.read_ahead
        return cls(
            ledger.bytes_streamed,
            ledger.copy_s,
            ledger.exposed_copy_s,
            runtime.pack_s,
            reads.bytes_read if reads is not None else 0,
            reads.read_s if reads is not None else 0.0,
        )

    def since(self, start: Counters) -> Counters:
        return Counters(*(now - then for now, then in zip(vars(self).values(), vars(start).values())))

    @property
    def link_bps(self) -> float:
        """Bytes a second over the link (a staged load takes the longer of its packing and
        its copy); infinite when nothing was copied (every block fit the slots)."""
        load_s = max(self.copy_s, self.pack_s)
        return self.bytes_streamed / load_s if self.bytes_streamed and load_s > 0 else float("inf")


@dataclass(frozen=True)
class MeasuredCall:
    call_s: float
    block_compute_s: dict[int, float]  # streamed block index -> seconds
    counters: Counters  # over the call

    @property
    def between_s(self) -> float:
        """The call's compute outside the measured blocks (non-block parts, blocks kept on the
        device): what is left of it after the blocks and the exposed waits."""
        return max(0.0, self.call_s - sum(self.block_compute_s.values()) - self.counters.exposed_copy_s)


class CallMeasurement:
    """`begin()` at a call's start, `finish()` at its end; between them the ledger times each
    block. Only one measurement runs at a time: its owner starts one after the other's end."""

    def __init__(self, runtime: RankLocalRuntime) -> None:
        self._runtime = runtime
        self._start: Any = None
        self._baseline: Counters | None = None
        self._compiles: CompileWatch | None = None
        self.attempts = 0

    @property
    def running(self) -> bool:
        return self._start is not None

    def begin(self) -> None:
        runtime = self._runtime
        runtime.drain()
        runtime.executor.synchronize()
        runtime.ledger.settle()
        self._baseline = Counters.of(runtime)
        self._compiles = CompileWatch()
        runtime.ledger.block_compute_s.clear()
        runtime.ledger.measuring_blocks = True
        self._start = runtime.executor.mark()

    def finish(self, streamed: Sequence[int]) -> MeasuredCall | str | None:
        """The call, if every block of `streamed` ran and nothing compiled; else None (measure
        the next), or after ATTEMPTS such calls why none was clean."""
        runtime = self._runtime
        ledger = runtime.ledger
        end = runtime.executor.mark()
        start, self._start = self._start, None
        runtime.drain()
        runtime.executor.synchronize()
        ledger.settle()
        ledger.measuring_blocks = False
        self.attempts += 1
        assert self._baseline is not None and self._compiles is not None
        self._compiles.poll()
        unmeasured = [runtime.blocks[i].name for i in streamed if i not in ledger.block_compute_s]
        if unmeasured or self._compiles.graphs or self._compiles.recompiles:
            if self.attempts < ATTEMPTS:
                return None
            why = f"blocks {unmeasured[:3]} did not run" if unmeasured else "each compiled something"
            return f"no clean call to measure in {ATTEMPTS} tries ({why})"
        return MeasuredCall(
            runtime.executor.seconds_between(start, end),
            {i: ledger.block_compute_s[i] for i in streamed},
            Counters.of(runtime).since(self._baseline),
        )


def class_medians(keys: Sequence[Hashable], values: Sequence[float]) -> list[float]:
    """Each value replaced by the median of those of its key (blocks of one size run the same
    kernels; one measurement per block is noisy)."""
    by_key: dict[Hashable, list[float]] = {}
    for key, value in zip(keys, values):
        by_key.setdefault(key, []).append(value)
    median = {key: statistics.median(group) for key, group in by_key.items()}
    return [median[key] for key in keys]
