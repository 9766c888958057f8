"""Moving block bytes into device slots: the copy stream, the slot events, the clock.

Two engines share one small interface so the hook logic is the same on every device:
`CudaTransfer` copies asynchronously on its own stream and orders work with events;
`SyncTransfer` (device "cpu") copies at once, so everything is testable without a GPU.
Marks are opaque timestamps: CUDA timing events, or `perf_counter` floats on the CPU.
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
        # One load's copies and dequantization are enqueued together: the landing buffer is
        # reused in stream order, and the stager's thread enqueues loads too.
        self._enqueue = threading.Lock()

    def allocate_slot(self, nbytes: int) -> DeviceSlot:
        # Slots are held until disable() or replace_slots(), which drop them only after
        # synchronizing the device: the caching allocator never gets their memory back while
        # a copy into them is in flight on the copy stream.
        return DeviceSlot(aligned_empty(nbytes, self.device), torch.cuda.Event(), torch.cuda.Event())

    def allocate_landing(self, nbytes: int) -> torch.Tensor | None:
        """The device buffer float8 weights land in before they are dequantized into a slot
        (None when no block has any). One per device: loads use it in copy-stream order. Held
        like the slots. See [Note: fp8 streaming]"""
        return aligned_empty(nbytes, self.device) if nbytes else None

    def compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def mark(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else self.compute_stream())
        return event

    def copy_into(self, slot: DeviceSlot, source: torch.Tensor) -> tuple[Any, Any]:
        """Enqueue `source` -> slot after the slot's last use; returns (start, end) marks."""
        return self.copy_pieces_into(slot, [CopyTask(slot.buffer[: source.numel()], source)])

    def copy_pieces_into(
        self, slot: DeviceSlot, tasks: Sequence[CopyTask], then: Callable[[], None] | None = None
    ) -> tuple[Any, Any]:
        """Enqueue every task's host -> device copy after the slot's last use, as one load,
        then `then` (dequantization) on the same stream, before the slot's "ready" event.
        Sources must be page-locked (pinned or registered) for the copies to be asynchronous."""
        stream = self.copy_stream
        with self._enqueue, torch.cuda.stream(stream):
            stream.wait_event(slot.free)
            start = self.mark(stream)
            for task in tasks:
                task.target.copy_(task.source, non_blocking=True)
            if then is not None:
                then()
            slot.ready.record(stream)
            end = self.mark(stream)
        return start, end

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
        torch.cuda.synchronize(self.device)


class SyncTransfer:
    overlaps_compute = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocate_slot(self, nbytes: int) -> DeviceSlot:
        return DeviceSlot(aligned_empty(nbytes, self.device), None, None)

    def allocate_landing(self, nbytes: int) -> torch.Tensor | None:
        return aligned_empty(nbytes, self.device) if nbytes else None

    def mark(self, stream: None = None) -> float:
        return time.perf_counter()

    def copy_into(self, slot: DeviceSlot, source: torch.Tensor) -> tuple[float, float]:
        return self.copy_pieces_into(slot, [CopyTask(slot.buffer[: source.numel()], source)])

    def copy_pieces_into(
        self, slot: DeviceSlot, tasks: Sequence[CopyTask], then: Callable[[], None] | None = None
    ) -> tuple[float, float]:
        start = time.perf_counter()
        for task in tasks:
            task.run()
        if then is not None:
            then()
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
