"""Whether a cache root and its entries can be trusted with the weights a process will run.

A cache directory that other users can write to could plant weights; a root on tmpfs would
double host memory (the point is one copy in the page cache of a local disk), and network
filesystems do not give flock and page sharing the guarantees the protocol relies on.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

REFUSED_FILESYSTEMS = {
    "tmpfs": "tmpfs lives in RAM: entries would cost memory twice",
    "ramfs": "ramfs lives in RAM: entries would cost memory twice",
    "nfs": "a network filesystem", "nfs4": "a network filesystem", "cifs": "a network filesystem",
    "smb3": "a network filesystem", "9p": "a network filesystem", "fuse.sshfs": "a network filesystem",
    "ceph": "a network filesystem", "glusterfs": "a network filesystem", "lustre": "a network filesystem",
}


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (the longest mount point above it)."""
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) >= 3:
                mount_point = fields[1].replace("\\040", " ")
                inside = str(path) == mount_point or str(path).startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, kind = mount_point, fields[2]
    return kind


def untrusted_reason(path: Path) -> str | None:
    """Why `path` (a directory or file of the cache) must not be trusted, or None."""
    try:
        info = os.lstat(path)
    except OSError as err:
        return f"{path}: {err}"
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symlink"
    if info.st_uid != os.getuid():
        return f"{path} belongs to uid {info.st_uid}, not to this user ({os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.filemode(info.st_mode)})"
    return None


def root_refusal(root: Path, allow_any_filesystem: bool) -> str | None:
    """Why the cache root cannot be used, or None. Creates it (mode 0700) if missing."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    reason = untrusted_reason(root)
    if reason is not None:
        return reason
    kind = filesystem_type(root)
    if kind in REFUSED_FILESYSTEMS and not allow_any_filesystem:
        return (
            f"the cache root {root} is on {kind} ({REFUSED_FILESYSTEMS[kind]}); put OffloadConfig.cache_dir on a "
            "local disk (cache_allow_any_filesystem=True overrides, for tests)"
        )
    return None
