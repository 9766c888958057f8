"""One kernel flock per key, `<root>/.locks/<key>.lock`, that a tidy-up may remove.

[Note: removable lock files]
Removing a lock file races with a process that opened it and waits for its flock: once the
file is gone, a third process creates a new one and two processes "hold the lock" on two
inodes. So a lock counts as taken only if, once flocked, the path still names the inode that
was locked; otherwise it is retried. And a lock file is only ever removed by the holder of
its flock (`KeyLock.remove_file`), so whoever locks the old inode afterwards sees the path gone.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

from dlo.host.cache.trust import FILE_MODE, SAFE_OPEN, stat_reason
from dlo.host.cache.unavailable import CacheUnavailable

POLL_S = 0.05


class KeyLock:
    """`with KeyLock(path, timeout_s):` holds the flock of `path`; raises CacheUnavailable
    with `lock_timeout` or `lock_failed`. A timeout of 0 tries once."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._fd: int | None = None

    def __enter__(self) -> KeyLock:
        deadline = time.monotonic() + self.timeout_s
        while self._fd is None:
            fd = self._open()
            try:
                if not self._flock_until(fd, deadline):
                    raise CacheUnavailable(
                        "lock_timeout", f"{self.path.name} stayed locked by another process for {self.timeout_s} s"
                    )
                if self._still_named(fd):
                    self._fd = fd
            finally:
                if self._fd is None:
                    os.close(fd)
        return self

    def __exit__(self, *exc: object) -> None:
        fd, self._fd = self._fd, None
        os.close(fd)  # closing the last descriptor releases the flock

    def remove_file(self) -> None:
        """Unlink the lock file while holding it. See [Note: removable lock files]."""
        assert self._fd is not None, "only the holder of a lock removes its file"
        self.path.unlink(missing_ok=True)

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | SAFE_OPEN, FILE_MODE)
        except OSError as err:
            raise CacheUnavailable("lock_failed", f"cannot open {self.path}: {err}") from err
        info = os.fstat(fd)
        reason = stat_reason(self.path, info) or (None if stat.S_ISREG(info.st_mode) else f"{self.path} is not a file")
        if reason is not None:
            os.close(fd)
            raise CacheUnavailable("lock_failed", reason)
        return fd

    def _flock_until(self, fd: int, deadline: float) -> bool:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(POLL_S)
            except OSError as err:
                raise CacheUnavailable("lock_failed", f"flock on {self.path}: {err}") from err

    def _still_named(self, fd: int) -> bool:
        try:
            named = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        locked = os.fstat(fd)
        return (named.st_dev, named.st_ino) == (locked.st_dev, locked.st_ino)


def is_held(path: Path) -> bool:
    """Whether a process holds the lock of `path` now. Creates nothing and waits for nothing:
    a missing file is nobody's lock; one that cannot be opened counts as held."""
    try:
        fd = os.open(path, os.O_RDONLY | SAFE_OPEN)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # taken (EWOULDBLOCK), or a filesystem that cannot tell: held
        return True
    finally:
        os.close(fd)  # releases the flock if it was taken
    return False
