"""Warm start: find a cache entry from the load's sources alone, without loading the model.

The ordinary path must load and hash the whole model to learn its key. After a publication,
the index records which key a given load identity produced: `sources/<digest of the load
identity>.json` holds `{"key": ...}`. A later load with the same load identity (same files,
config, dtype, inputs, code and topology) maps that entry directly instead of loading the
checkpoint. Records are hints read from disk, so untrusted: the key must be a key, and the
entry must hold this very load identity (see [Note: warm start identity]).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from dlo.host.cache.identity import digest_of, is_key
from dlo.host.cache.trust import FILE_MODE, SAFE_OPEN, private_dir_reason
from dlo.host.cache.unavailable import CacheUnavailable

RECORD_SIZE_CAP = 4096
SUFFIX = ".json"


class SourceIndex:
    def __init__(self, root: Path) -> None:
        self.path = Path(root) / "sources"

    def _read(self, name: str) -> str | None:
        """The key a record names, or None (missing, unreadable, not a key)."""
        try:
            fd = os.open(self.path / name, os.O_RDONLY | SAFE_OPEN)
        except OSError:
            return None
        try:
            key = json.loads(os.read(fd, RECORD_SIZE_CAP + 1)[:RECORD_SIZE_CAP]).get("key")
        except (OSError, ValueError, AttributeError, RecursionError):
            return None
        finally:
            os.close(fd)
        return key if is_key(key) else None

    def lookup(self, load_identity: Mapping[str, object]) -> str | None:
        if private_dir_reason(self.path, create=False) is not None:
            return None
        return self._read(f"{digest_of(load_identity)}{SUFFIX}")

    def record(self, load_identity: Mapping[str, object], key: str) -> None:
        """Write atomically (temp file + rename): readers see the old record or the new one."""
        reason = private_dir_reason(self.path, create=True)  # an OSError propagates
        if reason is not None:
            raise CacheUnavailable("invalid_configuration", reason)
        temp = self.path / f".{os.getpid()}.{uuid.uuid4().hex}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_OPEN, FILE_MODE)
        try:
            os.write(fd, json.dumps({"key": key}).encode())
        finally:
            os.close(fd)
        try:
            os.replace(temp, self.path / f"{digest_of(load_identity)}{SUFFIX}")
        except OSError:
            temp.unlink(missing_ok=True)
            raise

    def forget(self, keep: Callable[[str | None], bool]) -> list[str]:
        """Remove the records whose key `keep` rejects (e.g. a removed entry's); the names
        removed. A record a writer replaces meanwhile may go too: it is only a hint, the
        next load records it again."""
        try:
            names = os.listdir(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return []
        removed = []
        for name in names:
            if name.endswith(SUFFIX) and not keep(self._read(name)):
                (self.path / name).unlink(missing_ok=True)
                removed.append(name)
        return removed
