"""resident_layers='auto': measure one call, choose the resident blocks and slots under the
memory budget, apply the choice between two calls. See [Note: automatic residency]

[Note: residency budget]
The budget is the device memory this process may use at its peak while the module runs: the
module's weights on the device, slots and activations, and whatever else the process keeps
there (other models of a pipeline, a compiled graph's workspaces: the allocator's peak cannot
tell them apart). `hbm_budget_gib`, or unset: on CUDA, what the device had free at enable()
plus what this process's allocator held then; on the CPU it must be given (no allocator to
ask; activations are not counted there). enable() refuses a budget below the non-block parts
plus `num_slots` slots of the largest block before it moves anything.

The activations are measured, not guessed: the first call warms up (compilation, library
workspaces), the second is measured with every block streamed (again, up to 3 calls, when a
call raised, skipped a block or compiled something). Its peak (CUDA: `max_memory_allocated`
since enable) minus the slots on the device is what the rest of the process takes; the
blocks and slots may use the budget minus that, less `HEADROOM` of the budget for allocator
rounding and call-to-call variation. On CUDA the budget is capped then by what the process
could still hold (memory taken outside the allocator since enable(), by this process or
another, is not in the peak). The choice is made once, at the end of the measured call, and
applied before the next one: never in the middle of a call. Peaks outside the module's calls
(a VAE decoding after the last step) are not measured: a pipeline's plan predicts the largest
and hands it over (`hold_beside`), and the rest of the process is then the larger of the two.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from dlo.config import OffloadConfig
from dlo.errors import ConfigError
from dlo.backend.measured_call import WARMUP_CALLS, CallMeasurement, MeasuredCall, class_medians
from dlo.hotpath.rank_local import RankLocalRuntime
from dlo.observe.stats import ResidencyStats
from dlo.planning.plan_summary import PlanSummary
from dlo.planning.residency import BlockCost, choose_residency

logger = logging.getLogger(__name__)

HEADROOM = 0.02  # of the budget
_TIMED_CALLS = 16  # calls after the plan whose median stats() reports


def residency_budget(config: OffloadConfig, summary: PlanSummary, device: torch.device) -> int:
    """The budget in bytes (see [Note: residency budget]); refuses one below what streaming
    needs before activations. Before anything moves."""
    if config.hbm_budget_gib is not None:
        budget = int(config.hbm_budget_gib * 2**30)
        given = f"OffloadConfig.hbm_budget_gib={config.hbm_budget_gib}"
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free + torch.cuda.memory_reserved(device)
        given = f"the {budget / 2**30:.2f} GiB free on {device}"
    else:
        raise ConfigError(
            "OffloadConfig.resident_layers='auto' on the CPU needs hbm_budget_gib: there is no device allocator to ask"
        )
    largest = summary.largest_block.slot_bytes if summary.largest_block is not None else 0
    if budget < summary.device_weight_bytes:
        raise ConfigError(
            f"{given} is below the {summary.device_weight_bytes / 2**30:.2f} GiB that streaming "
            f"{summary.class_name} needs before activations ({summary.non_block_bytes / 2**30:.2f} GiB of non-block "
            f"parts + {summary.num_slots} slots of {largest / 2**30:.2f} GiB); raise hbm_budget_gib or lower num_slots"
        )
    return budget


class AutoResidency:
    def __init__(
        self,
        runtime: RankLocalRuntime,
        budget_bytes: int,
        peak_bytes: Callable[[], int],
        device_limit: Callable[[], int] | None,
        weight_bytes: int,
        candidates: frozenset[int],
        slot_counts: tuple[int, ...],
    ) -> None:
        """`peak_bytes`: the device's peak since enable(). `device_limit`: what this process
        could hold on the device now (None: no allocator to ask). `weight_bytes`: the
        non-streamed parts on the device. `candidates`: blocks that may be resident (the
        plan's resident-eligible lists)."""
        self._runtime = runtime
        self.budget_bytes = budget_bytes
        self._peak_bytes = peak_bytes
        self._device_limit = device_limit
        self._weight_bytes = weight_bytes
        self._candidates = candidates
        self._slot_counts = slot_counts
        self._calls = 0
        self._measurement = CallMeasurement(runtime)
        self._call_start: Any = None  # of a timed call, after the plan
        self._timed: deque[tuple[Any, Any]] = deque(maxlen=_TIMED_CALLS)
        self._report = ResidencyStats(state="measuring", budget_bytes=budget_bytes)
        self._beside: Callable[[], int] = lambda: 0  # See hold_beside()

    def hold_beside(self, other_phase_bytes: Callable[[], int]) -> None:
        """Another phase of the process, outside the module's calls, holds `other_phase_bytes()`
        on the device beside the module's non-block parts (a pipeline's VAE decode, with every
        other component's weights), asked when the plan is made: the blocks and slots chosen must
        fit beside that too, not only beside the measured call's peak. See [Note: pipeline
        budget]"""
        self._beside = other_phase_bytes

    @property
    def measuring(self) -> bool:
        """No plan made yet: calls are measured (and a plan that times its calls waits)."""
        return self._report.state == "measuring"

    def call_starts(self) -> None:
        if self._calls < WARMUP_CALLS:
            return
        if self.measuring:
            self._measurement.begin()
        else:
            self._call_start = self._runtime.executor.mark()

    def call_ends(self) -> None:
        self._calls += 1
        runtime = self._runtime
        if self._measurement.running:
            # Blocks that look up on the host take no slot and copy nothing: not planned.
            streamed = [i for i, b in enumerate(runtime.blocks) if i not in runtime.promoted and not b.on_host]
            measured = self._measurement.finish(streamed)
            if isinstance(measured, str):  # the call raised, skipped blocks, or compiled, every time
                self._keep({}, f"{measured}; kept the slots of enable()")
            elif measured is not None:
                self._plan(streamed, measured)
            return
        if self._call_start is not None:
            start, self._call_start = self._call_start, None
            self._timed.append((start, runtime.executor.mark()))

    def report(self) -> ResidencyStats:
        """After the device was synchronized (stats() does)."""
        report = self._report
        if not self._timed:
            return report
        seconds = [self._runtime.executor.seconds_between(start, end) for start, end in self._timed]
        return ResidencyStats(**{**vars(report), "measured_call_s": statistics.median(seconds)})

    def _plan(self, streamed: list[int], call: MeasuredCall) -> None:
        runtime = self._runtime
        # Blocks promoted before the plan (used outside their call) are not planned: their
        # memory counts as the rest of the process's, their compute as the time between blocks.
        sizes = [runtime.blocks[i].layout.nbytes for i in streamed]
        measured = [call.block_compute_s[i] for i in streamed]
        costs = _per_class(sizes, measured, [runtime.blocks[i].wire.nbytes for i in streamed])
        between_s = call.between_s
        peak = self._peak_bytes()
        # The slots at the peak's moment. Without an allocator the peak is dlo's own count, the
        # slots at their capacity; a device's measured peak may fall where each slot held the
        # smallest streamed block (a slot follows its block's size class: See [Note: slots per
        # size class]), and assuming so never underestimates the rest of the process.
        if self._device_limit is None:
            slots_at_peak = runtime.slot_bytes
        else:
            slots_at_peak = len(runtime.slots) * min((runtime.blocks[i].slot_bytes for i in streamed), default=0)
        budget = self.budget_bytes
        if self._device_limit is not None:  # memory taken since enable() outside the allocator
            budget = min(budget, self._device_limit())
        available = int(budget * (1 - HEADROOM)) - max(peak - slots_at_peak, self._beside())
        # No copies measured (every block fit in the slots): the link rate does not matter.
        bytes_per_s = call.counters.link_bps
        local = {i: n for n, i in enumerate(streamed)}
        choice = choose_residency(
            costs,
            bytes_per_s,
            available,
            between_s,
            overlap=runtime.executor.overlaps_compute,
            slot_counts=self._slot_counts,
            candidates=[local[i] for i in streamed if i in self._candidates],
        )
        measured_report = dict(
            activation_bytes=max(0, peak - slots_at_peak - self._weight_bytes - _promoted_bytes(runtime)),
            link_gbps=bytes_per_s / 1e9 if call.counters.bytes_streamed else None,
            block_compute_s=tuple(measured),
        )
        if choice is None:
            self._keep(
                measured_report,
                f"the measured call's peak leaves {available / 2**30:.2f} GiB of the {budget / 2**30:.2f} GiB "
                "budget for blocks and slots, less than streaming needs; kept the slots of enable()",
            )
            return
        chosen = frozenset(streamed[n] for n in choice.resident)
        before = _slot_shape(runtime)
        try:
            self._apply(chosen, choice.num_slots, choice.slot_bytes)
        except BaseException as err:
            self._undo(chosen, before)
            if not isinstance(err, torch.OutOfMemoryError):
                raise
            self._keep(measured_report, f"applying the plan failed ({err}); kept the slots of enable()")
            return
        self._report = ResidencyStats(
            state="planned",
            budget_bytes=self.budget_bytes,
            resident=tuple(runtime.blocks[i].name for i in sorted(runtime.promoted)),
            num_slots=len(runtime.slots),
            slot_bytes=choice.slot_bytes if runtime.slots else 0,
            predicted_call_s=choice.call_s,
            **measured_report,
        )
        logger.info(
            "dlo: resident_layers='auto': %d of %d blocks resident, %d slots, predicted %.4f s per call (measured "
            "%.4f s with every block streamed)",
            len(chosen), len(runtime.blocks), len(runtime.slots), choice.call_s, call.call_s,
        )

    def _apply(self, chosen: frozenset[int], num_slots: int, slot_bytes: int) -> None:
        runtime = self._runtime
        if _slot_shape(runtime) != (num_slots, slot_bytes if num_slots else 0):
            runtime.replace_slots(num_slots, slot_bytes)  # frees the old slots first
        for index in sorted(chosen - runtime.promoted.keys()):
            runtime.promote(index)

    def _undo(self, chosen: frozenset[int], slots: tuple[int, int]) -> None:
        """Back to streaming every chosen block through `slots` (count, bytes) of before: the
        promoted memory is freed first, then the slots are replaced."""
        runtime = self._runtime
        for index in sorted(chosen & runtime.promoted.keys()):
            runtime.demote(index)
        if _slot_shape(runtime) != slots:
            runtime.replace_slots(*slots)

    def _keep(self, measured: dict, note: str) -> None:
        logger.warning("dlo: resident_layers='auto': %s", note)
        self._report = ResidencyStats(state="kept", budget_bytes=self.budget_bytes, note=note, **measured)


def _slot_shape(runtime: RankLocalRuntime) -> tuple[int, int]:
    return len(runtime.slots), runtime.slot_capacity


def _per_class(sizes: list[int], measured: list[float], link_bytes: list[int]) -> list[BlockCost]:
    """Each block's cost, its compute the median of its size class's."""
    medians = class_medians(sizes, measured)
    return [BlockCost(size, seconds, link) for size, seconds, link in zip(sizes, medians, link_bytes)]


def _promoted_bytes(runtime: RankLocalRuntime) -> int:
    return sum(memory.numel() for memory in runtime.promoted.values())
