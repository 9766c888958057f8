"""The manifest of a cache entry, checked as the untrusted input it is: every field an entry
is judged by has its type checked before it is used, and each problem is a named reason.
validate() returns a `Rejection` instead of raising, whatever the manifest holds."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from dlo.host.cache.identity import digest_of, is_key
from dlo.host.checkpoint import is_plain_file_name
from dlo.host.safetensors_file import DTYPES

SCHEMA = "dlo-host-weight-cache/4"  # 2: chunked file digests; 3: the load identity, owner-only modes;
# 4: blocks laid out as their wire images (See [Note: one copy per block])
MANIFEST = "manifest.json"
MANIFEST_SIZE_CAP = 64 * 2**20
TORCH_DTYPE_NAMES = frozenset(str(dtype) for dtype in DTYPES.values())  # as manifests spell them: "torch.bfloat16"


class RejectionKind(enum.Enum):
    """Why an entry is not used (it is then rebuilt under the lock, or the load goes cold)."""

    BAD_KEY = "bad_key"  # not a key as dlo writes them: never turned into a path
    MISSING = "missing"
    UNTRUSTED = "untrusted"  # a symlink, another owner, writable by group or others, not a regular file
    MANIFEST_UNREADABLE = "manifest_unreadable"  # unreadable, too large, not JSON
    MANIFEST_MALFORMED = "manifest_malformed"  # a field missing or of the wrong type
    SCHEMA_MISMATCH = "schema_mismatch"  # another version of dlo's layout
    KEY_MISMATCH = "key_mismatch"  # the manifest's key or identity does not give this key
    BAD_FILE_NAME = "bad_file_name"  # a name that is not a plain file name of the entry
    FILES_DIFFER = "files_differ"  # the directory holds other files than the manifest lists
    SIZE_MISMATCH = "size_mismatch"
    DIGEST_MISMATCH = "digest_mismatch"
    IO_FAILED = "io_failed"  # an I/O error while reading the entry (e.g. files removed under it)
    FILE_INVALID = "file_invalid"  # a safetensors file that does not parse
    TENSORS_DIFFER = "tensors_differ"  # the files' tensors are not the manifest's `tensors`


@dataclass(frozen=True)
class Rejection:
    kind: RejectionKind
    detail: str

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}"


def _malformed(detail: str) -> Rejection:
    return Rejection(RejectionKind.MANIFEST_MALFORMED, detail)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _file_problem(name: object, meta: object) -> Rejection | None:
    if not is_plain_file_name(name) or name == MANIFEST:
        return Rejection(RejectionKind.BAD_FILE_NAME, f"file name {name!r} is not a plain file name of the entry")
    if not isinstance(meta, Mapping):
        return _malformed(f"files[{name!r}] is not an object")
    if not _is_count(meta.get("size")):
        return _malformed(f"files[{name!r}].size is not a byte count")
    if not is_key(meta.get("sha256_chunked")):  # a SHA-256 hex digest, as keys are
        return _malformed(f"files[{name!r}].sha256_chunked is not a SHA-256 hex digest")
    return None


def _tensor_problem(name: object, meta: object, files: Mapping[str, object]) -> Rejection | None:
    if not isinstance(name, str) or not isinstance(meta, Mapping):
        return _malformed(f"tensors[{name!r}] is not an object")
    if meta.get("file") not in files:
        return _malformed(f"tensors[{name!r}].file is not one of the entry's files")
    if meta.get("dtype") not in TORCH_DTYPE_NAMES:
        return _malformed(f"tensors[{name!r}].dtype {meta.get('dtype')!r} is not a supported dtype")
    shape = meta.get("shape")
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        return _malformed(f"tensors[{name!r}].shape is not a list of sizes")
    if not _is_count(meta.get("nbytes")):
        return _malformed(f"tensors[{name!r}].nbytes is not a byte count")
    return None


def manifest_problem(manifest: object, key: str) -> Rejection | None:
    """Why `manifest` cannot describe the entry `key`, or None. Checks structure and types,
    the schema, and that the key is the digest of the manifest's identity."""
    if not isinstance(manifest, Mapping):
        return _malformed("the manifest is not an object")
    if manifest.get("schema") != SCHEMA:
        return Rejection(RejectionKind.SCHEMA_MISMATCH, f"schema {manifest.get('schema')!r}, this dlo reads {SCHEMA!r}")
    identity = manifest.get("identity")
    if not isinstance(identity, Mapping):
        return _malformed("identity is not an object")
    if manifest.get("key") != key or digest_of(identity) != key:
        return Rejection(RejectionKind.KEY_MISMATCH, "the manifest's key or identity does not hash to the entry's key")
    files, tensors = manifest.get("files"), manifest.get("tensors")
    if not isinstance(files, Mapping) or not files:
        return _malformed("files is not a non-empty object")
    if not isinstance(tensors, Mapping) or not tensors:
        return _malformed("tensors is not a non-empty object")
    for name, meta in files.items():
        problem = _file_problem(name, meta)
        if problem is not None:
            return problem
    for name, meta in tensors.items():
        problem = _tensor_problem(name, meta, files)
        if problem is not None:
            return problem
    return None
