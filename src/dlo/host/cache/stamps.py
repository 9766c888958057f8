"""Per-file stamps that let a warm start skip re-hashing an entry it validated before.

[Note: stamps]
After a full SHA-256 validation, the stamp (device, inode, size, mtime_ns, ctime_ns) of every
file of the entry, manifest included, is recorded in `<root>/.stamps/<key>.json` (owner-only,
like everything under the root). With `cache_verify="stamp"`, a validation whose open
descriptors all fstat to their recorded stamps skips hashing; any difference hashes everything
again and records new stamps once that passes.
Threat model: every write to a file, every truncate, chmod or utime sets its ctime to the
current time, and only root can set a ctime (by moving the clock); a replaced file has another
inode and ctime. Other users cannot write the entry or the stamps (trust checks refuse
group/other-writable and foreign-owned paths). So a matching stamp proves no non-root process
changed the file since it was hashed. It does not catch root moving the clock, the owner
forging the stamp file (that user can change dlo itself), or the disk silently flipping bits
(no write happens): `cache_verify="full"` and `dlo cache verify` hash every byte for those.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from collections.abc import Mapping
from pathlib import Path

from dlo.host.cache.trust import FILE_MODE, SAFE_OPEN, stat_reason

STAMP_SIZE_CAP = 2**20


def file_stamp(info: os.stat_result) -> list[int]:
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


class Stamps:
    """The stamp files under `directory` (a trusted `.stamps`, made by the caller)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def matches(self, key: str, stamps: Mapping[str, list[int]]) -> bool:
        """Whether `key`'s recorded stamps are exactly `stamps` (False if none are readable)."""
        try:
            fd = os.open(self.directory / f"{key}.json", os.O_RDONLY | SAFE_OPEN)
        except OSError:
            return False
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or stat_reason(key, info) is not None:
                return False
            return json.loads(os.read(fd, STAMP_SIZE_CAP + 1)[:STAMP_SIZE_CAP]) == dict(stamps)
        except (OSError, ValueError, RecursionError):
            return False
        finally:
            os.close(fd)

    def record(self, key: str, stamps: Mapping[str, list[int]]) -> None:
        """Write atomically (temp file + rename)."""
        temp = self.directory / f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_OPEN, FILE_MODE)
        try:
            os.write(fd, json.dumps(dict(stamps), sort_keys=True).encode())
            os.replace(temp, self.directory / f"{key}.json")
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def forget(self, key: str) -> None:
        (self.directory / f"{key}.json").unlink(missing_ok=True)
