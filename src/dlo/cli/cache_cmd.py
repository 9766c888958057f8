"""`dlo cache ls | verify | rm | gc`: maintenance of the host weight cache (flags: cache_flags)."""

from __future__ import annotations

import argparse
import datetime
import json
import time

from dlo.cli.cache_flags import DEFAULT_FORCE_TIMEOUT_S, SHOWN_KEY
from dlo.cli.format import human_bytes, table
from dlo.errors import ConfigError
from dlo.host.cache.entry_store import Entry, EntryStore
from dlo.host.cache.manifest import MANIFEST
from dlo.host.cache.trust import root_refusal
from dlo.host.cache.unavailable import CacheUnavailable

def _store(args: argparse.Namespace) -> EntryStore:
    """The cache at --cache-dir, which must exist: these commands never create one."""
    store = EntryStore(args.cache_dir)
    refusal = root_refusal(store.root, allow_any_filesystem=True, create=False)  # maintenance works anywhere
    if refusal is not None:
        raise ConfigError(refusal)
    return store


def _resolve(store: EntryStore, key: str) -> str:
    matches = [k for k in store.keys() if k.startswith(key)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ConfigError(f"no entry {key!r} in {store.root} (dlo cache ls lists them)")
    raise ConfigError(f"{key!r} matches {len(matches)} entries in {store.root}; give more of the key")


def _described(store: EntryStore, key: str) -> tuple[str, str]:
    """(model, dtype) an entry's manifest names, for display only (validation judges it). The
    dtype: the load's ("checkpoint": each tensor's own), then the float8 format it streams in."""
    try:
        identity = json.loads((store.entry_path(key) / MANIFEST).read_text()).get("identity")
        model = f"{identity['model_class'].rsplit('.', 1)[-1]} {identity['model_path']}"
        dtype = str(identity["dtype"]).removeprefix("torch.")
        stream = identity.get("stream")
        if stream is not None:
            dtype += f" as {stream['dtype']} {stream['scale']}"
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return "?", "?"
    return model, dtype


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M")


def _list(store: EntryStore) -> int:
    rows = [
        [key[:SHOWN_KEY], *_described(store, key), human_bytes(store.size(key)), _when(store.last_used(key)),
         str(store.users(key))]
        for key in store.keys()
    ]
    for left in store.leftovers():
        try:
            when = _when(left.path.stat().st_mtime)
        except FileNotFoundError:  # removed since it was listed (gc, or its writer finished)
            continue
        rows.append([left.key[:SHOWN_KEY], f"({left.kind.value}, in {left.path.relative_to(store.root)}: dlo cache gc removes it)",
                     "-", human_bytes(store.leftover_size(left)), when, "-"])
    header = ["key", "model", "dtype", "size", "last used", "in use by"]
    print(table(header, rows) if rows else f"{store.root}: no entries")
    return 0


def _verify(store: EntryStore, key: str | None) -> int:
    bad = 0
    for key in [_resolve(store, key)] if key is not None else store.keys():
        started = time.perf_counter()
        found = store.validate(key)
        seconds = time.perf_counter() - started
        if isinstance(found, Entry):
            found.close()
            print(f"{key[:SHOWN_KEY]}  ok  ({human_bytes(store.size(key))} re-hashed in {seconds:.2f} s)")
        else:
            bad += 1
            # A load never maps it (it validates first) and publishes a good copy in its place.
            print(f"{key[:SHOWN_KEY]}  BAD  {found}; remove it: dlo cache rm {key[:SHOWN_KEY]} (the next load that "
                  "uses it publishes it again)")
    return 1 if bad else 0


def _remove(store: EntryStore, key: str, force: bool, timeout_s: float | None) -> int:
    key = _resolve(store, key)
    wait_s = (DEFAULT_FORCE_TIMEOUT_S if timeout_s is None else timeout_s) if force else 0.0
    deadline = time.monotonic() + wait_s
    while not store.evict(key, lock_timeout_s=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            users = store.users(key)
            if force:
                raise ConfigError(f"timed out after {wait_s:g} s: {key[:SHOWN_KEY]} is still in use by {users} process(es)")
            raise ConfigError(
                f"{key[:SHOWN_KEY]} is in use by {users} process(es); stop them, or add --force to wait for them"
            )
        time.sleep(0.2)
    print(f"removed {key[:SHOWN_KEY]}")
    return 0


def _collect(store: EntryStore, max_size: int) -> int:
    """Least recently used first, skipping entries in use; then everything left over."""
    total = sum(store.size(key) for key in store.keys())
    for key in sorted(store.keys(), key=store.last_used):
        if total <= max_size:
            break
        size = store.size(key)
        try:
            removed = store.evict(key)
        except CacheUnavailable:  # a writer holds it right now
            removed = False
        if removed:
            total -= size
            print(f"evicted {key[:SHOWN_KEY]} ({human_bytes(size)})")
        else:
            print(f"kept {key[:SHOWN_KEY]}: in use")
    for path in store.tidy():
        print(f"removed {path}")
    print(f"cache size {human_bytes(total)} (limit {human_bytes(max_size)})")
    return 0 if total <= max_size else 1


def run(args: argparse.Namespace) -> int:
    """After cache_flags.check."""
    store = _store(args)
    if args.action == "ls":
        return _list(store)
    if args.action == "verify":
        return _verify(store, args.key)
    if args.action == "rm":
        return _remove(store, args.key, args.force, args.timeout)
    return _collect(store, args.max_size)
