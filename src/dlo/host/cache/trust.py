"""Whether a cache root and its entries can be trusted with the weights a process will run.

A cache directory that other users can write to could plant weights; a root on tmpfs would
double host memory (the point is one copy in the page cache of a local disk), and network
filesystems do not give flock and page sharing the guarantees the protocol relies on.

Every directory dlo makes under the root gets DIR_MODE and every file FILE_MODE explicitly:
the umask decides nothing, so the trust check of the next use cannot fail on what dlo wrote.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
# Flags for every file dlo opens under the root: a planted symlink is refused (ELOOP) instead
# of followed, no child process inherits a lock or a hold, and a planted FIFO cannot block
# the open (fstat then refuses anything but a regular file).
SAFE_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

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


def stat_reason(what: object, info: os.stat_result) -> str | None:
    """Why a file or directory with this (l)stat must not be trusted, or None."""
    if stat.S_ISLNK(info.st_mode):
        return f"{what} is a symlink"
    if info.st_uid != os.getuid():
        return f"{what} belongs to uid {info.st_uid}, not to this user ({os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others (mode {stat.filemode(info.st_mode)})"
    return None


def untrusted_reason(path: Path) -> str | None:
    """Why `path` (a directory or file of the cache) must not be trusted, or None."""
    try:
        info = os.lstat(path)
    except OSError as err:
        return f"{path}: {err}"
    return stat_reason(path, info)


def private_dir_reason(path: Path, create: bool) -> str | None:
    """Why the cache directory `path` cannot be used, or None. With `create`, a missing one
    is made with DIR_MODE (then chmod'ed: mkdir's mode passes through the umask); failing to
    make it raises the OSError (a full disk is not a matter of trust)."""
    if create:
        try:
            os.mkdir(path, DIR_MODE)
            os.chmod(path, DIR_MODE, follow_symlinks=False)
        except FileExistsError:
            pass
    reason = untrusted_reason(path)
    if reason is None and not stat.S_ISDIR(os.lstat(path).st_mode):
        reason = f"{path} is not a directory"
    return reason


def root_refusal(root: Path, allow_any_filesystem: bool, create: bool = True) -> str | None:
    """Why the cache root cannot be used, or None. With `create`, a missing root is made
    (its missing parents too, with the umask's modes: they are not the cache's), unless its
    filesystem is refused: that is known from the mount table before anything is created."""
    if not create and not os.path.lexists(root):
        return f"the cache root {root} does not exist (check --cache-dir / OffloadConfig.cache_dir)"
    kind = filesystem_type(root)
    if kind in REFUSED_FILESYSTEMS and not allow_any_filesystem:
        return (
            f"the cache root {root} is on {kind} ({REFUSED_FILESYSTEMS[kind]}); put OffloadConfig.cache_dir on a "
            "local disk (cache_allow_any_filesystem=True overrides, for tests)"
        )
    try:
        if create:
            root.parent.mkdir(parents=True, exist_ok=True)
        reason = private_dir_reason(root, create)
    except OSError as err:
        return f"cannot create the cache root {root}: {err}"
    if reason is not None and os.path.islink(root):
        return f"the cache root {root} is a symlink: set --cache-dir / OffloadConfig.cache_dir to {os.path.realpath(root)}"
    return reason
