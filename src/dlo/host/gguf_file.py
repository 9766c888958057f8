"""The validated tensor index of a GGUF file, read before anything maps the file.

A GGUF file (llama.cpp's format, which diffusers' GGUF loader reads with the `gguf` package) is
"GGUF", a version, the tensor and metadata counts, the metadata key/value pairs, one record per
tensor (name, dims, ggml type, offset into the data section), then the data section, which
starts at the file's alignment. Every count, length and offset in it is untrusted: each is
checked against the bytes left before it is used, so a crafted count cannot make the parser
allocate or loop beyond the file, and each violation is one `CheckpointError` kind, as for
safetensors headers (safetensors_file.py). A tensor's bytes must be what its type and dims
need, lie inside the file, start at the alignment, and overlap no other tensor. `GgufFile` then
maps the file as a safetensors file is mapped: shared, read-only, each tensor a view.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from dlo.errors import ConfigError
from dlo.host.safetensors_file import HEADER_SIZE_CAP, CheckpointError, CheckpointErrorKind, SafetensorsFile, TensorEntry

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # 64-bit counts and lengths (version 1 had 32-bit ones and is not read)
# ggml's own limit is 4, but the gguf package writes (and diffusers reads) the 5-D convolution
# weights of video models, such as Wan's patch embedding: a bound on the loop, not ggml's rule.
MAX_DIMS = 8
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
RESERVED_PREFIX = "GGUF."
MAX_ARRAY_NESTING = 8
# Far above any real model's counts (a DiT has a few thousand tensors, an LLM's tokenizer lives in
# arrays, not pairs), far below what a crafted 100 MiB header could list: parsing stays quick.
MAX_TENSORS = 100_000
MAX_METADATA_PAIRS = 100_000
_READ_CHUNK = 2**20

# GGUF metadata value types: fixed-size ones by struct format; 8 is a string, 9 an array.
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# ggml types stored as plain elements (the gguf package's reader gives them as these dtypes);
# every other type is packed: uint8 rows of its blocks.
PLAIN_TYPES = {
    "F32": torch.float32, "F16": torch.float16, "F64": torch.float64,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    quant: str  # the ggml type's name: Q8_0, Q4_K, F32, ...
    shape: tuple[int, ...]  # torch's order (the file lists dims innermost first)
    begin: int  # absolute file offset
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class GgufIndex:
    path: Path
    version: int
    alignment: int
    tensors: dict[str, GgufTensor]
    metadata: dict[str, object]  # the scalar and string values (arrays are skipped)


class _Cursor:
    """Reads the header forward with bounds checks, a chunk of the file at a time."""

    def __init__(self, path: Path, fd: int, size: int) -> None:
        self.path, self.fd, self.size = path, fd, size
        self.pos = 0
        self._buffer = b""
        self._buffer_start = 0

    def take(self, nbytes: int, what: str) -> bytes:
        if self.pos + nbytes > self.size:
            raise CheckpointError(
                CheckpointErrorKind.TRUNCATED, self.path,
                f"{what} at byte {self.pos} needs {nbytes} bytes, the file ends at {self.size}",
            )
        if self.pos + nbytes > HEADER_SIZE_CAP:
            raise CheckpointError(
                CheckpointErrorKind.HEADER_TOO_LARGE, self.path, f"the header runs past the cap of {HEADER_SIZE_CAP} bytes"
            )
        offset = self.pos - self._buffer_start
        if offset + nbytes > len(self._buffer):
            self._buffer = os.pread(self.fd, max(nbytes, _READ_CHUNK), self.pos)
            self._buffer_start, offset = self.pos, 0
            if len(self._buffer) < nbytes:  # the file shrank while it was read
                raise CheckpointError(CheckpointErrorKind.TRUNCATED, self.path, f"{what}: the file ended while it was read")
        self.pos += nbytes
        return self._buffer[offset : offset + nbytes]

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.unpack("<Q", f"{what}'s length")
        try:
            return self.take(length, what).decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(CheckpointErrorKind.HEADER_INVALID, self.path, f"{what} is not UTF-8") from None

    def skip_array(self, what: str, depth: int) -> None:
        if depth > MAX_ARRAY_NESTING:
            raise CheckpointError(CheckpointErrorKind.HEADER_INVALID, self.path, f"{what}: arrays nested deeper than {MAX_ARRAY_NESTING}")
        element_type = self.unpack("<I", f"{what}'s element type")
        count = self.unpack("<Q", f"{what}'s length")
        if element_type in _FIXED:
            self.take(count * struct.calcsize(_FIXED[element_type]), what)
            return
        if element_type not in (_STRING, _ARRAY):
            raise CheckpointError(CheckpointErrorKind.HEADER_INVALID, self.path, f"{what}: unknown element type {element_type}")
        if count * 8 > self.size - self.pos:  # each string or array takes at least 8 bytes
            raise CheckpointError(
                CheckpointErrorKind.TRUNCATED, self.path, f"{what}: {count} elements cannot fit in the {self.size}-byte file"
            )
        for _ in range(count):
            self.string(what) if element_type == _STRING else self.skip_array(what, depth + 1)


def _metadata(cursor: _Cursor, count: int) -> dict[str, object]:
    values: dict[str, object] = {}
    seen: set[str] = set()
    for index in range(count):
        key = cursor.string(f"metadata key {index}")
        if key in seen:
            raise CheckpointError(CheckpointErrorKind.DUPLICATE_KEY, cursor.path, f"metadata key {key!r} is given twice")
        if key.startswith(RESERVED_PREFIX):  # the gguf package's reader keeps its own fields under these names
            raise CheckpointError(CheckpointErrorKind.HEADER_INVALID, cursor.path, f"metadata key {key!r} is reserved")
        seen.add(key)
        value_type = cursor.unpack("<I", f"{key!r}'s type")
        if value_type in _FIXED:
            value = cursor.unpack(_FIXED[value_type], repr(key))
        elif value_type == _STRING:
            value = cursor.string(repr(key))
        elif value_type == _ARRAY:
            cursor.skip_array(repr(key), 1)
            value = None
        else:
            raise CheckpointError(CheckpointErrorKind.HEADER_INVALID, cursor.path, f"{key!r}: unknown value type {value_type}")
        if value is not None:
            values[key] = value
        if key == ALIGNMENT_KEY and (value_type != _UINT32 or value == 0 or value & (value - 1)):
            raise CheckpointError(
                CheckpointErrorKind.HEADER_INVALID, cursor.path, f"{ALIGNMENT_KEY} must be a power of two as a uint32, got {value!r}"
            )
    return values


def _tensor_record(cursor: _Cursor, index: int) -> tuple[str, str, tuple[int, ...], int, int]:
    """(name, quant type, torch shape, offset in the data section, byte count) of one record."""
    import gguf

    kinds = CheckpointErrorKind
    name = cursor.string(f"tensor name {index}")
    n_dims = cursor.unpack("<I", f"{name!r}'s dimension count")
    if not 1 <= n_dims <= MAX_DIMS:
        raise CheckpointError(kinds.HEADER_INVALID, cursor.path, f"{name!r}: {n_dims} dimensions (1 to {MAX_DIMS} are valid)")
    dims = [cursor.unpack("<Q", f"{name!r}'s dims") for _ in range(n_dims)]
    type_id = cursor.unpack("<I", f"{name!r}'s type")
    offset = cursor.unpack("<Q", f"{name!r}'s offset")
    try:
        quant = gguf.GGMLQuantizationType(type_id)
        values_per_block, block_bytes = gguf.GGML_QUANT_SIZES[quant]
    except (ValueError, KeyError):
        raise CheckpointError(kinds.UNKNOWN_DTYPE, cursor.path, f"{name!r}: ggml type {type_id} is not one the gguf package knows") from None
    numel = 1
    for dim in dims:
        numel *= dim
        if numel > cursor.size * values_per_block:  # more values than the file could hold
            raise CheckpointError(kinds.SIZE_MISMATCH, cursor.path, f"{name!r}: dims {dims} need more bytes than the file holds")
    if dims[0] % values_per_block:
        raise CheckpointError(
            kinds.SIZE_MISMATCH, cursor.path,
            f"{name!r}: {quant.name} packs rows of a multiple of {values_per_block} values, its rows have {dims[0]}",
        )
    return name, quant.name, tuple(reversed(dims)), offset, numel // values_per_block * block_bytes


def read_gguf_index(path: str | Path) -> GgufIndex:
    """The validated header of the GGUF file at `path`, without mapping it."""
    path = Path(path)
    with open(path, "rb") as handle:
        return _read_index(path, handle.fileno(), os.fstat(handle.fileno()).st_size)


def _read_index(path: Path, fd: int, size: int) -> GgufIndex:
    kinds = CheckpointErrorKind
    cursor = _Cursor(path, fd, size)
    if cursor.take(len(MAGIC), "the magic") != MAGIC:
        raise CheckpointError(kinds.HEADER_INVALID, path, "does not start with GGUF's magic bytes: not a GGUF file")
    version = cursor.unpack("<I", "the version")
    if version not in VERSIONS:
        raise CheckpointError(kinds.HEADER_INVALID, path, f"GGUF version {version}; dlo reads versions {VERSIONS}")
    tensor_count = cursor.unpack("<Q", "the tensor count")
    metadata_count = cursor.unpack("<Q", "the metadata count")
    if (tensor_count + metadata_count) * 8 > cursor.size:  # each record takes at least 8 bytes
        raise CheckpointError(
            kinds.TRUNCATED, path, f"{tensor_count} tensors and {metadata_count} metadata pairs cannot fit in {cursor.size} bytes"
        )
    if tensor_count > MAX_TENSORS or metadata_count > MAX_METADATA_PAIRS:
        raise CheckpointError(
            kinds.HEADER_TOO_LARGE, path,
            f"{tensor_count} tensors and {metadata_count} metadata pairs; dlo reads at most {MAX_TENSORS} and {MAX_METADATA_PAIRS}",
        )
    metadata = _metadata(cursor, metadata_count)
    alignment = metadata.get(ALIGNMENT_KEY, DEFAULT_ALIGNMENT)
    records = [_tensor_record(cursor, index) for index in range(tensor_count)]
    data_start = -(-cursor.pos // alignment) * alignment
    tensors: dict[str, GgufTensor] = {}
    for name, quant, shape, offset, nbytes in records:
        if name in tensors:
            raise CheckpointError(kinds.DUPLICATE_KEY, path, f"tensor {name!r} is listed twice")
        if offset % alignment:
            raise CheckpointError(kinds.MISALIGNED, path, f"{name!r} starts at data offset {offset}, not a multiple of the alignment {alignment}")
        begin = data_start + offset
        if begin + nbytes > cursor.size:
            raise CheckpointError(
                kinds.TRUNCATED, path, f"{name!r} ({quant}, {nbytes} bytes at byte {begin}) runs past the end of the {cursor.size}-byte file"
            )
        tensors[name] = GgufTensor(name, quant, shape, begin, begin + nbytes)
    ordered = sorted(tensors.values(), key=lambda t: (t.begin, t.end))
    for before, after in zip(ordered, ordered[1:]):
        if after.begin < before.end:
            raise CheckpointError(kinds.OFFSETS_INVALID, path, f"{after.name!r} overlaps {before.name!r}")
    return GgufIndex(path, version, alignment, tensors, metadata)


def stored_entry(tensor: GgufTensor) -> TensorEntry:
    """How the file holds `tensor`, as diffusers' GGUF loader reads it: plain types as their
    dtype and shape, every other type as uint8 rows of its packed blocks (its `ggml_type`)."""
    if tensor.quant in PLAIN_TYPES:
        return TensorEntry(tensor.name, PLAIN_TYPES[tensor.quant], tensor.shape, tensor.begin, tensor.end)
    rows = tensor.shape[:-1]
    row_bytes = tensor.nbytes // max(1, math.prod(rows))
    return TensorEntry(tensor.name, torch.uint8, (*rows, row_bytes), tensor.begin, tensor.end, tensor.quant)


def diffusers_gguf_types() -> set[str]:
    """The ggml types diffusers' GGUF loader reads: plain F32/F16 and those it dequantizes."""
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    return {"F32", "F16", *(quant.name for quant in SUPPORTED_GGUF_QUANT_TYPES)}


def check_diffusers_reads(index: GgufIndex, what: str) -> None:
    """Refuse, in one line, a file holding a ggml type diffusers' GGUF loader cannot read."""
    unsupported = sorted({t.quant for t in index.tensors.values()} - diffusers_gguf_types())
    if unsupported:
        raise ConfigError(
            f"{what}: diffusers' GGUF loader has no dequantization for {', '.join(unsupported)}; "
            f"it reads {', '.join(sorted(diffusers_gguf_types()))}"
        )


class GgufFile(SafetensorsFile):
    """A validated GGUF file mapped read-only and shared like a safetensors file; its entries
    are `stored_entry`s under the file's tensor names."""

    def _read_header(self, fd: int, size: int) -> tuple[dict[str, TensorEntry], dict]:
        index = _read_index(self.path, fd, size)
        return {name: stored_entry(tensor) for name, tensor in index.tensors.items()}, index.metadata
