"""All-gather mode across real processes and a Gloo group (docs/guides/multi-gpu.md)."""

import dataclasses
import math
import queue as queue_module
import re
import sys
import time
from pathlib import Path

import pytest
import torch

import dlo
from dlo.backend.gather_group import choose_gather_role
from dlo.hotpath.gather import GatherRole
from dlo.planning.block_layout import align_up

sys.path.insert(0, str(Path(__file__).parent))
import allgather_ranks  # noqa: E402  (the ranks import it by name)
from child_processes import child_context  # noqa: E402

TIMEOUT_S = 120  # the harness never waits longer: a hang fails the test


def run_ranks(tmp_path, scenario, world, stuck=(), context=None, **kwargs):
    """Every rank runs `scenario`; the ranks in `stuck` never report and are killed once the
    others did. `context`: how the ranks start (default: the forkserver of child_processes)."""
    context = context or child_context()
    results = context.Queue()
    rendezvous = tmp_path / f"rendezvous-{scenario}-{world}"
    processes = [
        context.Process(target=allgather_ranks.rank_main, args=(scenario, rank, world, str(rendezvous), results, kwargs))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    collected = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(collected) < world - len(stuck):
            try:
                rank, result = results.get(timeout=1)
                collected[rank] = result
            except queue_module.Empty:
                silent = [p for rank, p in enumerate(processes) if rank not in collected and rank not in stuck]
                if all(p.exitcode is not None for p in silent):
                    break  # the missing ranks died without reporting
                if time.monotonic() > deadline:
                    raise AssertionError(f"ranks did not report within {TIMEOUT_S} s (hang?): {collected}") from None
    finally:
        for rank in stuck:
            processes[rank].kill()
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return collected, [p.exitcode for p in processes]


def assert_no_errors(results):
    for rank, result in results.items():
        assert not (isinstance(result, tuple) and result[0] == "raised"), f"rank {rank}: {result[2]}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["flux", "odd"])
def test_gathered_blocks_are_bit_identical_and_each_rank_holds_a_shard(tmp_path, world, name):
    results, _ = run_ranks(tmp_path, "parity", world, name=name)
    assert_no_errors(results)
    assert sorted(results) == list(range(world))
    for result in results.values():
        assert result["identical_to_resident"] and result["identical_to_local"] and result["identical_after_disable"]
        assert result["group_size"] == world
        # Per rank: every block's layout split into `world` equal 512-aligned shards,
        # host = sum(align_up(ceil(L / world))), so about total / world plus < 512 B per block.
        shards = sum(align_up(-(-size // world)) for size in result["block_bytes"])
        assert result["host_bytes"] == shards
        assert result["host_bytes"] <= sum(result["block_bytes"]) / world + 512 * len(result["block_bytes"])


def test_gguf_blocks_are_sharded_and_gathered_as_their_packed_bytes(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf_files import write_gguf

    from dlo.models.tiny import TINY_MODELS

    model = TINY_MODELS["wan"].build(seed=0)
    model.save_config(tmp_path)
    path = write_gguf(model, tmp_path / "wan.gguf", gguf.GGMLQuantizationType.Q8_0)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    packed = sum(  # Q8_0: 34 bytes per 32 values
        p.numel() * 34 // 32 for n, p in model.named_parameters()
        if n.startswith("blocks.") and n.rpartition(".")[0] in linears and n.endswith(".weight") and p.shape[-1] % 32 == 0
    )
    results, _ = run_ranks(tmp_path, "gguf_parity", 2, path=str(path), config_dir=str(tmp_path),
                           class_name="WanTransformer3DModel")
    assert_no_errors(results)
    for result in results.values():
        assert result["identical_to_resident"] and result["identical_after_disable"] and result["still_gguf"]
        assert result["group_size"] == 2
        assert result["uint8_image_bytes"] == packed  # the blocks' images hold the packed bytes, not dequantized
        assert result["host_bytes"] == sum(align_up(-(-size // 2)) for size in result["block_bytes"])  # half each


def test_float8_blocks_are_sharded_and_gathered_as_float8(tmp_path):
    """Each rank keeps 1/2 of every block's float8 image; the gathered block is dequantized
    in the slot and equals the quantized model resident and rank-local float8 streaming."""
    results, _ = run_ranks(tmp_path, "parity", 2, name="flux", num_slots=3, stream_dtype="fp8")
    assert_no_errors(results)
    for result in results.values():
        assert result["identical_to_resident"] and result["identical_to_local"] and result["identical_after_disable"]
        assert result["host_bytes"] == sum(align_up(-(-size // 2)) for size in result["block_bytes"])
        assert result["float8_bytes"] > 0


def test_fp8_gemm_blocks_are_sharded_and_gathered_as_float8(tmp_path):
    """See [Note: fp8 compute]: the slots hold float8 weights and scales, gathered as they are."""
    results, _ = run_ranks(tmp_path, "parity", 2, name="flux", stream_dtype="fp8", fp8_compute=True)
    assert_no_errors(results)
    for result in results.values():
        assert result["identical_to_resident"] and result["identical_to_local"] and result["identical_after_disable"]
        assert result["gemms_differ_after_disable"] and result["float8_bytes"] > 0


def test_three_slots_and_resident_layers_in_allgather_mode(tmp_path):
    results, _ = run_ranks(tmp_path, "parity", 2, name="wan", num_slots=3, resident_layers=2)
    assert_no_errors(results)
    for result in results.values():
        assert result["identical_to_resident"] and result["identical_to_local"] and result["resident"] == 2
        assert len(result["block_bytes"]) == 2  # 4 blocks, 2 resident on every rank, 2 sharded


# sd3's 4 blocks: unchunked, and in 10 and 15 chunks; with 4 slots every block stays loaded,
# so a rank that left the schedule must end the call holding what its peer holds.
@pytest.mark.parametrize(("chunk_mib", "num_slots"), [(64.0, 2), (0.01, 2), (64.0, 4)])
def test_a_rank_that_leaves_the_schedule_fails_every_rank_without_a_hang(tmp_path, chunk_mib, num_slots):
    results, _ = run_ranks(tmp_path, "diverge", 2, gather_chunk_mib=chunk_mib, num_slots=num_slots)
    assert_no_errors(results)
    assert results[0][:2] == ["ok", "ok"]  # its peer's remaining collectives were issued for it
    assert results[1][0] == "ok" and "where the agreed schedule has 'transformer_blocks.1'" in results[1][1]
    for rank in (0, 1):
        assert "all-gather lockstep broken" in results[rank][2] and "left the schedule" in results[rank][2]
        assert results[rank][4] == "disabled"  # disable()'s gathers matched: nothing was left over
    assert results[0][3] == results[1][3]  # the same collectives on both ranks


def test_ctrl_c_right_after_any_load_collective_still_disables_in_step(tmp_path):
    """See [Note: interrupts between collectives]: without SIGINT held over each planner step
    and its collectives, some of these points leave the interrupted rank a load ahead or
    behind, and disable()'s gathers pair with the wrong collectives (Gloo aborts)."""
    results, _ = run_ranks(tmp_path, "sigint_between_collectives", 2)
    assert_no_errors(results)
    assert len(results[0]) == len(results[1]) >= 4
    for point, (zero, one) in enumerate(zip(results[0], results[1])):
        assert zero[0] == "ok" and one[0] == "interrupted", point
        assert zero[2] and one[2], point  # both restored every weight
        assert point + 1 <= one[1] <= zero[1], point  # it stopped as that load's planner step ended


def test_a_block_run_after_the_last_one_fails_the_next_call_on_every_rank(tmp_path):
    """Rank 1 runs a block from inside the last one's forward (still running there): the call
    is closed from the state its peer closes it from (the last block released), or the next
    call's first loads differ and disable()'s gathers pair with the wrong collectives."""
    results, _ = run_ranks(tmp_path, "extra_block", 2)
    assert_no_errors(results)
    assert results[0][:2] == ["ok", "ok"]
    assert results[1][0] == "ok" and "where the agreed schedule has the end of the call" in results[1][1]
    for rank in (0, 1):
        assert "all-gather lockstep broken" in results[rank][2]


@pytest.mark.parametrize("shards", ["in memory", "on disk"])
def test_disable_after_ctrl_c_inside_a_call_issues_the_collectives_its_peers_issued(tmp_path, shards):
    """disable() gathers every block (collectives): the interrupted rank first issues the rest
    of its call, as its peer did, or their collectives pair up wrongly (a crash on Gloo, wrong
    weights or a hang on NCCL). On disk: that rest reads shards before the reads stop."""
    kwargs = {}
    if shards == "on disk":
        from dlo.models.tiny import TINY_MODELS

        TINY_MODELS["sd3"].build(seed=1).save_pretrained(tmp_path / "sd3")
        size = sum(f.stat().st_size for f in (tmp_path / "sd3").glob("*.safetensors"))
        kwargs = dict(directory=str(tmp_path / "sd3"), budget_gib=0.4 * size / 2**30)
    results, _ = run_ranks(tmp_path, "interrupt_then_disable", 2, **kwargs)
    assert_no_errors(results)
    assert [results[rank]["outcome"] for rank in (0, 1)] == ["ok", "interrupted"]
    assert results[0]["restored"] and results[1]["restored"]  # every gather paired with its peer's


def test_disable_without_restore_after_ctrl_c_still_closes_the_call_in_step(tmp_path):
    """disable(restore=False) gathers nothing, but the interrupted rank still issues the rest of
    its call as its peer did (else Gloo pairs them wrongly: a crash); then neither model runs."""
    results, _ = run_ranks(tmp_path, "interrupt_then_disable", 2, restore=False)
    assert_no_errors(results)
    assert [results[rank]["outcome"] for rank in (0, 1)] == ["ok", "interrupted"]
    assert all("disabled with restore=False" in (results[rank]["refused"] or "") for rank in (0, 1))


def test_allgather_slots_are_never_reallocated_in_a_call(tmp_path):
    """Flux's two block sizes would resize slots between phases (rank-local mode does): with
    allocation failing on rank 1 after enable(), both ranks still stream exactly."""
    results, _ = run_ranks(tmp_path, "slots_kept_whole", 2)
    assert_no_errors(results)
    assert results[0] == results[1] and results[0]["identical"]


def test_a_rank_that_dies_mid_wave_makes_the_others_fail_with_a_clear_error(tmp_path):
    results, exitcodes = run_ranks(tmp_path, "die_mid_wave", 3)
    assert exitcodes[2] == 3 and 2 not in results
    for rank in (0, 1):
        kind, name, text = results[rank]
        assert (kind, name) == ("raised", "StreamingError") and "all-gather in the dp group failed" in text
        # Named by the heartbeats: the survivors' kept beating, rank 2's stopped.
        assert "the dp group lost rank 2 (its heartbeat stopped)" in text


def test_a_rank_that_stops_mid_wave_is_named_on_its_peer(tmp_path):
    """Rank 1 stops (SIGSTOP) mid-call: its sockets stay open, so rank 0's collective does not
    fail at once. Rank 0's watch sees rank 1's heartbeat stop for half the 5 s timeout while
    the collective is unfinished and gives its verdict; the collective (which Gloo's abort
    does not end: it times out at 5 s) raises it. See [Note: dead ranks]
    (5 s, was 8 s: the test waits the timeout out; the watch beats every 0.5 s.)"""
    results, _ = run_ranks(tmp_path, "stopped_mid_wave", 2, stuck=(1,), pg_timeout_s=5)
    kind, name, text = results[0]
    assert (kind, name) == ("raised", "StreamingError")
    assert re.search(r"^all-gather mode: the dp group lost rank 1 \(no heartbeat for \d s while rank 0 waited", text)
    assert "During handling" not in text  # raised once, by the collective, not also by the watch


def test_a_survivor_blocked_past_the_graces_is_ended_with_the_verdict(tmp_path):
    """The same, with the watch's graces cut to 0.2 s (the verdict comes after 3 s of silence,
    the survivor's Gloo collective only times out at 6 s): the watch writes the verdict to
    stderr and ends the process with status 1 (NCCL's own teardown would come a minute after
    the timeout). See [Note: dead ranks] (6 s, was 10 s: the test waits for the verdict.)"""
    stderr = tmp_path / "rank0.stderr"
    results, exitcodes = run_ranks(
        tmp_path, "stopped_mid_wave", 2, stuck=(1,), pg_timeout_s=6, grace_s=0.2, stderr=str(stderr)
    )
    assert results == {} and exitcodes[0] == 1
    assert re.search(
        r"^dlo: all-gather mode: the dp group lost rank 1 \(no heartbeat .*; the thread running the calls stayed "
        r"blocked, ending the process$",
        stderr.read_text(),
        re.MULTILINE,
    )


def test_sp_group_is_used_when_dp_is_one(tmp_path):
    results, _ = run_ranks(tmp_path, "sp_group", 2)
    assert_no_errors(results)
    assert all(r == {"identical": True, "role": "sp"} for r in results.values())


def test_shards_from_a_checkpoint_mapping_release_it(tmp_path):
    from dlo.models.tiny import TINY_MODELS

    TINY_MODELS["flux"].build(seed=4).save_pretrained(tmp_path / "flux", max_shard_size="100KB")
    results, _ = run_ranks(tmp_path, "from_checkpoint", 2, directory=str(tmp_path / "flux"))
    assert_no_errors(results)
    for result in results.values():
        assert result["identical"] and result["mapping_closed"] and result["mapped_bytes"] == 0
        assert result["host_bytes"] > 0


def _flux_checkpoint(tmp_path) -> str:
    from dlo.models.tiny import TINY_MODELS

    TINY_MODELS["flux"].build(seed=4).save_pretrained(tmp_path / "flux", max_shard_size="100KB")
    return str(tmp_path / "flux")


@pytest.mark.parametrize(
    ("stream_dtype", "fake_driver", "world"),
    # bf16 registered by the fake driver, as on CUDA; float8 on the plain CPU path (nothing to register);
    # 3 ranks: every block's padded image then runs into the next block's bytes, which must land unread
    [(None, True, 2), ("fp8", False, 2), (None, True, 3)],
)
def test_every_rank_shards_from_views_of_the_one_cache_entry_of_the_node(tmp_path, stream_dtype, fake_driver, world):
    """All-gather with the host weight cache: the ranks load at once, one publishes the entry
    and the other maps it (one entry: its identity names no rank), and every piece of every
    rank's shards is a view of that entry's files (registered where the mapping is), with no
    private copy, unchunked and in chunks (0.03 MiB: 6 and 3 chunks of the tiny Flux blocks,
    their padding inside the files). Outputs equal resident, during and after disable()."""
    cache = tmp_path / "cache"
    kwargs = dict(directory=_flux_checkpoint(tmp_path), cache_dir=str(cache), chunks_mib=[0, 0.03])
    results, _ = run_ranks(tmp_path, "cache_shards", world, stream_dtype=stream_dtype, fake_driver=fake_driver, **kwargs)
    assert_no_errors(results)
    (key,) = [p.name for p in (cache / "v1").iterdir()]
    entry_files = {str(p) for p in (cache / "v1" / key).glob("*.safetensors")}
    for result in results.values():
        assert result.pop("still_registered") == 0  # disable() unregistered what enable() registered
        for chunk_mib, got in result.items():
            assert got["identical_to_resident"] and got["identical_after_disable"]
            assert got["backing"] == "host_weight_cache" and got["entry"] == key
            assert got["stats_backing"] == "host_weight_cache shards"
            assert got["shard_files"] <= entry_files and got["private_bytes"] == 0 and got["mapped_bytes"] > 0
            assert got["pieces"] == got["chunks"] and (max(got["chunks"]) > 1) == (chunk_mib > 0)
            assert got["registered"] == fake_driver and (got["registered_bytes"] > 0) == fake_driver
            assert got["mapping_closed"]  # by disable()
            assert (got["float8_bytes"] > 0) == (stream_dtype == "fp8")


def test_a_padded_image_that_runs_past_its_entry_file_gets_a_private_shard(tmp_path):
    """64-byte chunks: every piece pads to 512 bytes, so a block's padded image (1024 chunks of
    2 x 512 bytes: 1 MiB) runs past the whole entry file. The shard is then private, holding the
    same image bytes the entry's view holds unchunked."""
    from dlo.backend.block_binding import collect_block, placeholders, shard_block
    from dlo.backend.plan_binding import BoundPlan
    from dlo.hotpath.gather import GatherGroup
    from dlo.planning.offload_plan import resolve_blocks

    config = dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(tmp_path / "cache"), cache_allow_any_filesystem=True)
    model, plan = dlo.load_transformer(_flux_checkpoint(tmp_path), config)
    bound = BoundPlan(plan)
    try:
        bound.bind(model, torch.device("cpu"))
        block = collect_block(resolve_blocks(model, plan.offload_plan)[-1])
        group = GatherGroup(None, 0, 2, GatherRole.DP)
        stand_ins = placeholders([block], torch.device("cpu"))
        viewed = shard_block(block, bound, group, False, stand_ins, None, chunk_bytes=0).source
        far = shard_block(block, bound, group, False, stand_ins, None, chunk_bytes=64).source
        assert far.shards.padded_bytes > max(f.size for f in bound.weights.checkpoint.files)
        assert viewed.views_entry and bound.weights.checkpoint.holds(viewed.pieces[0])
        assert not far.views_entry and far.host_bytes == far.shards.shard_bytes
        (unchunked,) = viewed.pieces  # rank 0: image bytes [0, W)
        for piece, host in zip(far.shards.pieces(0), far.pieces):
            if piece.image_start < unchunked.numel():
                assert torch.equal(host, unchunked[piece.image_start : piece.image_start + piece.nbytes])
    finally:
        bound.release()


def test_float8_data_of_another_float8_dtype_in_the_entry_gets_a_private_shard(tmp_path):
    """Bytes viewed from the entry are sent as they are, while a private shard converts them:
    an fp8 entry whose header gave a weight the other float8 dtype (no entry dlo writes does;
    the header is edited here) must not be viewed, or ranks would gather different blocks."""
    from dlo.backend.block_binding import collect_block, placeholders, shard_block
    from dlo.backend.plan_binding import BoundPlan
    from dlo.hotpath.gather import GatherGroup
    from dlo.planning.fp8_selection import fp8_format, quantized_tensors
    from dlo.planning.offload_plan import resolve_blocks

    config = dlo.OffloadConfig(
        host_weight_cache=True, cache_dir=str(tmp_path / "cache"), cache_allow_any_filesystem=True, stream_dtype="fp8"
    )
    model, plan = dlo.load_transformer(_flux_checkpoint(tmp_path), config)
    bound = BoundPlan(plan)
    try:
        bound.bind(model, torch.device("cpu"))
        ref = resolve_blocks(model, plan.offload_plan)[-1]
        block = collect_block(ref, quantized_tensors(model, ref, config))
        group = GatherGroup(None, 0, 2, GatherRole.DP)
        stand_ins = placeholders([block], torch.device("cpu"))

        def shard():
            return shard_block(block, bound, group, False, stand_ins, fp8_format(config), chunk_bytes=0).source

        assert shard().views_entry
        tensors = bound.weights.checkpoint.tensors
        key = next(k for k, t in tensors.items() if t.entry.dtype == torch.float8_e4m3fn and k.startswith(ref.name))
        tensors[key] = dataclasses.replace(
            tensors[key], entry=dataclasses.replace(tensors[key].entry, dtype=torch.float8_e5m2)
        )
        assert not shard().views_entry
    finally:
        bound.release()


def test_a_rank_that_cannot_use_the_cache_gathers_from_private_shards_with_its_peers(tmp_path):
    """Rank 1 refuses its cache root (writable by others) and keeps the ordinary tensors, as
    rank-local mode does, packing private shards from them: its private pieces and rank 0's
    views of the entry rebuild the same blocks (no hang, outputs equal resident)."""
    kwargs = dict(directory=_flux_checkpoint(tmp_path), cache_dir=str(tmp_path / "cache"), chunks_mib=[0.03])
    results, _ = run_ranks(tmp_path, "cache_shards", 2, refused_rank=1, **kwargs)
    assert_no_errors(results)
    shared, private = results[0][0.03], results[1][0.03]
    assert shared["identical_to_resident"] and private["identical_to_resident"]
    assert shared["backing"] == "host_weight_cache" and shared["private_bytes"] == 0
    assert (shared["stats_backing"], private["stats_backing"]) == ("host_weight_cache shards", "shards")
    assert private["backing"] is None and private["private_bytes"] > 0 and private["mapped_bytes"] == 0
    assert not any(path and path.endswith(".safetensors") for path in private["shard_files"])  # its own memory


@pytest.mark.parametrize(
    ("dp", "sp", "role"), [(4, 1, "dp"), (4, 2, "dp"), (1, 2, "sp"), (1, 1, "none"), (2, 8, "dp")]
)
def test_group_selection_rule(dp, sp, role):
    assert choose_gather_role(dp, sp).value == role


def test_single_process_without_distributed_is_a_group_of_one(tiny_pair):
    reference, streamed, entry = tiny_pair("wan")
    with torch.inference_mode():
        expected = reference(**entry.inputs(3))[0]
    with dlo.enable(streamed, "cpu", dlo.OffloadConfig(use_allgather=True)) as handle, torch.inference_mode():
        assert torch.equal(streamed(**entry.inputs(3))[0], expected)
        stats = handle.stats()
    assert stats.gather_group_size == 1 and stats.collectives == 0


@pytest.mark.parametrize(("backend", "device"), [("gloo", "cuda"), ("nccl", "cpu")])
def test_backend_must_match_the_device(backend, device):
    from dlo.backend.gather_group import check_backend

    with pytest.raises(dlo.ConfigError, match="needs a '(nccl|gloo)' process group; the dp group is"):
        check_backend(backend, torch.device(device), GatherRole.DP)
    check_backend("nccl", torch.device("cuda"), "dp")
    check_backend("gloo", torch.device("cpu"), "dp")


def test_config_rules_for_groups(tiny_pair):
    _, streamed, _ = tiny_pair("wan")
    with pytest.raises(dlo.ConfigError, match="groups= is used by all-gather mode only"):
        dlo.enable(streamed, "cpu", groups=dlo.ParallelGroups())
    with pytest.raises(dlo.ConfigError, match="HSDP"):
        dlo.enable(streamed, "cpu", dlo.OffloadConfig(use_allgather=True), groups=dlo.ParallelGroups(hsdp=True))
    with pytest.raises(dlo.ConfigError, match="must be a dlo.ParallelGroups"):
        dlo.enable(streamed, "cpu", dlo.OffloadConfig(use_allgather=True), groups=("dp",))


@pytest.mark.parametrize("rank0", [dict(num_slots=3), dict(gather_chunk_mib=0.03)], ids=["slots", "chunks"])
def test_ranks_with_different_slot_counts_or_chunks_are_refused_before_any_block_collective(tmp_path, rank0):
    results, _ = run_ranks(tmp_path, "mismatched", 2, **rank0)
    assert_no_errors(results)
    assert all(results[rank].startswith("StreamingError: all-gather lockstep broken") for rank in (0, 1))


def expected_shard_bytes(image_bytes, world, chunk_mib):
    """Each block in ceil(L / chunk) chunks (1 unchunked) of `world` equal 512-aligned pieces."""
    chunk = math.ceil(chunk_mib * 2**20)
    chunks = -(-image_bytes // chunk) if chunk else 1
    return chunks, chunks * align_up(-(-image_bytes // (chunks * world)))


@pytest.mark.parametrize(
    ("stream_dtype", "chunks_mib"),
    # Tiny Flux blocks of 157696 and 65536 bytes: sizes that divide neither, one that divides
    # the small block (0.0625 MiB = 65536), and one in the hundreds of chunks of 512-byte pieces.
    [(None, [0.1, 0.0625, 0.03, 0.001]), ("fp8", [0.03])],
)
def test_chunked_gathers_are_bit_identical_and_each_rank_still_holds_half(tmp_path, stream_dtype, chunks_mib):
    results, _ = run_ranks(tmp_path, "chunked", 2, chunks_mib=chunks_mib, stream_dtype=stream_dtype)
    assert_no_errors(results)
    for result in results.values():
        assert sorted(result) == sorted([0, *chunks_mib])
        for chunk_mib, got in result.items():
            assert got["identical_to_resident"] and got["identical_to_unchunked"] and got["identical_after_disable"]
            planned = [expected_shard_bytes(size, 2, chunk_mib) for size in got["image_bytes"]]
            assert got["host_bytes"] == sum(shard for _, shard in planned)
            # 1/2 of every block, plus under 512 bytes of padding per piece
            assert got["host_bytes"] < sum(got["image_bytes"]) / 2 + 512 * sum(chunks for chunks, _ in planned)
            if chunk_mib:  # really chunked: more collectives than one a load
                assert max(chunks for chunks, _ in planned) > 1
                assert got["collectives"] > result[0]["collectives"]


def test_diffusers_sequence_parallelism_with_dlo_matches_it_without(tmp_path):
    """Ulysses-2 context parallelism (diffusers' enable_parallelism) on two Gloo ranks, with
    dlo all-gathering each block over the SP group: bit-identical to the same SP run without
    dlo, for Wan and Flux, in either order, each rank holding about half the blocks."""
    results, _ = run_ranks(tmp_path, "sequence_parallel", 2)
    assert_no_errors(results)
    for rank_results in results.values():
        assert sorted(rank_results) == [("flux", "dlo_first"), ("flux", "sp_first"), ("wan", "dlo_first"), ("wan", "sp_first")]
        for (name, order), result in rank_results.items():
            assert result["identical"], (name, order)
            assert result["role"] == ("sp" if order == "sp_first" else "dp")  # dlo_first: the world, as DP
            # Each shard is ceil(block / 2) rounded up to 512 bytes.
            half = result["streamed_bytes"] / 2
            assert half <= result["host_bytes"] <= half + 512 * result["blocks"]


@pytest.mark.parametrize(("stream_dtype", "cache"), [(None, False), ("fp8", False), (None, True)], ids=["shards", "fp8", "cache"])
def test_weight_changes_reach_every_ranks_shards(tmp_path, tiny_loras, stream_dtype, cache):
    """load_state_dict, fuse_lora and unfuse_lora (the handle's, then diffusers' own: the
    pipeline's unfuse layer by layer) in step on every rank: each rank gathers the blocks it
    changes, and rewrites its own shard (requantized with float8; copied on write from a shared
    cache entry, whose files never change)."""
    kwargs = dict(lora=str(tiny_loras("flux")["a"]), stream_dtype=stream_dtype)
    if cache:
        kwargs.update(directory=_flux_checkpoint(tmp_path), cache_dir=str(tmp_path / "cache"))
    results, _ = run_ranks(tmp_path, "weight_changes", 2, **kwargs)
    assert_no_errors(results)
    for result in results.values():
        assert all(result["identical"]) and len(result["identical"]) == 7 and result["identical_after_disable"]
        assert "in all-gather mode each rank holds 1/2 of every streamed block" in result["save_refused"]
        # load_state_dict: the 3 single blocks; fuse and unfuse: all 5 blocks
        assert result["rewritten_blocks"] == 3 + 2 * result["blocks"]
        assert result["views_before"] == cache and result["private_after"]
        assert result["copied_on_write_bytes"] == (result["host_bytes"] if cache else 0)


def _file_bytes_per_block(directory) -> dict[str, int]:
    """Each block's bytes in the checkpoint's files: what the group reads of it per use."""
    from safetensors.torch import load_file

    found: dict[str, int] = {}
    for path in Path(directory).glob("*.safetensors"):
        for key, tensor in load_file(path).items():
            if key.startswith(("transformer_blocks.", "single_transformer_blocks.")):
                block = ".".join(key.split(".")[:2])
                found[block] = found.get(block, 0) + tensor.nbytes
    return found


@pytest.mark.parametrize(
    ("world", "chunk_mib", "source", "fraction"),
    # 3 ranks in chunks of 64 KiB: pieces cut tensors anywhere, and the last rank's run into the padding.
    # `fraction` of the blocks' file bytes over the ranks: a budget that keeps some blocks and not others.
    [(2, 64.0, "checkpoint", 0.95), (3, 1 / 16, "checkpoint", 1.0), (2, 64.0, "fp8", 1.2), (2, 1 / 16, "cache", 0.95)],
)
def test_under_a_host_budget_each_rank_reads_only_its_shard_of_the_blocks_on_disk(
    tmp_path, capsys, world, chunk_mib, source, fraction
):
    """Every output equals the resident model's, before and after a weight change into a block
    on disk (copied on write) and after disable(); what a rank holds stays within the budget;
    the ranks' reads of a block on disk add up to its bytes in the files: each byte read by one
    rank, once per use; and `dlo inspect --nproc` shows the split the ranks made."""
    from safetensors.torch import save_file

    kwargs = {}
    if source == "fp8":
        from fp8_checkpoints import write_fp8_checkpoint

        directory, dequantized = write_fp8_checkpoint(tmp_path)
        kwargs["reference"] = str(tmp_path / "resident.safetensors")
        save_file(dequantized, kwargs["reference"])
    else:
        directory = _flux_checkpoint(tmp_path)
    if source == "cache":
        kwargs["cache_dir"] = str(tmp_path / "cache")
    per_block = _file_bytes_per_block(directory)
    budget = sum(per_block.values()) / world * fraction / 2**30
    results, _ = run_ranks(
        tmp_path, "disk_shards", world, directory=str(directory), budget_gib=budget, gather_chunk_mib=chunk_mib, **kwargs
    )
    assert_no_errors(results)
    for rank, result in results.items():
        assert result["identical"] and result["identical_after_change"] and result["identical_after_disable"], rank
        assert 0 < len(result["disk_blocks"]) < len(per_block) and result["choice"] == "kept"
        assert result["held_bytes"] <= result["budget_bytes"]
        assert result["reads"] >= 2 * len(result["disk_blocks"])  # two calls, each block read per use
        assert result["kinds"][result["changed_block"]] == "ShardSource"  # its changed shard: a private copy
    on_every_rank = set.intersection(*(set(r["disk_blocks"]) for r in results.values()))
    assert on_every_rank
    for block in on_every_rank:
        assert sum(r["payload"][block] for r in results.values()) == per_block[block], block
    assert all(r["disk_blocks"] == results[0]["disk_blocks"] for r in results.values())  # one split
    if source != "cache":  # `dlo inspect` plans from the directory's files, before anything loads
        from dlo.cli.main import main

        flags = ["--host-budget-gib", str(budget), "--nproc", str(world), "--gather-chunk-mib", str(chunk_mib)]
        assert main(["inspect", str(directory), *flags]) == 0
        shown = capsys.readouterr().out.split("read from disk:", 1)[1].splitlines()[0].strip().split(", ")
        assert shown == list(results[0]["disk_blocks"])


def test_a_rank_whose_shard_read_fails_is_named_on_its_peers_within_the_group_timeout(tmp_path):
    """A read failing on one rank leaves a collective its peers issued unmatched; the rank
    stops its heartbeat as it breaks off, so a peer's error names it (not a bare timeout)."""
    import shutil

    from test_disk_tier import budget_gib

    source = _flux_checkpoint(tmp_path)
    directories = []
    for rank in range(2):
        shutil.copytree(source, tmp_path / f"rank{rank}")
        directories.append(str(tmp_path / f"rank{rank}"))
    files = sorted(Path(source).glob("*.safetensors"))
    results, _ = run_ranks(
        tmp_path, "shard_read_fails", 2, directories=directories, budget_gib=budget_gib(files, 0.45),
        stay_alive_s=15.0, pg_timeout_s=10,
    )
    assert_no_errors(results)
    assert results[1]["outcome"][0] == "raised" and "ended early" in results[1]["outcome"][1]
    kind, message = results[0]["outcome"]
    assert kind == "raised" and "rank 1" in message and "no heartbeat" in message, message
