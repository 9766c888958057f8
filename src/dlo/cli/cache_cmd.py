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
from dlo.host.cache.entry_store import Entry, EntryStore
from dlo.host.cache.manifest import MANIFEST
from dlo.host.cache.trust import root_refusal
from dlo.host.cache.unavailable import CacheUnavailable

DEFAULT_FORCE_TIMEOUT_S = 600.0
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
# A KEY argument names one entry by at least this many of its hex digits: an empty string
# (a script's unset $KEY) or a few characters prefix every key, or most, and `rm` would
# remove whichever entry happened to be the only match. `ls` shows 16.
MIN_KEY_PREFIX = 8
SHOWN_KEY = 16
_HEX = re.compile(r"[0-9a-f]*")


def parse_size(text: str) -> int:
    """'200G', '1.5T', '512M', '1000' (bytes) -> bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 200G, 512M or 1.5T")
    number, unit = match.groups()
    return int(float(number) * 1024 ** "BKMGT".index(unit.upper() or "B"))


def key_prefix(text: str) -> str:
    """An argparse type: a KEY argument, refused unless it is MIN_KEY_PREFIX or more hex digits."""
    if _HEX.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not (the start of) a key: keys are lowercase hex digits")
    if len(text) < MIN_KEY_PREFIX:
        raise argparse.ArgumentTypeError(
            f"{text!r} is too short: give at least {MIN_KEY_PREFIX} characters of the key "
            f"(`dlo cache ls` shows {SHOWN_KEY})"
        )
    return text


key_prefix.__name__ = "key"  # argparse's "invalid key value: ..."


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
    actions.add_parser(
        "ls", parents=[common], help="key, model, size, last used, in use by N; and leftovers gc would remove"
    )
    verify = actions.add_parser("verify", parents=[common], help="re-hash entries (all, or KEY)")
    verify.add_argument(
        "key", nargs="?", type=key_prefix, metavar="KEY",
        help=f"an entry's key, or a unique prefix of it as `ls` shows, {MIN_KEY_PREFIX} characters or more "
        "(default: every entry)",
    )
    remove = actions.add_parser("rm", parents=[common], help="remove an entry nobody uses")
    remove.add_argument(
        "key", type=key_prefix, metavar="KEY",
        help=f"the entry's key, or a unique prefix of it as `ls` shows, {MIN_KEY_PREFIX} characters or more",
    )
    remove.add_argument("--force", action="store_true", help="wait until no process uses it, then remove it")
    wait = f"with --force: seconds to wait (default: {DEFAULT_FORCE_TIMEOUT_S:g})"
    remove.add_argument("--timeout", type=float, metavar="S", help=wait)
    collect = actions.add_parser(
        "gc", parents=[common], help="evict least recently used entries nobody uses, and remove what is left over"
    )
    collect.add_argument("--max-size", type=parse_size, required=True, metavar="SIZE", help="e.g. 200G")
    parser.set_defaults(run=run)


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


def _model(store: EntryStore, key: str) -> str:
    """The model an entry's manifest names, for display only (validation judges it)."""
    try:
        identity = json.loads((store.entry_path(key) / MANIFEST).read_text()).get("identity")
        return f"{identity['model_class'].rsplit('.', 1)[-1]} {identity['model_path']}"
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return "?"


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M")


def _list(store: EntryStore) -> int:
    rows = [
        [key[:SHOWN_KEY], _model(store, key), human_bytes(store.size(key)), _when(store.last_used(key)), str(store.users(key))]
        for key in store.keys()
    ]
    for left in store.leftovers():
        try:
            when = _when(left.path.stat().st_mtime)
        except FileNotFoundError:  # removed since it was listed (gc, or its writer finished)
            continue
        rows.append([left.key[:SHOWN_KEY], f"({left.kind.value}, in {left.path.relative_to(store.root)}: dlo cache gc removes it)",
                     human_bytes(store.leftover_size(left)), when, "-"])
    print(table(["key", "model", "size", "last used", "in use by"], rows) if rows else f"{store.root}: no entries")
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
            print(f"{key[:SHOWN_KEY]}  BAD  {found}")
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
    if args.action == "rm" and args.timeout is not None and not args.force:
        raise ConfigError("--timeout is how long --force waits for an entry's users; add --force or drop --timeout")
    store = _store(args)
    if args.action == "ls":
        return _list(store)
    if args.action == "verify":
        return _verify(store, args.key)
    if args.action == "rm":
        return _remove(store, args.key, args.force, args.timeout)
    return _collect(store, args.max_size)
