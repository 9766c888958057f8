"""Holds: which processes use a cache entry, so eviction never removes one in use.

A hold is a file of the process's own under `<root>/.users/<key>/`, flocked (shared) for as
long as the process maps the entry; the kernel drops the flock when the process dies.

[Note: hold visibility]
A hold file becomes visible under its final name `<pid>.<uuid>` only once it is flocked: it
is created as `.pending.<pid>.<uuid>`, locked, then renamed. So a visible hold whose flock can
be taken is proved dead, and only such files (and pending ones left unlocked for longer than
any hold takes) are ever removed. A pending file counts as a user for its first
PENDING_GRACE_S seconds even when unlocked: its process is between creating and locking it.
Its age, not its pid, tells: a cache shared by containers (PID namespaces) sees pids that are
not its own. A pending file that vanishes while a sweep looks at it is looked up again under
its final name: the rename may have just happened. Removing a pending file never removes a
user: its process then fails to rename it and does not use the entry. A process that holds a
key before it validates or publishes the entry cannot lose the entry to an eviction that
counted users before the hold appeared: the eviction's rename of the entry then comes first,
and the validation sees no entry.
"""

from __future__ import annotations

import enum
import fcntl
import os
import time
import uuid
from pathlib import Path

from dlo.host.cache.trust import FILE_MODE, SAFE_OPEN, private_dir_reason
from dlo.host.cache.unavailable import CacheUnavailable, failure_code

PENDING = ".pending."
PENDING_GRACE_S = 60.0  # creating and locking a hold file takes microseconds


class HoldState(enum.Enum):
    LIVE = "live"  # flocked, or pending for less than PENDING_GRACE_S
    DEAD = "dead"  # proved: its flock was free (and, if pending, for PENDING_GRACE_S)
    GONE = "gone"  # removed by someone else while we looked


def is_hold_name(name: str) -> bool:
    """Whether `name` is one dlo gives hold files, pending or not (other files are neither
    counted nor removed)."""
    parts = name.removeprefix(PENDING).split(".")
    return len(parts) == 2 and parts[0].isdigit() and len(parts[1]) == 32


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
        except OSError as err:
            os.close(fd)
            (users / f"{PENDING}{name}").unlink(missing_ok=True)
            raise CacheUnavailable("cache_operation_failed", f"cannot hold {users.name}: {err}") from err
        return fd
    raise CacheUnavailable("cache_operation_failed", f"{users} kept disappearing while holding it")


def record_use(path: Path) -> None:
    """Set the modification time of `path` (created, FILE_MODE, in a trusted directory) to now:
    the entry's "last used" time, the order in which `dlo cache gc` evicts. A file of its own,
    which only this function changes: the hold directory's time also moves when a dead hold in
    it is removed (every `gc` removes them), which would reorder the eviction."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | SAFE_OPEN, FILE_MODE)
    except OSError as err:
        raise CacheUnavailable(failure_code(err), f"cannot record the use of {path.name}: {err}") from err
    try:
        os.utime(fd)
    finally:
        os.close(fd)


def last_use(path: Path) -> float | None:
    """The time `record_use(path)` last ran, or None if it never did."""
    try:
        return os.stat(path, follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return None


def _state(path: Path, remove_dead: bool) -> HoldState:
    pending = path.name.startswith(PENDING)
    try:
        fd = os.open(path, os.O_RDONLY | SAFE_OPEN)
    except FileNotFoundError:
        if pending:  # renamed into place since the listing? See [Note: hold visibility]
            return _state(path.with_name(path.name.removeprefix(PENDING)), remove_dead)
        return HoldState.GONE
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return HoldState.LIVE
        if pending and time.time() - os.fstat(fd).st_mtime < PENDING_GRACE_S:
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
    return [_state(users / name, remove_dead) for name in names if is_hold_name(name)]


def count_users(users: Path) -> int:
    """How many processes hold the entry; changes nothing (`dlo cache ls`)."""
    return hold_states(users, remove_dead=False).count(HoldState.LIVE)


def sweep(users: Path, remove_dir: bool) -> int:
    """Remove the holds proved dead (and, with `remove_dir`, the directory once empty);
    returns the number of live users."""
    live = hold_states(users, remove_dead=True).count(HoldState.LIVE)
    if not live and remove_dir:
        try:
            users.rmdir()  # fails if a hold appeared meanwhile: then it stays
        except OSError:
            pass
    return live
