"""The on-disk protocol of the host weight cache (SPEC §5.2): immutable, content-addressed
entries published atomically and validated byte for byte before use.

Layout under the cache root:
    v1/<key>/model-0000i-of-0000N.safetensors + manifest.json   published entries
    .locks/<key>.lock                                            one flock per key
    .tmp/<key>.<pid>.<uuid>/                                     a writer's work in progress

[Note: publication]
An entry becomes visible only by one atomic rename of a complete, fsync'ed directory, made
by the holder of the key's flock. So a reader sees no entry or a whole one: a writer killed
at any point leaves at most a temp dir, which the next lock holder removes once its pid is
gone. Readers validate without the lock (entries never change in place); a corrupt entry is
moved aside under the lock before a new one takes its name.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tqdm.auto import tqdm

from dlo.errors import DloError
from dlo.host.cache.trust import untrusted_reason

logger = logging.getLogger(__name__)

SCHEMA = "dlo-host-weight-cache/2"  # 2: chunked file digests
MANIFEST = "manifest.json"
MANIFEST_SIZE_CAP = 64 * 2**20
HASH_CHUNK = 64 * 2**20


class CacheUnavailable(DloError):
    """The cache cannot serve this load; `code` is the SPEC §5.2 fallback code."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class Entry:
    path: Path
    manifest: dict


def _chunk_digest(mapping: mmap.mmap | None, offset: int) -> bytes:
    if mapping is None:  # an empty file (mmap cannot map zero bytes)
        return hashlib.sha256(b"").digest()
    # A view of the mapping, not a read(): no copy and no fresh 64 MiB buffer to fault in per
    # chunk (2.3x faster per thread measured on the CPU machine). hashlib releases the GIL.
    # Like every reader of a mapping (the streaming hot path too), a file truncated under it
    # would raise SIGBUS instead of a short read: entries are immutable and owner-only.
    with memoryview(mapping) as whole, whole[offset : offset + HASH_CHUNK] as chunk:
        return hashlib.sha256(chunk).digest()


def _map_file(path: Path) -> mmap.mmap | None:
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        return mmap.mmap(handle.fileno(), size, prot=mmap.PROT_READ) if size else None


def file_digests(paths: list[Path], threads: int) -> list[str]:
    """One digest per file: SHA-256 over the SHA-256s of its 64 MiB chunks, in order. Every
    byte is hashed, and the chunks of all files are hashed in parallel, so one large shard
    does not serialize validation on one core."""
    sizes = [path.stat().st_size for path in paths]
    jobs = [(i, offset) for i, size in enumerate(sizes) for offset in range(0, max(size, 1), HASH_CHUNK)]
    total = sum(sizes)
    started = time.perf_counter()
    mappings: list[mmap.mmap | None] = []
    chunks = []
    try:
        mappings.extend(_map_file(path) for path in paths)
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
    per_file: list[list[bytes]] = [[] for _ in paths]
    for (i, _), chunk in zip(jobs, chunks):
        per_file[i].append(chunk)
    return [hashlib.sha256(b"".join(parts)).hexdigest() for parts in per_file]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EntryStore:
    def __init__(self, root: str | Path, hash_threads: int | None = None) -> None:
        self.root = Path(root).expanduser().resolve()
        self.hash_threads = hash_threads or max(1, len(os.sched_getaffinity(0)))

    def entry_path(self, key: str) -> Path:
        return self.root / "v1" / key

    # -- consumers --------------------------------------------------------------------

    def hold(self, key: str) -> int:
        """Mark `key` in use by this process until the returned fd is closed: an flock on a
        file of its own under .users/<key>/. Eviction refuses entries with a held file."""
        users = self.root / ".users" / key
        users.mkdir(parents=True, exist_ok=True)
        fd = os.open(users / f"{os.getpid()}.{uuid.uuid4().hex}", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.utime(users)  # "last used"
        return fd

    def users(self, key: str) -> int:
        """How many processes hold `key` (files whose owner is gone are removed)."""
        count = 0
        for path in (self.root / ".users" / key).glob("*"):
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                path.unlink(missing_ok=True)  # nobody holds it: a consumer that is gone
            except BlockingIOError:
                count += 1
            finally:
                os.close(fd)
        return count

    def last_used(self, key: str) -> float:
        users = self.root / ".users" / key
        return users.stat().st_mtime if users.exists() else self.entry_path(key).stat().st_mtime

    def keys(self) -> list[str]:
        return sorted(p.name for p in (self.root / "v1").iterdir()) if (self.root / "v1").exists() else []

    def size(self, key: str) -> int:
        return sum(p.stat().st_size for p in self.entry_path(key).iterdir())

    def evict(self, key: str, lock_timeout_s: float = 0.0) -> bool:
        """Remove `key` unless a process holds it; returns whether it was removed."""
        with self._lock(key, lock_timeout_s):
            if self.users(key):
                return False
            path = self.entry_path(key)
            if path.exists():
                doomed = self.root / ".tmp" / f"{key}.evicted.{uuid.uuid4().hex}"
                (self.root / ".tmp").mkdir(parents=True, exist_ok=True)
                path.rename(doomed)  # atomic: readers see the whole entry or none
                shutil.rmtree(doomed, ignore_errors=True)
            return True

    # -- validation ---------------------------------------------------------------------

    def validate(self, key: str) -> Entry | str:
        """The entry if every byte checks out, else why not (a reason, never an exception)."""
        path = self.entry_path(key)
        if not path.is_dir() or path.is_symlink():
            return "missing"
        for checked in [path, *path.iterdir()]:
            reason = untrusted_reason(checked)
            if reason is not None:
                return f"untrusted: {reason}"
        manifest_path = path / MANIFEST
        try:
            if manifest_path.is_symlink() or manifest_path.stat().st_size > MANIFEST_SIZE_CAP:
                return "manifest is a symlink or too large"
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError, RecursionError) as err:
            return f"manifest unreadable ({err})"
        if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA or manifest.get("key") != key:
            return "manifest schema or key differs"
        files = manifest.get("files")
        if not isinstance(files, dict) or not files:
            return "manifest lists no files"
        for name in files:
            if not isinstance(name, str) or Path(name).name != name or name == MANIFEST:
                return f"file name {name!r} is not a plain basename"
        present = {p.name for p in path.iterdir()}
        if present != set(files) | {MANIFEST}:
            return f"files differ from the manifest: {sorted(present ^ (set(files) | {MANIFEST}))}"
        for name, meta in files.items():
            file_path = path / name
            if file_path.is_symlink() or not file_path.is_file():
                return f"{name} is not a regular file"
            if file_path.stat().st_size != meta.get("size"):
                return f"{name} has {file_path.stat().st_size} bytes, the manifest says {meta.get('size')}"
        names = list(files)
        try:
            digests = dict(zip(names, file_digests([path / n for n in names], self.hash_threads)))
        except (OSError, ValueError) as err:  # e.g. removed between the checks above and hashing
            return f"hashing failed ({err})"
        for name, meta in files.items():
            if digests[name] != meta.get("sha256_chunked"):
                return f"{name} does not hash to its manifest digest"
        return Entry(path, manifest)

    # -- publication --------------------------------------------------------------------

    def publish(
        self,
        key: str,
        tensors: dict[str, torch.Tensor],
        identity: dict,
        lock_timeout_s: float = 600.0,
        shard_bytes: int = 2 * 2**30,
    ) -> Entry:
        """The valid entry for `key`, publishing `tensors` first if there is none. See
        [Note: publication]. Raises CacheUnavailable (lock_timeout, lock_failed,
        insufficient_disk, cache_operation_failed) and leaves no partial entry."""
        found = self.validate(key)
        if isinstance(found, Entry):
            return found
        with self._lock(key, lock_timeout_s):
            found = self.validate(key)  # another writer may have finished while we waited
            if isinstance(found, Entry):
                return found
            try:
                return self._write(key, tensors, identity, shard_bytes)
            except (OSError, SafetensorError) as err:
                raise CacheUnavailable(_failure_code(err), f"publishing {key}: {err}") from err

    def _lock(self, key: str, timeout_s: float):
        store = self

        class _Held:
            def __enter__(self):
                try:
                    (store.root / ".locks").mkdir(parents=True, exist_ok=True)
                    self.fd = os.open(store.root / ".locks" / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
                except OSError as err:
                    raise CacheUnavailable("lock_failed", f"cannot open the lock of {key}: {err}") from err
                deadline = time.monotonic() + timeout_s
                while True:
                    try:
                        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        return self
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            os.close(self.fd)
                            raise CacheUnavailable(
                                "lock_timeout", f"{key} stayed locked by another writer for {timeout_s} s"
                            ) from None
                        time.sleep(0.05)
                    except OSError as err:
                        os.close(self.fd)
                        raise CacheUnavailable("lock_failed", f"flock on {key}: {err}") from err

            def __exit__(self, *exc):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
                os.close(self.fd)

        return _Held()

    def _remove_stale_temps(self, key: str) -> None:
        """Temp dirs of this key whose writer is gone (called under the key's lock)."""
        for temp in (self.root / ".tmp").glob(f"{key}.*"):
            parts = temp.name.split(".")
            pid = int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None
            if pid is None or not _pid_alive(pid):
                shutil.rmtree(temp, ignore_errors=True)

    def _write(self, key: str, tensors: dict[str, torch.Tensor], identity: dict, shard_bytes: int) -> Entry:
        (self.root / ".tmp").mkdir(parents=True, exist_ok=True)
        (self.root / "v1").mkdir(parents=True, exist_ok=True)
        self._remove_stale_temps(key)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        free = shutil.disk_usage(self.root).free
        need = total + max(64 * 2**20, total // 100)
        if free < need:
            raise CacheUnavailable("insufficient_disk", f"{key} needs {need} bytes, {free} are free under {self.root}")

        temp = self.root / ".tmp" / f"{key}.{os.getpid()}.{uuid.uuid4().hex}"
        temp.mkdir(mode=0o755)
        try:
            shards = _split(sorted(tensors), tensors, shard_bytes)
            files, index = {}, {}
            progress = tqdm(total=total, unit="B", unit_scale=True, desc="dlo: publishing", disable=None, leave=False)
            with progress:
                for i, names in enumerate(shards, start=1):
                    name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                    save_file({n: tensors[n].contiguous() for n in names}, str(temp / name), metadata={"format": "pt"})
                    os.chmod(temp / name, 0o644)  # whatever the umask: validation refuses group-writable files
                    with open(temp / name, "rb") as handle:
                        os.fsync(handle.fileno())
                    files[name] = {"size": (temp / name).stat().st_size}
                    for n in names:
                        t = tensors[n]
                        nbytes = t.numel() * t.element_size()
                        index[n] = {"file": name, "dtype": str(t.dtype), "shape": list(t.shape), "nbytes": nbytes}
                    progress.update(sum(index[n]["nbytes"] for n in names))
            for name, digest in zip(files, file_digests([temp / n for n in files], self.hash_threads)):
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
            with open(temp / MANIFEST, "w") as handle:
                json.dump(manifest, handle, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(temp / MANIFEST, 0o644)
            os.chmod(temp, 0o755)
            _fsync_dir(temp)
            final = self.entry_path(key)
            if final.exists():  # invalid (we validated under the lock): move it aside first
                final.rename(self.root / ".tmp" / f"{key}.corrupt.{uuid.uuid4().hex}")
            temp.rename(final)
            _fsync_dir(final.parent)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        return Entry(final, manifest)


def _failure_code(err: OSError | SafetensorError) -> str:
    """insufficient_disk for a full filesystem, else cache_operation_failed. safetensors'
    writer reports I/O errors as SafetensorError, whose text carries the OS error as Rust
    prints it ("... (os error 28)"), not an errno."""
    if isinstance(err, OSError):
        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
    else:
        full = any(f"(os error {code})" in str(err) for code in (errno.ENOSPC, errno.EDQUOT))
    return "insufficient_disk" if full else "cache_operation_failed"


def _split(names: list[str], tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards
