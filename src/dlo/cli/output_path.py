"""Proving, before any work, that a file the run will write can be written."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from dlo.errors import ConfigError


def check_writable(path: Path, flag: str) -> None:
    """Create `path` and remove it again (an existing file is opened for writing, untouched):
    the only test that catches a directory in the way, a file as parent, a read-only or
    pseudo filesystem, a missing directory or a permission, exactly as the later write would."""
    existed = path.is_file()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | (0 if existed else os.O_CREAT | os.O_EXCL), 0o644)
    except IsADirectoryError:
        raise ConfigError(f"{flag} {path}: is a directory; give a file name inside it") from None
    except FileExistsError:
        what = "is a directory; give a file name inside it" if path.is_dir() else "exists and is not a regular file"
        raise ConfigError(f"{flag} {path}: {what}") from None
    except OSError as err:
        if err.errno == errno.ENOTDIR:
            raise ConfigError(f"{flag} {path}: a parent of it is a file, not a directory") from None
        if err.errno == errno.ENOENT and not path.parent.is_dir():
            raise ConfigError(f"{flag} {path}: directory {path.parent} does not exist") from None
        raise ConfigError(f"{flag} {path}: cannot be written ({os.strerror(err.errno)})") from None
    os.close(fd)
    if not existed:
        path.unlink()
