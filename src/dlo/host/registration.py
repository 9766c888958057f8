"""Registering host memory with the device driver, all or nothing (docs/guides/host-weight-cache.md).

Platform-neutral: a `RegistrationDriver` does the platform calls; `HostRegistration` owns the
policy. Ranges are page-aligned and merged only within one backing file, checked against the
ceiling before any driver call, read ahead where they are not in memory (`read_ahead`),
registered read-only one by one; any failure unregisters what was registered, in reverse, and
reports why, so the caller keeps its staging path. An interrupt (Ctrl-C, SystemExit) is
rolled back the same way and re-raised as it is: it stops the run. If that rollback itself
fails, startup must abort: the driver may still own memory the caller would otherwise unmap.

The CUDA driver is `dlo.backend.cuda_registration`; `dlo.backend.mapping_registration` applies
this to a host weight cache mapping at enable() and owns the mapping's lifetime.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dlo.errors import DloError

READ_ONLY = 0x08  # cudaHostRegisterReadOnly: default flags on a file mapping break page sharing


class RegistrationError(DloError):
    """Registration was refused or failed; nothing is registered (use the staging path)."""


class RegistrationCleanupError(DloError):
    """Unregistering failed: some memory may still belong to the driver. Abort startup and do
    not unmap those ranges; `registration` still lists them (its close() retries)."""

    def __init__(self, message: str, registration: HostRegistration) -> None:
        super().__init__(message)
        self.registration = registration


@dataclass(frozen=True)
class HostRange:
    """A page-aligned range [start, end) of one backing file's mapping."""

    file: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def coalesce(pieces: Iterable[tuple[str, int, int]], page: int) -> list[HostRange]:
    """(file, address, nbytes) pieces -> page-aligned ranges, overlapping or adjacent ones
    merged, but never across two files (each file is its own mapping)."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for file, address, nbytes in pieces:
        if nbytes > 0:
            start = address - address % page
            end = -(-(address + nbytes) // page) * page
            by_file.setdefault(file, []).append((start, end))
    merged: list[HostRange] = []
    for file, spans in by_file.items():
        spans.sort()
        current_start, current_end = spans[0]
        for start, end in spans[1:]:
            if start <= current_end:
                current_end = max(current_end, end)
            else:
                merged.append(HostRange(file, current_start, current_end))
                current_start, current_end = start, end
        merged.append(HostRange(file, current_start, current_end))
    return merged


PROBE_BYTES = 8 << 20  # one page of each region this large tells whether it is in memory
ADVICE_FLOOR_BYTES = 128 << 10  # the usual least read_ahead_kb and max_sectors_kb of a disk


@functools.cache
def advice_bytes(device: int) -> int:
    """How much of one WILLNEED call the kernel reads on the block device `device` (st_dev):
    max(read_ahead_kb, max_sectors_kb) of its queue (a partition's is its disk's); where
    that is not known (no sysfs queue: network or virtual filesystems), the usual floor.
    Pieces of this size have every byte read, and as few calls as that allows."""
    node = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    for queue in (node / "queue", node / ".." / "queue"):
        try:
            limits = [int((queue / name).read_text()) << 10 for name in ("read_ahead_kb", "max_sectors_kb")]
        except (OSError, ValueError):
            continue
        return max(ADVICE_FLOOR_BYTES, min(max(limits), PROBE_BYTES))
    return ADVICE_FLOOR_BYTES


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library with mincore and madvise typed, or None where there is none (then
    nothing is read ahead)."""
    try:
        libc = ctypes.CDLL(None)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    except (OSError, TypeError, AttributeError):
        return None
    return libc if hasattr(mmap, "MADV_WILLNEED") else None


def read_ahead(ranges: Sequence[HostRange]) -> None:
    """Have the kernel read the ranges' pages that are not in memory, all at once, before
    they are registered. cudaHostRegister faults a cold file mapping in page by page, one disk
    read after another; advised first, the kernel queues the reads together (4 GiB cold on a
    virtio disk, 15 paired runs: faulted in at 0.6-1.7 GB/s, advised then faulted in at
    1.0-2.2 GB/s, faster in 12, about equal in 3). A region whose last page is in memory is
    skipped (its last: a file's first page, its header, is in memory once the file was
    opened), so a hot 4 GiB costs ~3 ms. Advice only, so results are not checked: the driver
    faults in whatever was not read."""
    libc = _libc()
    if libc is None:
        return
    resident = ctypes.c_ubyte()
    for host_range in ranges:
        try:
            piece = advice_bytes(os.stat(host_range.file).st_dev)
        except OSError:  # not a file (a test's stand-in): the floor
            piece = ADVICE_FLOOR_BYTES
        for start in range(host_range.start, host_range.end, PROBE_BYTES):
            end = min(start + PROBE_BYTES, host_range.end)
            if libc.mincore(end - mmap.PAGESIZE, mmap.PAGESIZE, ctypes.byref(resident)) == 0 and resident.value & 1:
                continue
            for advised in range(start, end, piece):
                libc.madvise(advised, min(piece, end - advised), mmap.MADV_WILLNEED)


class RegistrationDriver(Protocol):
    def read_only_supported(self) -> bool: ...

    def register(self, address: int, nbytes: int, flags: int) -> int: ...  # 0: success

    def unregister(self, address: int) -> int: ...  # 0: success

    def is_registered(self, address: int) -> bool: ...

    def clear_error(self, code: int) -> None: ...  # clear the pending error `code` left, only it

    def error_name(self, code: int) -> str: ...


class HostRegistration:
    """Registered ranges, created all or nothing, released in reverse by close()."""

    def __init__(
        self, driver: RegistrationDriver, ranges: Sequence[HostRange], limit_bytes: int, probes: Sequence[int] = ()
    ) -> None:
        """`probes`: addresses (e.g. every mapped tensor's) that must read as registered."""
        self._driver = driver
        total = sum(r.nbytes for r in ranges)
        if limit_bytes and total > limit_bytes:
            raise RegistrationError(
                f"registering {total} bytes exceeds the registration ceiling ({limit_bytes / 2**30:g} GiB)"
            )
        self._ranges: list[HostRange] = []
        in_flight: HostRange | None = None
        try:
            if not driver.read_only_supported():
                raise RegistrationError("the device does not support read-only host registration (attribute 113)")
            read_ahead(ranges)  # registering pins every page: have the missing ones read at once
            for host_range in ranges:
                in_flight = host_range
                code = driver.register(host_range.start, host_range.nbytes, READ_ONLY)
                in_flight = None
                if code != 0:
                    driver.clear_error(code)
                    raise RegistrationError(
                        f"registering {host_range.nbytes} bytes of {host_range.file} failed: {driver.error_name(code)}"
                    )
                self._ranges.append(host_range)
            unregistered = [hex(a) for a in probes if not driver.is_registered(a)]
            if unregistered:
                raise RegistrationError(f"{len(unregistered)} mapped tensors do not read as pinned: {unregistered[:3]}")
        except BaseException as err:
            if in_flight is not None and self._maybe_registered(in_flight):
                self._ranges.append(in_flight)  # Ctrl-C is raised once the call returns: it may have succeeded
            failures = self.close()
            if failures:
                raise RegistrationCleanupError(
                    f"rollback after a failed registration ({err}) could not unregister: {'; '.join(failures)}", self
                ) from err
            if isinstance(err, RegistrationError) or not isinstance(err, Exception):
                raise  # Ctrl-C or SystemExit, rolled back, still stops the run
            raise RegistrationError(f"host registration failed: {err!r}") from err

    def _maybe_registered(self, host_range: HostRange) -> bool:
        """Whether the range may be registered; where the driver cannot tell, it counts as
        registered: unregistering it then fails, and the caller keeps the mapping open."""
        try:
            return self._driver.is_registered(host_range.start)
        except Exception:
            return True

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self._ranges)

    @property
    def region_count(self) -> int:
        return len(self._ranges)

    def close(self) -> list[str]:
        """Unregister in reverse order; idempotent. Returns the failures, whose ranges are
        kept so a later close() retries them; their mappings must stay open until then."""
        failures, kept = [], []
        for host_range in reversed(self._ranges):
            try:
                code = self._driver.unregister(host_range.start)
            except Exception as err:  # a driver that raises is a failure like any other
                code = repr(err)
            if code != 0:
                failures.append(f"{host_range}: {code if isinstance(code, str) else self._driver.error_name(code)}")
                kept.append(host_range)
        self._ranges = list(reversed(kept))
        return failures
