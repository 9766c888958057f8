"""Packing mapped blocks into pinned staging buffers, off the main thread.

[Note: staged loads]
A block streamed from a checkpoint mapping takes three steps: pack (host threads copy the
tensors from page cache into a pinned staging buffer, applying the loader's adapters), H2D
(the copy stream), compute. One packing thread runs load jobs in submission order, fanning
each block's copies out to a pool, so packing block k+1 overlaps the H2D of block k and the
compute of block k-1. Two staging buffers alternate; before packing into one, the job waits
(in the packing thread, never the main thread) for the event recorded after the last H2D out
of it. The main thread waits for a load's job only when the block is about to run: the job
records the slot's "ready" event, and waiting on an event before it is recorded would wait
for nothing.

On the CPU the same thread packs and copies into the slot (host memory), so the CPU suite runs
the staging thread and its ordering against the caller's own loads.

Packing on the main thread instead (one torch._foreach_copy_ per block, no hand-offs) was
measured on the H200 host and is slower for large blocks: 22 vs 24 GB/s transfer-bound, and
0.978 vs 0.950 s per Wan-14B-shaped forward at 480p, because the host cannot enqueue the next
block's kernels while it packs. It does cut the per-load latency of tiny blocks, where thread
hand-offs wait for the GIL (see benchmarks/RESULTS.md; that variant was measured, not kept).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from dlo.host.pinned_buffer import host_buffers
from dlo.host.tensor_source import CopyTask, balanced_batches, run_batch
from dlo.hotpath.executors import BlockLoad, Executor, LoadMarks
from dlo.hotpath.read_ahead import ReadAhead


def default_pack_threads() -> int:
    """Every core this process may run on. Packing is a memcpy that needs several cores to
    approach memory bandwidth (on the H200 host: 5.7 GB/s on one core, 46 GB/s on 16); with
    several processes per node, give each its share with OffloadConfig.pack_threads."""
    return max(1, len(os.sched_getaffinity(0)))


class Stager:
    def __init__(self, executor: Executor, nbytes: int, threads: int, pin: bool) -> None:
        self._executor = executor
        self._buffers = host_buffers(2, nbytes, pin)
        self._copied_out = [executor.staging_event() for _ in self._buffers]
        self._turn = 0
        # One thread runs the jobs in submission order: the order of a slot's queue. See
        # [Note: one writer per slot] in dlo.hotpath.slot_queue
        self._sequencer = ThreadPoolExecutor(1, thread_name_prefix="dlo-stage")
        self._threads = threads
        self._copiers = ThreadPoolExecutor(threads, thread_name_prefix="dlo-pack")
        self.pack_s = 0.0  # host time spent packing (written by the job thread only)
        self._stopped = False

    @property
    def staging_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers)

    def submit(
        self, pack: Callable[[torch.Tensor], list[CopyTask]], load: Callable[[torch.Tensor], BlockLoad]
    ) -> Future[LoadMarks]:
        """Pack a block into the next staging buffer with the tasks `pack(staging)`, then run
        `load(staging)`, which copies it from there."""
        # See [Note: staged loads]
        turn = self._turn
        self._turn ^= 1
        return self._sequencer.submit(self._load, turn, pack, load)

    def _load(
        self, turn: int, pack: Callable[[torch.Tensor], list[CopyTask]], load: Callable[[torch.Tensor], BlockLoad]
    ) -> LoadMarks:
        staging = self._buffers[turn].tensor
        with self._executor.device_context():
            self._copied_out[turn].synchronize()
            started = time.perf_counter()
            for _ in self._copiers.map(run_batch, balanced_batches(pack(staging), self._threads)):
                pass
            self.pack_s += time.perf_counter() - started
            marks = self._executor.run(load(staging))
            self._executor.record_copied_out(self._copied_out[turn])
        return marks

    def submit_read(
        self, read_ahead: ReadAhead, index: int, load: Callable[[torch.Tensor], BlockLoad]
    ) -> Future[LoadMarks]:
        """A disk block: wait for its read, run `load(read buffer)`, which copies from there,
        and give the buffer back (`ReadAhead.copy_out`). See [Note: the disk tier]"""
        return self._sequencer.submit(self._read_load, read_ahead, index, load)

    def _read_load(self, read_ahead: ReadAhead, index: int, load: Callable[[torch.Tensor], BlockLoad]) -> LoadMarks:
        with self._executor.device_context():
            return read_ahead.copy_out(index, self._executor, load)

    def wait_idle(self) -> None:
        """Wait for every job submitted so far, whether a slot's queue holds it or not (one
        submitted as a step was cut short, before its queue took it)."""
        if not self._stopped:  # stopped: every job has finished
            self._sequencer.submit(lambda: None).result()

    def stop(self) -> None:
        """Finish the queued jobs (their copies are then enqueued) and accept no more;
        idempotent. After it, synchronizing the device settles every staged copy."""
        self._stopped = True
        self._sequencer.shutdown(wait=True)
        self._copiers.shutdown(wait=True)

    def close(self) -> None:
        """Stop, then unpin the staging buffers (the device must be synchronized in between
        if jobs were still queued: their copies read these buffers)."""
        self.stop()
        for buffer in self._buffers:
            buffer.unpin()
