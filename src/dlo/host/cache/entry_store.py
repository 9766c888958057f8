"""The on-disk protocol of the host weight cache (docs/guides/host-weight-cache.md): immutable, content-addressed
entries published atomically and validated byte for byte before use.

Layout under the cache root (every directory DIR_MODE, every file FILE_MODE, see trust.py):
    v1/<key>/model-0000i-of-0000N.safetensors + manifest.json   published entries
    .locks/<key>.lock                                            one flock per key
    .tmp/<key>.<pid>.<uuid>/                                     a writer's work in progress
    .tmp/<key>.corrupt.<uuid>/, .tmp/<key>.evicted.<uuid>/       moved aside, removed by gc
    .users/<key>/<pid>.<uuid>                                    holds (see holds.py)
    .stamps/<key>.json                                           file stamps (see stamps.py)
    sources/<digest>.json                                        warm start hints (source_index.py)

[Note: publication]
An entry becomes visible only by one atomic rename of a complete, fsync'ed directory, made
by the holder of the key's flock. So a reader sees no entry or a whole one: a writer killed
at any point leaves at most a temp dir, which the next lock holder removes once its pid is
gone. Readers validate without the lock (entries never change in place); a corrupt entry is
moved aside under the lock before a new one takes its name.

[Note: writers in other containers]
A writer holds its key's lock for as long as its temp dir exists, so a temp dir is removed
only by whoever holds that lock, and whoever holds it may remove every temp dir of the key;
`dlo cache ls` lists one as a dead writer's while nobody holds it (a probe that waits for and
changes nothing). The pid in the name cannot tell: processes in several containers (PID
namespaces) may share one cache, and a live writer's pid is not visible in another one, while
a dead writer's pid may be a live process there.

[Note: validate what you map]
Nothing read from disk is trusted: a key must be a key before it becomes a path, file names
must be plain names, and the manifest's every field is type-checked (manifest.py). The entry
directory is opened once (O_NOFOLLOW) and its files are opened through it, once each; those
same descriptors are fstat-checked, hashed and mapped. A file swapped by path after the
check is never the one mapped.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import mmap
import os
import shutil
import stat
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from tqdm.auto import tqdm

from dlo.config.offload_config import CacheVerify
from dlo.host.cache import holds
from dlo.host.cache.entry_layout import FILE_TAIL_BYTES
from dlo.host.cache.identity import CONTENT, content_digest, is_key
from dlo.host.cache.key_lock import KeyLock, is_held
from dlo.host.cache.manifest import MANIFEST, MANIFEST_SIZE_CAP, SCHEMA, Rejection, RejectionKind, manifest_problem
from dlo.host.cache.source_index import SourceIndex
from dlo.host.cache.stamps import Stamps, file_stamp
from dlo.host.cache.trust import DIR_MODE, FILE_MODE, SAFE_OPEN, private_dir_reason, stat_reason
from dlo.host.cache.unavailable import CacheUnavailable, failure_code
from dlo.host.checkpoint import Checkpoint
from dlo.host.safetensors_file import PAD_PREFIX, CheckpointError, write_file
from dlo.planning.block_layout import align_up

logger = logging.getLogger(__name__)

HASH_CHUNK = 64 * 2**20
Kind = RejectionKind


@dataclass(frozen=True)
class Entry:
    """A validated entry, mapped through the descriptors it was validated with. The caller
    owns the mapping: `checkpoint.close()` (or `close()`) when done."""

    path: Path
    manifest: dict
    checkpoint: Checkpoint

    def close(self) -> None:
        self.checkpoint.close()


class LeftoverKind(enum.Enum):
    CORRUPT = "corrupt"  # an invalid entry moved aside by the writer that replaced it
    EVICTED = "evicted"  # an evicted entry whose removal was interrupted
    DEAD_WRITER = "dead_writer"  # the temp dir of a writer that no longer holds its key's lock


@dataclass(frozen=True)
class Leftover:
    """A directory under .tmp that nothing will use again; `dlo cache gc` removes it."""

    path: Path
    key: str
    kind: LeftoverKind


def _chunk_digest(mapping: mmap.mmap | None, offset: int) -> bytes:
    if mapping is None:  # an empty file (mmap cannot map zero bytes)
        return hashlib.sha256(b"").digest()
    # A view of the mapping, not a read(): no copy and no fresh 64 MiB buffer to fault in per
    # chunk (2.3x faster per thread measured on the CPU machine). hashlib releases the GIL.
    # Like every reader of a mapping (the streaming hot path too), a file truncated under it
    # would raise SIGBUS instead of a short read: entries are immutable and owner-only.
    with memoryview(mapping) as whole, whole[offset : offset + HASH_CHUNK] as chunk:
        return hashlib.sha256(chunk).digest()


def _map_descriptor(handle: BinaryIO) -> mmap.mmap | None:
    size = os.fstat(handle.fileno()).st_size
    return mmap.mmap(handle.fileno(), size, prot=mmap.PROT_READ) if size else None


def file_digests(handles: list[BinaryIO], threads: int) -> list[str]:
    """One digest per open file: SHA-256 over the SHA-256s of its 64 MiB chunks, in order.
    Every byte is hashed, and the chunks of all files are hashed in parallel, so one large
    shard does not serialize validation on one core."""
    sizes = [os.fstat(handle.fileno()).st_size for handle in handles]
    jobs = [(i, offset) for i, size in enumerate(sizes) for offset in range(0, max(size, 1), HASH_CHUNK)]
    total = sum(sizes)
    started = time.perf_counter()
    mappings: list[mmap.mmap | None] = []
    chunks = []
    try:
        mappings.extend(_map_descriptor(handle) for handle in handles)
        # A progress bar on a terminal only (tqdm's disable=None): hashing a large model takes seconds.
        with ThreadPoolExecutor(threads) as pool, tqdm(
            total=total, unit="B", unit_scale=True, desc="dlo: hashing", disable=None, leave=False
        ) as progress:
            for (i, offset), chunk in zip(jobs, pool.map(lambda job: _chunk_digest(mappings[job[0]], job[1]), jobs)):
                chunks.append(chunk)
                progress.update(min(HASH_CHUNK, sizes[i] - offset))
    finally:
        for mapping in mappings:
            if mapping is not None:
                mapping.close()
    seconds = time.perf_counter() - started
    rate = total / 1e9 / max(seconds, 1e-9)
    logger.info("dlo: hashed %.2f GB in %.2f s (%.1f GB/s on %d threads)", total / 1e9, seconds, rate, threads)
    per_file: list[list[bytes]] = [[] for _ in handles]
    for (i, _), chunk in zip(jobs, chunks):
        per_file[i].append(chunk)
    return [hashlib.sha256(b"".join(parts)).hexdigest() for parts in per_file]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_read(name: str, dir_fd: int) -> BinaryIO:
    return open(os.open(name, os.O_RDONLY | SAFE_OPEN, dir_fd=dir_fd), "rb", buffering=0)


def _tensors_problem(checkpoint: Checkpoint, index: Mapping[str, Mapping]) -> str | None:
    """Why the mapped files' tensors are not exactly the manifest's `tensors`, or None."""
    if set(checkpoint.tensors) != set(index):
        return f"the files hold {len(checkpoint.tensors)} tensors, the manifest lists {len(index)} (names differ)"
    for name, source in checkpoint.tensors.items():
        entry = source.entry
        found = [source.file.path.name, str(entry.dtype), list(entry.shape), entry.nbytes]
        listed = [index[name][field] for field in ("file", "dtype", "shape", "nbytes")]
        if found != listed or not entry.aligned:
            return f"{name!r} is {found} in the files, {listed} in the manifest"
    return None


def _parse_temp_name(name: str) -> tuple[str, LeftoverKind | int] | None:
    """(key, kind) of a moved-aside entry, (key, pid) of a writer's temp dir, else None."""
    key, dot, rest = name[:64], name[64:65], name[65:].split(".")
    if not is_key(key) or dot != "." or len(rest) != 2:
        return None
    if rest[0] in (LeftoverKind.CORRUPT.value, LeftoverKind.EVICTED.value):
        return key, LeftoverKind(rest[0])
    return (key, int(rest[0])) if rest[0].isdigit() else None


class EntryStore:
    def __init__(self, root: str | Path, hash_threads: int | None = None) -> None:
        path = Path(root).expanduser()
        # Only the parents are resolved: a root that is a symlink stays one, and is refused.
        self.root = path.resolve() if path.name in ("", "..") else path.parent.resolve() / path.name
        self.hash_threads = hash_threads or max(1, len(os.sched_getaffinity(0)))

    def entry_path(self, key: str) -> Path:
        if not is_key(key):  # see [Note: validate what you map]
            raise ValueError(f"{key!r} is not a cache key (64 lowercase hex digits)")
        return self.root / "v1" / key

    def _users(self, key: str) -> Path:
        return self.root / ".users" / key

    def _lock(self, key: str, timeout_s: float) -> KeyLock:
        self._dir(".locks", create=True)
        return KeyLock(self.root / ".locks" / f"{key}.lock", timeout_s)

    def _dir(self, name: str, create: bool) -> Path | None:
        """The trusted directory `name` under the root; None if it is missing (and not
        created). Creating it creates a missing root too (its parents with the umask's modes:
        they are not the cache's)."""
        path = self.root / name
        if not create and not os.path.lexists(path):
            return None
        try:
            if create:
                self.root.parent.mkdir(parents=True, exist_ok=True)
            reason = private_dir_reason(self.root, create) or private_dir_reason(path, create)
        except OSError as err:
            raise CacheUnavailable(failure_code(err), f"cannot create {path}: {err}") from err
        if reason is not None:
            raise CacheUnavailable("invalid_configuration", reason)
        return path

    # -- consumers --------------------------------------------------------------------

    def hold(self, key: str) -> int:
        """Mark `key` in use by this process until the returned fd is closed (holds.py).
        Hold before validating or publishing: an entry held can no longer be evicted."""
        self.entry_path(key)  # only a key becomes a path
        self._dir(".users", create=True)
        return holds.hold(self._users(key))

    def users(self, key: str) -> int:
        """How many processes hold `key`; changes nothing."""
        return holds.count_users(self._users(key)) if self._dir(".users", create=False) is not None else 0

    def last_used(self, key: str) -> float:
        users = self._users(key)
        if self._dir(".users", create=False) is not None and users.is_dir():
            return users.stat().st_mtime
        return self.entry_path(key).stat().st_mtime

    def keys(self) -> list[str]:
        """The published entries (names that are not keys are no entries of dlo's)."""
        v1 = self._dir("v1", create=False)
        return sorted(name for name in os.listdir(v1) if is_key(name)) if v1 is not None else []

    def size(self, key: str) -> int:
        return _tree_size(self.entry_path(key))

    # -- maintenance ------------------------------------------------------------------

    def evict(self, key: str, lock_timeout_s: float = 0.0) -> bool:
        """Remove `key` unless a process holds it, with what belongs to it: its lock file,
        the holds proved dead, its empty hold directory and the source records naming it.
        Returns whether it was removed."""
        path = self.entry_path(key)
        with self._lock(key, lock_timeout_s) as lock:
            if holds.sweep(self._users(key), remove_dir=True):
                return False
            if os.path.lexists(path):
                doomed = self._dir(".tmp", create=True) / f"{key}.{LeftoverKind.EVICTED.value}.{uuid.uuid4().hex}"
                path.rename(doomed)  # atomic: readers see the whole entry or none
                shutil.rmtree(doomed, ignore_errors=True)
            if self._dir("sources", create=False) is not None:
                SourceIndex(self.root).forget(lambda named: named != key)
            stamps = self._dir(".stamps", create=False)
            if stamps is not None:
                Stamps(stamps).forget(key)
            lock.remove_file()  # see [Note: removable lock files]
        return True

    def _temp_dirs(self) -> list[tuple[Path, str, LeftoverKind | int]]:
        """(path, key, kind or writer pid) of every directory under .tmp dlo names."""
        tmp = self._dir(".tmp", create=False)
        names = sorted(os.listdir(tmp)) if tmp is not None else []
        return [(tmp / name, *parsed) for name in names if (parsed := _parse_temp_name(name)) is not None]

    def leftovers(self) -> list[Leftover]:
        """Directories under .tmp nothing will use again, as `dlo cache ls` shows them;
        changes nothing. A writer's temp dir is listed while nobody holds its key's lock (gc
        removes it only holding that lock): see [Note: writers in other containers]."""
        found = []
        for path, key, kind in self._temp_dirs():
            if isinstance(kind, int):
                if is_held(self.root / ".locks" / f"{key}.lock") or not path.exists():
                    continue  # a writer at work, or one that published (or gave up) since the listing
                kind = LeftoverKind.DEAD_WRITER
            found.append(Leftover(path, key, kind))
        return found

    @staticmethod
    def leftover_size(leftover: Leftover) -> int:
        return _tree_size(leftover.path)

    def tidy(self) -> list[str]:
        """Remove what nothing will use again: leftovers under .tmp, holds proved dead and
        empty hold directories, the lock files and source records of keys without an entry.
        Never waits for a lock, never removes anything in use. Returns what it removed."""
        removed = []
        for path, key, kind in self._temp_dirs():
            if isinstance(kind, int):  # a writer's, whatever its pid: see [Note: writers in other containers]
                try:
                    with self._lock(key, timeout_s=0):
                        shutil.rmtree(path, ignore_errors=True)
                except CacheUnavailable:
                    continue  # its writer is at work
            else:
                shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path.relative_to(self.root)))
        users = self._dir(".users", create=False)
        for name in os.listdir(users) if users is not None else []:
            if is_key(name) and not holds.sweep(users / name, remove_dir=not self.entry_path(name).is_dir()):
                if not (users / name).exists():
                    removed.append(f".users/{name}")
        locks = self._dir(".locks", create=False)
        for name in os.listdir(locks) if locks is not None else []:
            key = name.removesuffix(".lock")
            if is_key(key) and name == f"{key}.lock" and not os.path.lexists(self.entry_path(key)):
                try:
                    with KeyLock(locks / name, timeout_s=0) as lock:
                        if not os.path.lexists(self.entry_path(key)):  # not published meanwhile
                            lock.remove_file()
                            removed.append(f".locks/{name}")
                except CacheUnavailable:
                    pass  # a writer holds it right now
        stamps = self._dir(".stamps", create=False)
        for name in os.listdir(stamps) if stamps is not None else []:
            key = name.removesuffix(".json")
            if name == f"{key}.json" and is_key(key) and not self.entry_path(key).is_dir():
                Stamps(stamps).forget(key)
                removed.append(f".stamps/{name}")
        if self._dir("sources", create=False) is not None:
            index = SourceIndex(self.root)
            removed += [f"sources/{n}" for n in index.forget(lambda k: k is not None and self.entry_path(k).is_dir())]
        return removed

    # -- validation ---------------------------------------------------------------------

    def validate(self, key: str, verify: CacheVerify = CacheVerify.FULL) -> Entry | Rejection:
        """The entry, mapped, if every byte checks out (with `CacheVerify.STAMP`, bytes whose
        files kept their stamps are not hashed again, see [Note: stamps]); else why not.
        Never raises: see [Note: validate what you map]."""
        if not is_key(key):
            return Rejection(Kind.BAD_KEY, f"{key!r:.80} is not a cache key")
        v1 = self.root / "v1"
        try:
            if not os.path.lexists(v1):
                return Rejection(Kind.MISSING, f"no entry {key} (no {v1})")
            reason = private_dir_reason(v1, create=False)
            if reason is not None:
                return Rejection(Kind.UNTRUSTED, reason)
            return self._validate(key, self.entry_path(key), verify)
        except OSError as err:  # e.g. the entry removed while it was read
            return Rejection(Kind.IO_FAILED, f"reading {key}: {err}")

    def _validate(self, key: str, path: Path, verify: CacheVerify) -> Entry | Rejection:
        try:
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | SAFE_OPEN)
        except FileNotFoundError:
            return Rejection(Kind.MISSING, f"no entry {key}")
        except OSError as err:  # ELOOP, ENOTDIR
            return Rejection(Kind.UNTRUSTED, f"{path} is a symlink or not a directory ({err.strerror})")
        with ExitStack() as stack:
            stack.callback(os.close, dir_fd)
            reason = stat_reason(path, os.fstat(dir_fd))
            present = set(os.listdir(dir_fd))
            for name in sorted(present):
                reason = reason or stat_reason(path / name, os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
            if reason is not None:
                return Rejection(Kind.UNTRUSTED, reason)
            read = _read_manifest(dir_fd, path)
            if isinstance(read, Rejection):
                return read
            manifest, manifest_info = read
            problem = manifest_problem(manifest, key)
            if problem is not None:
                return problem
            files = manifest["files"]
            if present != set(files) | {MANIFEST}:
                return Rejection(Kind.FILES_DIFFER, f"{sorted(present ^ (set(files) | {MANIFEST}))}")
            handles, stamps = {}, {MANIFEST: file_stamp(manifest_info)}
            for name, meta in files.items():
                handles[name] = stack.enter_context(_open_read(name, dir_fd))
                info = os.fstat(handles[name].fileno())
                if not stat.S_ISREG(info.st_mode):
                    return Rejection(Kind.UNTRUSTED, f"{name} is not a regular file")
                if info.st_size != meta["size"]:
                    detail = f"{name} has {info.st_size} bytes, the manifest says {meta['size']}"
                    return Rejection(Kind.SIZE_MISMATCH, detail)
                stamps[name] = file_stamp(info)
            stamped = verify is CacheVerify.STAMP and self._stamps_match(key, stamps)
            if not stamped:
                digests = file_digests(list(handles.values()), self.hash_threads)
                for (name, meta), digest in zip(files.items(), digests):
                    if digest != meta["sha256_chunked"]:
                        return Rejection(Kind.DIGEST_MISMATCH, f"{name} does not hash to its manifest digest")
            entry = _mapped_entry(path, manifest, handles)
            if isinstance(entry, Entry) and not stamped:
                problem = self._content_problem(entry)
                if problem is not None:
                    entry.checkpoint.close()
                    return problem
                if verify is CacheVerify.STAMP:
                    self._record_stamps(key, stamps)  # only a user of stamps writes them: verify stays read-only
            return entry

    def _content_problem(self, entry: Entry) -> Rejection | None:
        """Whether the mapped tensors hash to the content digest their identity names
        (docs/guides/host-weight-cache.md; dlo's identities always name one). The files' digests proved their bytes; this
        proves the manifest that says which bytes are which tensor."""
        expected = entry.manifest["identity"].get(CONTENT)
        if expected is None:
            return None
        checkpoint = entry.checkpoint
        tensors = {name: checkpoint.view(name) for name in checkpoint.tensors if not name.startswith(PAD_PREFIX)}
        found = content_digest(tensors, self.hash_threads)
        if found != expected:
            return Rejection(Kind.DIGEST_MISMATCH, "the mapped tensors do not hash to the identity's content digest")
        return None

    def _stamps_match(self, key: str, stamps: dict[str, list[int]]) -> bool:
        try:
            directory = self._dir(".stamps", create=False)
        except CacheUnavailable:
            return False
        return directory is not None and Stamps(directory).matches(key, stamps)

    def _record_stamps(self, key: str, stamps: dict[str, list[int]]) -> None:
        """After a full validation. A failure only costs hashing again next time."""
        try:
            Stamps(self._dir(".stamps", create=True)).record(key, stamps)
        except (OSError, CacheUnavailable) as err:
            logger.warning("dlo: host weight cache: no stamps for %s (%s); hashing again next time", key[:16], err)

    # -- publication --------------------------------------------------------------------

    def publish(
        self,
        key: str,
        tensors: dict[str, torch.Tensor],
        identity: dict,
        lock_timeout_s: float = 600.0,
        shard_bytes: int = 2 * 2**30,
        verify: CacheVerify = CacheVerify.FULL,
        images: Sequence[Mapping[str, int]] = (),
    ) -> Entry:
        """The valid entry for `key`, mapped, publishing `tensors` first if there is none.
        `images`: groups of tensors to store at these byte offsets from a 512-aligned start
        (See [Note: one copy per block]); every other tensor is a group of its own.
        See [Note: publication]. Raises CacheUnavailable (lock_timeout, lock_failed,
        insufficient_disk, invalid_configuration, cache_operation_failed: also for `images`
        that cannot be laid out) and leaves no partial entry."""
        self.entry_path(key)  # only a key becomes a path
        found = self.validate(key, verify)
        if isinstance(found, Entry):
            return found
        with self._lock(key, lock_timeout_s):
            found = self.validate(key, verify)  # another writer may have finished while we waited
            if isinstance(found, Entry):
                return found
            try:
                return self._write(key, tensors, identity, shard_bytes, images)
            except OSError as err:
                raise CacheUnavailable(failure_code(err), f"publishing {key}: {err}") from err
            except ValueError as err:  # images the writer cannot lay out (overlapping, a tensor in two)
                raise CacheUnavailable("cache_operation_failed", f"publishing {key}: {err}") from err

    def _remove_stale_temps(self, key: str) -> None:
        """Every temp dir of this key, its moved-aside copies included (called under the key's
        lock: no other writer of it is at work, see [Note: writers in other containers])."""
        for path, temp_key, _ in self._temp_dirs():
            if temp_key == key:
                shutil.rmtree(path, ignore_errors=True)

    def _write(
        self, key: str, tensors: dict[str, torch.Tensor], identity: dict, shard_bytes: int, images: Sequence[Mapping[str, int]]
    ) -> Entry:
        tmp = self._dir(".tmp", create=True)
        v1 = self._dir("v1", create=True)
        self._remove_stale_temps(key)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        shards = _split(_groups(tensors, images), tensors, shard_bytes)
        padded = sum(_data_bytes(shard, tensors) for shard in shards)  # with the layout's padding
        free = shutil.disk_usage(self.root).free
        need = padded + max(64 * 2**20, padded // 100)
        if free < need:
            raise CacheUnavailable("insufficient_disk", f"{key} needs {need} bytes, {free} are free under {self.root}")

        temp = tmp / f"{key}.{os.getpid()}.{uuid.uuid4().hex}"
        os.mkdir(temp, DIR_MODE)
        os.chmod(temp, DIR_MODE)  # mkdir's mode passes through the umask
        try:
            with ExitStack() as stack:
                temp_fd = os.open(temp, os.O_RDONLY | os.O_DIRECTORY | SAFE_OPEN)
                stack.callback(os.close, temp_fd)
                files, index, handles = self._write_shards(temp_fd, tensors, shards, stack)
                for name, digest in zip(files, file_digests(list(handles.values()), self.hash_threads)):
                    files[name]["sha256_chunked"] = digest
                manifest = {
                    "schema": SCHEMA,
                    "digest": f"sha256 over the sha256 of each {HASH_CHUNK}-byte chunk, in order",
                    "key": key,
                    "identity": identity,
                    "total_bytes": total,
                    "created": time.time(),
                    "writer_pid": os.getpid(),
                    "files": files,
                    "tensors": index,
                }
                fd = os.open(MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_OPEN, FILE_MODE, dir_fd=temp_fd)
                with open(fd, "w") as handle:
                    json.dump(manifest, handle, sort_keys=True)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.fsync(temp_fd)
                final = self.entry_path(key)
                if os.path.lexists(final):  # invalid (we validated under the lock): move it aside first
                    final.rename(tmp / f"{key}.{LeftoverKind.CORRUPT.value}.{uuid.uuid4().hex}")
                stamps = {name: file_stamp(os.fstat(handle.fileno())) for name, handle in handles.items()}
                stamps[MANIFEST] = file_stamp(os.stat(MANIFEST, dir_fd=temp_fd, follow_symlinks=False))
                temp.rename(final)
                _fsync_dir(v1)
                entry = _mapped_entry(final, manifest, handles)  # the descriptors we hashed
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        if isinstance(entry, Rejection):  # what we just wrote does not read back
            raise CacheUnavailable("cache_operation_failed", f"{key} published but does not read back: {entry}")
        self._record_stamps(key, stamps)  # hashed as written
        return entry

    def _write_shards(self, temp_fd: int, tensors, shards: list[list[tuple[str, int]]], stack: ExitStack):
        """Write, chmod and fsync the shards (see `_split`); (files, tensor index, read handles by name)."""
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        files, index, handles = {}, {}, {}
        progress = tqdm(total=total, unit="B", unit_scale=True, desc="dlo: publishing", disable=None, leave=False)
        with progress:
            for i, placed in enumerate(shards, start=1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_OPEN, FILE_MODE, dir_fd=temp_fd)
                with open(fd, "wb") as handle:
                    placed_tensors = [(n, tensors[n], offset) for n, offset in placed]
                    pads = write_file(handle, placed_tensors, {"format": "pt"}, f"{PAD_PREFIX}{i}.", FILE_TAIL_BYTES)
                    os.fchmod(fd, FILE_MODE)  # whatever the umask
                    os.fsync(fd)
                handles[name] = stack.enter_context(_open_read(name, temp_fd))  # what is hashed and mapped
                files[name] = {"size": os.fstat(handles[name].fileno()).st_size}
                for n, _ in placed:
                    t = tensors[n]
                    nbytes = t.numel() * t.element_size()
                    index[n] = {"file": name, "dtype": str(t.dtype), "shape": list(t.shape), "nbytes": nbytes}
                index.update({n: {"file": name, "dtype": str(torch.uint8), "shape": [b], "nbytes": b} for n, b in pads.items()})
                progress.update(sum(index[n]["nbytes"] for n, _ in placed))
        return files, index, handles


def _read_manifest(dir_fd: int, path: Path) -> tuple[object, os.stat_result] | Rejection:
    try:
        fd = os.open(MANIFEST, os.O_RDONLY | SAFE_OPEN, dir_fd=dir_fd)
    except OSError as err:
        return Rejection(Kind.MANIFEST_UNREADABLE, f"{path / MANIFEST}: {err.strerror}")
    with open(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MANIFEST_SIZE_CAP:
            detail = f"{path / MANIFEST} is not a regular file under {MANIFEST_SIZE_CAP} bytes"
            return Rejection(Kind.MANIFEST_UNREADABLE, detail)
        text = handle.read(MANIFEST_SIZE_CAP + 1)
    try:
        return json.loads(text), info
    except (ValueError, RecursionError) as err:
        return Rejection(Kind.MANIFEST_UNREADABLE, f"{path / MANIFEST} is not JSON ({str(err)[:200]})")


def _mapped_entry(path: Path, manifest: dict, handles: dict[str, BinaryIO]) -> Entry | Rejection:
    """Map the validated descriptors and check their tensors against the manifest's."""
    try:
        checkpoint = Checkpoint(path, handles)
    except CheckpointError as err:
        return Rejection(Kind.FILE_INVALID, str(err))
    problem = _tensors_problem(checkpoint, manifest["tensors"])
    if problem is not None:
        checkpoint.close()
        return Rejection(Kind.TENSORS_DIFFER, problem)
    return Entry(path, manifest, checkpoint)


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _groups(tensors: Mapping[str, torch.Tensor], images: Sequence[Mapping[str, int]]) -> list[dict[str, int]]:
    """The entry's groups: each image (names the entry holds), then every other tensor alone."""
    groups = [{name: offset for name, offset in image.items() if name in tensors} for image in images]
    grouped = {name for group in groups for name in group}
    if len(grouped) != sum(len(group) for group in groups):
        raise ValueError("a tensor is in two images")
    return [group for group in groups if group] + [{name: 0} for name in sorted(tensors) if name not in grouped]


def _data_bytes(shard: list[tuple[str, int]], tensors: Mapping[str, torch.Tensor]) -> int:
    """The data section of a shard placed by `_split`: its tensors, the padding between them
    and the file's tail."""
    return max((offset + tensors[name].nbytes for name, offset in shard), default=0) + FILE_TAIL_BYTES


def _split(groups: list[dict[str, int]], tensors: Mapping[str, torch.Tensor], shard_bytes: int) -> list[list[tuple[str, int]]]:
    """Groups into shards of about `shard_bytes` (a group is never split), each group at the
    next 512-aligned offset of its shard: (name, offset in the data section), in file order."""
    shards: list[list[tuple[str, int]]] = [[]]
    size = 0
    for group in groups:
        extent = max(offset + tensors[n].numel() * tensors[n].element_size() for n, offset in group.items())
        if shards[-1] and size + extent > shard_bytes:
            shards.append([])
            size = 0
        # By offset, then size: a zero-byte tensor at another's offset goes first (write_file
        # needs offsets that do not go back), then by name, so the order never depends on the caller's.
        placed = sorted(group.items(), key=lambda item: (item[1], tensors[item[0]].nbytes, item[0]))
        shards[-1].extend((n, size + offset) for n, offset in placed)
        size = align_up(size + extent)
    return shards
