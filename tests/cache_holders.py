"""A process caught between the steps of a hold (forked by tests/test_cache_holds.py).

It takes the steps of `dlo.host.cache.holds.hold` one at a time, waiting on a barrier after
each, so the test can look at the cache from another process at every point in between."""

import fcntl
import os
import signal
import uuid
from pathlib import Path

from dlo.host.cache.holds import PENDING


def hold_step_by_step(users: str, barrier) -> None:
    users_dir = Path(users)
    users_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = f"{os.getpid()}.{uuid.uuid4().hex}"
    fd = os.open(users_dir / f"{PENDING}{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    barrier.wait()  # 1: created, not locked yet
    barrier.wait()
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.rename(users_dir / f"{PENDING}{name}", users_dir / name)
    barrier.wait()  # 2: locked and visible
    barrier.wait()  # then exit: the kernel drops the flock, the file stays


def hold_until_killed(root: str, key: str, queue) -> None:
    from dlo.host.cache.entry_store import EntryStore

    EntryStore(root).hold(key)
    queue.put("held")
    while True:
        signal.pause()
