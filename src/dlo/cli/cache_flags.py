"""`dlo cache`'s flags: parsed, and refused where the flags alone are wrong, before the cache
(and torch, which its validation needs) is touched (see [Note: parse before torch]);
`cache_cmd` runs the actions."""

from __future__ import annotations

import argparse
import re

from dlo.config import OffloadConfig
from dlo.errors import ConfigError

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
    parser.set_defaults(command="dlo.cli.cache_cmd", check=check)


def check(args: argparse.Namespace) -> None:
    """What the flags alone rule out (run before the action's module is imported)."""
    if args.action == "rm" and args.timeout is not None and not args.force:
        raise ConfigError("--timeout is how long --force waits for an entry's users; add --force or drop --timeout")
