"""Holds: which processes use a cache entry, so eviction never removes one in use.

A hold is a file of the process's own under `<root>/.users/<key>/`, flocked (shared) for as
long as the process maps the entry; the kernel drops the flock when the process dies.

[Note: hold visibility]
A hold file becomes visible under its final name `<pid>.<uuid>` only once it is flocked: it
is created as `.pending.<pid>.<uuid>`, locked, then renamed. So a visible hold whose flock can
be taken is proved dead, and only such files (and pending ones whose pid is gone) are ever
removed. A pending file of a live pid counts as a user even when unlocked: its process is
between creating and locking it. A process that holds a key before it validates or publishes
the entry cannot lose the entry to an eviction that counted users before the hold appeared:
the eviction's rename of the entry then comes first, and the validation sees no entry.
"""

from __future__ import annotations

import enum
import fcntl
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from dlo.host.cache.trust import FILE_MODE, SAFE_OPEN, private_dir_reason
from dlo.host.cache.unavailable import CacheUnavailable, failure_code

PENDING = ".pending."


class HoldState(enum.Enum):
    LIVE = "live"  # flocked, or pending in a live process
    DEAD = "dead"  # proved: its flock was free (and, if pending, its pid is gone)
    GONE = "gone"  # removed by someone else while we looked


@dataclass(frozen=True)
class HoldName:
    pid: int
    pending: bool


def parse_hold_name(name: str) -> HoldName | None:
    """The pid a hold file's name gives and whether it is still pending; None if the name
    is not one dlo writes (such files are neither counted nor removed)."""
    pending = name.startswith(PENDING)
    parts = name.removeprefix(PENDING).split(".")
    if len(parts) != 2 or not parts[0].isdigit() or len(parts[1]) != 32:
        return None
    return HoldName(int(parts[0]), pending)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def hold(users: Path) -> int:
    """Mark the entry whose hold directory is `users` (in a trusted `.users`) in use by this
    process until the returned descriptor is closed. See [Note: hold visibility]."""
    for _ in range(3):  # a tidy-up may remove the (empty) directory between mkdir and create
        name = f"{os.getpid()}.{uuid.uuid4().hex}"
        try:
            reason = private_dir_reason(users, create=True)
            if reason is not None:
                raise CacheUnavailable("invalid_configuration", reason)
            fd = os.open(users / f"{PENDING}{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL | SAFE_OPEN, FILE_MODE)
        except FileNotFoundError:
            continue
        except OSError as err:
            raise CacheUnavailable(failure_code(err), f"cannot create a hold in {users}: {err}") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.rename(users / f"{PENDING}{name}", users / name)
            os.utime(users)  # "last used"
        except OSError as err:
            os.close(fd)
            (users / f"{PENDING}{name}").unlink(missing_ok=True)
            raise CacheUnavailable("cache_operation_failed", f"cannot hold {users.name}: {err}") from err
        return fd
    raise CacheUnavailable("cache_operation_failed", f"{users} kept disappearing while holding it")


def _state(path: Path, remove_dead: bool) -> HoldState:
    parsed = parse_hold_name(path.name)
    try:
        fd = os.open(path, os.O_RDONLY | SAFE_OPEN)
    except FileNotFoundError:
        return HoldState.GONE
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return HoldState.LIVE
        if parsed.pending and pid_alive(parsed.pid):
            return HoldState.LIVE  # between its creation and its flock
        if remove_dead:
            path.unlink(missing_ok=True)  # under our exclusive flock: nobody holds it
        return HoldState.DEAD
    finally:
        os.close(fd)


def hold_states(users: Path, remove_dead: bool) -> list[HoldState]:
    """The state of every hold file under `users` (none if it does not exist); with
    `remove_dead`, the ones proved dead are removed."""
    try:
        names = os.listdir(users)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [_state(users / name, remove_dead) for name in names if parse_hold_name(name) is not None]


def count_users(users: Path) -> int:
    """How many processes hold the entry; changes nothing (`dlo cache ls`)."""
    return hold_states(users, remove_dead=False).count(HoldState.LIVE)


def sweep(users: Path, remove_dir: bool) -> int:
    """Remove the holds proved dead (and, with `remove_dir`, the directory once empty; it
    keeps the entry's "last used" time otherwise); returns the number of live users."""
    live = hold_states(users, remove_dead=True).count(HoldState.LIVE)
    if not live and remove_dir:
        try:
            users.rmdir()  # fails if a hold appeared meanwhile: then it stays
        except OSError:
            pass
    return live
