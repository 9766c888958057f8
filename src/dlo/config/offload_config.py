"""User policy for one offloaded module: typed, frozen, validated once at construction."""

from __future__ import annotations

import enum
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dlo.errors import ConfigError


def _require_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; `num_slots=True` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"OffloadConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ConfigError(f"OffloadConfig.{name} must be >= {minimum}, got {value}")


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"OffloadConfig.{name} must be True or False, got {value!r}")


class CacheVerify(enum.Enum):
    """How a host weight cache entry is checked before a load maps it (see [Note: stamps])."""

    STAMP = "stamp"  # hash only the files whose stamp changed since the last full validation
    FULL = "full"  # hash every byte


AUTO = "auto"  # resident_layers: chosen from measured costs under a memory budget
GATHER_CHUNK_MIB = 64.0  # gather_chunk_mib's default


class Fp8Scale(enum.Enum):
    """How a quantized weight's fp32 scales are shared (see [Note: fp8 streaming])."""

    PER_CHANNEL = "per_channel"  # one scale per output row of a Linear weight
    PER_TENSOR = "per_tensor"  # one scale for the whole weight


# stream_dtype: accepted spellings -> the torch dtype name stored in the config.
STREAM_DTYPES = {
    "fp8": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
}


def _stream_dtype_name(value: object) -> str | None:
    """The canonical name of a stream dtype given as a torch dtype or a string."""
    if value is None:
        return None
    # A torch dtype exists only once torch is imported: the config does not import it, the
    # command line parses its flags from these fields without it. See [Note: parse before torch]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if isinstance(value, str) and value in STREAM_DTYPES:
        return STREAM_DTYPES[value]
    raise ConfigError(
        f"OffloadConfig.stream_dtype must be None, torch.float8_e4m3fn or torch.float8_e5m2 (or the names "
        f"{sorted(STREAM_DTYPES)}), got {value!r}"
    )


@dataclass(frozen=True)
class OffloadConfig:
    """How dlo streams a module's blocks. Each field's `help` metadata is its documentation
    (the CLI flags are generated from it, one flag per field)."""

    num_slots: int = field(
        default=2,
        metadata={
            "help": "rotating device buffers, each the size of the largest streamed block; 2 overlap one "
            "copy with one block's compute, N copy N-1 blocks ahead"
        },
    )
    resident_layers: int | str = field(
        default=0,
        metadata={
            "help": "keep the first N blocks (execution order) on the device, never streamed; 'auto': measure the "
            "first calls, then keep the blocks (any of them) and slot count that run fastest within hbm_budget_gib",
            "aliases": ("--resident",),
        },
    )
    hbm_budget_gib: float | None = field(
        default=None,
        metadata={
            "help": "with resident_layers='auto': GiB of device memory this process may use at its peak while the "
            "module runs (its weights, slots, activations and whatever else the process keeps there); unset: what "
            "the device has free at enable() plus what this process already holds"
        },
    )
    host_budget_gib: float | str | None = field(
        default=None,
        metadata={
            "help": "GiB of host memory the streamed blocks may hold (blocks kept in RAM plus the disk tier's read "
            "buffers); the other blocks are read from their checkpoint or cache files on every use, with direct "
            "I/O (docs/guides/disk-tier.md); in all-gather mode each block counts as this rank's shard, and only "
            "the shard is read. 'auto': what the cgroup and the machine have available at enable(), less a "
            "reserve. Unset: every streamed block stays in host memory"
        },
    )
    pin_memory: bool = field(
        default=True,
        metadata={"help": "page-lock the host copy of streamed blocks for async copies at link rate (cuda only)"},
    )
    record_timeline: bool = field(
        default=False,
        metadata={"help": "record per-block copy/compute intervals for handle.export_trace()"},
    )
    use_allgather: bool = field(
        default=False,
        metadata={
            "help": "each rank keeps 1/G of every streamed block in pinned host memory (or reads it from the host "
            "weight cache's entry) and the ranks rebuild "
            "blocks with an all-gather (torch.distributed; DP group, else SP group); every rank must run "
            "the blocks in plan order"
        },
    )
    gather_chunk_mib: float = field(
        default=GATHER_CHUNK_MIB,
        metadata={
            "help": "all-gather mode: MiB of a block gathered per collective, so that the next piece's host->device "
            "copy overlaps the gather of this one (0: one collective per block); every rank must use the same value"
        },
    )
    checkpoint_mmap: bool = field(
        default=True,
        metadata={
            "help": "dlo.load_transformer streams blocks straight from the read-only checkpoint mapping "
            "(shared page cache) when the checkpoint can stand in for the runtime tensors"
        },
    )
    host_weight_cache: bool = field(
        default=False,
        metadata={
            "help": "dlo.load_transformer publishes the final weights once per node to a content-addressed "
            "cache and streams from its shared read-only mapping (all-gather mode too: each rank's shards are "
            "views of it)"
        },
    )
    cache_dir: str = field(
        default=str(Path("~/.cache/dlo/host-weights").expanduser()),
        metadata={"help": "root of the host weight cache (local disk)"},
    )
    cache_lock_timeout_s: float = field(
        default=600.0,
        metadata={"help": "seconds to wait for another process publishing the same cache entry"},
    )
    cache_allow_any_filesystem: bool = field(
        default=False,
        metadata={"help": "accept a cache root on tmpfs or a network filesystem (tests only)"},
    )
    pin_limit_gib: float = field(
        default=0.0,
        metadata={
            "help": "most GiB of a checkpoint or host weight cache mapping this process may register (page-lock) "
            "for direct copies; above it blocks stream through staging buffers (0: no ceiling besides the OS's); "
            "in all-gather mode from the cache every rank registers the whole entry"
        },
    )
    pack_threads: int = field(
        default=0,
        metadata={
            "help": "host threads packing mapped blocks into pinned staging buffers (0: every core this "
            "process may use; with several processes per node give each its share)"
        },
    )
    cache_verify: str = field(
        default="stamp",
        metadata={
            "help": "how a load checks a host weight cache entry before mapping it: 'stamp' hashes its files only "
            "when their (device, inode, size, mtime, ctime) changed since the last full check, 'full' hashes every "
            "byte every time (dlo cache verify always does)"
        },
    )

    stream_dtype: str | None = field(
        default=None,
        metadata={
            "help": "store and stream the 2-D weights of every nn.Linear in the streamed blocks as scaled float8 "
            "('fp8' = 'float8_e4m3fn', or 'float8_e5m2'; a torch dtype in Python): half the host memory and "
            "the bytes per load; dequantized in the slot before the block runs. Unset: weights stream as they are"
        },
    )
    fp8_scale: str = field(
        default="per_channel",
        metadata={"help": "with stream_dtype: fp32 scales 'per_channel' (one per output row) or 'per_tensor'"},
    )
    fp8_skip: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "with stream_dtype: regular expressions (re.search on the full parameter name, e.g. "
            "'transformer_blocks.0.', 'ff.net.2'); matching weights keep their dtype. On the command line: "
            "the flag once per pattern"
        },
    )
    fp8_compute: bool = field(
        default=False,
        metadata={
            "help": "with stream_dtype 'fp8' (float8_e4m3fn): run the streamed blocks' bf16 Linears as FP8 GEMMs "
            "(torch._scaled_mm, activations quantized per row) on their float8 weights instead of dequantizing "
            "them; needs compute capability 8.9+ on CUDA and quantizes the model's own weights (not with the host "
            "weight cache; dlo.load_transformer loads the ordinary way)"
        },
    )

    def __post_init__(self) -> None:
        _require_int("num_slots", self.num_slots, minimum=2)
        if isinstance(self.resident_layers, str) and self.resident_layers != AUTO:
            raise ConfigError(f"OffloadConfig.resident_layers must be an int >= 0 or 'auto', got {self.resident_layers!r}")
        if self.resident_layers != AUTO:
            _require_int("resident_layers", self.resident_layers, minimum=0)
        budget = self.hbm_budget_gib
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
                raise ConfigError(f"OffloadConfig.hbm_budget_gib must be a finite number > 0 or None, got {budget!r}")
            if self.resident_layers != AUTO:
                raise ConfigError(
                    f"OffloadConfig.hbm_budget_gib={budget} is the budget of resident_layers='auto'; set "
                    f"resident_layers='auto' (now {self.resident_layers!r}), or leave hbm_budget_gib unset"
                )
        if self.resident_layers == AUTO and self.use_allgather:
            raise ConfigError(
                "OffloadConfig.resident_layers='auto' needs rank-local mode: in all-gather mode every load is a "
                "collective in plan order and blocks cannot change residency. Set use_allgather=False, or "
                "resident_layers to a number"
            )
        self._check_host_budget()
        _require_bool("pin_memory", self.pin_memory)
        _require_bool("record_timeline", self.record_timeline)
        _require_bool("use_allgather", self.use_allgather)
        _require_bool("checkpoint_mmap", self.checkpoint_mmap)
        chunk = self.gather_chunk_mib
        if isinstance(chunk, bool) or not isinstance(chunk, (int, float)) or not math.isfinite(chunk) or chunk < 0:
            raise ConfigError(
                f"OffloadConfig.gather_chunk_mib must be a finite number of MiB >= 0 (0: unchunked), got {chunk!r}"
            )
        if chunk != GATHER_CHUNK_MIB and not self.use_allgather:
            raise ConfigError(
                f"OffloadConfig.gather_chunk_mib={chunk:g} sizes all-gather mode's collectives and does nothing "
                "without it: set use_allgather=True, or leave gather_chunk_mib unset"
            )
        _require_int("pack_threads", self.pack_threads, minimum=0)
        _require_bool("host_weight_cache", self.host_weight_cache)
        _require_bool("cache_allow_any_filesystem", self.cache_allow_any_filesystem)
        modes = [mode.value for mode in CacheVerify]
        if self.cache_verify not in modes:
            raise ConfigError(f"OffloadConfig.cache_verify must be one of {modes}, got {self.cache_verify!r}")
        if not isinstance(self.cache_dir, str) or not self.cache_dir:
            raise ConfigError(f"OffloadConfig.cache_dir must be a non-empty path string, got {self.cache_dir!r}")
        timeout = self.cache_lock_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ConfigError(f"OffloadConfig.cache_lock_timeout_s must be a finite number > 0, got {timeout!r}")
        limit = self.pin_limit_gib
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit < 0:
            raise ConfigError(f"OffloadConfig.pin_limit_gib must be a finite number >= 0, got {limit!r}")
        self._check_fp8()
        if limit > 0 and not (self.host_weight_cache or self.checkpoint_mmap):
            raise ConfigError(
                f"OffloadConfig.pin_limit_gib={limit} limits registration of a checkpoint or cache mapping; it needs "
                "checkpoint_mmap=True or host_weight_cache=True (or leave pin_limit_gib=0)"
            )

    @property
    def gather_chunk_bytes(self) -> int:
        """gather_chunk_mib in bytes (0: unchunked); a tiny positive size stays positive."""
        return math.ceil(self.gather_chunk_mib * 2**20)

    def _check_host_budget(self) -> None:
        budget = self.host_budget_gib
        if budget is not None and budget != AUTO and (
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0
        ):
            raise ConfigError(
                f"OffloadConfig.host_budget_gib must be a finite number of GiB > 0, 'auto' or None, got {budget!r}"
            )
        if budget == AUTO and self.use_allgather:
            raise ConfigError(
                "OffloadConfig.host_budget_gib='auto' measures each rank's free memory at its own moment, so the ranks "
                "of an all-gather group would plan different splits (and each claim the node's memory): give every "
                "rank the same number of GiB (its share of the node), or use_allgather=False"
            )

    def _check_fp8(self) -> None:
        # Frozen: the canonical spelling is stored once, here.
        object.__setattr__(self, "stream_dtype", _stream_dtype_name(self.stream_dtype))
        scales = [mode.value for mode in Fp8Scale]
        if self.fp8_scale not in scales:
            raise ConfigError(f"OffloadConfig.fp8_scale must be one of {scales}, got {self.fp8_scale!r}")
        if isinstance(self.fp8_skip, str) or not isinstance(self.fp8_skip, (tuple, list)):
            raise ConfigError(f"OffloadConfig.fp8_skip must be a tuple of regular expressions, got {self.fp8_skip!r}")
        object.__setattr__(self, "fp8_skip", tuple(self.fp8_skip))
        for pattern in self.fp8_skip:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as err:
                raise ConfigError(f"OffloadConfig.fp8_skip: {pattern!r} is not a regular expression ({err})") from None
        _require_bool("fp8_compute", self.fp8_compute)
        if self.fp8_compute and self.stream_dtype != "float8_e4m3fn":
            found = "it is unset" if self.stream_dtype is None else f"got {self.stream_dtype!r}"
            raise ConfigError(
                f"OffloadConfig.fp8_compute=True needs stream_dtype='fp8' (float8_e4m3fn: what FP8 GEMMs take); {found}"
            )
        if self.fp8_compute and self.host_weight_cache:
            raise ConfigError(
                "OffloadConfig.fp8_compute=True quantizes the model's own weights at enable(); it does not stream "
                "from the host weight cache yet: set host_weight_cache=False"
            )
        if self.stream_dtype is None and (self.fp8_skip or self.fp8_scale != Fp8Scale.PER_CHANNEL.value):
            raise ConfigError(
                "OffloadConfig.fp8_scale and fp8_skip shape fp8 streaming; set stream_dtype (e.g. 'fp8'), or leave "
                "them at their defaults"
            )
