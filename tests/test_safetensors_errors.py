"""Untrusted safetensors bytes: every malformed file or index gets its named error kind.

Each file here is written byte by byte under tmp_path (8-byte little-endian header length,
the JSON header, the data section) and opened for real, so a test fails on any crash that is
not a `CheckpointError`, on a wrong kind, and on a file that opens when it should not. A
valid file from `safetensors.torch.save_file` and a crafted valid baseline show what passes.
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import pytest
import torch

from dlo import CheckpointError, CheckpointErrorKind
from dlo.errors import DloError
from dlo.host.checkpoint import INDEX_NAME, WEIGHTS_NAME, Checkpoint
from dlo.host.safetensors_file import HEADER_SIZE_CAP, SafetensorsFile

save_file = pytest.importorskip("safetensors.torch").save_file

Kind = CheckpointErrorKind


# ---------------------------------------------------------------------------------------------
# Crafting files


def write_raw(path: Path, header_bytes: bytes, data: bytes = b"", *, header_len: int | None = None) -> Path:
    """`<u64 header_len><header_bytes><data>`; header_len defaults to len(header_bytes)."""
    length = len(header_bytes) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + header_bytes + data)
    return path


def write_safetensors(path: Path, header: object, data: bytes = b"", *, data_start_mod8: int = 0) -> Path:
    """A safetensors file from a header (any JSON value) and data bytes.

    The JSON is padded with trailing spaces, as safetensors itself pads it, so the data
    section starts at an absolute offset congruent to `data_start_mod8` modulo 8 (0 keeps
    every tensor aligned to its element size)."""
    text = json.dumps(header).encode("utf-8")
    text += b" " * ((data_start_mod8 - 8 - len(text)) % 8)
    return write_raw(path, text, data)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


# The crafted baseline: F32 [2] then F16 [3], contiguous, covering the 14 data bytes exactly.
BASE_A = torch.tensor([1.5, -2.0], dtype=torch.float32)
BASE_B = torch.tensor([0.25, 3.0, -7.0], dtype=torch.float16)
BASE_HEADER = {
    "__metadata__": {"format": "pt"},
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "F16", "shape": [3], "data_offsets": [8, 14]},
}
BASE_DATA = tensor_bytes(BASE_A) + tensor_bytes(BASE_B)


def base_header() -> dict:
    return copy.deepcopy(BASE_HEADER)


def open_error(path: Path) -> CheckpointError:
    with pytest.raises(CheckpointError) as err:
        SafetensorsFile(path)
    return err.value


def mapped_paths() -> str:
    """This process's memory maps (Linux), to see which files are still mapped."""
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        pytest.skip("needs /proc/self/maps")
    return maps.read_text()


def map_lines(path: Path) -> list[str]:
    return [line for line in mapped_paths().splitlines() if line.endswith(str(path))]


def write_index(directory: Path, weight_map: object) -> Path:
    path = directory / INDEX_NAME
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


# ---------------------------------------------------------------------------------------------
# Valid files


# Odd shapes (17x257 forces no convenient sizes), every dtype family, a 0-dim and an empty tensor.
def _saved_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "f32.odd": torch.randn(17, 257, generator=gen),
        "f64": torch.randn(3, 5, generator=gen, dtype=torch.float64),
        "f16": torch.randn(31, generator=gen).half(),
        "bf16": torch.randn(7, 9, generator=gen).bfloat16(),
        "i64": torch.randint(-(2**40), 2**40, (11,), generator=gen, dtype=torch.int64),
        "i32": torch.randint(-1000, 1000, (4, 3), generator=gen, dtype=torch.int32),
        "i16": torch.randint(-1000, 1000, (5,), generator=gen, dtype=torch.int16),
        "i8": torch.randint(-128, 128, (13,), generator=gen, dtype=torch.int8),
        "u8": torch.randint(0, 256, (2, 3, 5), generator=gen, dtype=torch.uint8),
        "bool": torch.randint(0, 2, (19,), generator=gen).bool(),
        "f8e4m3": torch.randn(6, generator=gen).to(torch.float8_e4m3fn),
        "f8e5m2": torch.randn(6, generator=gen).to(torch.float8_e5m2),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 3),
    }


def save_file_at(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(path))
    return path


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # Compare the bytes: exact, and independent of float8 comparison support.
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert torch.equal(got, want)


def test_file_saved_by_safetensors_opens_and_every_view_equals_the_saved_tensor(tmp_path):
    tensors = _saved_tensors()
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})

    shard = SafetensorsFile(path)
    try:
        assert set(shard.entries) == set(tensors)
        assert shard.metadata == {"format": "pt", "note": "x"}
        assert shard.size == path.stat().st_size
        for key, want in tensors.items():
            assert_same(shard.view(key), want)
    finally:
        shard.close()


def test_file_is_mapped_shared_and_read_only(tmp_path):
    path = save_file_at(tmp_path / "model.safetensors", {"w": torch.arange(1024.0)})
    shard = SafetensorsFile(path)
    try:
        lines = map_lines(path)
        assert lines, "the file is not mapped"
        # /proc/self/maps permissions: r (read), no w, s (shared, not a private copy).
        assert all(line.split()[1] in ("r--s", "r-xs") for line in lines), lines
    finally:
        shard.close()
    assert map_lines(path) == []  # close() unmaps


def test_crafted_baseline_opens_with_exact_values(tmp_path):
    """The baseline the error tests mutate is itself valid, so each error is caused by the
    one thing its test changes."""
    shard = SafetensorsFile(write_safetensors(tmp_path / "base.safetensors", base_header(), BASE_DATA))
    try:
        assert shard.metadata == {"format": "pt"}
        assert torch.equal(shard.view("a"), BASE_A)
        assert torch.equal(shard.view("b"), BASE_B)
    finally:
        shard.close()


def test_header_only_file_with_no_tensors_opens_empty(tmp_path):
    shard = SafetensorsFile(write_safetensors(tmp_path / "empty.safetensors", {}))
    try:
        assert shard.entries == {} and shard.metadata == {}
    finally:
        shard.close()


def test_checkpoint_over_a_single_file_finds_every_key(tmp_path):
    tensors = _saved_tensors()
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))
    checkpoint = Checkpoint(tmp_path)
    try:
        assert set(checkpoint.tensors) == set(tensors)
        for key, want in tensors.items():
            assert_same(checkpoint.view(key), want)
    finally:
        checkpoint.close()


def test_checkpoint_over_sharded_directory_finds_every_key_in_its_shard(tmp_path):
    tensors = _saved_tensors()
    keys = sorted(tensors)
    shards = {
        "diffusion_pytorch_model-00001-of-00003.safetensors": keys[:5],
        "diffusion_pytorch_model-00002-of-00003.safetensors": keys[5:9],
        "diffusion_pytorch_model-00003-of-00003.safetensors": keys[9:],
    }
    for name, shard_keys in shards.items():
        save_file({k: tensors[k] for k in shard_keys}, str(tmp_path / name))
    write_index(tmp_path, {k: name for name, shard_keys in shards.items() for k in shard_keys})
    # A stray single file next to the index must not be read: the index decides.
    save_file({"stray": torch.ones(1)}, str(tmp_path / WEIGHTS_NAME))

    checkpoint = Checkpoint(tmp_path)
    try:
        assert set(checkpoint.tensors) == set(tensors)
        assert sorted(f.path.name for f in checkpoint.files) == sorted(shards)
        assert checkpoint.nbytes == sum((tmp_path / name).stat().st_size for name in shards)
        for name, shard_keys in shards.items():
            for key in shard_keys:
                assert checkpoint.tensors[key].file.path.name == name
                assert_same(checkpoint.view(key), tensors[key])
    finally:
        checkpoint.close()


# ---------------------------------------------------------------------------------------------
# TRUNCATED


@pytest.mark.parametrize("content", [b"", b"\x01", b"\x10\x00\x00\x00\x00\x00\x00"], ids=["empty", "1-byte", "7-bytes"])
def test_file_shorter_than_the_length_prefix_is_truncated(tmp_path, content):
    path = tmp_path / "short.safetensors"
    path.write_bytes(content)
    err = open_error(path)
    assert err.kind is Kind.TRUNCATED
    assert f"{len(content)} bytes" in str(err) and "8-byte" in str(err)
    assert err.path == path
    assert isinstance(err, DloError)


@pytest.mark.parametrize("extra", [1, 1000], ids=["by-1-byte", "by-1000-bytes"])
def test_header_length_past_the_end_of_the_file_is_truncated(tmp_path, extra):
    header = json.dumps(base_header()).encode()
    # The declared length covers the header, the data, and `extra` bytes that are not there.
    path = write_raw(tmp_path / "x.safetensors", header, BASE_DATA, header_len=len(header) + len(BASE_DATA) + extra)
    err = open_error(path)
    assert err.kind is Kind.TRUNCATED
    assert "runs past the end" in str(err)


def test_a_ten_byte_file_cut_inside_its_header_is_truncated(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(write_raw(tmp_path / "whole.safetensors", json.dumps(base_header()).encode(), BASE_DATA).read_bytes()[:10])
    err = open_error(path)
    assert err.kind is Kind.TRUNCATED and "10-byte file" in str(err)


# ---------------------------------------------------------------------------------------------
# HEADER_TOO_LARGE


@pytest.mark.parametrize("header_len", [HEADER_SIZE_CAP + 1, 2**63, 2**64 - 1], ids=["cap+1", "2**63", "u64-max"])
def test_header_length_above_the_cap_is_too_large(tmp_path, header_len):
    path = write_raw(tmp_path / "x.safetensors", b"{}", header_len=header_len)
    err = open_error(path)
    assert err.kind is Kind.HEADER_TOO_LARGE
    assert "exceeds the cap" in str(err) and str(header_len) in str(err)


def test_header_length_of_exactly_the_cap_on_a_small_file_is_truncated_not_read(tmp_path):
    path = write_raw(tmp_path / "x.safetensors", b"{}", header_len=HEADER_SIZE_CAP)
    err = open_error(path)
    assert err.kind is Kind.TRUNCATED
    assert "runs past the end" in str(err)


# ---------------------------------------------------------------------------------------------
# HEADER_INVALID


@pytest.mark.parametrize(
    "header_bytes, message",
    [
        (b"\xff\xfe{}", "not UTF-8 JSON"),
        (b'{"a": "\xc3\x28"}', "not UTF-8 JSON"),  # invalid 2-byte sequence
        (b"", "not UTF-8 JSON"),
        (b"not json", "not UTF-8 JSON"),
        (b'{"a": {"dtype": "F32"', "not UTF-8 JSON"),  # cut off mid-object
        (b"[]", "not a JSON object"),
        (b'[{"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}]', "not a JSON object"),
        (b'"a string"', "not a JSON object"),
        (b"42", "not a JSON object"),
        (b"null", "not a JSON object"),
    ],
    ids=["bom-bytes", "bad-utf8", "empty", "not-json", "cut-off", "empty-list", "list", "string", "number", "null"],
)
def test_header_that_is_not_a_utf8_json_object_is_invalid(tmp_path, header_bytes, message):
    err = open_error(write_raw(tmp_path / "x.safetensors", header_bytes))
    assert err.kind is Kind.HEADER_INVALID
    assert message in str(err)


def _mutate(key: str, field: str, value: object):
    def apply(header: dict) -> None:
        if value is _DELETE:
            del header[key][field]
        else:
            header[key][field] = value

    return apply


_DELETE = object()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_mutate("a", "data_offsets", _DELETE), "expected dtype, shape and data_offsets"),
        (_mutate("a", "shape", _DELETE), "expected dtype, shape and data_offsets"),
        (_mutate("a", "dtype", _DELETE), "expected dtype, shape and data_offsets"),
        (_mutate("a", "extra", 1), "expected dtype, shape and data_offsets"),
        (lambda h: h.update(a=[0, 8]), "expected dtype, shape and data_offsets"),
        (lambda h: h.update(a="F32"), "expected dtype, shape and data_offsets"),
        (_mutate("a", "shape", [-2]), "shape [-2] is not a list of sizes"),
        (_mutate("a", "shape", [2.0]), "shape [2.0] is not a list of sizes"),
        (_mutate("a", "shape", ["2"]), "is not a list of sizes"),
        (_mutate("a", "shape", [True, 2]), "is not a list of sizes"),
        (_mutate("a", "shape", [None]), "is not a list of sizes"),
        (_mutate("a", "shape", 2), "shape 2 is not a list of sizes"),
        (_mutate("a", "shape", {"0": 2}), "is not a list of sizes"),
        (_mutate("a", "data_offsets", [0, 4, 8]), "data_offsets [0, 4, 8] is not two offsets"),
        (_mutate("a", "data_offsets", [0]), "is not two offsets"),
        (_mutate("a", "data_offsets", []), "is not two offsets"),
        (_mutate("a", "data_offsets", [-8, 0]), "is not two offsets"),
        (_mutate("a", "data_offsets", [0.0, 8.0]), "is not two offsets"),
        (_mutate("a", "data_offsets", [False, 8]), "is not two offsets"),
        (_mutate("a", "data_offsets", "0-8"), "is not two offsets"),
        (_mutate("a", "data_offsets", {"begin": 0, "end": 8}), "is not two offsets"),
        (lambda h: h["__metadata__"].update(version=2), "__metadata__ must map strings to strings"),
        (lambda h: h["__metadata__"].update(nested={"k": "v"}), "__metadata__ must map strings to strings"),
        (lambda h: h["__metadata__"].update(none=None), "__metadata__ must map strings to strings"),
        (lambda h: h.update(__metadata__=["format", "pt"]), "__metadata__ must map strings to strings"),
        (lambda h: h.update(__metadata__="pt"), "__metadata__ must map strings to strings"),
        (lambda h: h.update(__metadata__=None), "__metadata__ must map strings to strings"),
    ],
    ids=[
        "no-data_offsets",
        "no-shape",
        "no-dtype",
        "extra-field",
        "entry-is-list",
        "entry-is-string",
        "negative-dim",
        "float-dim",
        "string-dim",
        "bool-dim",
        "null-dim",
        "shape-not-list",
        "shape-dict",
        "three-offsets",
        "one-offset",
        "no-offsets",
        "negative-offset",
        "float-offsets",
        "bool-offset",
        "offsets-string",
        "offsets-dict",
        "metadata-int-value",
        "metadata-dict-value",
        "metadata-null-value",
        "metadata-list",
        "metadata-string",
        "metadata-null",
    ],
)
def test_header_entry_of_the_wrong_structure_is_invalid(tmp_path, mutate, message):
    header = base_header()
    mutate(header)
    err = open_error(write_safetensors(tmp_path / "x.safetensors", header, BASE_DATA))
    assert err.kind is Kind.HEADER_INVALID
    assert message in str(err)


def test_deeply_nested_json_header_is_invalid_not_a_recursion_crash(tmp_path):
    nesting = 100_000  # 200 KB of brackets, far under the header cap
    err = open_error(write_raw(tmp_path / "x.safetensors", b"[" * nesting + b"]" * nesting))
    assert err.kind is Kind.HEADER_INVALID


@pytest.mark.parametrize(
    "shape, offsets",
    [(b"[" + b"1" * 5000 + b"]", b"[0, 4]"), (b"[1]", b"[0, " + b"1" * 5000 + b"]")],
    ids=["in-shape", "in-data_offsets"],
)
def test_integer_literal_too_long_to_parse_is_invalid_not_a_value_error(tmp_path, shape, offsets):
    header = b'{"a": {"dtype": "F32", "shape": ' + shape + b', "data_offsets": ' + offsets + b"}}"
    err = open_error(write_raw(tmp_path / "x.safetensors", header, b"\0" * 4))
    # Any named kind will do: the header is invalid, or the sizes cannot match.
    assert err.kind in (Kind.HEADER_INVALID, Kind.SIZE_MISMATCH, Kind.OFFSETS_INVALID)


# ---------------------------------------------------------------------------------------------
# UNKNOWN_DTYPE


@pytest.mark.parametrize("dtype", ["Q4", "f32", "F4", "", None, 4, ["F32"]], ids=repr)
def test_dtype_outside_the_known_set_is_unknown(tmp_path, dtype):
    header = base_header()
    header["a"]["dtype"] = dtype
    err = open_error(write_safetensors(tmp_path / "x.safetensors", header, BASE_DATA))
    assert err.kind is Kind.UNKNOWN_DTYPE
    assert f"dtype {dtype!r}" in str(err) and "'a'" in str(err)


# ---------------------------------------------------------------------------------------------
# SIZE_MISMATCH


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "F32 [3] needs 12 bytes, data_offsets give 8"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}, "F32 [1] needs 4 bytes, data_offsets give 8"),
        ({"dtype": "F64", "shape": [2], "data_offsets": [0, 8]}, "F64 [2] needs 16 bytes, data_offsets give 8"),
        ({"dtype": "F16", "shape": [2], "data_offsets": [0, 8]}, "F16 [2] needs 4 bytes, data_offsets give 8"),
        ({"dtype": "F32", "shape": [2, 0], "data_offsets": [0, 8]}, "needs 0 bytes, data_offsets give 8"),
        ({"dtype": "F32", "shape": [], "data_offsets": [0, 8]}, "F32 [] needs 4 bytes, data_offsets give 8"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "data_offsets give -8"),
        ({"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}, "data_offsets give -8"),
        ({"dtype": "F32", "shape": [2**32, 2**32, 2**32], "data_offsets": [0, 8]}, "data_offsets give 8"),
    ],
    ids=["too-few-elements", "too-many-bytes", "wider-dtype", "narrower-dtype", "zero-dim", "scalar", "end-before-begin",
         "end-before-begin-empty", "huge-shape"],
)
def test_byte_range_that_differs_from_dtype_times_shape_is_a_size_mismatch(tmp_path, entry, message):
    header = base_header()
    header["a"] = entry
    err = open_error(write_safetensors(tmp_path / "x.safetensors", header, BASE_DATA))
    assert err.kind is Kind.SIZE_MISMATCH
    assert message in str(err) and "'a'" in str(err)


def test_shape_whose_element_count_overflows_is_a_size_mismatch_not_a_value_error(tmp_path):
    header = base_header()
    header["a"] = {"dtype": "F32", "shape": [2**62] * 250, "data_offsets": [0, 8]}  # numel = 2**15500
    err = open_error(write_safetensors(tmp_path / "x.safetensors", header, BASE_DATA))
    assert err.kind is Kind.SIZE_MISMATCH
    assert "needs more bytes than the file holds" in str(err)


def test_a_dimension_beyond_int64_is_invalid_even_next_to_a_zero(tmp_path):
    """[0, 2**70] has no elements, but no tensor can have that dimension: refused at parse."""
    header = base_header()
    header["a"] = {"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}
    err = open_error(write_safetensors(tmp_path / "x.safetensors", header, BASE_DATA))
    assert err.kind is Kind.HEADER_INVALID


# ---------------------------------------------------------------------------------------------
# OFFSETS_INVALID


@pytest.mark.parametrize(
    "a, b, data, message",
    [
        # b starts inside a.
        ([0, 8], [4, 10], BASE_DATA[:10], "'b' at 4 overlaps the previous tensor"),
        # A 2-byte hole between a and b.
        ([0, 8], [10, 16], BASE_DATA + b"\0\0", "'b' at 10 leaves a gap"),
        # The first tensor does not start at the data section.
        ([4, 12], [12, 18], b"\0" * 4 + BASE_DATA, "'a' at 4 leaves a gap"),
        # b runs past the end of the file.
        ([0, 8], [8, 14], BASE_DATA[:12], "tensors cover 14 data bytes, the file holds 12"),
        # Both tensors lie past the end of the file.
        ([1000, 1008], [1008, 1014], BASE_DATA, "'a' at 1000 leaves a gap"),
        # The tensors end before the file does.
        ([0, 8], [8, 14], BASE_DATA + b"trailing", "tensors cover 14 data bytes, the file holds 22"),
        ([0, 8], [8, 14], BASE_DATA + b"\0", "tensors cover 14 data bytes, the file holds 15"),
    ],
    ids=["overlap", "gap", "gap-at-start", "past-end", "far-past-end", "trailing-bytes", "one-trailing-byte"],
)
def test_offsets_that_overlap_leave_gaps_or_miss_the_file_end_are_invalid(tmp_path, a, b, data, message):
    header = base_header()
    header["a"]["data_offsets"] = a
    header["b"]["data_offsets"] = b
    err = open_error(write_safetensors(tmp_path / "x.safetensors", header, data))
    assert err.kind is Kind.OFFSETS_INVALID
    assert message in str(err)


def test_two_tensors_on_the_same_bytes_are_invalid(tmp_path):
    header = base_header()
    header["a2"] = dict(header["a"])  # an alias of a's 8 bytes
    err = open_error(write_safetensors(tmp_path / "x.safetensors", header, BASE_DATA))
    assert err.kind is Kind.OFFSETS_INVALID
    assert "at 0 overlaps the previous tensor" in str(err)


def test_tensors_listed_out_of_file_order_are_valid(tmp_path):
    """Offsets are checked in sorted order; the header's key order does not matter."""
    header = {"b": {"dtype": "F16", "shape": [3], "data_offsets": [8, 14]}, "a": base_header()["a"]}
    shard = SafetensorsFile(write_safetensors(tmp_path / "x.safetensors", header, BASE_DATA))
    try:
        assert torch.equal(shard.view("a"), BASE_A) and torch.equal(shard.view("b"), BASE_B)
    finally:
        shard.close()


def test_no_tensors_but_data_bytes_is_invalid(tmp_path):
    err = open_error(write_safetensors(tmp_path / "x.safetensors", {"__metadata__": {}}, b"orphan"))
    assert err.kind is Kind.OFFSETS_INVALID
    assert "tensors cover 0 data bytes, the file holds 6" in str(err)


@pytest.mark.parametrize("data_start_mod8", [1, 2, 6])
def test_tensor_at_an_unaligned_file_offset_opens_but_refuses_an_in_place_view(tmp_path, data_start_mod8):
    """The format allows any offset, so the file is valid; a typed view cannot start at an
    unaligned address, so view() names the problem (the loader's preflight falls back to the
    ordinary loader before ever asking)."""
    path = write_safetensors(tmp_path / "x.safetensors", base_header(), BASE_DATA, data_start_mod8=data_start_mod8)
    shard = SafetensorsFile(path)
    try:
        assert not shard.entries["a"].aligned
        with pytest.raises(CheckpointError) as err:
            shard.view("a")
        assert err.value.kind is Kind.MISALIGNED
        assert "not a multiple of 4" in str(err.value)
    finally:
        shard.close()


# ---------------------------------------------------------------------------------------------
# Checkpoint directories: NO_CHECKPOINT, INDEX_INVALID, MISSING_SHARD, DUPLICATE_KEY

SHARD_1 = "diffusion_pytorch_model-00001-of-00002.safetensors"
SHARD_2 = "diffusion_pytorch_model-00002-of-00002.safetensors"


def checkpoint_error(directory: Path) -> CheckpointError:
    with pytest.raises(CheckpointError) as err:
        Checkpoint(directory)
    return err.value


def test_directory_without_weights_or_index_is_no_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))  # not the diffusers name
    (tmp_path / WEIGHTS_NAME).mkdir()  # a directory with the right name is not a file
    err = checkpoint_error(tmp_path)
    assert err.kind is Kind.NO_CHECKPOINT
    assert "neither" in str(err) and WEIGHTS_NAME in str(err) and INDEX_NAME in str(err)


def test_missing_directory_is_no_checkpoint(tmp_path):
    err = checkpoint_error(tmp_path / "absent")
    assert err.kind is Kind.NO_CHECKPOINT


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not json",
        b"\xff\xfe\x00",
        b"[]",
        b'"weight_map"',
        b"{}",
        b'{"metadata": {}}',
        b'{"weight_map": null}',
        b'{"weight_map": ["a.safetensors"]}',
        b'{"weight_map": "a.safetensors"}',
        b'{"weight_map": {"w": ["a.safetensors"]}}',
        b'{"weight_map": {"w": "a.safetensors", "v": 3}}',
    ],
    ids=["empty", "not-json", "not-utf8", "list", "string", "no-weight_map", "metadata-only", "null-map", "list-map",
         "string-map", "list-value", "mixed-values"],
)
def test_index_that_is_unreadable_or_has_no_weight_map_is_invalid(tmp_path, content):
    (tmp_path / INDEX_NAME).write_bytes(content)
    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    err = checkpoint_error(tmp_path)
    assert err.kind is Kind.INDEX_INVALID
    assert "no readable weight_map" in str(err)
    assert err.path == tmp_path / INDEX_NAME


@pytest.mark.parametrize(
    "shard_name",
    ["../x.safetensors", "sub/x.safetensors", "/tmp/x.safetensors", "./x.safetensors", 3, None],
    ids=repr,
)
def test_index_naming_a_shard_that_is_not_a_plain_file_name_is_invalid(tmp_path, shard_name):
    # The named files exist where a path walk would find them, so only the name check stops it.
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    for where in (tmp_path, model, model / "sub"):
        save_file({"w": torch.ones(2)}, str(where / "x.safetensors"))
    write_index(model, {"w": shard_name})
    err = checkpoint_error(model)
    assert err.kind is Kind.INDEX_INVALID
    assert "is not a file name" in str(err) and repr(shard_name) in str(err)


def test_index_naming_a_shard_that_is_not_there_is_a_missing_shard(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / SHARD_1))
    write_index(tmp_path, {"w": SHARD_1, "v": SHARD_2})
    err = checkpoint_error(tmp_path)
    assert err.kind is Kind.MISSING_SHARD
    assert f"names {SHARD_2!r}, which is missing" in str(err)


def test_same_key_in_two_shards_is_a_duplicate_key(tmp_path):
    save_file({"w": torch.ones(2), "u": torch.zeros(1)}, str(tmp_path / SHARD_1))
    save_file({"w": torch.ones(2), "v": torch.zeros(3)}, str(tmp_path / SHARD_2))
    write_index(tmp_path, {"w": SHARD_1, "u": SHARD_1, "v": SHARD_2})
    err = checkpoint_error(tmp_path)
    assert err.kind is Kind.DUPLICATE_KEY
    assert "'w' is also in" in str(err) and SHARD_1 in str(err)
    assert err.path == tmp_path / SHARD_2


def test_index_assigning_a_key_to_a_shard_without_it_is_invalid(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / SHARD_1))
    save_file({"v": torch.ones(2)}, str(tmp_path / SHARD_2))
    write_index(tmp_path, {"w": SHARD_1, "v": SHARD_2, "ghost": SHARD_2})
    err = checkpoint_error(tmp_path)
    assert err.kind is Kind.INDEX_INVALID


@pytest.mark.parametrize(
    "break_second_shard, kind",
    [
        (lambda path: path.write_bytes(b"\x01\x02"), Kind.TRUNCATED),
        (lambda path: write_raw(path, b"{}", header_len=HEADER_SIZE_CAP + 1), Kind.HEADER_TOO_LARGE),
        (lambda path: write_raw(path, b"[]"), Kind.HEADER_INVALID),
        (lambda path: write_safetensors(path, {"v": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),
         Kind.UNKNOWN_DTYPE),
        (lambda path: write_safetensors(path, {"v": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
         Kind.SIZE_MISMATCH),
        (lambda path: write_safetensors(path, {"v": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 5),
         Kind.OFFSETS_INVALID),
        (lambda path: save_file({"w": torch.ones(2)}, str(path)), Kind.DUPLICATE_KEY),
    ],
    ids=["truncated", "header-too-large", "header-invalid", "unknown-dtype", "size-mismatch", "offsets-invalid",
         "duplicate-key"],
)
def test_checkpoint_failing_on_a_later_shard_raises_its_kind_and_unmaps_earlier_shards(tmp_path, break_second_shard, kind):
    first, second = tmp_path / SHARD_1, tmp_path / SHARD_2
    save_file({"w": torch.arange(4096.0)}, str(first))
    break_second_shard(second)
    write_index(tmp_path, {"w": SHARD_1, "v": SHARD_2})

    # Control: a checkpoint that opened the first shard shows it in the process's maps.
    (tmp_path / "ok").mkdir()
    save_file({"w": torch.arange(4096.0)}, str(tmp_path / "ok" / WEIGHTS_NAME))
    control = Checkpoint(tmp_path / "ok")
    assert map_lines(tmp_path / "ok" / WEIGHTS_NAME)
    control.close()
    assert map_lines(tmp_path / "ok" / WEIGHTS_NAME) == []

    # `err` keeps the traceback, hence the failed Checkpoint object, alive: only close()
    # can have unmapped the first shard here.
    with pytest.raises(CheckpointError) as err:
        Checkpoint(tmp_path)
    assert err.value.kind is kind
    assert err.value.path.name in (SHARD_2, INDEX_NAME)
    assert map_lines(first) == []
    assert map_lines(second) == []

    # The first shard can be replaced and the repaired checkpoint opens with the new bytes.
    first.unlink()
    save_file({"w": torch.full((4,), 7.0)}, str(first))
    save_file({"v": torch.ones(3)}, str(second))
    checkpoint = Checkpoint(tmp_path)
    try:
        assert torch.equal(checkpoint.view("w"), torch.full((4,), 7.0))
        assert torch.equal(checkpoint.view("v"), torch.ones(3))
    finally:
        checkpoint.close()
