"""Moving block bytes into device slots: the copy stream, the slot events, the clock.

Two engines share one small interface so the hook logic is the same on every device:
`CudaTransfer` copies asynchronously on its own stream and orders work with events;
`SyncTransfer` (device "cpu") copies at once, so everything is testable without a GPU.
Marks are opaque timestamps: CUDA timing events, or `perf_counter` floats on the CPU.

[Note: fp8 landing]
A block with float8 weights (See [Note: fp8 streaming]) is copied whole (its wire image) into
one of two device landing buffers, then written into its slot by a second, high-priority
stream: the plain region copied, each weight dequantized. The copy stream waits only for
the block that last used the landing buffer to be dequantized out of it, not for a slot, so
it runs up to two blocks ahead; the dequantization waits for its slot's last use and write
and records the slot's "ready". Measured on the H200 (Flux-shaped, benchmarks/RESULTS.md):
0.0763 s per forward against a 0.0682 s link floor; dequantizing on the copy stream itself,
into the slot, through one landing buffer, with two torch kernels per weight (so the next
copy queued behind the dequantization kernels, which queue behind the compute stream's),
took 0.101 s. The price is two landing
buffers of the largest float8 block's wire image (about half a bf16 block each); they are
freed with the slots when every block is made resident (`replace_slots(0, ...)`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dlo.host.pinned_buffer import aligned_empty
from dlo.host.tensor_source import CopyTask


@dataclass(frozen=True)
class DeviceSlot:
    """A rotating device buffer with the events that guard it: `ready` is recorded after a
    block lands in `buffer` (on the copy stream, or the communication stream in all-gather
    mode); `free` on the compute stream after the block that used it finished. None on the CPU."""

    buffer: torch.Tensor
    ready: torch.cuda.Event | None
    free: torch.cuda.Event | None


class CudaTransfer:
    overlaps_compute = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # The one copy stream: the H2D of the next block runs here while the current
        # block's kernels run on the caller's stream.
        self.copy_stream = torch.cuda.Stream(device)
        self.landings: tuple[torch.Tensor, ...] = ()
        self._dequant_stream: torch.cuda.Stream | None = None
        self._landed: list[torch.cuda.Event] = []
        self._drained: list[torch.cuda.Event] = []
        self._turn = 0
        # A landing buffer's turn, its H2D and its dequantization are enqueued together (the
        # stager's thread loads blocks too).
        self._enqueue = threading.Lock()

    def allocate_slot(self, nbytes: int) -> DeviceSlot:
        # Slots are held until disable() or replace_slots(), which drop them only after
        # synchronizing the device: the caching allocator never gets their memory back while
        # a copy into them is in flight on the copy stream.
        slot = DeviceSlot(aligned_empty(nbytes, self.device), torch.cuda.Event(), torch.cuda.Event())
        # The allocator may hand over memory that work queued on the compute stream still
        # uses: the slot is written only after that work. See [Note: slots per size class]
        slot.free.record(self.compute_stream())
        return slot

    def retire_slot(self, slot: DeviceSlot) -> DeviceSlot:
        """`slot` without its buffer, which returns to the caching allocator (to the compute
        stream, where it was allocated) once the caller drops it: the compute stream first
        waits for the buffer's last write, pending if its block never ran."""
        self.compute_stream().wait_event(slot.ready)
        return DeviceSlot(torch.empty(0, dtype=torch.uint8, device=self.device), slot.ready, slot.free)

    def allocate_landings(self, nbytes: int) -> None:
        """Two device buffers of `nbytes` that blocks with float8 weights land in (none when
        0), and the stream that dequantizes them into slots. See [Note: fp8 landing]"""
        if not nbytes:
            return
        self.landings = (aligned_empty(nbytes, self.device), aligned_empty(nbytes, self.device))
        self._landed = [torch.cuda.Event(), torch.cuda.Event()]
        self._drained = [torch.cuda.Event(), torch.cuda.Event()]
        for drained in self._drained:  # as for a slot: the first copy waits for work queued on the memory
            drained.record(self.compute_stream())
        # High priority: its short kernels take SMs as the compute stream's blocks retire,
        # instead of queueing behind a whole GEMM.
        self._dequant_stream = torch.cuda.Stream(self.device, priority=-1)

    def drop_landings(self) -> None:
        """Free the landing buffers (a failed enable(), or no slots left); the device must be idle."""
        self.landings = ()
        self._dequant_stream, self._landed, self._drained = None, [], []

    def land_into(
        self,
        slot: DeviceSlot,
        tasks_for: Callable[[int], Sequence[CopyTask]],
        finish: Callable[[int], None],
        gather: tuple[torch.cuda.Stream, Callable[[int, int], None]] | None = None,
    ) -> tuple[Any, Any, Any]:
        """One load of a block with float8 weights: `tasks_for(k)` copies its wire image (or,
        in all-gather mode, this rank's pieces of it, task i the piece of chunk i) into
        landing buffer k on the copy stream (after k's previous block was dequantized);
        `gather` = (stream, collective(k, i)) fills in the other ranks' pieces of chunk i on
        that stream once task i's copy landed, while the next task copies; `finish(k)` writes
        the block into `slot` (after the slot's last use and write) before its "ready" event,
        on the dequantization stream, or the gather's. Returns the marks (start, landed: the
        copy's or the last gather's end, ready: the block's). See [Note: fp8 landing] and
        [Note: chunked gathers]"""
        copy_stream = self.copy_stream
        finishing = self._dequant_stream if gather is None else gather[0]
        assert finishing is not None
        with self._enqueue:
            k = self._turn
            self._turn ^= 1
            copy_stream.wait_event(self._drained[k])
            start = self.mark(copy_stream)
            if gather is None:
                with torch.cuda.stream(copy_stream):
                    for task in tasks_for(k):
                        task.target.copy_(task.source, non_blocking=True)
            else:
                for i, task in enumerate(tasks_for(k)):
                    with torch.cuda.stream(copy_stream):
                        task.target.copy_(task.source, non_blocking=True)
                    finishing.wait_stream(copy_stream)  # this chunk's copy and the ones before it
                    with torch.cuda.stream(finishing):
                        gather[1](k, i)
            self._landed[k].record(copy_stream)
            finishing.wait_event(self._landed[k])
            landed = self.mark(copy_stream if gather is None else finishing)
            self.wait_writable(finishing, slot)
            with torch.cuda.stream(finishing):
                finish(k)
            self._drained[k].record(finishing)
            slot.ready.record(finishing)
            ready = self.mark(finishing)
        return start, landed, ready

    def compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def mark(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else self.compute_stream())
        return event

    def copy_into(self, slot: DeviceSlot, source: torch.Tensor) -> tuple[Any, Any]:
        """Enqueue `source` -> slot after the slot's last use; returns (start, end) marks."""
        return self.copy_pieces_into(slot, [CopyTask(slot.buffer[: source.numel()], source)])

    def copy_pieces_into(self, slot: DeviceSlot, tasks: Sequence[CopyTask]) -> tuple[Any, Any]:
        """Enqueue every task's host -> slot view copy after the slot's last use, as one load.
        Sources must be page-locked (pinned or registered) for the copies to be asynchronous."""
        stream = self.copy_stream
        self.wait_writable(stream, slot)
        start = self.mark(stream)
        with torch.cuda.stream(stream):
            for task in tasks:
                task.target.copy_(task.source, non_blocking=True)
        slot.ready.record(stream)
        return start, self.mark(stream)

    @staticmethod
    def wait_writable(stream: torch.cuda.Stream, slot: DeviceSlot) -> None:
        """Order `stream` after the slot's last use and after its last write, which may have
        been on another stream (a float8 block's, on the dequantization stream) and still be
        pending if that block never ran."""
        stream.wait_event(slot.free)
        stream.wait_event(slot.ready)

    def wait_ready(self, slot: DeviceSlot) -> None:
        self.compute_stream().wait_event(slot.ready)

    def mark_free(self, slot: DeviceSlot) -> None:
        slot.free.record(self.compute_stream())

    def is_done(self, mark: torch.cuda.Event) -> bool:
        return mark.query()

    def seconds_between(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def synchronize(self) -> None:
        self.copy_stream.synchronize()
        if self._dequant_stream is not None:
            self._dequant_stream.synchronize()
        torch.cuda.synchronize(self.device)


class SyncTransfer:
    overlaps_compute = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocate_slot(self, nbytes: int) -> DeviceSlot:
        return DeviceSlot(aligned_empty(nbytes, self.device), None, None)

    def retire_slot(self, slot: DeviceSlot) -> DeviceSlot:
        return DeviceSlot(torch.empty(0, dtype=torch.uint8, device=self.device), None, None)

    def allocate_landings(self, nbytes: int) -> None:
        self.landings = (aligned_empty(nbytes, self.device),) if nbytes else ()

    def drop_landings(self) -> None:
        self.landings = ()

    def land_into(
        self,
        slot: DeviceSlot,
        tasks_for: Callable[[int], Sequence[CopyTask]],
        finish: Callable[[int], None],
        gather: tuple[None, Callable[[int, int], None]] | None = None,
    ) -> tuple[float, float, float]:
        start = time.perf_counter()
        for i, task in enumerate(tasks_for(0)):
            task.run()
            if gather is not None:
                gather[1](0, i)
        landed = time.perf_counter()
        finish(0)
        return start, landed, time.perf_counter()

    def mark(self, stream: None = None) -> float:
        return time.perf_counter()

    def copy_into(self, slot: DeviceSlot, source: torch.Tensor) -> tuple[float, float]:
        return self.copy_pieces_into(slot, [CopyTask(slot.buffer[: source.numel()], source)])

    def copy_pieces_into(self, slot: DeviceSlot, tasks: Sequence[CopyTask]) -> tuple[float, float]:
        start = time.perf_counter()
        for task in tasks:
            task.run()
        return start, time.perf_counter()

    def wait_ready(self, slot: DeviceSlot) -> None:
        pass

    def mark_free(self, slot: DeviceSlot) -> None:
        pass

    def is_done(self, mark: float) -> bool:
        return True

    def seconds_between(self, start: float, end: float) -> float:
        return end - start

    def synchronize(self) -> None:
        pass


Transfer = CudaTransfer | SyncTransfer


def make_transfer(device: torch.device) -> Transfer:
    return CudaTransfer(device) if device.type == "cuda" else SyncTransfer(device)
