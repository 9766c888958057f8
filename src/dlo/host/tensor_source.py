"""How one runtime tensor is produced from checkpoint tensors while a block is packed.

The loader declares every non-identity step here (docs/guides/checkpoints.md): a dtype cast (e.g. an fp32
checkpoint streamed as bf16) and a fused projection made by concatenating separate
checkpoint tensors along dim 0 (q, k, v -> qkv). Nothing else may transform weights.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dlo.host.checkpoint import Checkpoint
from dlo.host.fp8_codec import dequantized
from dlo.planning.block_layout import ALIGNMENT
from dlo.planning.wire_layout import Fp8Format

# Copies are split into pieces of about this size so several threads share a large tensor.
CHUNK_BYTES = 8 * 2**20


@dataclass(frozen=True)
class CopyTask:
    """Copy `source` into `target` (same shape; dtype may differ: a cast)."""

    target: torch.Tensor
    source: torch.Tensor

    def run(self) -> None:
        if self.target.dtype == self.source.dtype and self.target.is_contiguous() and self.source.is_contiguous():
            # A plain memcpy that releases the GIL and stays on this thread: packing
            # threads run these side by side. (torch's copy_ would fan each one out to
            # its intra-op pool again, oversubscribing the cores.)
            np.copyto(_bytes(self.target), _bytes(self.source))
        else:
            self.target.copy_(self.source)


class TensorViews(Protocol):
    """Where a source's checkpoint tensors are read from: the mapping (a `Checkpoint`), or a
    disk-tier read buffer (`dlo.host.direct_reads.ReadImage`)."""

    def view(self, key: str) -> torch.Tensor: ...


def count_adapters(sources: Iterable[TensorSource | QuantizedSource], checkpoint: Checkpoint) -> dict[str, int]:
    """How many tensors each adapter ("cast", "concat") touches."""
    counts: dict[str, int] = {}
    for source in sources:
        for step in source.adapters(checkpoint):
            counts[step] = counts.get(step, 0) + 1
    return counts


def balanced_batches(tasks: list[CopyTask], count: int) -> list[list[CopyTask]]:
    """`tasks` split into at most `count` batches of about equal bytes (largest first, each
    to the lightest batch). One batch per thread keeps per-task Python overhead and GIL
    hand-offs off the copy path: a block has ~100 tensors, many of them tiny."""
    batches: list[list[CopyTask]] = [[] for _ in range(max(1, min(count, len(tasks))))]
    loads = [0] * len(batches)
    for task in sorted(tasks, key=lambda t: t.source.numel() * t.source.element_size(), reverse=True):
        lightest = loads.index(min(loads))
        batches[lightest].append(task)
        loads[lightest] += task.source.numel() * task.source.element_size()
    return batches


def run_batch(batch: list[CopyTask]) -> None:
    for task in batch:
        task.run()


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.reshape(-1).view(torch.uint8).numpy()


def coalesced(tasks: Iterable[CopyTask]) -> list[CopyTask]:
    """`tasks` with each run of copies that lie at the same distances in their source's and
    their target's memory merged into one copy of the whole range (the gaps between them,
    under ALIGNMENT bytes, are copied too). See [Note: one copy per block]. Casts and
    non-contiguous tensors stay as they are.

    A gap is copied over only where it ends at an ALIGNMENT-aligned target address: targets
    laid out like a slot start every tensor so, and then no other tensor can begin inside a
    gap shorter than ALIGNMENT. Copies into other targets merge only where they touch. And
    never over another task's target: the parts of a concatenated tensor (the converter's
    swapped halves) start inside their tensor, where its other parts, copied from elsewhere
    in the source, may lie in a gap."""
    tasks = list(tasks)
    kept: list[CopyTask] = []
    runs: list[_Run] = []
    targets = _Targets(tasks)
    for task in sorted(tasks, key=lambda t: t.source.data_ptr()):
        if not task.target.numel():  # nothing to copy (and an empty view may have no address)
            continue
        if task.source.dtype != task.target.dtype or not (task.source.is_contiguous() and task.target.is_contiguous()):
            kept.append(task)
            continue
        run = _Run(task.source, *_placed(task.source), task.target, *_placed(task.target), task.source.nbytes)
        if not (runs and runs[-1].absorb(run, targets)):
            runs.append(run)
    return kept + [run.task() for run in runs]


class _Targets:
    """Where the tasks write: the byte extents of their targets, by storage."""

    def __init__(self, tasks: list[CopyTask]) -> None:
        spans = sorted(_extent(task.target) for task in tasks if task.target.numel())
        self._starts = [(storage, begin) for storage, begin, _ in spans]
        # Per storage, the furthest any extent so far reaches: extents may interleave (strided
        # targets), so the last one to start is not the only one that can reach a range.
        self._reach: list[int] = []
        for i, (storage, _, end) in enumerate(spans):
            same = i and spans[i - 1][0] == storage
            self._reach.append(max(end, self._reach[-1]) if same else end)

    def any_within(self, storage: int, begin: int, end: int) -> bool:
        """Whether a task writes a byte of [begin, end) in `storage`."""
        i = bisect.bisect_left(self._starts, (storage, end)) - 1
        return i >= 0 and self._starts[i][0] == storage and self._reach[i] > begin


def _extent(tensor: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, end) of the bytes `tensor` spans in its storage."""
    storage, at = _placed(tensor)
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return storage, at, at + (last + 1) * tensor.element_size()


@dataclass
class _Run:
    """Bytes [source_at, source_at + nbytes) of the source's storage to the same length at
    target_at in the target's."""

    source: torch.Tensor
    source_storage: int
    source_at: int
    target: torch.Tensor
    target_storage: int
    target_at: int
    nbytes: int

    def absorb(self, other: _Run, targets: _Targets) -> bool:
        """Extend this run to the end of `other` if it follows at the same distance in both,
        over a gap no task writes (See `coalesced`)."""
        gap = other.source_at - (self.source_at + self.nbytes)
        end = self.target_at + self.nbytes
        if (
            (other.source_storage, other.target_storage) != (self.source_storage, self.target_storage)
            or not 0 <= gap < ALIGNMENT
            or other.target_at - end != gap
            or (gap and (other.target_storage + other.target_at) % ALIGNMENT)
            or (gap and targets.any_within(self.target_storage, end, other.target_at))
        ):
            return False
        self.nbytes = other.source_at + other.nbytes - self.source_at
        return True

    def task(self) -> CopyTask:
        return CopyTask(_span(self.target, self.target_at, self.nbytes), _span(self.source, self.source_at, self.nbytes))


def _placed(tensor: torch.Tensor) -> tuple[int, int]:
    """(its storage's address, its byte offset in that storage)."""
    storage = tensor.untyped_storage().data_ptr()
    return storage, tensor.data_ptr() - storage


def _span(tensor: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """`nbytes` bytes of `tensor`'s storage from `start`, as a view of `tensor`."""
    return tensor.reshape(-1).view(torch.uint8).as_strided((nbytes,), (1,), start)


@dataclass(frozen=True)
class TensorSource:
    keys: tuple[str, ...]  # checkpoint tensors, concatenated along dim 0 when more than one
    shape: tuple[int, ...]  # runtime shape
    dtype: torch.dtype  # runtime dtype

    def adapters(self, checkpoint: Checkpoint) -> tuple[str, ...]:
        steps = []
        if len(self.keys) > 1:
            steps.append("concat")
        if any(checkpoint.tensors[key].entry.dtype != self.dtype for key in self.keys):
            steps.append("cast")
        return tuple(steps)

    def pieces(self, checkpoint: TensorViews, target: torch.Tensor) -> list[CopyTask]:
        """One task per checkpoint tensor, filling its part of `target` (a view shaped and
        typed like the runtime tensor)."""
        tasks = []
        row = 0
        for key in self.keys:
            source = checkpoint.view(key)
            rows = source.shape[0] if source.dim() else 1
            tasks.append(CopyTask(target[row : row + rows] if len(self.keys) > 1 else target, source))
            row += rows
        return tasks

    def copy_tasks(self, checkpoint: Checkpoint, target: torch.Tensor) -> list[CopyTask]:
        """`pieces`, large ones split in chunks for several host threads."""
        return [chunk for piece in self.pieces(checkpoint, target) for chunk in _chunks(piece.target, piece.source)]

    def materialize(self, checkpoint: Checkpoint) -> torch.Tensor:
        """An ordinary (private, writable) CPU tensor holding this source's value."""
        tensor = torch.empty(self.shape, dtype=self.dtype)
        for task in self.copy_tasks(checkpoint, tensor):
            task.run()
        return tensor

    def readable(self, checkpoint: Checkpoint) -> torch.Tensor:
        """A CPU tensor holding this source's value: the mapping's view where it is one
        checkpoint tensor as saved (valid while the mapping is open), else `materialize`."""
        if self.adapters(checkpoint):
            return self.materialize(checkpoint)
        return checkpoint.view(self.keys[0]).view(self.shape)


@dataclass(frozen=True)
class QuantizedSource:
    """A runtime weight the checkpoint holds as float8 (`data_key`) with its scales
    (`scale_key`: one per output row, or one for the weight). It streams as stored and is
    dequantized on the device (See [Note: fp8 streaming]); copies out of the mapping
    (`materialize`) are dequantized on the CPU, which gives the same values."""

    data_key: str
    scale_key: str
    shape: tuple[int, ...]  # runtime shape
    dtype: torch.dtype  # runtime dtype (dequantized into)
    format: Fp8Format

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.data_key, self.scale_key)

    @property
    def scale_shape(self) -> tuple[int, int]:
        return self.format.scale_shape(self.shape[0])

    def adapters(self, checkpoint: Checkpoint) -> tuple[str, ...]:
        """The float8 bytes are used as saved; scales not stored as fp32 are cast."""
        return ("cast",) if checkpoint.tensors[self.scale_key].entry.dtype != torch.float32 else ()

    def scale(self, checkpoint: TensorViews) -> torch.Tensor:
        return checkpoint.view(self.scale_key).reshape(self.scale_shape)

    def pieces(self, checkpoint: TensorViews, target: tuple[torch.Tensor, torch.Tensor]) -> list[CopyTask]:
        """Tasks filling `target`: (float8 data, fp32 scale) views in a landing region."""
        data, scale = target
        return [CopyTask(data, checkpoint.view(self.data_key)), CopyTask(scale, self.scale(checkpoint))]

    def copy_tasks(self, checkpoint: Checkpoint, target: tuple[torch.Tensor, torch.Tensor]) -> list[CopyTask]:
        data, scale = target
        return [*_chunks(data, checkpoint.view(self.data_key)), CopyTask(scale, self.scale(checkpoint))]

    def materialize(self, checkpoint: Checkpoint) -> torch.Tensor:
        return dequantized(checkpoint.view(self.data_key), self.scale(checkpoint).float(), self.dtype)

    readable = materialize  # the mapping holds float8: never the runtime value as saved


MappedTensor = TensorSource | QuantizedSource


def _chunks(target: torch.Tensor, source: torch.Tensor) -> list[CopyTask]:
    nbytes = source.numel() * source.element_size()
    if source.dim() == 0 or nbytes <= CHUNK_BYTES or source.shape[0] < 2:
        return [CopyTask(target, source)]
    rows_per_chunk = max(1, source.shape[0] * CHUNK_BYTES // nbytes)
    return [
        CopyTask(target[start : start + rows_per_chunk], source[start : start + rows_per_chunk])
        for start in range(0, source.shape[0], rows_per_chunk)
    ]
