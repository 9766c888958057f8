"""The object `dlo.enable()` returns: statistics, trace export and ordered teardown."""

from __future__ import annotations

import contextlib
import enum
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dlo.backend.auto_residency import AutoResidency
from dlo.backend.disk_tier import DiskTier
from dlo.backend.fp8_compute import Fp8GemmConversion
from dlo.backend.host_tier_choice import HostTierChoice
from dlo.backend.lora_fusion import LoraFusion
from dlo.backend.mapping_registration import NOT_APPLICABLE, RegistrationOutcome, keep_registered, release_mapping
from dlo.backend.outside_use import OutsideUseProbe
from dlo.backend.state_dict_loads import StateDictLoads
from dlo.backend.streamed_saves import StreamedSaves, refuse_saves
from dlo.backend.weight_changes import WeightChanges
from dlo.config import OffloadConfig
from dlo.errors import EnableError, StreamingError
from dlo.host.block_sources import DiskSource
from dlo.host.checkpoint import Checkpoint
from dlo.host.memory_accounting import read_smaps_rollup
from dlo.host.registration import HostRegistration
from dlo.hotpath.compiled_call import CompileWatch, StreamedCallHandle
from dlo.hotpath.rank_local import RankLocalRuntime
from dlo.hotpath.runtime import StreamingRuntime
from dlo.hotpath.staging import Stager
from dlo.hotpath.executors import Executor
from dlo.observe.stats import CompileStats, DiskStats, HostTierStats, OffloadStats
from dlo.observe.trace import write_chrome_trace
from dlo.planning.offload_plan import BlockRef, OffloadPlan
from dlo.planning.wire_layout import bytes_by_dtype

logger = logging.getLogger(__name__)

# Every module under dlo (roots and blocks) -> a weak reference to its handle. The only state
# dlo keeps about user modules (nothing is attached to them besides hooks). Weak both ways: a
# handle references its module, so a strong value would keep a dropped module alive forever.
_MANAGED: weakref.WeakKeyDictionary[nn.Module, weakref.ref[OffloadHandle]] = weakref.WeakKeyDictionary()
# Modules disabled with restore=False: their streamed blocks hold stand-ins for good.
_EMPTIED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def refuse_if_managed(module: nn.Module) -> None:
    for name, sub in module.named_modules():
        if sub in _EMPTIED:
            raise EnableError(_emptied(module))
        handle = _MANAGED.get(sub)
        if handle is not None and handle() is not None:
            where = f"its submodule {name!r}" if name else "it"
            raise EnableError(
                f"{type(module).__name__} is already under dlo ({where}); call handle.disable() "
                "before enabling it again"
            )


class HandleState(enum.Enum):
    """ENABLED: hooks installed, streamed weights in host buffers and slots.
    DISABLED: a plain module again (terminal; enable() again makes a new handle)."""

    ENABLED = "enabled"
    DISABLED = "disabled"


class OffloadHandle:
    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        config: OffloadConfig,
        plan: OffloadPlan,
        runtime: StreamingRuntime,
        streamed_refs: Sequence[BlockRef],
        streamed_calls: Sequence[StreamedCallHandle],
        managed: Sequence[nn.Module],
        resident_blocks: int,
        device_weight_bytes: int,
        setup_s: float,
        checkpoint: Checkpoint | None = None,
        backing: str = "pinned",
        registration: RegistrationOutcome = NOT_APPLICABLE,
        probe: OutsideUseProbe | None = None,
        residency: AutoResidency | None = None,
        fp8_gemms: Fp8GemmConversion | None = None,
        disk: DiskTier | None = None,
        disk_sources: dict[int, DiskSource] | None = None,
    ) -> None:
        self.module = module
        self.device = device
        self.config = config
        self.plan = plan
        self.state = HandleState.ENABLED
        self._runtime = runtime
        self._ledger = runtime.ledger
        self._managed = list(managed)
        self._resident_blocks = resident_blocks
        self._device_weight_bytes = device_weight_bytes
        self._setup_s = setup_s
        self._checkpoint = checkpoint
        self._backing = backing
        self._registration = registration
        self._final_stats: OffloadStats | None = None
        self._probe = probe  # See [Note: blocks used outside their call]
        self._residency = residency  # See [Note: automatic residency]
        self._fp8_gemms = fp8_gemms  # See [Note: fp8 compute]
        self._disk_budget = disk.tier.budget_bytes if disk is not None else 0  # See [Note: the disk tier]
        self._releases = (
            [block.source.release for block in runtime.blocks]
            + ([runtime.stager.close] if runtime.stager is not None else [])
            + ([runtime.read_ahead.close] if runtime.read_ahead is not None else [])  # after the stager: See [Note: the disk tier]
        )
        # See [Note: stand-ins], [Note: editing a streamed block]; a private copy made for a
        # changed block joins the releases.
        pin = config.pin_memory and device.type == "cuda"
        self._changes = WeightChanges(runtime, list(streamed_refs), self._releases, pin)
        self._fusion = LoraFusion(module, self._changes)  # See [Note: fusing LoRA into streamed blocks]
        self._loads = StateDictLoads(module, self._changes)  # See [Note: loading a state dict while streaming]
        # See [Note: saving a streamed model]
        fp8_compute = fp8_gemms is not None and len(fp8_gemms) > 0
        self._saves = StreamedSaves(module, runtime, self._settle_changes, fp8_compute)
        self._host_tier = None  # See [Note: which blocks stay in RAM]
        if isinstance(runtime, RankLocalRuntime) and runtime.read_ahead is not None:  # an active disk tier
            assert disk is not None and disk_sources
            self._host_tier = HostTierChoice(runtime, disk, disk_sources, pin, self._releases, self._changes, residency)
        self._changes_settled: tuple[StreamingError, ...] | None = None  # by disable(): the refusal it raises
        # By disable(): whether the blocks got their weights back (None: not yet). A call cut short
        # after it must not restore them again (the mapping may be closed) nor decide otherwise.
        self._restored_with: bool | None = None
        self._written_back = False  # by disable(): the resident blocks' values are in their host copies
        self._finalizer: weakref.finalize | None = None
        self._streamed_calls = list(streamed_calls)
        self._block_classes = len({type(call.block) for call in self._streamed_calls})
        self._compile_watch = CompileWatch()
        self._warned_recompiles = False
        self._recompiles_seen = 0  # by the start of the last call
        self._root_hooks: list[RemovableHandle] = []
        self._planned_call = False  # the call in progress counts for resident_layers='auto'

    def activate(self) -> None:
        """enable()'s last step: the handle takes over the module (root hooks, the registry, the
        release at collection). `abandon()` undoes it, also after a partial activation."""
        # A module dropped without disable() must still give its host memory back in order:
        # the driver would otherwise keep pinning pages whose addresses get reused.
        runtime = self._runtime
        self._finalizer = weakref.finalize(
            self, _abandoned, runtime.executor, runtime.stager, self._registration.registration, self._releases,
            self._checkpoint,
        )
        self._finalizer.atexit = False  # at exit the process's memory goes with it
        # Root hooks are bound methods: the module keeps its handle alive through them, even
        # when the caller drops the handle (the registry only holds it weakly). Disabled for
        # dynamo: whole-model compilation must not trace them. See [Note: compiled blocks]
        module = self.module
        self._root_hooks.append(module.register_forward_pre_hook(torch.compiler.disable(self._call_starts)))
        self._root_hooks.append(
            module.register_forward_hook(torch.compiler.disable(self._call_ends), always_call=True)
        )
        for sub in self._managed:
            _MANAGED[sub] = weakref.ref(self)
        self._loads.install()
        self._fusion.install()
        self._saves.install()

    def abandon(self) -> None:
        """Undo activate() for a failed enable(), whose own rollback releases the host memory."""
        if self._finalizer is not None:
            self._finalizer.detach()
        self._loads.remove()
        self._fusion.remove()
        self._saves.remove()
        for hook in self._root_hooks:
            hook.remove()
        for sub in self._managed:
            if (owner := _MANAGED.get(sub)) is not None and owner() is self:
                del _MANAGED[sub]

    def _call_starts(self, module: nn.Module, args: tuple) -> None:
        self._planned_call = False  # until it is known (a refused call is not planned from)
        # First: blocks an interrupted call left pointing at their slots get their stand-ins back
        # (See [Note: one writer per slot]), so the check of the stand-ins sees only changes made
        # between calls.
        self._runtime.start_call()
        self._changes.before_call()
        self._fusion.before_call()
        for call in self._streamed_calls:  # a block compiled since the last call. See [Note: compiled blocks]
            call.keep_installed()
        self._watch_compiles()
        # A call inside handle.editing() sees the blocks it opened as resident, until the edit
        # ends: resident_layers='auto' neither plans nor measures from it.
        self._planned_call = self._residency is not None and not self._changes.edit_open
        if self._planned_call:
            self._residency.call_starts()
        if self._host_tier is not None:
            self._host_tier.call_starts()

    def _settle_changes(self) -> None:
        """What a call's start checks, for a save (See [Note: saving a streamed model]): blocks
        a cut-short change left open written back, changes that missed the streamed weights and
        adapters a direct unmerge lost refused. Running blocks are left as they are: the save
        may come from a hook inside a call."""
        self._changes.before_call()
        self._fusion.restore_lost()

    def real_state_dict(self) -> contextlib.AbstractContextManager[None]:
        """Within it, `module.state_dict()` holds the streamed blocks' values (views of the host
        copies where it can, copies otherwise), not their stand-ins: for code that keeps copies of
        them. See [Note: saving a streamed model]"""
        self._enabled("real_state_dict")
        self._settle_changes()
        return self._saves.real_values(self.module)

    def check_save(self) -> None:
        """Raise the StreamingError `module.save_pretrained()` would raise now, before anything
        is written. See [Note: saving a streamed model]"""
        if self.state is HandleState.ENABLED:
            self._saves.check(type(self.module).__name__)
        elif not self._restored_with:
            raise StreamingError(_emptied(self.module))

    def _watch_compiles(self) -> None:
        """Warn once when one call recompiled more often than there are block classes: a
        graph per block. (Per call: a change of a LoRA scale between calls recompiles each
        class once, which is not that.)"""
        watch = self._compile_watch
        watch.poll()
        seen, self._recompiles_seen = self._recompiles_seen, watch.recompiles
        if watch.recompiles - seen > self._block_classes and not self._warned_recompiles:
            self._warned_recompiles = True
            logger.warning(
                "dlo: torch.compile recompiled %d times in one call for %d streamed block class(es) of %s: dynamo "
                "specializes on something that differs from block to block (first reason: %s). Streaming keeps each "
                "weight's shape, stride and dtype, so blocks of one class share one graph unless their code or inputs "
                "differ; TORCH_LOGS=recompiles lists every reason, handle.stats().compile counts them",
                watch.recompiles - seen,
                self._block_classes,
                type(self.module).__name__,
                watch.recompile_reasons[seen],
            )

    def _call_ends(self, module: nn.Module, args: tuple, output: object) -> None:
        self._runtime.end_call()
        if self._planned_call:
            self._residency.call_ends()
        if self._host_tier is not None:
            self._host_tier.call_ends()

    def device_bytes(self) -> int:
        """The weights dlo holds on the device now: non-block parts, resident blocks, slots (at
        their capacity) and landing buffers."""
        return self._device_weight_bytes + self._runtime.held_bytes

    def hold_beside(self, other_phase_bytes: Callable[[], int]) -> None:
        """resident_layers='auto': another phase of the process, outside the module's calls,
        holds `other_phase_bytes()` on the device beside the module's non-block parts, asked
        when the residency is planned. See AutoResidency.hold_beside"""
        if self._residency is not None:
            self._residency.hold_beside(other_phase_bytes)

    @property
    def residency_budget(self) -> int | None:
        """The device memory budget of resident_layers='auto' in bytes (None otherwise)."""
        return self._residency.budget_bytes if self._residency is not None else None

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disable()

    def _enabled(self, operation: str) -> None:
        if self.state is not HandleState.ENABLED:
            raise StreamingError(
                f"handle.{operation}: the handle is disabled and {type(self.module).__name__} is a plain module "
                "again; change its weights directly"
            )

    def release_slots(self) -> int:
        """Between calls: the slots' device memory goes back to the caching allocator, for the
        rest of the process to use; the next call takes it again as its blocks load (a
        component that runs once per pipeline call: See [Note: pipeline budget]). Resident
        blocks stay. Returns the bytes given back. Not from inside the module's own call (a hook
        of one of its blocks): blocks still marked running are taken as left by an interrupted
        call, and end (a Ctrl-C skips the root hooks that would tell the two apart)."""
        self._enabled("release_slots()")
        if not isinstance(self._runtime, RankLocalRuntime):
            raise StreamingError(
                "handle.release_slots(): in all-gather mode every load is a collective in plan order, so the slots "
                "are kept; stream in rank-local mode (no gather group) to give them back between calls"
            )
        return self._runtime.release_slots()

    def editing(self, *modules: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Between calls, `with handle.editing(block):` gives the streamed blocks holding
        `modules` (a block or any module inside one; none: every streamed block) their real
        values on the device for the body; what the body changes in them (in-place edits,
        `p.data = ...`, PEFT merges) is then written into the blocks' host copies and streamed
        from the next call on. Each open block takes its own device memory, a slot's size.
        See [Note: editing a streamed block]"""
        self._enabled("editing()")
        indices = []
        for module in modules:
            index = self._changes.block_of(module)
            if index is None:
                raise StreamingError(
                    f"handle.editing(): {type(module).__name__} is not a streamed block of {type(self.module).__name__} "
                    "nor inside one; its weights are on the device as they are: change them directly"
                )
            indices.append(index)
        return self._edit(indices if modules else list(range(len(self._runtime.blocks))))

    @contextlib.contextmanager
    def _edit(self, indices: list[int]) -> Iterator[None]:
        # Outermost: PEFT merges made in it, recorded once the blocks are written back. See
        # [Note: fusing LoRA into streamed blocks]
        with self._fusion.editing(indices), self._changes.editing(indices):
            yield

    def fuse_lora(self, lora_scale: float = 1.0, safe_fusing: bool = False, adapter_names: list[str] | None = None) -> None:
        """diffusers' `fuse_lora()` for the streamed module: the LoRA layers' deltas are added to
        the base weights dlo streams (their host copies), and to the other base weights where
        they are. The arguments are diffusers'. Between calls. See [Note: fusing LoRA into
        streamed blocks]"""
        self._enabled("fuse_lora()")
        self._fusion.fuse(lora_scale, safe_fusing, adapter_names)

    def unfuse_lora(self) -> None:
        """diffusers' `unfuse_lora()` for the streamed module. See [Note: fusing LoRA into
        streamed blocks]"""
        self._enabled("unfuse_lora()")
        self._fusion.unfuse()

    def stats(self) -> OffloadStats:
        """Counters since enable(). Synchronizes the device to settle pending copy timings."""
        if self._final_stats is not None:
            return self._final_stats
        runtime = self._runtime
        runtime.drain()
        runtime.executor.synchronize()
        ledger = runtime.ledger
        ledger.settle()
        registered = self._registration.registration
        slot_bytes = runtime.slot_bytes
        device_weight_bytes = self.device_bytes()
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = device_weight_bytes
        return OffloadStats(
            streamed_blocks=len(runtime.blocks) - len(runtime.promoted),
            resident_blocks=self._resident_blocks + len(runtime.promoted),
            bytes_streamed=ledger.bytes_streamed,
            copies=ledger.copies,
            copy_s=ledger.copy_s,
            h2d_gbps=ledger.bytes_streamed / ledger.copy_s / 1e9 if ledger.copy_s > 0 else 0.0,
            exposed_copy_s=ledger.exposed_copy_s,
            demand_loads=runtime.planner.demand_loads,
            peak_device_bytes=peak,
            device_weight_bytes=device_weight_bytes,
            slot_bytes=slot_bytes,
            host_bytes=sum(block.source.host_bytes for block in runtime.blocks),
            pinned=any(block.source.pinned for block in runtime.blocks) or registered is not None,
            backing=self._backing,
            mapped_bytes=self._checkpoint.nbytes if self._checkpoint is not None else 0,
            staging_bytes=runtime.stager.staging_bytes if runtime.stager is not None else 0,
            pack_s=runtime.pack_s,
            gather_group_size=runtime.gather.size if runtime.gather is not None else 1,
            collectives=runtime.gather.collectives if runtime.gather is not None else 0,
            registered_bytes=registered.total_bytes if registered is not None else 0,
            registered_ranges=registered.region_count if registered is not None else 0,
            register_s=self._registration.seconds,
            registration_fallback=self._registration.fallback,
            setup_s=self._setup_s,
            host_memory=read_smaps_rollup(),
            compile=self._compile_stats(),
            residency=self._residency.report() if self._residency is not None else None,
            host_bytes_by_dtype=_host_bytes_by_dtype(runtime),
            rewritten_blocks=self._changes.rewritten_blocks,
            copied_on_write_bytes=self._changes.copied_bytes,
            disk=self._disk_stats(),
        )

    def _disk_stats(self) -> DiskStats | None:
        reads = self._runtime.read_ahead
        if reads is None:
            return None
        if self._host_tier is not None:
            choice = self._host_tier.report
        else:  # all-gather mode: every rank would have to measure alike to move blocks
            choice = HostTierStats(state="kept", note="all-gather mode: the blocks stay where enable() spread them")
        return DiskStats(
            blocks=tuple(self._runtime.blocks[i].name for i in reads.blocks),
            budget_bytes=self._disk_budget,
            read_buffer_bytes=reads.buffer_bytes,
            read_bytes=reads.bytes_read,
            reads=reads.reads,
            read_s=reads.read_s,
            gbps=reads.bytes_read / reads.read_s / 1e9 if reads.read_s > 0 else 0.0,
            wait_s=reads.wait_s,
            direct_io=reads.direct,
            choice=choice,
        )

    def _compile_stats(self) -> CompileStats:
        watch = self._compile_watch
        watch.poll()
        return CompileStats(graphs=watch.graphs, recompiles=watch.recompiles, graph_breaks=watch.graph_breaks)

    def export_trace(self, path: str | Path) -> int:
        """Write the copy/compute timeline as Chrome/Perfetto JSON; returns the event count.
        Needs OffloadConfig(record_timeline=True)."""
        if not self.config.record_timeline:
            raise EnableError("export_trace needs OffloadConfig(record_timeline=True) at enable()")
        self.stats()
        return write_chrome_trace(path, self._ledger.timeline)

    def disable(self, restore: bool = True) -> OffloadStats:
        """Return the module to a plain state; idempotent. Streamed blocks get ordinary CPU
        tensors (their packed host copies, unpinned, or private copies of the mapped
        checkpoint tensors); everything else stays on the device.

        `restore=False`: the blocks get nothing back and the module can no longer run (calling
        it or a streamed block raises StreamingError, and dlo.enable() refuses it; a block's
        submodule called on its own computes on the stand-ins): for a model about to be
        dropped or a process about to exit, where copying every mapped block into private
        memory would only cost time, or more memory than the host has (the disk tier). In
        all-gather mode every rank passes the same value. Once the blocks were given back or
        not, later calls keep that (a call cut short before it decides anew).

        Order: synchronize the device (stats() does), unregister a registered mapping, unpin
        host memory, remove hooks (compiled blocks get their compiled callables back), repoint
        tensors, close the mapping (kept open if it could not be unregistered: see [Note:
        mapping lifetime]), free the slots. Destroy process groups only after this returned.
        Returns the final statistics."""
        if self.state is HandleState.DISABLED:
            assert self._final_stats is not None
            return self._final_stats
        if self._changes_settled is None:  # once, also when a disable() cut short is called again
            refused = []  # the module is disabled first, then the first is raised
            try:
                self._runtime.release_running()  # blocks an interrupted call left on their slots
                self._changes.before_call()  # See [Note: stand-ins]
            except StreamingError as err:
                refused.append(err)
            try:
                self._fusion.restore_lost()  # See [Note: fusing LoRA into streamed blocks]
            except StreamingError as err:
                refused.append(err)
            self._changes_settled = tuple(refused[:1])
        if restore and self._restored_with is None and not self._written_back:
            self._changes.write_back_resident()  # See [Note: editing a streamed block]
            self._written_back = True
        runtime = self._runtime
        try:
            with torch.no_grad():
                runtime.close_call()  # before the releases: its loads may read from disk
        except StreamingError:  # the rank broke off: restore_blocks() raises why, after the releases
            pass
        final = self.stats()  # synchronizes the device: nothing queued reads host memory after it
        registered = self._registration.registration
        errors = _release_host_memory(registered, self._releases)
        for hook in (*self._streamed_calls, *self._root_hooks):
            hook.remove()
        if self._probe is not None:
            self._probe.remove()
        self._loads.remove()
        self._fusion.remove()
        self._saves.remove()
        if self._restored_with is None:
            with torch.no_grad():
                runtime.restore_blocks(weights=restore)
            self._restored_with = restore
        if self._restored_with and self._fp8_gemms is not None:
            self._fp8_gemms.dequantize_back()
        if runtime.gather is not None:
            runtime.gather.close()  # after restore_blocks(): its collectives are watched too
        if self._checkpoint is not None:
            failures = release_mapping(self._checkpoint, registered)
            if failures:
                errors.append(f"cudaHostUnregister failed ({'; '.join(failures)}), so the mapping stays open")
        assert self._finalizer is not None  # activated by enable()
        self._finalizer.detach()  # only now: if a step above raised, it still releases at collection
        for sub in self._managed:
            _MANAGED.pop(sub, None)
        self._root_hooks.clear()
        self._streamed_calls.clear()
        self._final_stats = final
        if not self._restored_with:  # last: a call cut short before it and made again decides anew
            _refuse_calls(self.module, [self.module.get_submodule(block.name) for block in runtime.blocks])
        self.state = HandleState.DISABLED
        # Drop every reference to the runtime: its slots, promoted blocks, views and events
        # are freed now, not when the caller drops this handle.
        runtime.promoted.clear()
        self._runtime = self._probe = self._residency = None  # type: ignore[assignment]
        self._changes = self._fusion = self._loads = self._saves = None  # type: ignore[assignment]
        if errors:
            raise EnableError("disable() could not release host memory: " + "; ".join(errors))
        if self._changes_settled:
            raise self._changes_settled[0]
        return final


def _refuse_calls(module: nn.Module, blocks: list[nn.Module]) -> None:
    """After disable(restore=False): a call of the module or of a streamed block raises
    instead of computing on the blocks' stand-ins."""

    @torch.compiler.disable  # a compiled block runs it too, and raises this error, not dynamo's
    def refuse(called: nn.Module, args: object) -> None:
        raise StreamingError(_emptied(module))

    _EMPTIED.add(module)
    for target in (module, *blocks):
        target.register_forward_pre_hook(refuse)
    streamed = {id(t) for block in blocks for t in (*block.parameters(), *block.buffers())}
    refuse_saves(module, streamed, _emptied(module))


def _emptied(module: nn.Module) -> str:
    return (
        f"{type(module).__name__} was disabled with restore=False: its streamed blocks hold no weights; "
        "load the model again"
    )


def _release_host_memory(registration: HostRegistration | None, releases: list[Callable[[], None]]) -> list[str]:
    """After the device is synchronized: unregister the mapping, unpin private and staging
    buffers. Returns the errors; the bytes stay valid (their tensors keep them alive)."""
    if registration is not None:
        registration.close()  # failed ranges are kept and retried when the mapping closes
    errors = []
    for release in releases:
        try:
            release()
        except EnableError as err:
            errors.append(str(err))
    return errors


def _abandoned(
    executor: Executor,
    stager: Stager | None,
    registration: HostRegistration | None,
    releases: list[Callable[[], None]],
    checkpoint: Checkpoint | None,
) -> None:
    """The handle was collected without disable(): nothing can run the module any more, but
    copies issued before (a prefetch for the next call) may still be in flight, and staged
    loads may still be queued. Stop the stager first (no copy can be enqueued after it),
    then wait for the device, then release in disable()'s order. If waiting fails (a broken
    device), nothing is released: the driver may still be copying from that memory. See
    [Note: mapping lifetime]"""
    try:
        if stager is not None:
            stager.stop()
        executor.synchronize()
    except Exception as err:  # a finalizer cannot raise to anyone
        keep_registered(registration, releases, checkpoint)
        logger.error("dlo: dropped handle: device synchronize failed (%s); its host memory stays pinned", err)
        return
    _release_host_memory(registration, releases)
    if checkpoint is not None:
        release_mapping(checkpoint, registration)


def _host_bytes_by_dtype(runtime: StreamingRuntime) -> dict[str, int]:
    total: dict[str, int] = {}
    for block in runtime.blocks:
        for name, nbytes in bytes_by_dtype(block.layout, block.wire).items():
            total[name] = total.get(name, 0) + nbytes
    return total
