"""Read-only, validated, memory-mapped safetensors files, and writing one with each tensor at
a chosen offset.

The header is untrusted input. It is parsed the way safetensors' own Rust core validates it:
a size cap, checked sizes, every tensor's byte count equal to numel x itemsize, offsets
sorted, contiguous and covering the data section exactly. Each violation is one named
`CheckpointError` kind. Tensors are views into a shared read-only mapping, so processes that
map the same file share its page-cache pages.
"""

from __future__ import annotations

import contextlib
import enum
import json
import mmap
import os
import struct
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from dlo.errors import DloError

HEADER_SIZE_CAP = 100 * 2**20  # the Rust core's limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


SAFETENSORS_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}  # torch -> header name
PAD_PREFIX = ".pad."  # a writer's padding tensors: no state-dict key starts with a dot
DATA_ALIGNMENT = 4096  # write_file starts the data section at a multiple of this (4 KiB: a page on x86-64)


class CheckpointErrorKind(enum.Enum):
    TRUNCATED = "truncated"  # shorter than its 8-byte length prefix or the header length it gives
    HEADER_TOO_LARGE = "header_too_large"  # header length above the cap
    HEADER_INVALID = "header_invalid"  # not UTF-8 JSON of the expected structure
    UNKNOWN_DTYPE = "unknown_dtype"
    SIZE_MISMATCH = "size_mismatch"  # a tensor's byte range does not match dtype x shape
    OFFSETS_INVALID = "offsets_invalid"  # overlapping, gaps, out of range, not covering the data
    MISALIGNED = "misaligned"  # a tensor's file offset is not a multiple of its element size
    MISSING_SHARD = "missing_shard"  # the index names a file that is not there
    DUPLICATE_KEY = "duplicate_key"  # one tensor name in two shards
    INDEX_INVALID = "index_invalid"  # *.safetensors.index.json unreadable or inconsistent
    NO_CHECKPOINT = "no_checkpoint"  # no safetensors weights in the directory
    FP8_SCALES = "fp8_scales"  # float8 weights without scales dlo recognizes, or with unusable ones


class CheckpointError(DloError):
    def __init__(self, kind: CheckpointErrorKind, path: Path | str, detail: str) -> None:
        super().__init__(f"{path}: {kind.value}: {detail}")
        self.kind = kind
        self.path = Path(path)


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int
    # A GGUF file's packed tensor: its ggml type (Q8_0, Q4_K, BF16...), its bytes held as uint8
    # rows of that type's blocks (See [Note: GGUF streaming]); None for plain tensors.
    ggml_type: str | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def aligned(self) -> bool:
        """Whether a typed view can start here. The format allows any offset; safetensors'
        own writer aligns, other writers may not."""
        return self.begin % self.dtype.itemsize == 0


def _fail(kind: CheckpointErrorKind, path: Path, detail: str) -> CheckpointError:
    return CheckpointError(kind, path, detail)


def _brief(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _checked_nbytes(shape: list[int], itemsize: int, limit: int) -> int | None:
    """numel x itemsize, or None once it exceeds `limit` (checked arithmetic: a crafted shape
    cannot build numbers larger than the file)."""
    if 0 in shape:
        return 0
    nbytes = itemsize
    for dim in shape:
        nbytes *= dim
        if nbytes > limit:
            return None
    return nbytes


def parse_header(path: Path, prefix: bytes, file_size: int) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Validate the header bytes (`prefix` = the first 8 + N bytes of the file)."""
    kinds = CheckpointErrorKind
    if file_size < 8 or len(prefix) < 8:
        raise _fail(kinds.TRUNCATED, path, f"{file_size} bytes, less than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", prefix[:8])
    if header_len > HEADER_SIZE_CAP:
        raise _fail(kinds.HEADER_TOO_LARGE, path, f"header length {header_len} exceeds the cap {HEADER_SIZE_CAP}")
    if 8 + header_len > file_size:  # a header cut off (a partial download or copy)
        raise _fail(kinds.TRUNCATED, path, f"header length {header_len} runs past the end of the {file_size}-byte file")
    try:
        header = json.loads(prefix[8 : 8 + header_len].decode("utf-8"))
    except (ValueError, RecursionError) as err:  # not UTF-8, not JSON, absurd nesting or numbers
        raise _fail(kinds.HEADER_INVALID, path, f"header is not UTF-8 JSON ({str(err)[:200]})") from None
    if not isinstance(header, dict):
        raise _fail(kinds.HEADER_INVALID, path, "header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail(kinds.HEADER_INVALID, path, "__metadata__ must map strings to strings")

    data_start = 8 + header_len
    entries: list[TensorEntry] = []
    for key, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _fail(kinds.HEADER_INVALID, path, f"{key!r}: expected dtype, shape and data_offsets")
        shape, offsets = info["shape"], info["data_offsets"]
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in shape)
        ):
            raise _fail(kinds.HEADER_INVALID, path, f"{key!r}: shape {_brief(shape)} is not a list of sizes")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        ):
            raise _fail(kinds.HEADER_INVALID, path, f"{key!r}: data_offsets {offsets!r} is not two offsets")
        dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise _fail(kinds.UNKNOWN_DTYPE, path, f"{key!r}: dtype {info['dtype']!r}")
        begin, end = offsets
        nbytes = _checked_nbytes(shape, dtype.itemsize, limit=file_size)
        if end < begin or nbytes is None or end - begin != nbytes:
            needs = "more bytes than the file holds" if nbytes is None else f"{nbytes} bytes"
            raise _fail(
                kinds.SIZE_MISMATCH,
                path,
                f"{key!r}: {info['dtype']} {_brief(shape)} needs {needs}, data_offsets give {end - begin}",
            )
        entries.append(TensorEntry(key, dtype, tuple(shape), data_start + begin, data_start + end))

    cursor = data_start
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin != cursor:
            what = "overlaps the previous tensor" if entry.begin < cursor else "leaves a gap"
            raise _fail(kinds.OFFSETS_INVALID, path, f"{entry.key!r} at {entry.begin - data_start} {what}")
        cursor = entry.end
    if cursor != file_size:
        raise _fail(
            kinds.OFFSETS_INVALID, path, f"tensors cover {cursor - data_start} data bytes, the file holds {file_size - data_start}"
        )
    return {e.key: e for e in entries}, metadata


def _read_header(path: Path, fd: int, size: int) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    head = os.pread(fd, 8, 0)
    header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    prefix = head + os.pread(fd, min(header_len, HEADER_SIZE_CAP + 1, max(size - 8, 0)), 8)
    return parse_header(path, prefix, size)


def read_entries(path: Path) -> dict[str, TensorEntry]:
    """The validated header of the file at `path`, without mapping it."""
    with open(path, "rb") as handle:
        return _read_header(path, handle.fileno(), os.fstat(handle.fileno()).st_size)[0]


class SafetensorsFile:
    """One validated file, mapped read-only and shared (MAP_SHARED, PROT_READ). `private`: an
    unlinked file of this process's own (what a load computed, dlo.host.single_file_layout's
    `private_file`): its `path` is a label, and its pages are this process's memory."""

    private = False

    def __init__(self, path: str | Path, handle: BinaryIO | None = None) -> None:
        """Opens `path`, or reads and maps the already-open `handle` (whose position is left
        alone and which the caller still owns and closes): a cache entry validates and maps
        the very descriptors it hashed."""
        self.path = Path(path)
        with contextlib.ExitStack() as stack:
            if handle is None:
                handle = stack.enter_context(open(self.path, "rb"))
            fd = handle.fileno()
            stat = os.fstat(fd)
            size = stat.st_size
            self.entries, self.metadata = self._read_header(fd, size)
            self.size = size
            self.identity = (stat.st_dev, stat.st_ino, size)  # the file mapped: one reopened must be it
            # Empty files cannot be mapped; a valid header makes the file at least 8 bytes.
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        with warnings.catch_warnings():
            # torch warns that the buffer is read-only: dlo only ever reads these views.
            warnings.simplefilter("ignore", UserWarning)
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def _read_header(self, fd: int, size: int) -> tuple[dict[str, TensorEntry], dict]:
        """The validated entries and metadata of the open file (GgufFile reads a GGUF header)."""
        return _read_header(self.path, fd, size)

    def view(self, key: str) -> torch.Tensor:
        """The tensor `key` as a zero-copy view of the mapping. Never write to it."""
        return self.view_entry(self.entries[key])

    def view_entry(self, entry: TensorEntry) -> torch.Tensor:
        """The tensor `entry` places in this file (one of its own, or a part of one under
        another name: see dlo.host.single_file_layout) as a zero-copy view. Never write to it."""
        if not entry.aligned:
            raise CheckpointError(
                CheckpointErrorKind.MISALIGNED, self.path,
                f"{entry.key!r} starts at byte {entry.begin}, not a multiple of {entry.dtype.itemsize}",
            )
        raw = self._bytes[entry.begin : entry.end]
        return raw.view(entry.dtype).view(entry.shape)

    def region(self, begin: int, nbytes: int) -> torch.Tensor:
        """Bytes [begin, begin + nbytes) of the file as a uint8 view of the mapping. Never write to it."""
        if not 0 <= begin <= begin + nbytes <= self.size:
            raise ValueError(f"bytes [{begin}, {begin + nbytes}) are not inside {self.path} ({self.size} bytes)")
        return self._bytes[begin : begin + nbytes]

    def advise_dontneed(self) -> None:
        """Drop this mapping's page table entries (MADV_DONTNEED): its pages are no longer
        this process's, and a later read faults them in again from the page cache or the file."""
        if self._bytes is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` views this mapping (False once closed)."""
        if self._bytes is None:
            return False
        start = self._bytes.data_ptr()
        return tensor.device.type == "cpu" and start <= tensor.data_ptr() < start + self.size

    def when_collected(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the mapping is collected: this object and every view of it
        are gone (a view keeps the mapping alive, see close())."""
        weakref.finalize(self._map, callback)

    def close(self) -> bool:
        """Unmap, now: views taken earlier must not be used afterwards. (torch.frombuffer
        keeps the mmap object alive but does not hold its buffer exported, so close() does
        not wait for views: callers give live tensors private copies first.) False if the
        mapping stays: a buffer export by someone else (e.g. a memoryview) still holds it."""
        self._bytes = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:
            return False
        return True


def write_file(
    handle: BinaryIO,
    placed: list[tuple[str, torch.Tensor, int]],
    metadata: dict[str, str],
    pad_name: str = PAD_PREFIX,
    tail: int = 0,
) -> dict[str, int]:
    """Write a safetensors file whose data section holds each (name, tensor, offset) at that
    byte offset (in increasing order, not overlapping), into the empty file `handle`.

    safetensors' own writer chooses the order itself (by dtype, then name); this one is for
    files laid out like something else, e.g. a cache entry laid out like the streamed blocks.
    The format allows no holes, so each gap holds a uint8 padding tensor named `pad_name`
    and a number (`pad_name` starts with PAD_PREFIX; the files of one checkpoint need
    different ones: a name may be in one file only); the header is padded with spaces so that the data section starts at a
    multiple of DATA_ALIGNMENT. `tail` more bytes of padding close the data section. Any
    safetensors reader reads the file. Returns the padding tensors' names and sizes."""
    header: dict[str, object] = {"__metadata__": metadata}
    pads: dict[str, int] = {}
    cursor = 0
    for name, tensor, offset in placed:
        if offset < cursor:
            raise ValueError(f"{name!r} at byte {offset} overlaps the tensor before it (which ends at {cursor})")
        if offset > cursor:
            pad = f"{pad_name}{len(pads)}"
            pads[pad] = offset - cursor
            header[pad] = {"dtype": "U8", "shape": [offset - cursor], "data_offsets": [cursor, offset]}
        cursor = offset + tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPE[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, cursor]}
    if tail:
        pad = f"{pad_name}{len(pads)}"
        pads[pad] = tail
        header[pad] = {"dtype": "U8", "shape": [tail], "data_offsets": [cursor, cursor + tail]}
        cursor += tail
    text = json.dumps(header, separators=(",", ":")).encode()
    data_start = -(-(8 + len(text)) // DATA_ALIGNMENT) * DATA_ALIGNMENT
    text += b" " * (data_start - 8 - len(text))
    handle.write(struct.pack("<Q", len(text)) + text)
    for name, tensor, offset in placed:
        if tensor.numel():
            handle.seek(data_start + offset)
            handle.write(memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()))
    handle.truncate(data_start + cursor)  # the padding reads as zeros
    handle.flush()
    return pads
