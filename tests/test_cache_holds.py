"""Holds (docs/guides/host-weight-cache.md): an entry in use is never evicted, whatever the interleaving of a
process taking a hold with another listing or evicting; only holds proved dead are removed."""

import fcntl
import multiprocessing
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import torch

from dlo.cli.main import main
from dlo.host.cache import holds
from dlo.host.cache.entry_store import EntryStore
from dlo.host.cache.holds import PENDING, PENDING_GRACE_S
from dlo.host.cache.identity import digest_of

sys.path.insert(0, str(Path(__file__).parent))
import cache_holders  # noqa: E402

# fork: the children start at once (spawn would import torch again); the parent holds no
# hold of its own for them to inherit.
CONTEXT = multiprocessing.get_context("fork")


def published(root):
    key = digest_of({"name": "held"})
    EntryStore(root).publish(key, {"w": torch.ones(4)}, {"name": "held"})
    return key


def hold_files(root, key):
    users = root / ".users" / key
    return sorted(p.name for p in users.iterdir()) if users.exists() else []


def test_a_hold_being_taken_is_never_removed_by_listing_or_eviction(tmp_path, capsys):
    key = published(tmp_path)
    store = EntryStore(tmp_path)
    barrier = CONTEXT.Barrier(2, timeout=60)
    holder = CONTEXT.Process(target=cache_holders.hold_step_by_step, args=(str(tmp_path / ".users" / key), barrier))
    holder.start()
    try:
        barrier.wait()  # the holder created its file and has not locked it yet
        (pending,) = hold_files(tmp_path, key)
        assert pending.startswith(PENDING)
        assert main(["cache", "ls", "--cache-dir", str(tmp_path)]) == 0
        assert capsys.readouterr().out.splitlines()[2].rstrip().endswith("1")  # in use by 1
        assert store.users(key) == 1 and not store.evict(key)
        assert hold_files(tmp_path, key) == [pending] and store.keys() == [key]
        barrier.wait()
        barrier.wait()  # locked, then renamed into place
        (visible,) = hold_files(tmp_path, key)
        assert not visible.startswith(PENDING)
        assert store.users(key) == 1 and not store.evict(key)
        assert hold_files(tmp_path, key) == [visible] and store.keys() == [key]
        barrier.wait()
    finally:
        holder.join(timeout=60)
    assert hold_files(tmp_path, key) == [visible]  # the dead holder's file stays...
    assert store.evict(key)  # ...until an eviction proves it dead
    assert store.keys() == [] and not (tmp_path / ".users" / key).exists()


def test_a_pending_hold_is_judged_by_its_age_not_its_pid(tmp_path):
    """A process of another container (PID namespace) between creating and locking its hold
    file: its pid is not alive here, yet it is a user; once the file is older than any hold
    takes to lock, it is dead."""
    key = published(tmp_path)
    gone = CONTEXT.Process(target=os.getpid)
    gone.start()
    gone.join()
    users = tmp_path / ".users" / key
    users.mkdir(mode=0o700, parents=True)
    pending = users / f"{PENDING}{gone.pid}.{'0' * 32}"
    pending.touch()
    store = EntryStore(tmp_path)
    assert store.users(key) == 1 and not store.evict(key)
    assert hold_files(tmp_path, key) == [pending.name] and store.keys() == [key]
    past = time.time() - PENDING_GRACE_S - 1
    os.utime(pending, (past, past))
    assert store.users(key) == 0 and store.evict(key) and not users.exists()


def test_a_hold_renamed_into_place_while_eviction_looks_at_it_is_counted(tmp_path, monkeypatch):
    """The holder locks its pending file and renames it between the eviction's listing and its
    look at that file: the file is looked up again under its final name."""
    key = published(tmp_path)
    users = tmp_path / ".users" / key
    users.mkdir(mode=0o700, parents=True)
    name = f"{os.getpid()}.{uuid.uuid4().hex}"
    holder = os.open(users / f"{PENDING}{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    look = holds._state

    def holder_steps_first(path, remove_dead):
        if path.name == f"{PENDING}{name}":  # after the listing, before the look
            fcntl.flock(holder, fcntl.LOCK_SH)
            os.rename(path, users / name)
        return look(path, remove_dead)

    monkeypatch.setattr(holds, "_state", holder_steps_first)
    store = EntryStore(tmp_path)
    try:
        assert not store.evict(key)
        assert hold_files(tmp_path, key) == [name] and store.keys() == [key] and store.users(key) == 1
    finally:
        os.close(holder)
    assert store.evict(key) and store.keys() == []


def test_a_killed_holder_is_proved_dead_and_a_live_one_kept(tmp_path, capsys):
    key = published(tmp_path)
    queue = CONTEXT.Queue()
    args = (str(tmp_path), key, queue)
    holders = [CONTEXT.Process(target=cache_holders.hold_until_killed, args=args) for _ in range(2)]
    for holder in holders:
        holder.start()
    assert [queue.get(timeout=60) for _ in holders] == ["held", "held"]
    os.kill(holders[0].pid, signal.SIGKILL)
    holders[0].join(timeout=30)
    try:
        assert len(hold_files(tmp_path, key)) == 2
        assert main(["cache", "gc", "--max-size", "0", "--cache-dir", str(tmp_path)]) == 1
        assert f"kept {key[:16]}: in use" in capsys.readouterr().out
        assert [name.split(".")[0] for name in hold_files(tmp_path, key)] == [str(holders[1].pid)]
    finally:
        os.kill(holders[1].pid, signal.SIGKILL)
        holders[1].join(timeout=30)
    assert main(["cache", "rm", key, "--cache-dir", str(tmp_path)]) == 0
    assert not (tmp_path / ".users" / key).exists()
