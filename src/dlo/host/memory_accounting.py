"""Host memory of a process tree from /proc/<pid>/smaps_rollup: what is private, what is
shared page cache. Summed Pss counts a page shared by N processes once in total."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

import psutil

_FIELDS = {"Pss": "pss", "Pss_File": "pss_file", "Private_Dirty": "private_dirty", "Shared_Clean": "shared_clean", "Rss": "rss"}


@dataclass(frozen=True)
class HostMemory:
    """Bytes. pss: proportional set size (shared pages split among their users); pss_file:
    the file-backed part of it (mmap'd checkpoints); private_dirty: memory only this process
    wrote (private copies of weights land here); shared_clean: unmodified pages others map too."""

    rss: int = 0
    pss: int = 0
    pss_file: int = 0
    private_dirty: int = 0
    shared_clean: int = 0

    def __add__(self, other: HostMemory) -> HostMemory:
        return HostMemory(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def read_smaps_rollup(pid: int | None = None) -> HostMemory | None:
    """One process; None where the kernel does not provide smaps_rollup (not Linux, or gone)."""
    path = Path(f"/proc/{pid or os.getpid()}/smaps_rollup")
    try:
        text = path.read_text()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in _FIELDS:
            values[_FIELDS[key]] = int(rest.split()[0]) * 1024  # kB
    return HostMemory(**values)


def process_tree_memory(pid: int | None = None) -> HostMemory:
    """The process and all its descendants, summed."""
    root = psutil.Process(pid or os.getpid())
    total = HostMemory()
    for process in [root, *root.children(recursive=True)]:
        measured = read_smaps_rollup(process.pid)
        if measured is not None:
            total = total + measured
    return total
