import json

import pytest
import torch

import dlo


def test_stats_count_every_copy(tiny_pair):
    _, streamed, entry = tiny_pair("flux")  # 2 double + 3 single blocks
    with dlo.enable(streamed, "cpu") as handle:
        with torch.inference_mode():
            for seed in range(2):
                streamed(**entry.inputs(seed))
        stats = handle.stats()
    assert stats.streamed_blocks == 5
    assert stats.copies == 5 * 2 + 1  # every block each call, plus block 0 for the next call
    # The double blocks are larger than the single ones: bytes follow each block's own size.
    assert stats.bytes_streamed < stats.copies * stats.slot_bytes // 2
    assert stats.copy_s > 0 and stats.h2d_gbps > 0
    assert stats.exposed_copy_s == pytest.approx(stats.copy_s)  # on cpu nothing overlaps
    assert stats.host_bytes > 0 and not stats.pinned
    final = handle.stats()
    assert final is handle.stats()  # frozen after disable
    assert (final.copies, final.bytes_streamed) == (stats.copies, stats.bytes_streamed)
    assert final.host_memory is not None and final.host_memory.pss > 0


def test_trace_export_has_copy_and_compute_intervals(tiny_pair, tmp_path):
    _, streamed, entry = tiny_pair("wan")
    with dlo.enable(streamed, "cpu", dlo.OffloadConfig(record_timeline=True)) as handle:
        with torch.inference_mode():
            streamed(**entry.inputs(0))
        written = handle.export_trace(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert written == len(spans)
    assert sorted({e["cat"] for e in spans}) == ["compute", "copy"]
    assert [e["name"] for e in spans if e["cat"] == "compute"] == [f"blocks.{i}" for i in range(4)]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)


def test_trace_export_needs_record_timeline(tiny_pair, tmp_path):
    _, streamed, _ = tiny_pair("wan")
    with dlo.enable(streamed, "cpu") as handle:
        with pytest.raises(dlo.EnableError, match="record_timeline=True"):
            handle.export_trace(tmp_path / "trace.json")
