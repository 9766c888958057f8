"""All-gather mode: rebuilding a block in its slot from every rank's shard, and keeping the
ranks in lockstep.

[Note: lockstep schedule]
Every load is a collective, so every rank of the group must issue the same loads in the same
order, or a rank waits forever for a peer that issued something else. dlo therefore fixes
the schedule of a call to the plan's static order (no learning), and the ranks agree on each
call: they all-gather a digest (call index, plan digest, a "poisoned" flag) and, when the call
starts, compare: any difference raises StreamingError on every rank at once. The agreement
of call k+1 and the loads of its first blocks are issued at the end of call k, by every rank
whether or not call k went well, so they overlap call k's last blocks (the next call's start
would otherwise wait for them); the call's own start only reads the agreement. A rank whose
forward leaves the schedule (skips or reorders a block, or ends the call early) first issues
the rest of the call's collectives so its peers can finish, marks itself poisoned and raises;
it still issues the next agreement and first loads at the call's end, like its peers, so the
next call's agreement fails on every rank with every collective matched. A call cut short by
Ctrl-C is closed the same way at the rank's next call or disable(): See [Note: interrupts
between collectives] in dlo.hotpath.interrupts. A rank that dies
or stops mid-call is named by a StreamingError on every survivor within the group's timeout,
with Gloo (whose collective fails at once) and with NCCL (where nothing fails in Python
until NCCL's watchdog ends the process, slowly): See [Note: dead ranks] in
dlo.hotpath.liveness.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dlo.errors import StreamingError
from dlo.host.block_sources import ShardedSource
from dlo.host.tensor_source import CopyTask, coalesced
from dlo.hotpath.executors import BlockLoad, CudaExecutor, DeviceSlot, Executor
from dlo.hotpath.liveness import RankWatch, group_timeout_s
from dlo.hotpath.streamed_block import StreamedBlock
from dlo.planning.shard_layout import ShardLayout

class GatherRole(enum.Enum):
    """Which of the caller's groups rebuilds blocks (docs/guides/multi-gpu.md); NONE: a group of one."""

    DP = "dp"
    SP = "sp"
    NONE = "none"


@dataclass(frozen=True)
class GatherGroup:
    """The group chosen for all-gather mode (by `dlo.backend.gather_group`)."""

    group: dist.ProcessGroup | None  # None when size == 1: no collective is ever issued
    rank: int
    size: int
    role: GatherRole


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def plan_digest(num_slots: int, blocks: Sequence[StreamedBlock]) -> int:
    """A 62-bit digest of everything that decides which collectives a call issues and what
    they carry: the slot count (which blocks get reloaded), and per block its name, its
    chunks and shard width (See [Note: chunked gathers]), every tensor's name, shape, dtype
    and offset, and its float8 weights' formats. Equal on ranks that may gather together;
    anything else is refused at the first agreement."""
    lines = [f"slots {num_slots}"]
    for block in blocks:
        source = block.source
        sharded = isinstance(source, ShardedSource)
        shards = f"{source.shards.chunks} x {source.shards.width}" if sharded else "whole"
        lines.append(f"{block.name} {shards} {block.layout.nbytes}")
        lines.extend(
            f"  {p.spec.name} {list(p.spec.shape)} {p.spec.dtype} {p.offset}" for p in block.layout.placements
        )
        lines.extend(f"  float8 {q.index} {q.dtype} {q.data_offset} {q.scale_shape}" for q in block.wire.quantized)
    return int.from_bytes(hashlib.sha256("\n".join(lines).encode()).digest()[:8], "little") >> 2


@dataclass(frozen=True)
class Agreement:
    """A call's lockstep agreement in flight: the gathered digests (None in a group of one),
    and whether the call's first loads were issued with it (at the end of the previous call)."""

    gathered: torch.Tensor | None
    loads_issued: bool


class BlockGather:
    def __init__(self, gather_group: GatherGroup, executor: Executor) -> None:
        self.group = gather_group.group
        self.rank = gather_group.rank
        self.size = gather_group.size
        self.role = gather_group.role
        self._executor = executor
        self.collectives = 0
        # CUDA: recorded after each collective, for `unfinished()`
        self._issued = torch.cuda.Event() if isinstance(executor, CudaExecutor) and self.size > 1 else None
        self.in_collective = False  # a collective call is running (Gloo: it returns when it is done)
        self._failed: str | None = None  # why a collective failed: the group is broken, later ones raise it
        self.watch = None  # See [Note: dead ranks]
        if self.group is not None:
            timeout_s = group_timeout_s(self.group, executor.device)
            self.watch = RankWatch(self.group, self.rank, self.size, self.role.value, timeout_s, self)

    def block_load(
        self,
        slot: DeviceSlot,
        shards: ShardLayout,
        pieces: Sequence[torch.Tensor],
        finish: Callable[[int], None] | None,
        landings: Sequence[torch.Tensor],
    ) -> BlockLoad:
        """A load of a block whose shard is `pieces` on the host, laid out by `shards` (See
        [Note: chunked gathers]): this rank's pieces copied into their places in `slot` (or,
        for a float8 block that is then `finish`ed, in landing buffer k: See [Note: fp8
        landing]), the others' all-gathered there chunk by chunk. One host->device copy per
        chunk, from wherever the piece lives (a private shard, the cache entry, a read
        buffer): the fewest that let a chunk's copy overlap the previous chunk's gather. A
        group of one has nothing to gather: its pieces lie one after another in the image and
        on the host, so `coalesced` makes them one copy."""
        chunks = [self._chunks(image, shards, pieces) for image in ([slot.buffer] if finish is None else landings)]

        def copies(k: int) -> list[CopyTask]:
            tasks = [CopyTask(own, host) for own, _, host in chunks[k]]
            return tasks if self.size > 1 else coalesced(tasks)

        def gather_chunk(k: int, i: int) -> None:
            own, whole, _ = chunks[k][i]
            self._gather(whole, own)

        return BlockLoad(slot, copies, gather_chunk if self.size > 1 else None, finish)

    def _chunks(
        self, image: torch.Tensor, shards: ShardLayout, pieces: Sequence[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per chunk of the block in `image` (a slot, a landing buffer, the gathered block): this
        rank's piece there, the whole chunk there, and the piece on the host."""
        return [
            (
                image[piece.image_start : piece.image_start + piece.nbytes],
                image[piece.chunk * shards.chunk_bytes : (piece.chunk + 1) * shards.chunk_bytes],
                host,
            )
            for piece, host in zip(shards.pieces(self.rank), pieces)
        ]

    def issue_agreement(self, call_index: int, digest: int, poisoned: bool) -> torch.Tensor | None:
        """Start gathering every rank's (call index, plan digest, poisoned); `check` reads it.
        None in a group of one. See [Note: lockstep schedule]"""
        if self.size == 1:
            return None
        device = self._executor.device
        mine = torch.tensor([call_index, digest, int(poisoned)], dtype=torch.int64, device=device)
        everyone = torch.empty(3 * self.size, dtype=torch.int64, device=device)
        self._gather(everyone, mine)
        return everyone

    def check(self, agreement: Agreement) -> None:
        """Raises on every rank if any rank differs. Reading the gathered digests is the one
        place the host waits for the device in all-gather mode, once per call."""
        if agreement.gathered is None:
            return
        assert self.watch is not None
        self.watch.serve()
        rows = agreement.gathered.view(self.size, 3).tolist()
        self.watch.raise_if_lost()  # the read returns once an abort ended the collective: garbage
        if any(row != rows[0] for row in rows) or any(row[2] for row in rows):
            described = "; ".join(
                f"rank {r}: call {row[0]}, plan {row[1]:x}{', left the schedule' if row[2] else ''}"
                for r, row in enumerate(rows)
            )
            issued = "its first loads were issued by every rank" if agreement.loads_issued else "no collective of it was issued"
            raise StreamingError(
                f"all-gather lockstep broken in the {self.role.value} group ({described}). Every rank must call the "
                "model the same number of times and run the same blocks in plan order (same step counts "
                f"and options, e.g. skip_layers); this call did not run ({issued})"
            )

    def raise_if_broken(self) -> None:
        """Raise why the rank's collectives were broken off, if they were (a group of one
        too: its loads issue no collective, but its slots may hold what a cut step left)."""
        if self._failed is not None:
            raise StreamingError(self._failed)

    def break_off(self, reason: str) -> None:
        """This rank is out of step with its peers: every later collective raises `reason`
        instead of pairing with a peer's different one, and its heartbeat stops, so a peer
        waiting in a collective this rank will never issue is told which rank is gone (See
        [Note: dead ranks]) instead of waiting for the group's timeout. A rank whose collective
        already failed keeps that reason and its watch: the group is broken, and the watch
        goes on naming lost peers."""
        if self._failed is not None:
            return
        self._failed = reason
        if self.watch is not None:
            self.watch.stop()

    def gather_full(self, shards: ShardLayout, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole (padded) block as a CPU tensor, on every rank (collectives, one a chunk),
        from this rank's shard `pieces` on the host."""
        whole = torch.empty(shards.padded_bytes, dtype=torch.uint8, device=self._executor.device)
        for own, chunk, host in self._chunks(whole, shards, pieces):
            own.copy_(host)
            self._gather(chunk, own)
        return whole.cpu()

    def close(self) -> None:
        """Stop the watch (disable())."""
        if self.watch is not None:
            self.watch.stop()

    def unfinished(self) -> bool:
        """Whether a collective issued has not completed (the watch's thread asks)."""
        if self.in_collective:
            return True
        if self._issued is None:
            return False
        with torch.cuda.device(self._executor.device):  # the asking thread's device may be another
            return not self._issued.query()

    def _gather(self, whole: torch.Tensor, own: torch.Tensor) -> None:
        if self.size == 1:
            whole.copy_(own)
            return
        assert self.watch is not None
        if self.watch.lost is not None:
            self.watch.raise_if_lost()
        self.raise_if_broken()
        self.in_collective = True
        try:
            _all_gather(whole, own, group=self.group)
        except RuntimeError as err:
            self._failed = self.watch.verdict() or (
                f"all-gather in the {self.role.value} group failed on rank {self.rank}: {self.watch.name_loss()} ({err})"
            )
            raise StreamingError(self._failed) from err
        finally:
            self.in_collective = False
        if self._issued is not None:
            self._issued.record()
        self.collectives += 1
