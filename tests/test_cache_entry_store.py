"""The host weight cache's on-disk protocol: atomic publication under flock, validation of
every byte, crash safety, concurrent writers (docs/guides/host-weight-cache.md)."""

import fcntl
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dlo.config.offload_config import CacheVerify
from dlo.host.cache.entry_store import CacheUnavailable, Entry, EntryStore
from dlo.host.cache.identity import CONTENT, content_digest, digest_of
from dlo.host.cache.manifest import MANIFEST, Rejection, RejectionKind
from dlo.host.safetensors_file import PAD_PREFIX

sys.path.insert(0, str(Path(__file__).parent))
import cache_writers  # noqa: E402
from child_processes import child_context  # noqa: E402

KEY = digest_of(cache_writers.IDENTITY)  # a manifest's identity must hash to its key


def publish(root, key=KEY, **kwargs):
    tensors = cache_writers.tensors()
    return EntryStore(root).publish(key, tensors, cache_writers.IDENTITY, shard_bytes=2 * 2**20, **kwargs)


def read_back(entry):
    loaded = {}
    for name in entry.manifest["files"]:
        loaded.update(load_file(entry.path / name))
    return {name: tensor for name, tensor in loaded.items() if not name.startswith(PAD_PREFIX)}


def test_publish_then_validate_round_trip(tmp_path):
    entry = publish(tmp_path)
    assert entry.path == tmp_path / "v1" / KEY
    assert len(entry.manifest["files"]) == 6  # 12 tensors of 1 MiB, 2 MiB shards
    expected = cache_writers.tensors()
    assert set(read_back(entry)) == set(expected)
    assert all(torch.equal(read_back(entry)[n], t) for n, t in expected.items())
    validated = EntryStore(tmp_path).validate(KEY)
    assert validated.manifest == entry.manifest
    assert not list((tmp_path / ".tmp").iterdir())


def test_an_existing_valid_entry_is_reused_without_writing(tmp_path):
    first = publish(tmp_path)
    stamp = (first.path / MANIFEST).stat().st_mtime_ns
    second = publish(tmp_path)
    assert second.manifest == first.manifest and (first.path / MANIFEST).stat().st_mtime_ns == stamp


def _flip_byte(path):
    shard = sorted(path.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _truncate(path):
    shard = sorted(path.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])


def _edit_manifest(path):
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["total_bytes"] += 1
    name = next(iter(manifest["files"]))
    manifest["files"][name]["sha256_chunked"] = "0" * 64
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("corrupt", "kind"),
    [
        (_flip_byte, RejectionKind.DIGEST_MISMATCH),
        (_truncate, RejectionKind.SIZE_MISMATCH),
        (_edit_manifest, RejectionKind.DIGEST_MISMATCH),
        (lambda p: (p / "extra.bin").write_bytes(b"x"), RejectionKind.FILES_DIFFER),
        (lambda p: sorted(p.glob("*.safetensors"))[0].unlink(), RejectionKind.FILES_DIFFER),
        (lambda p: (p / MANIFEST).write_text("{"), RejectionKind.MANIFEST_UNREADABLE),
    ],
)
def test_a_corrupted_entry_is_detected_and_rebuilt_under_the_lock(tmp_path, corrupt, kind):
    entry = publish(tmp_path)
    corrupt(entry.path)
    found = EntryStore(tmp_path).validate(KEY)
    assert isinstance(found, Rejection) and found.kind is kind
    rebuilt = publish(tmp_path)
    assert isinstance(EntryStore(tmp_path).validate(KEY), Entry)
    assert all(torch.equal(read_back(rebuilt)[n], t) for n, t in cache_writers.tensors().items())


def test_a_held_lock_times_out_without_writing(tmp_path):
    (tmp_path / ".locks").mkdir(parents=True)
    holder = os.open(tmp_path / ".locks" / f"{KEY}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(CacheUnavailable) as raised:
            publish(tmp_path, lock_timeout_s=0.3)
        assert raised.value.code == "lock_timeout"
        assert not (tmp_path / "v1" / KEY).exists()
    finally:
        os.close(holder)


def test_a_writer_removes_every_temp_dir_of_its_key_under_the_lock(tmp_path):
    """Under the key's lock no other writer of the key is at work, whatever pid a temp dir
    names (a dead one; this live one: a writer of another PID namespace, or a reused pid);
    other keys' temp dirs are not its to judge."""
    dead = child_context().Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    stale = tmp_path / ".tmp" / f"{KEY}.{dead.pid}.0123"
    alive_pid = tmp_path / ".tmp" / f"{KEY}.{os.getpid()}.4567"
    other_key = tmp_path / ".tmp" / f"{'b' * 64}.{dead.pid}.89"
    for path in (stale, alive_pid, other_key):
        path.mkdir(parents=True)
    publish(tmp_path)
    assert not stale.exists() and not alive_pid.exists() and other_key.exists()


def test_a_writers_lock_that_cannot_be_probed_counts_as_held(tmp_path):
    """ls must never call a writer at work dead: a lock file it cannot open (here a symlink,
    refused by name) counts as held, so the temp dir is not listed."""
    publish(tmp_path)
    temp = tmp_path / ".tmp" / f"{KEY}.1.0123"
    temp.mkdir()
    lock = tmp_path / ".locks" / f"{KEY}.lock"
    assert [left.path for left in EntryStore(tmp_path).leftovers()] == [temp]  # nobody holds it
    lock.unlink(missing_ok=True)
    lock.symlink_to("/dev/null")
    assert EntryStore(tmp_path).leftovers() == []


@pytest.mark.parametrize("content", ["of these tensors", "of other tensors"])
def test_a_full_validation_hashes_the_mapped_tensors_against_the_identitys_content_digest(tmp_path, content):
    """Every file's digest can match its manifest while the manifest's identity names other
    content (a writer's bug, or a consistent edit): a full validation catches it."""
    tensors = {"a": torch.arange(8.0), "b": torch.ones(4)}
    named = tensors if content == "of these tensors" else {"a": torch.zeros(8), "b": torch.ones(4)}
    identity = {"name": "x", CONTENT: content_digest(named)}
    key = digest_of(identity)
    EntryStore(tmp_path).publish(key, tensors, identity)
    found = EntryStore(tmp_path).validate(key, CacheVerify.FULL)
    if content == "of these tensors":
        assert isinstance(found, Entry)
        found.checkpoint.close()
    else:
        assert isinstance(found, Rejection) and found.kind is RejectionKind.DIGEST_MISMATCH
        assert "do not hash to the identity's content digest" in found.detail


def _start_writers(root, count):
    context = child_context()
    queue = context.Queue()
    writers = [context.Process(target=cache_writers.publish, args=(str(root), KEY, queue)) for _ in range(count)]
    for writer in writers:
        writer.start()
    return writers, queue


def test_concurrent_publishers_produce_one_entry_that_all_map(tmp_path):
    writers, queue = _start_writers(tmp_path, 4)
    results = [queue.get(timeout=120) for _ in writers]
    for writer in writers:
        writer.join(timeout=30)
    assert {path for path, _ in results} == {str(tmp_path / "v1" / KEY)}
    assert len({pid for _, pid in results}) == 1  # exactly one of them wrote it
    assert [p.name for p in (tmp_path / "v1").iterdir()] == [KEY]
    assert isinstance(EntryStore(tmp_path).validate(KEY), Entry)


def test_a_writer_killed_at_random_points_never_leaves_a_visible_partial_entry(tmp_path):
    randomness = random.Random(7)
    context = child_context()
    caught_mid_write = 0
    for round_ in range(10):
        root = tmp_path / f"round{round_}"
        queue = context.Queue()
        writer = context.Process(target=cache_writers.publish_after_ready, args=(str(root), KEY, queue), daemon=True)
        writer.start()
        assert queue.get(timeout=120) == "ready"
        time.sleep(randomness.uniform(0.0, 0.25))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(timeout=30)
        temps = list((root / ".tmp").iterdir()) if (root / ".tmp").exists() else []
        caught_mid_write += bool(temps)
        entry_dir = root / "v1" / KEY
        assert not entry_dir.exists() or isinstance(EntryStore(root).validate(KEY), Entry)  # none, or whole
        publish(root)  # the next process succeeds and removes the dead writer's temp dir
        assert isinstance(EntryStore(root).validate(KEY), Entry)
        assert not list((root / ".tmp").iterdir())
    assert caught_mid_write >= 3  # the kills did land inside publication, not only around it


def test_a_full_disk_fails_cleanly_with_insufficient_disk(small_filesystem):
    root = small_filesystem("size=1m,mode=0700")
    with pytest.raises(CacheUnavailable) as raised:
        publish(root)  # 12 MiB of tensors for 1 MiB of room: refused by the free-space check
    assert raised.value.code == "insufficient_disk"
    assert not (root / "v1" / KEY).exists()
    assert not list((root / ".tmp").iterdir())


def test_the_free_space_check_counts_the_padding_of_the_block_layout(small_filesystem):
    root = small_filesystem("size=128m,mode=0700")
    tensors = {"a": torch.ones(4), "b": torch.ones(4)}  # 32 bytes, 100 MiB apart in their image
    with pytest.raises(CacheUnavailable) as raised:
        EntryStore(root).publish(KEY, tensors, cache_writers.IDENTITY, images=[{"a": 0, "b": 100 * 2**20}])
    assert raised.value.code == "insufficient_disk"
    assert not (root / "v1" / KEY).exists()


def test_running_out_of_space_mid_write_fails_cleanly_with_insufficient_disk(small_filesystem):
    # Bytes to spare, but 8 inodes: the root, .locks, the lock file, .tmp, v1 and the temp dir
    # take 6, two shards the last 2, and creating the third fails with a real ENOSPC.
    root = small_filesystem("size=128m,nr_inodes=8,mode=0700")
    with pytest.raises(CacheUnavailable) as raised:
        publish(root)  # 6 shards of 2 MiB
    assert raised.value.code == "insufficient_disk" and "No space left on device" in raised.value.reason
    assert not (root / "v1" / KEY).exists()
    assert not list((root / ".tmp").iterdir())  # the two written shards went with their temp dir


def test_file_digests_cover_every_chunk_of_every_file(tmp_path):
    import hashlib

    from dlo.host.cache.entry_store import HASH_CHUNK, file_digests

    big, small = tmp_path / "big", tmp_path / "small"
    data = os.urandom(HASH_CHUNK + 10)
    big.write_bytes(data)
    small.write_bytes(b"")
    chunks = [hashlib.sha256(data[:HASH_CHUNK]).digest(), hashlib.sha256(data[HASH_CHUNK:]).digest()]
    expected = [hashlib.sha256(b"".join(chunks)).hexdigest(), hashlib.sha256(hashlib.sha256(b"").digest()).hexdigest()]
    with open(big, "rb") as big_file, open(small, "rb") as small_file:
        assert file_digests([big_file, small_file], threads=2) == expected
    flipped = bytearray(data)
    flipped[-1] ^= 1  # in the second chunk
    big.write_bytes(bytes(flipped))
    with open(big, "rb") as big_file:
        assert file_digests([big_file], threads=2)[0] != expected[0]


def test_an_io_error_while_hashing_is_a_reason_not_an_exception(tmp_path, monkeypatch):
    import errno

    from dlo.host.cache import entry_store

    publish(tmp_path)

    def failing_map(handle):  # the disk failing under the entry (EIO): injected, no real fault
        raise OSError(errno.EIO, "Input/output error", handle.name)

    monkeypatch.setattr(entry_store, "_map_descriptor", failing_map)
    found = EntryStore(tmp_path).validate(KEY)
    assert found.kind is RejectionKind.IO_FAILED and "[Errno 5] Input/output error" in found.detail
