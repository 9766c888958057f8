"""The one error of the host weight cache's protocol: this load cannot use the cache, with
its SPEC §5.2 fallback code."""

from __future__ import annotations

import errno

from safetensors import SafetensorError

from dlo.errors import DloError


class CacheUnavailable(DloError):
    """The cache cannot serve this load; `code` is the SPEC §5.2 fallback code."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


def failure_code(err: OSError | SafetensorError) -> str:
    """insufficient_disk for a full filesystem, else cache_operation_failed. safetensors'
    writer reports I/O errors as SafetensorError, whose text carries the OS error as Rust
    prints it ("... (os error 28)"), not an errno."""
    if isinstance(err, OSError):
        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
    else:
        full = any(f"(os error {code})" in str(err) for code in (errno.ENOSPC, errno.EDQUOT))
    return "insufficient_disk" if full else "cache_operation_failed"
