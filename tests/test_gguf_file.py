"""dlo's GGUF header checks (dlo.host.gguf_file): files written by the gguf package's writer read
back as it reads them; crafted, truncated and randomly damaged files are refused by
CheckpointError kind before anything maps them, never with another exception."""

from __future__ import annotations

import random
import sys
import struct

import numpy as np
import pytest

from dlo.cli.main import main
from dlo.errors import ConfigError
from dlo.host.gguf_file import read_gguf_index
from dlo.host.safetensors_file import CheckpointError, CheckpointErrorKind as Kind
from dlo.pipelines.single_file import check_single_file

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
UINT8, UINT32, STRING, ARRAY = 0, 4, 8, 9


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def gguf_bytes(tensors, metadata=(), version=3, alignment=32, data=b"", tensor_count=None) -> bytes:
    """A GGUF file from its parts: tensors as (name, dims innermost first, type id, data offset),
    metadata as (key, value type, packed value)."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if tensor_count is None else tensor_count, len(metadata))
    for key, value_type, payload in metadata:
        head += _string(key) + struct.pack("<I", value_type) + payload
    for name, dims, type_id, offset in tensors:
        head += _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)
    return head + b"\0" * (-len(head) % alignment) + data


# Two tensors: a Q8_0 (2 rows of 32 values: 2 x 34 bytes) and an F32 [4], 32-byte aligned.
VALID = [(b"blocks.0.w", (32, 2), Q.Q8_0, 0), (b"blocks.0.b", (4,), Q.F32, 96)]
VALID_DATA = bytes(range(68)) + b"\0" * 28 + struct.pack("<4f", 1, 2, 3, 4)


def _write(tmp_path, content: bytes, name="model.gguf"):
    path = tmp_path / name
    path.write_bytes(content)
    return path


def _kind(path) -> Kind:
    with pytest.raises(CheckpointError) as caught:
        read_gguf_index(path)
    return caught.value.kind


def test_a_file_the_gguf_writer_wrote_reads_back_as_the_gguf_reader_reads_it(tmp_path):
    path = tmp_path / "written.gguf"
    writer = gguf.GGUFWriter(path, "dlo-test")
    writer.add_array("tokens", ["a", "bc", "def"])  # an array of strings, skipped
    writer.add_array("nested", [[1, 2], [3]])
    rows = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    writer.add_tensor("blocks.0.attn.weight", gguf.quants.quantize(rows, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.add_tensor("blocks.0.attn.bias", np.arange(5, dtype=np.float32))
    writer.add_tensor("norm.weight", np.ones((2, 3), dtype=np.float16))
    writer.add_tensor("patch_embedding.weight", np.ones((2, 1, 1, 2, 2), dtype=np.float32))  # 5-D, as Wan's
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    index = read_gguf_index(path)
    reader = gguf.GGUFReader(path)
    assert index.version == 3 and index.alignment == 32 and index.metadata["general.architecture"] == "dlo-test"
    assert list(index.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        mine = index.tensors[tensor.name]
        assert (mine.quant, mine.nbytes, mine.begin) == (tensor.tensor_type.name, tensor.n_bytes, tensor.data_offset)
        assert mine.shape == tuple(reversed(tensor.shape.tolist()))


def test_a_crafted_valid_file_reads_and_its_byte_ranges_are_the_ones_given(tmp_path):
    index = read_gguf_index(_write(tmp_path, gguf_bytes(VALID, data=VALID_DATA)))
    q8, f32 = index.tensors["blocks.0.w"], index.tensors["blocks.0.b"]
    assert (q8.quant, q8.shape, q8.nbytes, f32.quant, f32.shape, f32.nbytes) == ("Q8_0", (2, 32), 68, "F32", (4,), 16)
    assert f32.begin - q8.begin == 96 and q8.begin % 32 == 0


@pytest.mark.parametrize(
    "content, kind, words",
    [
        (b"GGU", Kind.TRUNCATED, "the magic"),
        (b"GGML" + bytes(20), Kind.HEADER_INVALID, "magic"),
        (gguf_bytes(VALID, version=1, data=VALID_DATA), Kind.HEADER_INVALID, "version 1"),
        (gguf_bytes(VALID, data=VALID_DATA, tensor_count=2**60), Kind.TRUNCATED, "cannot fit"),
        (gguf_bytes(VALID, data=VALID_DATA + bytes(2**20), tensor_count=100_001), Kind.HEADER_TOO_LARGE, "at most 100000"),
        (gguf_bytes([(b"w", (32,), Q.Q8_0, 0)], metadata=[(b"k", STRING, struct.pack("<Q", 2**63))]), Kind.TRUNCATED, "'k'"),
        (gguf_bytes([(b"w", (32,), Q.Q8_0, 0)], metadata=[(b"k", ARRAY, struct.pack("<IQ", UINT8, 2**40))]), Kind.TRUNCATED, "'k'"),
        (gguf_bytes([], metadata=[(b"k", ARRAY, struct.pack("<IQ", ARRAY, 1) * 9 + struct.pack("<IQ", UINT8, 0))]),
         Kind.HEADER_INVALID, "nested"),
        (gguf_bytes([], metadata=[(b"k", 13, b"")]), Kind.HEADER_INVALID, "unknown value type 13"),
        (gguf_bytes([], metadata=[(b"k", UINT8, b"\1"), (b"k", UINT8, b"\2")]), Kind.DUPLICATE_KEY, "'k'"),
        (gguf_bytes([], metadata=[(b"k", ARRAY, struct.pack("<IQ", UINT8, 0)), (b"k", UINT8, b"\2")]), Kind.DUPLICATE_KEY, "'k'"),
        (gguf_bytes([], metadata=[(b"GGUF.version", UINT32, struct.pack("<I", 3))]), Kind.HEADER_INVALID, "reserved"),
        (gguf_bytes(VALID, metadata=[(b"general.alignment", ARRAY, struct.pack("<IQI", UINT32, 1, 64))], data=VALID_DATA),
         Kind.HEADER_INVALID, "power of two"),
        (gguf_bytes(VALID, metadata=[(b"general.alignment", UINT32, struct.pack("<I", 24))], data=VALID_DATA),
         Kind.HEADER_INVALID, "power of two"),
        (gguf_bytes(VALID, metadata=[(b"general.alignment", STRING, _string(b"32"))], data=VALID_DATA),
         Kind.HEADER_INVALID, "power of two"),
        (gguf_bytes([(b"\xff\xfe", (4,), Q.F32, 0)], data=bytes(16)), Kind.HEADER_INVALID, "not UTF-8"),
        (gguf_bytes([(b"w", (1,) * 8 + (4,), Q.F32, 0)], data=bytes(16)), Kind.HEADER_INVALID, "9 dimensions"),
        (gguf_bytes([(b"w", (4,), 99, 0)], data=bytes(16)), Kind.UNKNOWN_DTYPE, "ggml type 99"),
        (gguf_bytes([(b"w", (48, 2), Q.Q8_0, 0)], data=bytes(128)), Kind.SIZE_MISMATCH, "multiple of 32"),
        (gguf_bytes([(b"w", (2**40, 2**40), Q.F32, 0)], data=bytes(16)), Kind.SIZE_MISMATCH, "more bytes than the file"),
        (gguf_bytes([(b"w", (4,), Q.F32, 8)], data=bytes(64)), Kind.MISALIGNED, "alignment 32"),
        (gguf_bytes([(b"w", (4,), Q.F32, 0), (b"v", (16,), Q.F32, 0)], data=bytes(64)), Kind.OFFSETS_INVALID, "overlaps"),
        (gguf_bytes([(b"w", (4,), Q.F32, 0), (b"w", (4,), Q.F32, 32)], data=bytes(64)), Kind.DUPLICATE_KEY, "'w'"),
        (gguf_bytes([(b"w", (4,), Q.F32, 2**62)], data=bytes(16)), Kind.TRUNCATED, "runs past the end"),
        (gguf_bytes(VALID, data=VALID_DATA[:-1]), Kind.TRUNCATED, "'blocks.0.b'"),
    ],
    ids=lambda value: value.value if isinstance(value, Kind) else None,
)
def test_a_crafted_file_is_refused_by_kind_naming_what_is_wrong(tmp_path, content, kind, words):
    path = _write(tmp_path, content)
    with pytest.raises(CheckpointError) as caught:
        read_gguf_index(path)
    assert caught.value.kind is kind and words in str(caught.value)


def test_every_cut_of_a_valid_file_is_refused_as_truncated(tmp_path):
    content = gguf_bytes(VALID, metadata=[(b"name", STRING, _string(b"tiny"))], data=VALID_DATA)
    kinds = {_kind(_write(tmp_path, content[:cut])) for cut in range(len(content))}
    assert kinds == {Kind.TRUNCATED}


def test_random_damage_is_refused_by_kind_or_reads_as_ranges_inside_the_file(tmp_path):
    """Seeded byte flips anywhere in the header: either one CheckpointError, or an index whose
    every tensor lies inside the file and overlaps no other (never another exception)."""
    content = gguf_bytes(VALID, metadata=[(b"name", STRING, _string(b"tiny")), (b"ids", ARRAY, struct.pack("<IQ3I", UINT32, 3, 1, 2, 3))], data=VALID_DATA)
    header_end = len(content) - len(VALID_DATA)
    rng = random.Random(0)
    refused = 0
    for trial in range(400):
        damaged = bytearray(content)
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(header_end)] = rng.randrange(256)
        path = _write(tmp_path, bytes(damaged), f"damaged-{trial % 4}.gguf")
        try:
            index = read_gguf_index(path)
        except CheckpointError:
            refused += 1
            continue
        ranges = sorted((t.begin, t.end) for t in index.tensors.values())
        assert all(0 <= begin <= end <= len(damaged) for begin, end in ranges)
        assert all(a_end <= b_begin for (_, a_end), (b_begin, _) in zip(ranges, ranges[1:]))
    assert refused > 100  # most damage is caught; the rest reads as ranges inside the file


def test_check_single_file_refuses_a_damaged_file_and_a_type_diffusers_cannot_dequantize_in_one_line(tmp_path):
    damaged = _write(tmp_path, gguf_bytes(VALID, data=VALID_DATA[:-1]), "damaged.gguf")
    with pytest.raises(ConfigError) as caught:
        check_single_file(damaged, "--transformer")
    assert str(caught.value).startswith(f"--transformer {damaged}: truncated: ")
    q8_1 = _write(tmp_path, gguf_bytes([(b"w", (32,), Q.Q8_1, 0)], data=bytes(64)), "q8_1.gguf")
    with pytest.raises(ConfigError, match=r"no dequantization for Q8_1; it reads .*Q8_0") as caught:
        check_single_file(q8_1, "--transformer")
    assert "\n" not in str(caught.value)
    check_single_file(_write(tmp_path, gguf_bytes(VALID, data=VALID_DATA), "valid.gguf"), "--transformer")


def test_inspect_shows_a_files_tensor_types_and_bytes_per_block_and_refuses_a_damaged_one(tmp_path, capsys):
    tensors = [(f"blocks.{i}.{name}".encode(), dims, kind, 128 * (2 * i + j)) for i in range(3)
               for j, (name, dims, kind) in enumerate([("w", (32, 2), Q.Q8_0), ("b", (4,), Q.F32)])]
    tensors.append((b"head.weight", (8,), Q.F16, 128 * 6))
    tensors.append((b"time_embedding.1.weight", (8,), Q.F16, 128 * 7))  # one indexed module: not a block list
    path = _write(tmp_path, gguf_bytes(tensors, data=bytes(128 * 8)))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model.gguf: 8 tensors, 284 B" in out  # 3 x (68 + 16) + 2 x 16
    assert any(line.split() == ["blocks", "3", "Q8_0", "x1,", "F32", "x1", "84", "B"] for line in out.splitlines()), out
    assert "outside the blocks:   32 B (F16 x2)" in out and "time_embedding" not in out
    damaged = _write(tmp_path, gguf_bytes(tensors, data=bytes(128 * 7)), "cut.gguf")
    assert main(["inspect", str(damaged)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dlo: error: {damaged}: truncated: 'time_embedding.1.weight'"), err


def test_inspect_of_a_gguf_file_without_the_gguf_extra_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    path = _write(tmp_path, gguf_bytes(VALID, data=VALID_DATA))
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the extra were not installed
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dlo: error: {path}: GGUF files need the [gguf] extra: pip install 'dlo[gguf]'"]
