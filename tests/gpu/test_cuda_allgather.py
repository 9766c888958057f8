"""All-gather mode on GPUs: with NCCL initialized and a group of one, it behaves as
rank-local streaming and issues no collective; on two GPUs, chunked gathers are bit-identical
to the resident model. (Speed: benchmarks/bench_allgather.py.)"""

import copy
import multiprocessing
import sys
from pathlib import Path
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import dlo
from dlo.models.tiny import TINY_MODELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).parent.parent))
from test_allgather import assert_no_errors, run_ranks  # noqa: E402


@pytest.fixture
def nccl_world_of_one(tmp_path):
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["wan", "flux"])
def test_group_of_one_is_rank_local_without_collectives(nccl_world_of_one, name):
    entry = TINY_MODELS[name]
    reference = entry.build(seed=1, dtype=torch.bfloat16)
    streamed = copy.deepcopy(reference)
    reference.cuda()
    with torch.inference_mode():
        expected = [reference(**entry.inputs(s, torch.bfloat16, "cuda"))[0] for s in (1, 2, 3)]
    config = dlo.OffloadConfig(use_allgather=True, num_slots=3)
    with dlo.enable(streamed, "cuda", config) as handle, torch.inference_mode():
        got = [streamed(**entry.inputs(s, torch.bfloat16, "cuda"))[0] for s in (1, 2, 3)]
        stats = handle.stats()
        assert handle._runtime.executor.comm_stream is None  # no communication stream either
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.gather_group_size == 1 and stats.collectives == 0 and stats.copies > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_chunked_gathers_over_nccl_are_bit_identical(tmp_path):
    """Two ranks, one GPU each, NCCL: tiny Flux bf16 blocks (78848 and 32768 bytes) in chunks
    that divide neither, bf16 and float8 streamed, every output equal to the resident model's."""
    chunks_mib = [0.03, 0.01]
    # Spawned: a forkserver started after this process initialized CUDA cannot give it to its children.
    spawn = multiprocessing.get_context("spawn")
    results, _ = run_ranks(tmp_path, "cuda_chunked", 2, context=spawn, chunks_mib=chunks_mib)
    assert_no_errors(results)
    for result in results.values():
        assert sorted(result, key=str) == sorted(
            [(dtype, chunk) for dtype in (None, "fp8") for chunk in [0, *chunks_mib]], key=str
        )
        for (dtype, chunk), got in result.items():
            assert got["identical"], (dtype, chunk)
            if chunk:  # really chunked: more collectives than one a load
                assert got["collectives"] > result[(dtype, 0)]["collectives"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_shards_from_the_registered_cache_entry_over_nccl_are_bit_identical(tmp_path):
    """Two ranks, one GPU each, NCCL, the host weight cache: both map the one entry, register
    it, and copy their pieces straight from its pages (no private shard), bf16 and float8,
    unchunked and chunked; every output equal to the resident model's."""
    TINY_MODELS["flux"].build(seed=1, dtype=torch.bfloat16).save_pretrained(tmp_path / "flux")
    chunks_mib = [0.03]
    spawn = multiprocessing.get_context("spawn")  # see test_chunked_gathers_over_nccl_are_bit_identical
    kwargs = dict(directory=str(tmp_path / "flux"), cache_dir=str(tmp_path / "cache"), chunks_mib=chunks_mib)
    results, _ = run_ranks(tmp_path, "cuda_cache_shards", 2, context=spawn, **kwargs)
    assert_no_errors(results)
    assert len(list((tmp_path / "cache" / "v1").iterdir())) == 2  # one entry per streamed dtype, not per rank
    for result in results.values():
        assert len(result) == 2 * (1 + len(chunks_mib))
        for key, got in result.items():
            assert got["identical"] and got["backing"] == "host_weight_cache", (key, got)
            assert got["views"] and got["private_bytes"] == 0, (key, got)
            assert got["registered_bytes"] > 0 and got["fallback"] == "", (key, got)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_schedule_breaks_over_nccl_fail_cleanly_and_disable_in_step(tmp_path):
    """Rank 1 leaves the lockstep schedule (an error or Ctrl-C inside a block, a block run
    from inside the last one): its peer finishes the call, the next call fails on both (the
    poisoned agreement), and disable() gathers every block in step on both ranks (a mismatched
    NCCL collective would hang, time out or mix blocks up)."""
    spawn = multiprocessing.get_context("spawn")  # see test_chunked_gathers_over_nccl_are_bit_identical
    results, _ = run_ranks(tmp_path, "cuda_schedule_breaks", 2, context=spawn)
    assert_no_errors(results)
    for how, expected_break in (("error", "ValueError"), ("ctrl-c", "KeyboardInterrupt"), ("extra block", "StreamingError")):
        zero, one = results[0][how], results[1][how]
        assert zero["outcomes"][:2] == ["ok", "ok"] and one["outcomes"][0] == "ok", how
        assert one["outcomes"][1].startswith(expected_break), (how, one["outcomes"][1])
        for result in (zero, one):
            assert "all-gather lockstep broken" in result["outcomes"][2], (how, result["outcomes"][2])
            assert result["restored"], how
