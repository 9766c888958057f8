"""The one error of the host weight cache's protocol: this load cannot use the cache, with
its fallback code (docs/troubleshooting.md)."""

from __future__ import annotations

import errno

from dlo.errors import DloError


class CacheUnavailable(DloError):
    """The cache cannot serve this load; `code` is the fallback code (docs/troubleshooting.md)."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


def failure_code(err: OSError) -> str:
    """insufficient_disk for a full filesystem, else cache_operation_failed."""
    return "insufficient_disk" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "cache_operation_failed"
