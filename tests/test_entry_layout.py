"""Cache entries laid out like the streamed blocks, and copies merged where the layout allows:
See [Note: one copy per block]. (The registered loads' copy counts are checked in
test_cache_registration.py and test_fp8_cache.py.)"""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

import dlo
from dlo.host.cache.entry_store import Entry, EntryStore
from dlo.host.cache.identity import digest_of
from dlo.host.pinned_buffer import aligned_empty
from dlo.host.safetensors_file import DATA_ALIGNMENT, PAD_PREFIX, write_file
from dlo.host.tensor_source import CopyTask, coalesced
from dlo.models.tiny import TINY_MODELS
from dlo.planning.block_layout import ALIGNMENT

pytest.importorskip("diffusers")


def run_all(tasks):
    for task in tasks:
        task.run()


def placed_tasks(source, target, spans):
    """Copies of float32 views [offset, offset + n) (bytes) of two flat uint8 buffers."""
    return [
        CopyTask(target[t : t + n].view(torch.float32), source[s : s + n].view(torch.float32)) for s, t, n in spans
    ]


def test_copies_at_equal_distances_merge_into_one_with_the_same_result():
    source = torch.randint(0, 255, (8192,), dtype=torch.uint8)
    spans = [(0, 1024, 64), (512, 1536, 128), (1024, 2048, 4)]  # gaps of 448 and 384 bytes in both
    merged_target, single_target = (aligned_empty(8192, torch.device("cpu")).zero_() for _ in range(2))
    merged = coalesced(placed_tasks(source, merged_target, spans))
    assert len(merged) == 1 and merged[0].source.numel() == 1024 + 4
    run_all(merged)
    run_all(placed_tasks(source, single_target, spans))
    for s, t, n in spans:
        assert torch.equal(merged_target[t : t + n], single_target[t : t + n])
        assert torch.equal(merged_target[t : t + n], source[s : s + n])


@pytest.mark.parametrize(
    "spans, copies",
    [
        ([(0, 0, 64), (64 + ALIGNMENT, 64 + ALIGNMENT, 64)], 2),  # a gap of ALIGNMENT bytes: its own copy
        ([(0, 0, 64), (512, 1024, 64)], 2),  # different distances in source and target
        ([(512, 512, 64), (0, 0, 64)], 1),  # any order: sorted by source address
    ],
)
def test_copies_merge_only_at_equal_small_gaps(spans, copies):
    source, target = torch.arange(4096, dtype=torch.int32).view(torch.uint8), aligned_empty(16384, torch.device("cpu")).zero_()
    merged = coalesced(placed_tasks(source, target, spans))
    assert len(merged) == copies
    run_all(merged)
    assert all(torch.equal(target[t : t + n], source[s : s + n]) for s, t, n in spans)


def test_casts_strided_views_and_other_buffers_stay_separate_copies():
    source, other = torch.ones(1024, dtype=torch.uint8), torch.ones(1024, dtype=torch.uint8)
    target = torch.zeros(2048, dtype=torch.uint8)
    cast = CopyTask(target[64:68].view(torch.float16), source[64:72].view(torch.float32))
    strided = CopyTask(target[128:136].view(torch.float32), source[128:144].view(torch.float32)[::2])
    tasks = [
        CopyTask(target[0:64], source[0:64]),
        cast,
        strided,
        CopyTask(target[256:320], other[256:320]),  # the right distance, but another source buffer
    ]
    merged = coalesced(tasks)
    assert len(merged) == 4 and any(task is cast for task in merged) and any(task is strided for task in merged)


def test_a_gap_is_never_copied_over_a_part_of_a_concatenated_target():
    """A converter's swapped halves [x1; x0] of one file tensor x: the part copied from x's end
    lands at the start of its target, the other part after it. A later tensor y whose source
    and target gaps happen to match must not merge with x1's copy across x0's target."""
    half = 16
    source = torch.randint(1, 255, (4096,), dtype=torch.uint8)
    target = aligned_empty(4096, torch.device("cpu")).zero_()
    spans = [(half, 0, half), (0, half, half), (ALIGNMENT + half, ALIGNMENT, 64)]  # x1, x0, then y
    merged = coalesced(placed_tasks(source, target, spans))
    run_all(merged)
    assert all(torch.equal(target[t : t + n], source[s : s + n]) for s, t, n in spans)


@pytest.mark.parametrize("seed", range(20))
def test_merged_copies_write_every_target_as_its_own_copy_would(seed):
    """Random slot-like layouts (each tensor's target ALIGNMENT-aligned, its source somewhere in
    a file with small gaps), some tensors concatenations of parts of their source in another
    order: after the merged copies, every target holds its source's bytes."""
    g = torch.Generator().manual_seed(seed)
    randint = lambda low, high: int(torch.randint(low, high, (), generator=g))  # noqa: E731
    source = torch.randint(1, 255, (1 << 16,), dtype=torch.uint8, generator=g)
    target = aligned_empty(1 << 16, torch.device("cpu")).zero_()
    spans, at_source, at_target = [], 0, 0
    while True:
        nbytes = 4 * randint(1, 96)
        if at_source + nbytes > len(source) - 1024 or at_target + nbytes > len(target) - ALIGNMENT:
            break
        cuts = sorted({0, nbytes, *(4 * randint(0, nbytes // 4 + 1) for _ in range(randint(0, 3)))})
        parts = list(zip(cuts, cuts[1:]))
        order = torch.randperm(len(parts), generator=g).tolist()
        placed = 0
        for i in order:  # the parts' sources in file order, their targets in the concatenation's
            begin, end = parts[i]
            spans.append((at_source + begin, at_target + placed, end - begin))
            placed += end - begin
        at_source += nbytes + 4 * randint(0, ALIGNMENT // 4)
        at_target += -(-nbytes // ALIGNMENT) * ALIGNMENT
    tasks = placed_tasks(source, target, spans)
    merged = coalesced([tasks[i] for i in torch.randperm(len(tasks), generator=g).tolist()])
    run_all(merged)
    wrong = [(s, t, n) for s, t, n in spans if not torch.equal(target[t : t + n], source[s : s + n])]
    assert not wrong, f"{len(wrong)} of {len(spans)} targets overwritten, e.g. {wrong[0]}"


def test_an_empty_copy_is_dropped_from_the_merged_copies():
    """A zero-element tensor copies nothing (its view may have no address at all)."""
    source = torch.randint(1, 255, (4096,), dtype=torch.uint8)
    target = aligned_empty(4096, torch.device("cpu")).zero_()
    tasks = placed_tasks(source, target, [(0, 0, 0), (4, ALIGNMENT, 16)])
    merged = coalesced(tasks)
    assert len(merged) == 1
    run_all(merged)
    assert torch.equal(target[ALIGNMENT : ALIGNMENT + 16], source[4:20])


def header_of(path):
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    return 8 + length, json.loads(data[8 : 8 + length])


def test_write_file_puts_each_tensor_at_its_offset_in_a_file_safetensors_reads(tmp_path):
    a, b = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), torch.full((5,), 7.0)
    path = tmp_path / "placed.safetensors"
    with open(path, "wb") as handle:
        pads = write_file(handle, [("a", a, 0), ("b", b, 512)], {"format": "pt"})
    data_start, header = header_of(path)
    assert data_start % DATA_ALIGNMENT == 0
    assert header["b"]["data_offsets"] == [512, 532] and pads == {f"{PAD_PREFIX}0": 512 - 12}
    loaded = load_file(path)
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["b"], b) and set(loaded) == {"a", "b", *pads}


def test_write_file_refuses_overlapping_offsets(tmp_path):
    with open(tmp_path / "bad.safetensors", "wb") as handle, pytest.raises(ValueError, match="overlaps"):
        write_file(handle, [("a", torch.ones(4), 0), ("b", torch.ones(4), 8)], {})


def test_images_keep_their_offsets_across_the_shards_of_an_entry(tmp_path):
    """Several shards, each with padding: the entry reads back (padding names are unique across
    its files) and every image keeps its offsets, starting 512-aligned."""
    tensors = {name: torch.randn(100 + i) for i, name in enumerate("abcdef")}  # sizes that need padding
    images = [{"a": 0, "b": 512}, {"c": 0, "d": 1024}]
    identity = {"model": "images"}
    store = EntryStore(tmp_path)
    store.publish(digest_of(identity), tensors, identity, shard_bytes=1500, images=images)
    entry = store.validate(digest_of(identity))
    assert isinstance(entry, Entry) and len(entry.manifest["files"]) > 1
    views = {name: entry.checkpoint.view(name) for name in tensors}
    assert all(torch.equal(views[name], value) for name, value in tensors.items())
    for image in images:
        first, *rest = image
        assert views[first].data_ptr() % ALIGNMENT == 0
        assert all(views[name].data_ptr() - views[first].data_ptr() == image[name] for name in rest)
    del views
    entry.checkpoint.close()


def test_a_cache_entry_holds_the_models_tensors_with_each_block_laid_out_like_its_slot(tmp_path):
    directory = tmp_path / "wan"
    model = TINY_MODELS["wan"].build(seed=1)
    model.save_pretrained(directory)
    config = dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(tmp_path / "cache"))
    loaded, plan = dlo.load_transformer(directory, config)
    assert plan is not None
    (entry,) = (tmp_path / "cache" / "v1").iterdir()
    stored = {}
    offsets = {}
    for path in entry.glob("*.safetensors"):
        stored.update(load_file(path))  # safetensors' own reader
        data_start, header = header_of(path)
        offsets.update({name: data_start + meta["data_offsets"][0] for name, meta in header.items() if name != "__metadata__"})
    expected = model.state_dict()
    assert {name: value for name, value in stored.items() if not name.startswith(PAD_PREFIX)}.keys() == expected.keys()
    assert all(torch.equal(stored[name], value) for name, value in expected.items())
    # Block 1's tensors lie at their slot offsets from the block's first tensor, which is 512-aligned in the file.
    with dlo.enable(loaded, "cpu", config, plan=plan) as handle:
        block = handle._runtime.blocks[1]
        start = offsets[f"{block.name}.{block.layout.placements[0].spec.name}"]
        assert start % ALIGNMENT == 0
        assert all(offsets[f"{block.name}.{p.spec.name}"] - start == p.offset for p in block.layout.placements)


def test_a_gap_is_copied_over_only_where_the_next_target_starts_aligned():
    """A gap before an unaligned target may hold a tensor that is not in the tasks: it stays."""
    source = torch.randint(1, 255, (4096,), dtype=torch.uint8)
    target = aligned_empty(4096, torch.device("cpu")).zero_()
    target[64:72] = 9  # another tensor's bytes, inside the gap
    tasks = placed_tasks(source, target, [(0, 0, 64), (128, 128, 64)])
    merged = coalesced(tasks)
    assert len(merged) == 2
    run_all(merged)
    assert torch.equal(target[64:72], torch.full((8,), 9, dtype=torch.uint8))
    assert torch.equal(target[128:192], source[128:192])
    touching = coalesced(placed_tasks(source, target, [(0, 0, 64), (64, 64, 60)]))  # no gap: any address
    assert len(touching) == 1


def test_a_zero_byte_tensor_at_another_tensors_offset_is_written_first(tmp_path):
    tensors = {"a": torch.randn(10), "empty": torch.empty(0), "b": torch.randn(3)}
    identity = {"model": "zero-byte"}
    store = EntryStore(tmp_path)
    entry = store.publish(digest_of(identity), tensors, identity, images=[{"a": 0, "empty": 0, "b": 512}])
    assert all(torch.equal(entry.checkpoint.view(name), value) for name, value in tensors.items())
    entry.checkpoint.close()
