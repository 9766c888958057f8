"""What `handle.stats()` returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from dlo.host.memory_accounting import HostMemory


@dataclass(frozen=True)
class CompileStats:
    """torch.compile activity since `enable()`, from dynamo's process-wide counters (other
    models compiled meanwhile count too). graphs: graphs compiled. recompiles: frames compiled
    again because their guards failed (streaming blocks through the slots causes none).
    graph_breaks: the breaks dynamo reports, those at dlo's block boundaries under whole-model
    compilation included (a few per model, not per block or call: see [Note: compiled
    blocks]); none inside a block."""

    graphs: int = 0
    recompiles: int = 0
    graph_breaks: int = 0


@dataclass(frozen=True)
class ResidencyStats:
    """resident_layers='auto' (see [Note: automatic residency]). state: "measuring" until the
    measured call ended, then "planned", or "kept" when no plan was applied (`note` says why).
    budget_bytes: the device memory the process may use at its peak. activation_bytes: the
    measured call's peak minus the module's weights and slots on the device then (activations
    and whatever else the process held). resident: the
    blocks chosen (names, execution order); num_slots / slot_bytes: the slots streaming the
    rest. predicted_call_s: the model's seconds per call for that choice; measured_call_s:
    the median of the calls since (None before one ran). link_gbps / block_compute_s: what
    the measured call gave the model (per block, execution order)."""

    state: str
    budget_bytes: int
    activation_bytes: int | None = None
    resident: tuple[str, ...] = ()
    num_slots: int | None = None
    slot_bytes: int | None = None
    predicted_call_s: float | None = None
    measured_call_s: float | None = None
    link_gbps: float | None = None
    block_compute_s: tuple[float, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class HostTierStats:
    """Which blocks stay in host memory under host_budget_gib, chosen from a measured call
    (See [Note: which blocks stay in RAM]). state: "measuring" (the blocks as enable() spread
    them) until the measured call ended, then "chosen", or "kept" when no choice was applied
    (`note` says why; always in all-gather mode, which makes no choice). predicted_call_s: the model's seconds per call for the choice;
    measured_call_s: the measured call's, on the blocks of before, and predicted_before_s the
    model's for those; disk_gbps: the disk's rate in it; moved_to_disk / moved_to_ram: the
    blocks the choice moved (names; none when no split was predicted faster enough)."""

    state: str
    predicted_call_s: float | None = None
    predicted_before_s: float | None = None
    measured_call_s: float | None = None
    disk_gbps: float | None = None
    moved_to_disk: tuple[str, ...] = ()
    moved_to_ram: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class DiskStats:
    """The disk tier (See [Note: the disk tier]). blocks: the streamed blocks read from their
    files on every use (names, execution order); budget_bytes: host_budget_gib in bytes;
    read_buffer_bytes: the buffers they are read into. read_bytes / reads: what was read
    (file bytes, alignment included) in how many block reads; read_s: the reads' summed
    duration, and gbps the rate during them; wait_s: time loads waited for a read (exposed
    when the compute stream waits on those loads: see exposed_copy_s). direct_io: every file
    read with O_DIRECT (False: the file system refused it, and pages are dropped after each
    read instead). choice: how the blocks on disk were chosen (HostTierStats)."""

    blocks: tuple[str, ...]
    budget_bytes: int
    read_buffer_bytes: int
    read_bytes: int
    reads: int
    read_s: float
    gbps: float
    wait_s: float
    direct_io: bool
    choice: HostTierStats = HostTierStats(state="measuring")


@dataclass(frozen=True)
class OffloadStats:
    """Counters since `enable()`.

    streamed_blocks / resident_blocks: the blocks streamed now, and those on the device for
        good (resident_layers, blocks used outside their call, resident_layers='auto''s
        choice); together every block of the plan.
    bytes_streamed / copies: block copies into device slots (prefetched or on demand).
    copy_s: summed duration of those copies.
    h2d_gbps: the achieved rate, bytes_streamed / copy_s / 1e9.
    exposed_copy_s: time the compute stream waited for a block that had not landed yet,
        i.e. copy time not hidden behind compute (on "cpu" every copy is exposed).
    demand_loads: copies issued when a block started without having been prefetched (the
        first block of the first call, and every time the call order changed).
    peak_device_bytes: CUDA: torch.cuda.max_memory_allocated since enable. CPU: the weight
        bytes dlo keeps on the device (no allocator to ask).
    device_weight_bytes: non-streamed parts + resident blocks + slots (+ the two landing
        buffers of blocks with float8 weights: See [Note: fp8 landing]).
    host_bytes: private host copies of the streamed blocks.
    pinned: whether those are page-locked.
    host_bytes_by_dtype: the streamed blocks' host bytes (private or mapped) by dtype name,
        without padding: with OffloadConfig.stream_dtype, the float8 weights and their
        float32 scales appear here (see [Note: fp8 streaming]).
    backing: where the streamed blocks live on the host: "pinned" or "pageable" (private
        packed copies), "checkpoint_mmap", "host_weight_cache" (shared read-only mappings),
        or "shards" (all-gather mode: this rank's 1/G; "host_weight_cache shards" when they are
        views of the node's cache entry).
    mapped_bytes: size of the read-only checkpoint mapping blocks stream from (shared page
        cache, not private memory).
    staging_bytes: the pinned staging buffers those loads pack into.
    pack_s: host time spent packing them (in background threads, overlapping copies and
        compute).
    registered_bytes / registered_ranges / register_s: the checkpoint or cache mapping
        registered read-only with the driver (docs/guides/host-weight-cache.md): blocks are then copied straight
        from its shared pages, and staging_bytes is 0.
    registration_fallback: why the mapping is not registered ("" when it is, when no mapping
        is streamed, or on the CPU).
    gather_group_size / collectives: all-gather mode's group size (1: rank-local or a group
        of one) and the collectives issued (block all-gathers and per-call agreements); in
        that mode bytes_streamed counts this rank's shards, what crossed its own link.
    host_memory: this process's smaps_rollup (Pss, Pss_File, Private_Dirty, Shared_Clean)
        when stats() was called; None where /proc is not available.
    slot_bytes: the most device memory the slots hold at once.
    setup_s: seconds enable() took.
    compile: torch.compile activity since enable() (see CompileStats).
    residency: what resident_layers='auto' measured and chose (None otherwise).
    rewritten_blocks: streamed blocks whose host copy a weight change rewrote since enable()
        (fuse_lora, load_state_dict, handle.editing(); see [Note: rewriting a host copy]).
    copied_on_write_bytes: private host bytes made for changed blocks of a read-only mapping
        (checkpoint, cache entry, or its shards), which is never written; in host_bytes too.
    disk: the disk tier under host_budget_gib (None without one: every block in host memory).
    """

    streamed_blocks: int
    resident_blocks: int
    bytes_streamed: int
    copies: int
    copy_s: float
    h2d_gbps: float
    exposed_copy_s: float
    demand_loads: int
    peak_device_bytes: int
    device_weight_bytes: int
    slot_bytes: int
    host_bytes: int
    pinned: bool
    backing: str
    mapped_bytes: int
    staging_bytes: int
    pack_s: float
    registered_bytes: int
    registered_ranges: int
    register_s: float
    registration_fallback: str
    gather_group_size: int
    collectives: int
    setup_s: float
    host_memory: HostMemory | None
    compile: CompileStats = CompileStats()
    residency: ResidencyStats | None = None
    host_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    rewritten_blocks: int = 0
    copied_on_write_bytes: int = 0
    disk: DiskStats | None = None
