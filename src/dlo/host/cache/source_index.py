"""Warm start: find a cache entry from the load's sources alone, without loading the model.

The ordinary path must load and hash the whole model to learn its key. After a publication,
the index records which key a given *source* produced: the checkpoint files' identities
(path, size, mtime, inode), the dtype and loader inputs, the code hash and the topology parts
of the identity. A later load whose source matches maps that entry directly (after validating
every byte of it) instead of loading the checkpoint. Any change to a file changes the source
key, so a stale index entry is simply never found.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dlo.config import Topology
from dlo.host.cache.identity import code_hash


def source_key(
    directory: Path, model_class: type, dtype: str, loader_inputs: dict, topology: Topology
) -> str | None:
    """Key of this load's sources, or None when they cannot be described stably."""
    files = []
    for path in sorted(Path(directory).resolve().iterdir()):
        if path.is_file() and (path.suffix == ".safetensors" or path.name.endswith((".json",))):
            info = path.stat()
            files.append([path.name, info.st_size, info.st_mtime_ns, info.st_ino])
    try:
        text = json.dumps(
            {
                "directory": str(Path(directory).resolve()),
                "files": files,
                "dtype": dtype,
                "loader_inputs": loader_inputs,
                "code": code_hash(model_class),
                "tp": [topology.tp_size, topology.tp_rank],
                "sp_size": topology.sp_size,
            },
            sort_keys=True,
            allow_nan=False,
        )
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


class SourceIndex:
    def __init__(self, root: Path) -> None:
        self.path = Path(root) / "sources"

    def lookup(self, source: str) -> str | None:
        try:
            key = json.loads((self.path / f"{source}.json").read_text()).get("key")
        except (OSError, ValueError, AttributeError):
            return None
        return key if isinstance(key, str) and len(key) == 64 else None

    def record(self, source: str, key: str) -> None:
        """Write atomically (temp file + rename): readers see the old record or the new one."""
        self.path.mkdir(parents=True, exist_ok=True)
        temp = self.path / f".{source}.{os.getpid()}.tmp"
        temp.write_text(json.dumps({"key": key}))
        os.replace(temp, self.path / f"{source}.json")
