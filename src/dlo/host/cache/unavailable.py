"""The one error of the host weight cache's protocol: this load cannot use the cache."""

from __future__ import annotations

from dlo.errors import DloError


class CacheUnavailable(DloError):
    """The cache cannot serve this load; `code` is the SPEC §5.2 fallback code."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason
