"""Changes to a streamed module's weights after enable(): each reaches the host copy dlo
streams from, or is refused with a StreamingError before any weight dlo streams changed.

[Note: stand-ins]
Between its calls a streamed block's tensors point at stand-ins: one 0-d tensor per dtype on
the device, NaN (bytes of 0xFF for uint8: a GGUF weight's packed bytes, whose float16 scales
then are NaN; 0 for other integers), expanded to each tensor's shape. Shape, dtype and device
are the real ones, which is what PEFT (placing a new adapter beside its base weight) and
diffusers' LoRA loaders (comparing a LoRA's shapes with the model's) read. Every stride is 0:
no memory of its own, and torch refuses most writes into it ("more than one element of the
written-to tensor refers to a single memory location") before changing anything; a read
gives NaN, never a plausible wrong weight (PEFT's safe merge refuses a NaN result). What
torch lets through, an in-place op that bumps the tensor's version counter (`p.zero_()`) or
a new tensor assigned (`p.data = x`, a cast by `.to(dtype)` / `.half()`, a move by
`.to(device)`), is found before the next call starts (`WeightChanges.before_call`, a version
and an address compared per tensor) and refused: the tensor is pointed back at its stand-in,
so the next call runs the weights dlo streams, unchanged, and the StreamingError names the
weight and the way to change it. disable() refuses the same way after it finished. (Not
found: a write into the stand-in through `.data`, such as `p.data.fill_(v)`, which bumps no
counter and leaves the address; it changes no weight.)

[Note: editing a streamed block]
The changes that work (`handle.editing()`, `load_state_dict`, `fuse_lora()`) open the
block first: it is promoted (its own device memory, laid out like a slot, filled from its
host copy), so its tensors hold real values on the device and the change runs as it runs on
the resident model, with its kernels. When the change ends, the device memory is read back
and the host copy rewritten from it (See [Note: rewriting a host copy]): a private buffer in
place, a mapping copied on write, float8 weights requantized where they changed. Then the
block streams again from the new copy; no slot keeps its old bytes (`discard_loaded`). A
block dlo keeps resident (used outside its call, or resident_layers='auto') is already open:
its device memory is its weight, and edits to it between calls, through any API, are real;
its host copy is rewritten from the device memory at the next edit and at disable(). In
all-gather mode a block is opened by gathering it (a collective: every rank opens the same
blocks in the same order, as it makes the same edit) and each rank rewrites its shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from dlo.backend.block_binding import stand_in_value
from dlo.errors import StreamingError
from dlo.host.block_rewrite import Rewrite, load_image, old_image, rewrite, rewrite_in_place
from dlo.host.block_sources import PackedSource, ShardedSource
from dlo.host.fp8_codec import dequantize_into
from dlo.host.pinned_buffer import aligned_empty
from dlo.hotpath.interrupts import interrupts_held
from dlo.hotpath.lockstep import LockstepRuntime
from dlo.hotpath.runtime import StreamingRuntime
from dlo.hotpath.streamed_block import StreamedBlock
from dlo.planning.block_layout import TensorSpec, view_placement
from dlo.planning.offload_plan import BlockRef
from dlo.planning.wire_layout import landing_views


@dataclass(frozen=True)
class _Opened:
    """A block opened for a change: `memory` holds its values on the device (laid out like a
    slot). `gathered`: all-gather mode, its whole image as the group gathered it. `kept`: it
    was resident before (and stays so)."""

    memory: torch.Tensor
    gathered: torch.Tensor | None
    kept: bool


class WeightChanges:
    """Opens streamed blocks for a change and writes the change into their host copies;
    finds and refuses the changes that would be lost. See [Note: stand-ins], [Note: editing a
    streamed block]"""

    def __init__(
        self, runtime: StreamingRuntime, refs: list[BlockRef], releases: list, pin: bool
    ) -> None:
        """`refs`: the streamed blocks, in the runtime's order. `releases`: the handle's list of
        host-memory releases, which a private copy made here joins. `pin`: page-lock those."""
        self._runtime = runtime
        self._refs = refs
        self._releases = releases
        self._pin = pin
        self._open: dict[int, _Opened] = {}
        self._editing = False  # inside editing(): its blocks stay open through calls made in it
        self._versions = [self._versions_of(i) for i in range(len(refs))]
        self._stand_in_addresses = [[t.data_ptr() for t in block.placeholders] for block in runtime.blocks]
        self.rewritten_blocks = 0  # host copies rewritten since enable()
        self.rewritten: set[int] = set()  # blocks whose host copy may differ from its file
        # Blocks whose last change was dropped (its write-back failed): it streams as before it,
        # so what PEFT recorded during it (merged adapters) is taken back by its caller.
        self.dropped: set[int] = set()
        self.copied_bytes = 0  # private bytes made for blocks of a read-only mapping

    @property
    def runtime(self) -> StreamingRuntime:
        return self._runtime

    @property
    def refs(self) -> list[BlockRef]:
        return self._refs

    def _versions_of(self, index: int) -> list[int]:
        return [tensor._version for tensor in self._runtime.blocks[index].tensors]

    def block_of(self, module: nn.Module) -> int | None:
        """The index of the streamed block `module` is or lies in; None for any other module."""
        for index, ref in enumerate(self._refs):
            if any(sub is module for sub in ref.module.modules()):
                return index
        return None

    def is_open(self, index: int) -> bool:
        return index in self._open

    @property
    def edit_open(self) -> bool:
        """Inside handle.editing(): its blocks are resident only until it ends."""
        return self._editing

    def kept_resident(self, index: int) -> bool:
        """Whether block `index` is resident for good (not only opened for an edit): its
        device memory is its weight, and changes to it through any API are real."""
        return index in self._runtime.promoted and (index not in self._open or self._open[index].kept)

    @contextlib.contextmanager
    def opened(self, index: int) -> Iterator[None]:
        """Block `index` open for the body, then written back (also when it raised); one
        already open (an edit in progress) stays as it is, for its edit to close."""
        if index in self._open:
            yield
            return
        self.open(index)
        try:
            yield
        finally:
            self.close(index)

    def open(self, index: int) -> None:
        """Give block `index` real values on the device until `close(index)`. Between calls."""
        if index in self._open:
            return
        runtime = self._runtime
        block = runtime.blocks[index]
        kept = index in runtime.promoted
        if isinstance(block.source, ShardedSource):
            assert isinstance(runtime, LockstepRuntime)
            gathered = runtime.gathered(index)
            memory = aligned_empty(block.layout.nbytes, runtime.executor.device)
            views = load_image(memory, gathered, block.layout, block.wire)
            runtime.discard_loaded([index])
            block.point_at(views)
            self._open[index] = _Opened(memory, gathered, kept=False)
            return
        if not kept:
            runtime.discard_loaded([index])  # first: no copy still reads the host copy about to change
            runtime.promote(index)
        self._open[index] = _Opened(runtime.promoted[index], None, kept)

    def close(self, index: int) -> None:
        """Write block `index`'s values into its host copy, then stream it again (unless it
        was resident before). The block is closed even when writing fails."""
        opened = self._open[index]
        # One held step: a Ctrl-C waits until the change is in the host copy and the block
        # streams again with its stand-ins' versions recorded. Cut between those, the change
        # was dropped (the block streamed its old host copy) or the next call took the
        # stand-ins' new versions for a write that missed the weights.
        with interrupts_held():
            try:
                self._write_back(index, opened)
            except BaseException:
                if not opened.kept:  # a kept block's device memory holds the change still
                    self.dropped.add(index)
                raise
            finally:
                del self._open[index]
                block = self._runtime.blocks[index]
                if opened.gathered is not None:
                    block.point_at(block.placeholders)
                elif not opened.kept:
                    self._runtime.demote(index)
                self._versions[index] = self._versions_of(index)

    @contextlib.contextmanager
    def editing(self, indices: Iterable[int]) -> Iterator[None]:
        """Blocks `indices` open for the body, then written back (also when it raised: what
        it changed is what the resident model would have changed). See [Note: editing a
        streamed block]"""
        if self._editing:
            raise StreamingError("handle.editing() is already open: finish that edit before starting another")
        self.close_all()
        opened = []
        self._editing = True
        try:
            for index in sorted(set(indices)):
                self.open(index)
                opened.append(index)
            yield
        finally:
            self._editing = False
            failures = []
            for index in opened:
                try:
                    self.close(index)
                except Exception as failure:  # every block is closed; the first failure is raised
                    failures.append(failure)
            if failures:
                raise failures[0]

    def _write_back(self, index: int, opened: _Opened) -> None:
        runtime = self._runtime
        block = runtime.blocks[index]
        _gather_assigned(block, opened.memory)
        in_place = isinstance(block.source, PackedSource) and not block.wire.quantized
        self.rewritten.add(index)  # first: its host copy may differ from its file from here on
        with interrupts_held():  # a private copy made is either streamed and released, or never made
            try:
                if in_place:
                    done = rewrite_in_place(block.source, block.wire, opened.memory)
                else:
                    done = self._rewrite_on_host(block, opened)
            except torch.OutOfMemoryError:
                if not in_place:
                    raise
                done = self._rewrite_on_host(block, opened)  # no device room to compare: the host way needs none
            if done is None:
                return
            if done.source is not block.source:
                runtime.replace_source(index, done.source)
                self._releases.append(done.source.release)
            else:
                runtime.discard_loaded([index])
            self.rewritten_blocks += 1
            self.copied_bytes += done.copied_bytes
        if opened.kept and done.requantized:  # the device copy streams nothing: it must equal a load
            views = tuple(view_placement(opened.memory, p) for p in block.layout.placements)
            landed = landing_views(done.image[block.wire.plain_bytes :].to(opened.memory.device), block.wire)
            for k in done.requantized:
                q = block.wire.quantized[k]
                dequantize_into(views[q.index], *landed[k])

    def _rewrite_on_host(self, block: StreamedBlock, opened: _Opened) -> Rewrite | None:
        values = opened.memory.cpu()
        old = old_image(block.source, block.layout, block.wire, opened.gathered)
        return rewrite(block.source, old, block.layout, block.wire, values, block.name, self._pin)

    def close_all(self) -> None:
        """Close the blocks a change cut short (an exception in load_state_dict) left open:
        what it changed stays, as on the resident model."""
        for index in list(self._open):
            self.close(index)

    def write_back_resident(self) -> None:
        """disable(): the host copies of the blocks kept resident get what their device memory
        holds (changed between calls or not, through any API). See [Note: editing a streamed
        block]"""
        for index, memory in list(self._runtime.promoted.items()):
            if index not in self._open:
                self._write_back(index, _Opened(memory, None, kept=True))

    def before_call(self) -> None:
        """Before a call (and in disable()): blocks a cut-short change left open are written
        back; a change that missed the weights dlo streams is refused. See [Note: stand-ins]"""
        if not self._editing:
            self.close_all()
        runtime = self._runtime
        refused: list[str] = []
        for index, block in enumerate(runtime.blocks):
            # Blocks an interrupt left running still point at their slots; the call's start frees them.
            if index in runtime.promoted or index in self._open or runtime.is_running(index):
                continue
            tensors = block.tensors
            versions, addresses = [t._version for t in tensors], [t.data_ptr() for t in tensors]
            if versions == self._versions[index] and addresses == self._stand_in_addresses[index]:
                continue  # the per-call path: two lists compared per block
            changed = [
                k
                for k, (tensor, stand_in) in enumerate(zip(tensors, block.placeholders))
                if versions[k] != self._versions[index][k] or addresses[k] != stand_in.data_ptr()
            ]
            refused.extend(
                _what_changed(block.name, block.layout.placements[k].spec, tensors[k], block.placeholders[k])
                for k in changed
            )
            block.point_at(block.placeholders)
            for k in changed:  # an in-place write into the stand-in changed its one element
                _refill(block.placeholders[k])
            self._versions[index] = self._versions_of(index)
        if refused:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            raise StreamingError(
                f"{refused[0]}{more} after dlo.enable(): between calls a streamed block's weights are stand-ins, so "
                "the change never reached the weights dlo streams and was dropped; the call runs them unchanged. "
                "Change streamed weights with module.load_state_dict(...), fuse_lora() / unfuse_lora(), or "
                "inside `with handle.editing(block):`; to cast or move the model, disable() first and enable() again"
            )


def _refill(stand_in: torch.Tensor) -> None:
    stand_in.fill_(stand_in_value(stand_in.dtype))


def _gather_assigned(block: StreamedBlock, memory: torch.Tensor) -> None:
    """Tensors of an open block given a new tensor (`p.data = x`) get their value copied into
    the block's memory and point at it again; one of another shape, dtype or device is
    refused, the block left as it was."""
    views = tuple(view_placement(memory, p) for p in block.layout.placements)
    moved = [k for k, (t, v) in enumerate(zip(block.tensors, views)) if t.data_ptr() != v.data_ptr() or t.stride() != v.stride()]
    for k in moved:
        tensor, view = block.tensors[k], views[k]
        if (tensor.shape, tensor.dtype, tensor.device) != (view.shape, view.dtype, view.device):
            block.point_at(views)
            spec = block.layout.placements[k].spec
            raise StreamingError(
                f"{_what_changed(block.name, spec, tensor, view)}; block {block.name!r} was left as it was. A streamed "
                "weight keeps its shape, dtype and device: disable() first to change them"
            )
    with torch.no_grad():
        for k in moved:
            views[k].copy_(block.tensors[k].detach())
    block.point_at(views)


def _what_changed(block: str, spec: TensorSpec, tensor: torch.Tensor, stand_in: torch.Tensor) -> str:
    name = f"{block}.{spec.name}"
    if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
        become = f"{str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)}"
        return f"{name!r} became {become} (a cast, .to(dtype) or .half(), which changed the non-streamed weights too)"
    if tensor.device != stand_in.device:
        return f"{name!r} moved to {tensor.device} (.to(device), .cpu(), which moved the non-streamed weights too)"
    return f"{name!r} was written in place or given a new tensor (p.mul_(...), p.data = ...)"
