"""`dlo cache ls | verify | rm | gc`: maintenance of the host weight cache."""

from __future__ import annotations

import argparse
import datetime
import json
import re
import time

from dlo.cli.format import human_bytes, table
from dlo.config import OffloadConfig
from dlo.errors import ConfigError
from dlo.host.cache.entry_store import MANIFEST, CacheUnavailable, Entry, EntryStore
from dlo.host.cache.trust import root_refusal

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'200G', '1.5T', '512M', '1000' (bytes) -> bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 200G, 512M or 1.5T")
    number, unit = match.groups()
    return int(float(number) * 1024 ** "BKMGT".index(unit.upper() or "B"))


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "cache",
        help="list, verify and evict host weight cache entries",
        description="Maintain the host weight cache (OffloadConfig(host_weight_cache=True)). Entries held by a "
        "running process are never evicted.",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    default_dir = OffloadConfig().cache_dir
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", default=default_dir, help=f"cache root (default: {default_dir})")
    actions.add_parser("ls", parents=[common], help="key, model, size, last used, in use by N")
    verify = actions.add_parser("verify", parents=[common], help="re-hash entries (all, or KEY)")
    verify.add_argument("key", nargs="?", metavar="KEY")
    remove = actions.add_parser("rm", parents=[common], help="remove an entry nobody uses")
    remove.add_argument("key", metavar="KEY")
    remove.add_argument("--force", action="store_true", help="wait until no process uses it, then remove it")
    remove.add_argument("--timeout", type=float, default=600.0, help="with --force: seconds to wait (default: 600)")
    collect = actions.add_parser("gc", parents=[common], help="evict least recently used entries nobody uses")
    collect.add_argument("--max-size", type=parse_size, required=True, metavar="SIZE", help="e.g. 200G")
    parser.set_defaults(run=run)


def _store(args: argparse.Namespace) -> EntryStore:
    store = EntryStore(args.cache_dir)
    refusal = root_refusal(store.root, allow_any_filesystem=True)  # maintenance works anywhere
    if refusal is not None:
        raise ConfigError(refusal)
    return store


def _resolve(store: EntryStore, key: str) -> str:
    matches = [k for k in store.keys() if k.startswith(key)]
    if len(matches) != 1:
        raise ConfigError(f"{key!r} matches {len(matches)} entries in {store.root}; give more of the key")
    return matches[0]


def _describe(store: EntryStore, key: str) -> list[str]:
    try:
        identity = json.loads((store.entry_path(key) / MANIFEST).read_text()).get("identity", {})
    except (OSError, ValueError):
        identity = {}
    used = datetime.datetime.fromtimestamp(store.last_used(key)).strftime("%Y-%m-%d %H:%M")
    model = f"{identity.get('model_class', '?')} {identity.get('model_path', '')}".strip()
    return [key[:16], model, human_bytes(store.size(key)), used, str(store.users(key))]


def run(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.action == "ls":
        rows = [_describe(store, key) for key in store.keys()]
        print(table(["key", "model", "size", "last used", "in use by"], rows) if rows else f"{store.root}: no entries")
        return 0
    if args.action == "verify":
        keys = [_resolve(store, args.key)] if args.key else store.keys()
        bad = 0
        for key in keys:
            started = time.perf_counter()
            found = store.validate(key)
            seconds = time.perf_counter() - started
            if isinstance(found, Entry):
                print(f"{key[:16]}  ok  ({human_bytes(store.size(key))} re-hashed in {seconds:.2f} s)")
            else:
                bad += 1
                print(f"{key[:16]}  BAD  {found}")
        return 1 if bad else 0
    if args.action == "rm":
        key = _resolve(store, args.key)
        deadline = time.monotonic() + (args.timeout if args.force else 0)
        while not store.evict(key, lock_timeout_s=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise ConfigError(f"{key[:16]} is in use by {store.users(key)} process(es); --force waits for them")
            time.sleep(0.2)
        print(f"removed {key[:16]}")
        return 0
    # gc: least recently used first, skipping entries in use
    total = sum(store.size(key) for key in store.keys())
    for key in sorted(store.keys(), key=store.last_used):
        if total <= args.max_size:
            break
        size = store.size(key)
        try:
            removed = store.evict(key)
        except CacheUnavailable:  # a writer holds it right now
            removed = False
        if removed:
            total -= size
            print(f"evicted {key[:16]} ({human_bytes(size)})")
        else:
            print(f"kept {key[:16]}: in use")
    print(f"cache size {human_bytes(total)} (limit {human_bytes(args.max_size)})")
    return 0 if total <= args.max_size else 1
