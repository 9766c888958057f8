"""Processes that stream the same checkpoint share its pages through the page cache
(docs/guides/checkpoints.md); processes that load it the ordinary way each hold a private copy.

Every number here comes from real spawned processes reading /proc/<pid>/smaps_rollup: no
mocks. The model is a WanTransformer3DModel with random weights, big enough (~211 MB) that
the checkpoint dominates interpreter and allocator noise.

Model sizes for `WAN` below (float32, 4 bytes a parameter), inner = 8 heads x 64 = 512:
  one block = self-attn q,k,v,out (4 x (512*512 + 512)) + cross-attn q,k,v,out (same)
              + q/k RMSNorm weights (4 x 512) + cross-attn norm (2 x 512)
              + ffn (512*2048 + 2048 + 2048*512 + 512) + scale_shift_table (6 x 512)
            = 4_207_104 parameters = 16.83 MB
  12 blocks = 201.9 MB; non-block parts (patch embed, condition embedder with its
  512 -> 6*512 time projection, proj_out, scale_shift_table) = 8.74 MB
  model     = 210.7 MB (the RoPE tables are non-persistent buffers, a few KB, not saved).
The test recomputes these from the built model; the comments are what they come to.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import queue
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import dlo
from dlo.host.tensor_source import CopyTask
from dlo.models.tiny import TinyModel, _wan_inputs

pytest.importorskip("diffusers")
gguf = pytest.importorskip("gguf")
from gguf_files import write_gguf  # noqa: E402
if dlo.read_smaps_rollup() is None:  # pragma: no cover - non-Linux
    pytest.skip("needs /proc/<pid>/smaps_rollup", allow_module_level=True)

WAN = TinyModel(
    "wan-page-sharing",
    "WanTransformer3DModel",
    dict(
        patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=64, in_channels=4, out_channels=4,
        text_dim=64, freq_dim=64, ffn_dim=2048, num_layers=12, rope_max_seq_len=32,
    ),
    # 2 x 4 x 4 = 32 latent tokens and 12 text tokens: the forward costs milliseconds.
    _wan_inputs(latent=(1, 4, 2, 8, 8), text=(1, 12, 64)),
)

MB = 1e6
# A broken worker must fail the test, never hang it. Generous next to the few seconds a
# worker takes (spawn + imports + load + one forward), even with 3 workers on 2 cores.
BARRIER_TIMEOUT_S = 90.0
RESULTS_TIMEOUT_S = 110.0


@dataclass(frozen=True)
class SavedCheckpoint:
    directory: Path
    gguf_file: Path  # the same model in one GGUF file, its Linear weights Q8_0
    fp8_directory: Path  # the same model's checkpoint with its block Linear weights float8 (per-row scales)
    file_bytes: int  # summed sizes of the safetensors shards (tensor bytes + headers)
    model_bytes: int  # parameters + persistent buffers of the model, float32
    block_bytes: int  # the largest block
    non_block_bytes: int


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> SavedCheckpoint:
    directory = tmp_path_factory.mktemp("wan_page_sharing")
    model = WAN.build(seed=0)
    model.save_pretrained(directory, max_shard_size="50MB")
    gguf_file = write_gguf(model, tmp_path_factory.mktemp("wan_gguf") / "wan-Q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    fp8_directory = tmp_path_factory.mktemp("wan_fp8")
    _write_fp8(model, fp8_directory)
    state = model.state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    block_bytes = max(sum(p.numel() * p.element_size() for p in block.state_dict().values()) for block in model.blocks)
    block_total = sum(sum(p.numel() * p.element_size() for p in b.state_dict().values()) for b in model.blocks)
    del model, state
    shards = sorted(directory.glob("*.safetensors"))
    assert len(shards) > 1, "the checkpoint should be sharded"
    return SavedCheckpoint(
        directory=directory,
        gguf_file=gguf_file,
        fp8_directory=fp8_directory,
        file_bytes=sum(p.stat().st_size for p in shards),
        model_bytes=model_bytes,
        block_bytes=block_bytes,
        non_block_bytes=model_bytes - block_total,
    )


def _write_fp8(model: torch.nn.Module, directory: Path) -> None:
    """`model` as a float8 checkpoint the way the ecosystem writes one: each block Linear weight
    float8 with its per-row `weight_scale`, the rest as it is."""
    from safetensors.torch import save_file

    stored = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("blocks.") and name.endswith(".weight") and tensor.dim() == 2:
            scale = (tensor.float().abs().amax(dim=1, keepdim=True) / 448).clamp_min(1e-12)
            stored[name] = (tensor.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            stored[name[: -len("weight")] + "weight_scale"] = scale
        else:
            stored[name] = tensor.contiguous()
    model.save_config(directory)
    save_file(stored, directory / "diffusion_pytorch_model.safetensors")


def _sharing_worker(rank: int, directory: str, scenarios, barrier, results) -> None:
    """For each (mmap, cache_dir, source) of `scenarios` in turn: load (`source` where one is
    given: a GGUF file, with the directory's config, or another model directory), enable on
    cpu, run one forward; report smaps_rollup before loading and after the forward, measured while every
    worker holds its mapping. Between scenarios the model and its handle are dropped, and
    every worker has dropped them before anyone takes the next baseline."""
    try:
        # Everything imported and the inputs built before the first measurement, so the
        # deltas are the load, enable and forward only.
        importlib.import_module("diffusers.models.transformers.transformer_wan")  # diffusers imports lazily

        torch.set_num_threads(1)  # up to 3 workers on 2 cores
        inputs = WAN.inputs(seed=rank)
        copy_sources = _record_copy_sources()
        for index, (mmap, cache_dir, source) in enumerate(scenarios):
            # Every worker has mapped torch's libraries (and dropped the last scenario's model)
            # before anyone takes a baseline: a late starter would otherwise lower the others'
            # share of those pages between their two measurements.
            barrier.wait(BARRIER_TIMEOUT_S)
            before = dlo.read_smaps_rollup()
            barrier.wait(BARRIER_TIMEOUT_S)

            config = dlo.OffloadConfig(
                checkpoint_mmap=mmap, host_weight_cache=cache_dir is not None, cache_dir=cache_dir or "unused"
            )
            if source is None:
                model, plan = dlo.load_transformer(directory, config=config)
            elif Path(source).is_file():
                model, plan = dlo.load_transformer(source, config=config, model_config=directory)
            else:
                model, plan = dlo.load_transformer(source, config=config)
            handle = dlo.enable(model, "cpu", config, plan=plan)
            copy_sources.clear()
            with torch.inference_mode():
                output = model(**inputs)[0]
            stats = handle.stats()
            copied_from = _files_holding(copy_sources)  # by the forward

            barrier.wait(BARRIER_TIMEOUT_S)  # everyone loaded and ran: all mappings are live
            after = dlo.read_smaps_rollup()
            barrier.wait(BARRIER_TIMEOUT_S)  # nobody unmaps (exits, drops) before everyone measured
            results.put(
                dict(
                    scenario=index,
                    rank=rank,
                    plan=plan is not None,
                    before=before,
                    after=after,
                    mapped_bytes=stats.mapped_bytes,
                    host_bytes=stats.host_bytes,
                    backing=stats.backing,
                    slot_bytes=stats.slot_bytes,
                    copied_from=copied_from,
                    finite=bool(torch.isfinite(output).all()),
                )
            )
            del model, plan, handle, output, stats
            gc.collect()
    except BaseException:
        barrier.abort()  # the others fail fast instead of waiting out the timeout
        results.put(dict(scenario=None, rank=rank, error=traceback.format_exc()))


def _record_copy_sources() -> list[tuple[int, int]]:
    """From now on in this process, the (address, bytes) of every copy dlo runs on the host
    (into a slot, a staging buffer). Only addresses: views of a mapping must not outlive it."""
    sources: list[tuple[int, int]] = []
    run = CopyTask.run

    def record(task: CopyTask) -> None:
        sources.append((task.source.data_ptr(), task.source.numel() * task.source.element_size()))
        run(task)

    CopyTask.run = record
    return sources


def _files_holding(sources: list[tuple[int, int]]) -> dict[str | None, int]:
    """Bytes of `sources` per file whose mapping holds them, as this process's /proc/self/maps
    lists it (None: anonymous memory, a copy of the process's own)."""
    with open("/proc/self/maps") as maps:
        regions = []
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            regions.append((start, end, fields[5].strip() if len(fields) == 6 else None))
    held: dict[str | None, int] = {}
    for address, nbytes in sources:
        owner = next((name for start, end, name in regions if start <= address and address + nbytes <= end), None)
        held[owner] = held.get(owner, 0) + nbytes
    return held


@dataclass(frozen=True)
class Delta:
    rank: int
    private_dirty: int
    pss_file: int
    pss: int
    rss: int


def _run_workers(directory: Path, workers: int, scenarios) -> list[tuple[list[dict], list[Delta]]]:
    """`workers` spawned processes run each (mmap, cache_dir or None, source or None) of
    `scenarios` in turn; per scenario, (reports, deltas) ordered by rank."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(workers)
    results = ctx.Queue()
    scenarios = [tuple(str(given) if isinstance(given, Path) else given for given in scenario) for scenario in scenarios]
    processes = [
        ctx.Process(target=_sharing_worker, args=(rank, str(directory), scenarios, barrier, results), daemon=True)
        for rank in range(workers)
    ]
    for process in processes:
        process.start()
    reports: list[dict] = []
    expected = workers * len(scenarios)
    try:
        deadline = time.monotonic() + RESULTS_TIMEOUT_S * len(scenarios)
        while len(reports) < expected and time.monotonic() < deadline:
            try:
                reports.append(results.get(timeout=1.0))
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    # A worker died without reporting (killed, segfault): stop waiting.
                    codes = {p.pid: p.exitcode for p in dead}
                    pytest.fail(f"workers died without reporting: exit codes {codes}; got {reports}")
            if any("error" in r for r in reports):
                break
        errors = [r["error"] for r in reports if "error" in r]
        assert not errors, "worker failed:\n" + "\n".join(errors)
        assert len(reports) == expected, f"only {len(reports)} of {expected} reports came in"
        for process in processes:
            process.join(timeout=30)
            assert process.exitcode == 0, f"worker pid {process.pid} exit code {process.exitcode}"
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    per_scenario = []
    for index in range(len(scenarios)):
        mine = sorted((r for r in reports if r["scenario"] == index), key=lambda r: r["rank"])
        deltas = [
            Delta(
                rank=r["rank"],
                private_dirty=r["after"].private_dirty - r["before"].private_dirty,
                pss_file=r["after"].pss_file - r["before"].pss_file,
                pss=r["after"].pss - r["before"].pss,
                rss=r["after"].rss - r["before"].rss,
            )
            for r in mine
        ]
        per_scenario.append((mine, deltas))
    return per_scenario


@pytest.fixture(scope="module")
def three_workers(checkpoint, tmp_path_factory):
    """One set of 3 spawned workers (each costs seconds of imports) runs four scenarios in
    turn, each measured on its own baseline: checkpoint_mmap=True, then through the host
    weight cache (checkpoint_mmap=False), then the GGUF file mapped, then the float8
    checkpoint mapped. Returns (mmap (reports, deltas), cache (reports, deltas), the cache dir,
    gguf (reports, deltas), fp8 (reports, deltas)). The mmap
    scenario runs first, on fresh processes, as it did alone; the others after the previous
    one had dropped its model (their bounds are upper bounds on what a worker writes: memory
    freed by an earlier scenario cannot make a private copy pass)."""
    cache_dir = tmp_path_factory.mktemp("page-sharing-cache") / "cache"
    scenarios = [
        (True, None, None), (False, cache_dir, None), (True, None, checkpoint.gguf_file), (True, None, checkpoint.fp8_directory)
    ]
    mmap, cache, gguf_mapped, fp8_mapped = _run_workers(checkpoint.directory, 3, scenarios)
    return mmap, cache, cache_dir, gguf_mapped, fp8_mapped


def _print_table(title: str, ckpt: SavedCheckpoint, reports: list[dict], deltas: list[Delta]) -> None:
    print(f"\n{title}: model {ckpt.model_bytes / MB:.1f} MB, files {ckpt.file_bytes / MB:.1f} MB")
    print("  rank  plan  d.Private_Dirty  d.Pss_File    d.Pss    d.Rss  mapped_bytes  host_bytes (MB)")
    for report, delta in zip(reports, deltas):
        print(
            f"  {delta.rank:4d}  {str(report['plan']):>5}  {delta.private_dirty / MB:15.1f}"
            f"  {delta.pss_file / MB:10.1f}  {delta.pss / MB:7.1f}  {delta.rss / MB:7.1f}"
            f"  {report['mapped_bytes'] / MB:12.1f}  {report['host_bytes'] / MB:10.1f}"
        )
    summed_dirty = sum(d.private_dirty for d in deltas) / MB
    summed_pss_file = sum(d.pss_file for d in deltas) / MB
    print(f"   sum        {summed_dirty:15.1f}  {summed_pss_file:10.1f}")


def test_mmap_workers_share_one_copy_of_the_checkpoint(checkpoint, three_workers):
    workers = 3  # more than two: a page shared by N counts 1/N in each worker's Pss
    reports, deltas = three_workers[0]
    _print_table(f"checkpoint_mmap=True, {workers} workers", checkpoint, reports, deltas)

    for report in reports:
        assert report["plan"], f"worker {report['rank']} fell back to the ordinary loader (no HostWeightPlan)"
        assert report["finite"]
        assert report["mapped_bytes"] == checkpoint.file_bytes
        # Wan blocks have no non-persistent buffers: nothing of a streamed block is private.
        assert report["host_bytes"] == 0

    # Pss charges a page mapped by N processes 1/N to each, so summed over the workers a
    # shared page counts once: sum(d.Pss_File) ~= the checkpoint pages every worker touched
    # (all of them: the forward reads every block, the loader copies the non-block parts)
    # = file_bytes, not workers x file_bytes. The parent never maps the files. Slack for
    # torch's library pages touched during the forward (also split by Pss) and the header.
    summed_pss_file = sum(d.pss_file for d in deltas)
    assert 0.6 * checkpoint.file_bytes < summed_pss_file < 1.4 * checkpoint.file_bytes, (
        f"summed Pss_File growth {summed_pss_file / MB:.1f} MB for {checkpoint.file_bytes / MB:.1f} MB of files"
    )

    # What a worker writes itself (Private_Dirty) is not the weights:
    #   slots      = num_slots (2) x largest block            = 2 x 16.83 = 33.7 MB
    #   non-block  = materialized from the mapping, then cloned by enable() on cpu; the
    #                freed first copy may stay in malloc's heap: <= 2 x 8.74  = 17.5 MB
    #   noise      = python objects of the model, forward activations (32 tokens), torch's
    #                per-thread state: ~6-15 MB (measured totals ~52-57 MB), allow 50 MB
    #   bound      = 33.7 + 17.5 + 50 = 101 MB < 0.5 x model (105 MB)
    # A private copy would be >= model_bytes (211 MB) instead.
    slots = 2 * checkpoint.block_bytes
    bound = slots + 2 * checkpoint.non_block_bytes + 50 * MB
    assert bound < 0.5 * checkpoint.model_bytes
    for report, delta in zip(reports, deltas):
        assert report["slot_bytes"] >= slots
        assert delta.private_dirty < bound, (
            f"worker {delta.rank}: Private_Dirty grew {delta.private_dirty / MB:.1f} MB, "
            f"bound {bound / MB:.1f} MB (model {checkpoint.model_bytes / MB:.1f} MB)"
        )


def test_private_load_gives_every_worker_its_own_copy(checkpoint):
    """The contrast: with checkpoint_mmap=False each process packs its own host copy of
    every block (and an ordinary copy of the rest), so Private_Dirty grows by at least the
    model in every worker: 2 workers hold 2 copies."""
    ((reports, deltas),) = _run_workers(checkpoint.directory, 2, [(False, None, None)])
    _print_table("checkpoint_mmap=False, 2 workers", checkpoint, reports, deltas)

    for report, delta in zip(reports, deltas):
        assert not report["plan"]
        assert report["finite"]
        assert report["mapped_bytes"] == 0
        # host copies of the 12 blocks: 201.9 MB plus 512-byte alignment padding per tensor.
        assert report["host_bytes"] >= checkpoint.model_bytes - checkpoint.non_block_bytes
        assert delta.private_dirty >= 0.9 * checkpoint.model_bytes, (
            f"worker {delta.rank}: Private_Dirty grew only {delta.private_dirty / MB:.1f} MB "
            f"for a {checkpoint.model_bytes / MB:.1f} MB model"
        )


def test_cache_workers_map_one_entry(checkpoint, three_workers):
    """Three processes load through the host weight cache at once: one publishes, the others
    join, and all map the same entry, so the weights cost about one copy in total. (The same
    3 processes as the mmap test, its scenario done and dropped: see three_workers.)"""
    _, (reports, deltas), cache_dir, _, _ = three_workers
    _print_table("host_weight_cache=True, 3 workers", checkpoint, reports, deltas)
    assert all(r["plan"] and r["backing"] == "host_weight_cache" and r["host_bytes"] == 0 for r in reports)
    assert len(list((cache_dir / "v1").iterdir())) == 1
    # As above, summed Pss_File counts each shared page once: ~ the entry's bytes (the
    # checkpoint's own pages, mapped by diffusers' loader, are dropped with the tensors it
    # made). The ordinary load's private copies are freed (gc + malloc_trim), so no worker
    # keeps a model-sized Private_Dirty.
    entry_bytes = reports[0]["mapped_bytes"]
    assert 0.6 * entry_bytes < sum(d.pss_file for d in deltas) < 1.4 * entry_bytes
    assert all(d.private_dirty < 0.5 * checkpoint.model_bytes for d in deltas)


@pytest.mark.parametrize("kind", ["gguf", "fp8"])
def test_quantized_files_mapped_by_three_workers_cost_one_copy(checkpoint, three_workers, kind):
    """Three processes load the same GGUF file (See [Note: GGUF files mapped]) or the same
    float8 checkpoint (See [Note: fp8 streaming]): their quantized bytes are mapped, not
    copied, so summed over the workers they cost about one file."""
    if kind == "gguf":
        reports, deltas = three_workers[3]
        files = [checkpoint.gguf_file]
    else:
        reports, deltas = three_workers[4]
        files = sorted(checkpoint.fp8_directory.glob("*.safetensors"))
    file_bytes = sum(p.stat().st_size for p in files)
    files = [str(p) for p in files]
    # The blocks' quantized bytes: most of the file (its non-block parts are a few MB).
    blocks_bytes = 0.8 * file_bytes
    _print_table(f"{kind} file mapped ({file_bytes / MB:.1f} MB), 3 workers", checkpoint, reports, deltas)
    for report, delta in zip(reports, deltas):
        assert report["plan"] and report["backing"] == "checkpoint_mmap" and report["host_bytes"] == 0
        assert report["finite"] and report["mapped_bytes"] >= file_bytes
        assert delta.pss_file < 0.7 * file_bytes  # a third of the file each, not all of it
        # The forward copied the blocks' bytes out of the file's mapping (as /proc/self/maps
        # says), not out of a copy the worker made at load or enable(). (Not a bound on
        # Private_Dirty, as for the bf16 checkpoint above: here a worker's own writes (slots,
        # the weights a forward dequantizes, malloc's retained heap) measured 0.3-65 MB beside
        # a 56-60 MB file, so such a bound cannot tell a private copy apart.)
        from_files = sum(report["copied_from"].get(f, 0) for f in files)
        assert from_files >= blocks_bytes, report["copied_from"]
    summed_pss_file = sum(d.pss_file for d in deltas)
    assert 0.6 * file_bytes < summed_pss_file < 1.4 * file_bytes, (
        f"summed Pss_File growth {summed_pss_file / MB:.1f} MB for a {file_bytes / MB:.1f} MB {kind} file"
    )
