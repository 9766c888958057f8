"""A Hugging Face hub cache laid out as the hub writes it, for tests of hub ids: files in
blobs/ named by their hash, a snapshot of relative symlinks to them, refs/main naming it."""

import hashlib
import os
import shutil
from pathlib import Path


def cache_repo(hub: Path, repo_id: str, source: Path, revision: str = "abc123") -> Path:
    """Put the files under `source` into the cache `hub` as model repository `repo_id`; returns `hub`."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        link = repo / "snapshots" / revision / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return hub
