"""Running a load: the streams, the slot events, the clock, and the one sequence every load
takes (copy, gather, finish, record ready), for each kind of device.

`CudaExecutor` enqueues a load asynchronously on its streams and orders work with events;
`CpuExecutor` (device "cpu") runs it at once, so everything is testable without a GPU. Marks
are opaque timestamps: CUDA timing events, or `perf_counter` floats on the CPU. What a load
copies is data (`BlockLoad`), made by `dlo.hotpath.block_loads`; who may run it on a slot is
decided by the slot's queue (See [Note: one writer per slot] in dlo.hotpath.slot_queue).

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
took 0.101 s. The price is two landing buffers of the largest float8 block's wire image
(about half a bf16 block each); they are freed with the slots when every block is made
resident (`replace_slots(0, ...)`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dlo.errors import StreamingError
from dlo.host.pinned_buffer import aligned_empty
from dlo.host.tensor_source import CopyTask


@dataclass(frozen=True)
class DeviceSlot:
    """A rotating device buffer with the events that guard it: `ready` is recorded after a
    block lands in `buffer` (on the copy stream, the dequantization stream or the
    communication stream); `free` on the compute stream after the block that used it
    finished. None on the CPU."""

    buffer: torch.Tensor
    ready: torch.cuda.Event | None
    free: torch.cuda.Event | None


@dataclass(frozen=True)
class BlockLoad:
    """One load as data. `copies(k)`: the host -> device copies, into the slot, or, when the
    block is `finish`ed, into landing buffer k. `gather(k, i)`, all-gather mode: fill in the
    other ranks' bytes of chunk i once copy i landed (copy i is this rank's piece of it).
    `finish(k)`: write the block from landing buffer k into the slot (float8: dequantize)."""

    slot: DeviceSlot
    copies: Callable[[int], Sequence[CopyTask]]
    gather: Callable[[int, int], None] | None = None
    finish: Callable[[int], None] | None = None


@dataclass(frozen=True)
class LoadMarks:
    """When a load started, when its bytes crossed the link (or were gathered), and when its
    block can run."""

    start: Any
    copied: Any
    ready: Any


class CudaExecutor:
    overlaps_compute = True

    def __init__(self, device: torch.device, gathers: bool = False) -> None:
        """`gathers`: loads all-gather (a group of two or more), on a stream of their own."""
        self.device = device
        # The copy stream: the H2D of the next block runs here while the current block's
        # kernels run on the caller's stream.
        self.copy_stream = torch.cuda.Stream(device)
        # The communication stream: the all-gather of the next block runs here, after its
        # shard's H2D, while the current block computes and the next shard copies.
        self.comm_stream = torch.cuda.Stream(device) if gathers else None
        self.landings: tuple[torch.Tensor, ...] = ()
        self._dequant_stream: torch.cuda.Stream | None = None
        self._landed: list[torch.cuda.Event] = []
        self._drained: list[torch.cuda.Event] = []
        self._turn = 0
        # A load's landing turn and its steps are enqueued together: the stager's thread
        # runs loads too.
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

    def run(self, load: BlockLoad) -> LoadMarks:
        """Enqueue `load`: its copies on the copy stream after the slot's last use and write
        (or, when it lands, after landing buffer k's last block was finished out of it), each
        chunk's gather on the communication stream after its copy, the finish after the slot's
        last use and write, then the slot's "ready". See [Note: fp8 landing] and [Note: chunked
        gathers]"""
        slot, copy_stream = load.slot, self.copy_stream
        gathering = self.comm_stream if load.gather is not None else None
        with self._enqueue:
            k = 0
            if load.finish is not None:
                k, self._turn = self._turn, self._turn ^ 1
                copy_stream.wait_event(self._drained[k])
            else:
                self.wait_writable(copy_stream, slot)
            start = self.mark(copy_stream)
            # One stream context for all the block's copies: entering one costs the host
            # thread three times what a copy does (benchmarks/investigations/copy_issue_cost.py),
            # and a mapped block is copied tensor by tensor.
            with torch.cuda.stream(copy_stream):
                for i, task in enumerate(load.copies(k)):
                    task.target.copy_(task.source, non_blocking=True)
                    if gathering is not None:
                        # This chunk's copy and the ones before it only: the next chunk's copy,
                        # enqueued after this, overlaps this chunk's gather.
                        gathering.wait_stream(copy_stream)
                        with torch.cuda.stream(gathering):
                            load.gather(k, i)
            last = gathering if gathering is not None else copy_stream
            if load.finish is None:
                slot.ready.record(last)
                copied = self.mark(last)
                return LoadMarks(start, copied, copied)
            finishing = gathering if gathering is not None else self._dequant_stream
            assert finishing is not None
            self._landed[k].record(copy_stream)
            finishing.wait_event(self._landed[k])
            copied = self.mark(last)
            self.wait_writable(finishing, slot)
            with torch.cuda.stream(finishing):
                load.finish(k)
            self._drained[k].record(finishing)
            slot.ready.record(finishing)
            return LoadMarks(start, copied, self.mark(finishing))

    def compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def check_not_capturing(self) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise StreamingError(
                "a streamed block ran inside a CUDA graph capture (torch.cuda.graph): a replay would reuse the "
                "weight addresses of the capture, and dlo moves a streamed block's weights from slot to slot. "
                "Capture without dlo, or keep every block resident (resident_layers)"
            )

    def mark(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else self.compute_stream())
        return event

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

    def staging_event(self) -> torch.cuda.Event:
        """An event a staging buffer's last copy out of it records (See [Note: staged loads])."""
        return torch.cuda.Event()

    def record_copied_out(self, event: torch.cuda.Event) -> None:
        event.record(self.copy_stream)

    def device_context(self) -> Any:
        """Make the executor's device current (a stager thread's may be another)."""
        return torch.cuda.device(self.device)

    def is_done(self, mark: torch.cuda.Event) -> bool:
        return mark.query()

    def seconds_between(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def synchronize(self) -> None:
        for stream in (self.copy_stream, self._dequant_stream, self.comm_stream):
            if stream is not None:
                stream.synchronize()
        torch.cuda.synchronize(self.device)


class _NoEvent:
    """A staging buffer's event on the CPU: copies out of it are done when they return."""

    def synchronize(self) -> None:
        pass


class CpuExecutor:
    overlaps_compute = False

    def __init__(self, device: torch.device, gathers: bool = False) -> None:
        self.device = device
        self.landings: tuple[torch.Tensor, ...] = ()
        # The one landing buffer is used by the stager's thread and the caller's alike.
        self._enqueue = threading.Lock()

    def allocate_slot(self, nbytes: int) -> DeviceSlot:
        return DeviceSlot(aligned_empty(nbytes, self.device), None, None)

    def retire_slot(self, slot: DeviceSlot) -> DeviceSlot:
        return DeviceSlot(torch.empty(0, dtype=torch.uint8, device=self.device), None, None)

    def allocate_landings(self, nbytes: int) -> None:
        self.landings = (aligned_empty(nbytes, self.device),) if nbytes else ()

    def drop_landings(self) -> None:
        self.landings = ()

    def run(self, load: BlockLoad) -> LoadMarks:
        with self._enqueue:
            start = time.perf_counter()
            for i, task in enumerate(load.copies(0)):
                task.run()
                if load.gather is not None:
                    load.gather(0, i)
            copied = time.perf_counter()
            if load.finish is None:
                return LoadMarks(start, copied, copied)
            load.finish(0)
            return LoadMarks(start, copied, time.perf_counter())

    def mark(self, stream: None = None) -> float:
        return time.perf_counter()

    def check_not_capturing(self) -> None:
        pass

    def wait_ready(self, slot: DeviceSlot) -> None:
        pass

    def mark_free(self, slot: DeviceSlot) -> None:
        pass

    def staging_event(self) -> _NoEvent:
        return _NoEvent()

    def record_copied_out(self, event: _NoEvent) -> None:
        pass

    def device_context(self) -> Any:
        return contextlib.nullcontext()

    def is_done(self, mark: float) -> bool:
        return True

    def seconds_between(self, start: float, end: float) -> float:
        return end - start

    def synchronize(self) -> None:
        pass


Executor = CudaExecutor | CpuExecutor


def make_executor(device: torch.device, gathers: bool = False) -> Executor:
    return CudaExecutor(device, gathers) if device.type == "cuda" else CpuExecutor(device, gathers)
