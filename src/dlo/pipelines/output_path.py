"""Proving, before any work, that a file the run will write can be written.

[Note: publishing beside the output]
An output written through a partial sibling renamed onto it (media_output) needs more than
the output itself being writable: the directory must take a new entry, under a name some 20
characters longer. An existing, writable file in a read-only directory, or a name near the
filesystem's limit, pass the probe of the file alone and fail the write, after the generation.
check_publishable also creates and removes that sibling, under the name the write will use.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
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


def partial_sibling(path: Path) -> Path:
    """Where the output is written before it is renamed onto `path` (by this process). The same
    suffix: the encoders pick the format by it. See [Note: publishing beside the output]."""
    return path.with_name(f".{path.stem}.dlo-partial-{os.getpid()}{path.suffix}")


def check_publishable(path: Path, flag: str) -> None:
    """check_writable, and the partial sibling the write goes through created and removed."""
    check_writable(path, flag)
    partial = partial_sibling(path)
    try:
        os.close(os.open(partial, os.O_WRONLY | os.O_CLOEXEC | os.O_CREAT | os.O_EXCL, 0o644))
    except OSError as err:
        fix = "give a shorter name" if err.errno == errno.ENAMETOOLONG else f"make {path.parent} writable, or write elsewhere"
        raise ConfigError(
            f"{flag} {path}: it is written as {partial.name} beside it, then renamed, and that file cannot be created "
            f"({os.strerror(err.errno)}); {fix}"
        ) from None
    partial.unlink()


@contextlib.contextmanager
def published(path: Path) -> Iterator[Path]:
    """A sibling temp file (same suffix: writers may pick the format by it) renamed onto `path`
    once complete: an interrupted or failed write leaves nothing behind, and an existing `path`
    as it was. See [Note: publishing beside the output]."""
    partial = partial_sibling(path)
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
