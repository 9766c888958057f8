"""Processes that publish cache entries (spawned by tests/test_cache_entry_store.py)."""

import time

import torch

from dlo.host.cache.entry_store import EntryStore

IDENTITY = {"model": "test"}


def tensors(seed: int = 0, count: int = 12, rows: int = 256) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"blocks.{i}.weight": torch.randn(rows, 1024, generator=generator) for i in range(count)}


def publish(root: str, key: str, queue) -> None:
    entry = EntryStore(root).publish(key, tensors(), IDENTITY, shard_bytes=2 * 2**20)
    queue.put((str(entry.path), entry.manifest["writer_pid"]))


def publish_after_ready(root: str, key: str, queue) -> None:
    """Say "ready" once imported, then publish 48 MiB in 24 shards (a ~0.1-0.2 s window), then
    wait to be killed: a kill that comes after the publication still finds the process (a daemon:
    one left over by a failing test ends with it)."""
    many = tensors(count=48)
    queue.put("ready")
    EntryStore(root).publish(key, many, IDENTITY, shard_bytes=2 * 2**20)
    time.sleep(600)
