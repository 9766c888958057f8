"""Scenarios run by every rank of a Gloo group in child processes (tests/test_allgather.py).

Each scenario returns a small picklable result; an exception becomes ("raised", type, text).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import signal
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ordinary_tensors import ordinary_tensors
from torch import nn

import dlo
from dlo.hotpath import liveness
from dlo.models.tiny import TINY_MODELS


def rank_main(scenario: str, rank: int, world: int, rendezvous: str, queue, kwargs: dict) -> None:
    timeout = timedelta(seconds=kwargs.pop("pg_timeout_s", 30))
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=timeout)
        result = SCENARIOS[scenario](rank, world, **kwargs)
    except BaseException as err:  # reported, then the process exits
        result = ("raised", type(err).__name__, f"{err}\n{traceback.format_exc()}")
    queue.put((rank, result))
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


class OddBlock(nn.Module):
    """Shapes like 17x257 whose bytes never split evenly: shards need padding."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 257)
        self.down = nn.Linear(257, width)
        self.register_buffer("scale", torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x))) * self.scale


class OddStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(17, 17)
        self.blocks = nn.ModuleList([OddBlock(17) for _ in range(5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


def _tiny_outputs(model, name, seeds, dtype=torch.float32):
    with torch.inference_mode():
        return [model(**TINY_MODELS[name].inputs(seed, dtype))[0] for seed in seeds]


def parity(
    rank: int,
    world: int,
    name: str,
    num_slots: int = 2,
    resident_layers: int = 0,
    stream_dtype: str | None = None,
    fp8_compute: bool = False,
) -> dict:
    """Different prompts per rank (a DP wave), same step count: bit-identical to resident and
    to rank-local streaming; per-rank host bytes of the shards. With `stream_dtype`, the
    resident model is the quantized one (dlo.quantize_resident); with `fp8_compute` (bf16
    weights), disable() gives back Linears holding the dequantized weights: the weight-only
    quantized model's."""
    dtype = torch.bfloat16 if fp8_compute else torch.float32
    seeds = [10 * rank + step for step in range(3)]
    if name == "odd":
        reference = OddStack()
        inputs = [torch.randn(3, 17, generator=torch.Generator().manual_seed(s)) for s in seeds]

        def run(model):
            with torch.inference_mode():
                return [model(x) for x in inputs]
    else:
        reference = TINY_MODELS[name].build(seed=1, dtype=dtype)

        def run(model):
            return _tiny_outputs(model, name, seeds, dtype)

    local, gathered = copy.deepcopy(reference), copy.deepcopy(reference)
    local_config = dlo.OffloadConfig(
        num_slots=num_slots, resident_layers=resident_layers, stream_dtype=stream_dtype, fp8_compute=fp8_compute
    )
    disabled = copy.deepcopy(reference)  # what disable() gives back
    dlo.quantize_resident(disabled, dataclasses.replace(local_config, fp8_compute=False))
    dlo.quantize_resident(reference, local_config)
    expected = run(reference)
    with dlo.enable(local, "cpu", local_config):
        from_local = run(local)
    config = dataclasses.replace(local_config, use_allgather=True)
    handle = dlo.enable(gathered, "cpu", config)
    from_gather = run(gathered)
    stats = handle.stats()
    block_bytes = [b.wire.nbytes for b in handle._runtime.blocks]  # the host image (float8: smaller)
    handle.disable()
    after = run(gathered)  # disable() gathered the full blocks back: a plain module again
    return dict(
        identical_to_resident=all(torch.equal(a, b) for a, b in zip(expected, from_gather)),
        identical_to_local=all(torch.equal(a, b) for a, b in zip(from_local, from_gather)),
        identical_after_disable=all(torch.equal(a, b) for a, b in zip(run(disabled), after)),
        gemms_differ_after_disable=not any(torch.equal(a, b) for a, b in zip(expected, after)),
        host_bytes=stats.host_bytes,
        block_bytes=block_bytes,
        group_size=stats.gather_group_size,
        collectives=stats.collectives,
        resident=stats.resident_blocks,
        float8_bytes=stats.host_bytes_by_dtype.get("float8_e4m3fn", 0),
    )


def gguf_parity(rank: int, world: int, path: str, config_dir: str, class_name: str) -> dict:
    """A diffusers GGUF model (loaded from the file by every rank): its packed blocks gathered
    across the group equal the resident GGUF model, in the call and after disable()."""
    import warnings

    from gguf_files import load_gguf

    warnings.simplefilter("ignore")  # diffusers' notes on the weights it keeps in float32
    reference, gathered = (load_gguf(path, config_dir, class_name) for _ in range(2))
    seeds = [10 * rank + step for step in range(2)]
    expected = _tiny_outputs(reference, "wan", seeds)
    with dlo.enable(gathered, "cpu", dlo.OffloadConfig(use_allgather=True)) as handle:
        got = _tiny_outputs(gathered, "wan", seeds)
        stats = handle.stats()
        block_bytes = [b.wire.nbytes for b in handle._runtime.blocks]
    return dict(
        identical_to_resident=all(torch.equal(a, b) for a, b in zip(expected, got)),
        identical_after_disable=all(torch.equal(a, b) for a, b in zip(expected, _tiny_outputs(gathered, "wan", seeds))),
        still_gguf=all(type(p).__name__ == "GGUFParameter" for n, p in gathered.named_parameters() if n.endswith("to_q.weight")),
        group_size=stats.gather_group_size,
        host_bytes=stats.host_bytes,
        block_bytes=block_bytes,
        uint8_image_bytes=stats.host_bytes_by_dtype.get("uint8", 0),
    )


def diverge(rank: int, world: int, gather_chunk_mib: float = 64.0, num_slots: int = 2) -> list:
    """Rank 1 skips a block in the second call: it raises there, rank 0 finishes the call,
    and the third call fails on every rank before any block collective. Then the
    collectives each rank issued, and disable() (which gathers every block: collectives)."""
    model = TINY_MODELS["sd3"].build(seed=1)
    config = dlo.OffloadConfig(use_allgather=True, gather_chunk_mib=gather_chunk_mib, num_slots=num_slots)
    handle = dlo.enable(model, "cpu", config)
    outcomes: list = []
    for call in range(3):
        skip = [1] if (rank == 1 and call == 1) else None
        try:
            with torch.inference_mode():
                model(**TINY_MODELS["sd3"].inputs(call), skip_layers=skip)
            outcomes.append("ok")
        except dlo.StreamingError as err:
            outcomes.append(f"StreamingError: {err}")
    outcomes.append(handle.stats().collectives)
    handle.disable()
    outcomes.append("disabled")
    return outcomes


def slots_kept_whole(rank: int, world: int) -> dict:
    """Flux (blocks of two sizes) in all-gather mode with slot allocation failing on rank 1
    after enable(): no load may allocate there (a failed allocation would put the ranks on
    different collectives), so every call still equals resident."""
    reference = TINY_MODELS["flux"].build(seed=1)
    streamed = copy.deepcopy(reference)
    expected = _tiny_outputs(reference, "flux", [0, 1, 2])
    handle = dlo.enable(streamed, "cpu", dlo.OffloadConfig(use_allgather=True))
    if rank == 1:

        def refuse(nbytes):
            raise torch.OutOfMemoryError(f"test: no {nbytes} bytes")

        handle._runtime.executor.allocate_slot = refuse
    got = _tiny_outputs(streamed, "flux", [0, 1, 2])
    collectives = handle.stats().collectives
    handle.disable()
    return dict(identical=all(torch.equal(a, b) for a, b in zip(expected, got)), collectives=collectives)


def die_mid_wave(rank: int, world: int) -> str:
    """The last rank exits in the second call, before block 1 would issue the collective for
    block 3 (its hook runs before dlo's); the others must fail, not hang."""
    model = TINY_MODELS["wan"].build(seed=1)
    dlo.enable(model, "cpu", dlo.OffloadConfig(use_allgather=True))
    if rank == world - 1:
        model.blocks[1].register_forward_pre_hook(lambda *_: os._exit(3) if calls else None, prepend=True)
    calls = []
    with torch.inference_mode():
        model(**TINY_MODELS["wan"].inputs(0))
        calls.append(1)
        model(**TINY_MODELS["wan"].inputs(1))
    return "finished"


def stopped_mid_wave(rank: int, world: int, grace_s: float | None = None, stderr: str | None = None) -> str:
    """Like die_mid_wave, but the last rank stops (SIGSTOP) instead of exiting: its sockets
    stay open, so the others' collective waits out the group's timeout unless dlo's watch
    ends it. `grace_s`: the watch's graces before it raises in the calling thread and before
    it ends the process; `stderr`: where rank 0's file descriptor 2 goes."""
    if grace_s is not None:
        liveness.DELIVERY_GRACE_S = liveness.EXIT_GRACE_S = grace_s
    if stderr is not None and rank == 0:
        os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    model = TINY_MODELS["wan"].build(seed=1)
    handle = dlo.enable(model, "cpu", dlo.OffloadConfig(use_allgather=True))

    def stop(*_: object) -> None:
        if calls:
            # Its watch first ends its beat: stopped inside a store operation, the process
            # would hold the FileStore's lock and stall its peers' watches too.
            watch = handle._runtime.gather.watch
            watch.stop()
            watch._thread.join()
            os.kill(os.getpid(), signal.SIGSTOP)

    if rank == world - 1:
        model.blocks[1].register_forward_pre_hook(stop, prepend=True)
    calls = []
    with torch.inference_mode():
        model(**TINY_MODELS["wan"].inputs(0))
        calls.append(1)
        model(**TINY_MODELS["wan"].inputs(1))
    return "finished"


def sp_group(rank: int, world: int) -> dict:
    """DP of size 1 and an SP group of `world`: the SP group rebuilds the blocks."""
    sp = dist.new_group(list(range(world)))
    model = TINY_MODELS["flux"].build(seed=1)
    expected = _tiny_outputs(copy.deepcopy(model), "flux", [5])
    groups = dlo.ParallelGroups(dp=None, sp=sp)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(use_allgather=True), groups=groups) as handle:
        got = _tiny_outputs(model, "flux", [5])
        role = handle._runtime.gather.role.value
    return dict(identical=torch.equal(expected[0], got[0]), role=role)


def sequence_parallel(rank: int, world: int) -> dict:
    """Wan and Flux, each in both orders (one spawn for all: imports dominate)."""
    torch.accelerator.device_count = lambda: 1  # diffusers divides by it; 0 on a CPU-only machine
    return {(name, order): _sequence_parallel(world, name, order) for name in ("wan", "flux") for order in ("sp_first", "dlo_first")}


def _sequence_parallel(world: int, name: str, order: str) -> dict:
    """diffusers context parallelism (Ulysses over the world) with and without dlo: dlo
    all-gathers over the model's SP group, picked from the model when enabled after
    `enable_parallelism` (order "sp_first"), or over the world taken as DP when enabled
    before it ("dlo_first")."""
    import diffusers

    entry = TINY_MODELS[name]
    reference = entry.build(seed=2)
    model = copy.deepcopy(reference)
    reference.enable_parallelism(config=diffusers.ContextParallelConfig(ulysses_degree=world))
    inputs = [entry.inputs(seed) for seed in (3, 4)]
    with torch.inference_mode():
        expected = [reference(**kwargs)[0] for kwargs in inputs]
    config = dlo.OffloadConfig(use_allgather=True)
    if order == "sp_first":
        model.enable_parallelism(config=diffusers.ContextParallelConfig(ulysses_degree=world))
        handle = dlo.enable(model, "cpu", config)
    else:
        handle = dlo.enable(model, "cpu", config)
        model.enable_parallelism(config=diffusers.ContextParallelConfig(ulysses_degree=world))
    with torch.inference_mode():
        got = [model(**kwargs)[0] for kwargs in inputs]
    stats = handle.stats()
    role = handle._runtime.gather.role.value
    handle.disable()
    from dlo.planning.plan_summary import summarize

    summary = summarize(model, dlo.discover(model))
    return dict(
        identical=all(torch.equal(a, b) for a, b in zip(expected, got)),
        role=role,
        host_bytes=stats.host_bytes,
        streamed_bytes=summary.streamed_bytes,
        blocks=len(summary.streamed),
    )


def from_checkpoint(rank: int, world: int, directory: str) -> dict:
    """Shards built from a checkpoint mapping, which is closed once they exist."""
    import diffusers

    reference = diffusers.FluxTransformer2DModel.from_pretrained(directory).eval()
    ordinary_tensors(reference)
    config = dlo.OffloadConfig(use_allgather=True)
    model, plan = dlo.load_transformer(directory, config)
    checkpoint = plan._weights.checkpoint
    with dlo.enable(model, "cpu", config, plan=plan) as handle:
        got = _tiny_outputs(model, "flux", [rank])
        closed = all(shard._map.closed for shard in checkpoint.files)
        stats = handle.stats()
    return dict(
        identical=torch.equal(_tiny_outputs(reference, "flux", [rank])[0], got[0]),
        mapping_closed=closed,
        mapped_bytes=stats.mapped_bytes,
        host_bytes=stats.host_bytes,
    )


def _mapped_file(address: int, nbytes: int) -> str | None:
    """The file whose mapping in this process holds [address, address + nbytes), as
    /proc/self/maps lists it (None: anonymous memory)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address and address + nbytes <= end:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def cache_shards(
    rank: int,
    world: int,
    directory: str,
    cache_dir: str,
    chunks_mib: list[float],
    stream_dtype: str | None = None,
    refused_rank: int | None = None,
    fake_driver: bool = False,
) -> dict:
    """All-gather from the node's cache entry, one enable() per chunk size of `chunks_mib`
    (the first load publishes or maps the entry, the next ones map it): outputs against the
    resident model (quantized with `stream_dtype`) and after disable(), and where each rank's
    shard pieces live. `refused_rank` gets a cache root it must refuse (writable by others):
    it falls back to the ordinary load and private shards while its peers read the entry.
    `fake_driver`: "register" the mapping with tests/fake_driver.py, as CUDA would."""
    import diffusers
    from fake_driver import FakeDriver

    from dlo.backend import cuda_registration

    driver = FakeDriver()
    if fake_driver:
        cuda_registration.registration_driver = lambda device: driver
    reference = diffusers.FluxTransformer2DModel.from_pretrained(directory).eval()
    ordinary_tensors(reference)
    base = dlo.OffloadConfig(use_allgather=True, stream_dtype=stream_dtype)
    dlo.quantize_resident(reference, base)
    seeds = [10 * rank + step for step in range(2)]
    expected = _tiny_outputs(reference, "flux", seeds)
    if rank == refused_rank:
        cache_dir = f"{cache_dir}-open-{rank}"
        os.makedirs(cache_dir)
        os.chmod(cache_dir, 0o777)
    results = {}
    for chunk_mib in chunks_mib:
        config = dataclasses.replace(
            base, gather_chunk_mib=chunk_mib, host_weight_cache=True, cache_dir=cache_dir, cache_allow_any_filesystem=True
        )
        model, plan = dlo.load_transformer(directory, config)
        backing = plan.backing if plan is not None else None  # None: the cache fell back to the ordinary tensors
        checkpoint = plan._weights.checkpoint if plan is not None else None
        with dlo.enable(model, "cpu", config, plan=plan) as handle:
            got = _tiny_outputs(model, "flux", seeds)
            shards = [block.source for block in handle._runtime.blocks]
            files = {_mapped_file(p.data_ptr(), p.numel()) for s in shards for p in s.pieces}
            registered = all(  # a piece's first and last byte: all of it lies in registered memory
                driver.is_registered(p.data_ptr()) and driver.is_registered(p.data_ptr() + p.numel() - 1)
                for s in shards for p in s.pieces
            )
            stats = handle.stats()
        after = _tiny_outputs(model, "flux", seeds)
        results[chunk_mib] = dict(
            identical_to_resident=all(torch.equal(a, b) for a, b in zip(expected, got)),
            identical_after_disable=all(torch.equal(a, b) for a, b in zip(expected, after)),
            backing=backing,
            entry=checkpoint.directory.name if backing == "host_weight_cache" else None,
            mapping_closed=checkpoint is None or all(shard._map.closed for shard in checkpoint.files),
            pieces=[len(s.pieces) for s in shards],
            private_blocks=[i for i, s in enumerate(shards) if not s.views_entry],
            chunks=[s.shards.chunks for s in shards],
            shard_files=files,
            registered=registered,
            registered_bytes=stats.registered_bytes,
            private_bytes=stats.host_bytes,
            mapped_bytes=stats.mapped_bytes,
            stats_backing=stats.backing,
            float8_bytes=stats.host_bytes_by_dtype.get("float8_e4m3fn", 0),
        )
    results["still_registered"] = len(driver.registered)
    return results


SCENARIOS = {
    "parity": parity,
    "diverge": diverge,
    "slots_kept_whole": slots_kept_whole,
    "die_mid_wave": die_mid_wave,
    "stopped_mid_wave": stopped_mid_wave,
    "sp_group": sp_group,
    "from_checkpoint": from_checkpoint,
    "cache_shards": cache_shards,
}


def mismatched(rank: int, world: int, **rank0: object) -> str:
    """Rank 0 streams with the options `rank0` (e.g. 3 slots, or another chunk size), the
    others with the defaults: they would issue different loads, so the first agreement
    refuses it on every rank."""
    model = TINY_MODELS["sd3"].build(seed=1)
    dlo.enable(model, "cpu", dlo.OffloadConfig(use_allgather=True, **(rank0 if rank == 0 else {})))
    try:
        with torch.inference_mode():
            model(**TINY_MODELS["sd3"].inputs(0))
    except dlo.StreamingError as err:
        return f"StreamingError: {err}"
    return "ok"


SCENARIOS["mismatched"] = mismatched
SCENARIOS["gguf_parity"] = gguf_parity
SCENARIOS["sequence_parallel"] = sequence_parallel


def chunked(rank: int, world: int, chunks_mib: list[float], stream_dtype: str | None = None) -> dict:
    """Tiny Flux gathered unchunked, then in chunks of each size of `chunks_mib` (one enable()
    each): every output against the resident model (quantized with `stream_dtype`) and the
    unchunked gather, the outputs after disable(), host bytes and collectives per size."""
    reference = TINY_MODELS["flux"].build(seed=1)
    seeds = [10 * rank + step for step in range(3)]
    base = dlo.OffloadConfig(use_allgather=True, stream_dtype=stream_dtype, gather_chunk_mib=0)
    dlo.quantize_resident(reference, base)
    expected = _tiny_outputs(reference, "flux", seeds)

    def gathered(chunk_mib: float) -> dict:
        model = TINY_MODELS["flux"].build(seed=1)
        handle = dlo.enable(model, "cpu", dataclasses.replace(base, gather_chunk_mib=chunk_mib))
        outputs = _tiny_outputs(model, "flux", seeds)
        stats = handle.stats()
        image_bytes = [b.wire.nbytes for b in handle._runtime.blocks]
        handle.disable()
        after = _tiny_outputs(model, "flux", seeds)
        return dict(
            outputs=outputs,
            identical_after_disable=all(torch.equal(a, b) for a, b in zip(expected, after)),
            host_bytes=stats.host_bytes,
            collectives=stats.collectives,
            image_bytes=image_bytes,
        )

    unchunked = gathered(0)
    results = {}
    for chunk_mib in [0, *chunks_mib]:
        got = unchunked if chunk_mib == 0 else gathered(chunk_mib)
        results[chunk_mib] = dict(
            identical_to_resident=all(torch.equal(a, b) for a, b in zip(expected, got["outputs"])),
            identical_to_unchunked=all(torch.equal(a, b) for a, b in zip(unchunked["outputs"], got["outputs"])),
            **{k: v for k, v in got.items() if k != "outputs"},
        )
    return results


SCENARIOS["chunked"] = chunked


def _nccl_tiny_flux(rank: int, world: int):
    """This rank's GPU, an NCCL group of every rank, and a function running a tiny Flux model
    there on three inputs of this rank's own (bf16, outputs on the CPU)."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    nccl = dist.new_group(list(range(world)), backend="nccl")
    entry = TINY_MODELS["flux"]
    seeds = [10 * rank + step for step in range(3)]

    def run(model):
        with torch.inference_mode():
            return [model(**entry.inputs(seed, torch.bfloat16, device))[0].cpu() for seed in seeds]

    return device, nccl, run


def cuda_chunked(rank: int, world: int, chunks_mib: list[float]) -> dict:
    """One GPU per rank and an NCCL group: tiny Flux in bf16 (and streamed as float8) gathered
    unchunked and in chunks of each size of `chunks_mib`, against the resident model."""
    device, nccl, run = _nccl_tiny_flux(rank, world)
    results = {}
    for stream_dtype in (None, "fp8"):
        built = TINY_MODELS["flux"].build(seed=1, dtype=torch.bfloat16)
        resident = copy.deepcopy(built).to(device)
        dlo.quantize_resident(resident, dlo.OffloadConfig(stream_dtype=stream_dtype))
        expected = run(resident)
        del resident
        for chunk_mib in [0, *chunks_mib]:
            model = copy.deepcopy(built)
            config = dlo.OffloadConfig(use_allgather=True, stream_dtype=stream_dtype, gather_chunk_mib=chunk_mib)
            with dlo.enable(model, device, config, groups=dlo.ParallelGroups(dp=nccl)) as handle:
                got = run(model)
                collectives = handle.stats().collectives
            results[(stream_dtype, chunk_mib)] = dict(
                identical=all(torch.equal(a, b) for a, b in zip(expected, got)), collectives=collectives
            )
    return results


SCENARIOS["cuda_chunked"] = cuda_chunked


def cuda_cache_shards(rank: int, world: int, directory: str, cache_dir: str, chunks_mib: list[float]) -> dict:
    """One GPU per rank and an NCCL group: tiny Flux bf16 loaded through the host weight cache
    (one entry for both ranks), streamed as saved and as float8, unchunked and in chunks of
    each size of `chunks_mib`; every shard piece a view of the registered entry. Against the
    resident model loaded from the same checkpoint."""
    import diffusers

    device, nccl, run = _nccl_tiny_flux(rank, world)
    results = {}
    for stream_dtype in (None, "fp8"):
        resident = diffusers.FluxTransformer2DModel.from_pretrained(directory, torch_dtype=torch.bfloat16).to(device)
        dlo.quantize_resident(resident, dlo.OffloadConfig(stream_dtype=stream_dtype))
        expected = run(resident)
        del resident
        for chunk_mib in [0, *chunks_mib]:
            config = dlo.OffloadConfig(
                use_allgather=True, stream_dtype=stream_dtype, gather_chunk_mib=chunk_mib,
                host_weight_cache=True, cache_dir=cache_dir, cache_allow_any_filesystem=True,
            )
            model, plan = dlo.load_transformer(directory, config, torch_dtype=torch.bfloat16)
            backing = plan.backing if plan is not None else None
            with dlo.enable(model, device, config, plan=plan, groups=dlo.ParallelGroups(dp=nccl)) as handle:
                got = run(model)
                views = all(block.source.views_entry for block in handle._runtime.blocks)
                stats = handle.stats()
            results[(stream_dtype, chunk_mib)] = dict(
                identical=all(torch.equal(a, b) for a, b in zip(expected, got)),
                backing=backing,
                views=views,
                private_bytes=stats.host_bytes,
                registered_bytes=stats.registered_bytes,
                fallback=stats.registration_fallback,
            )
    return results


SCENARIOS["cuda_cache_shards"] = cuda_cache_shards


def interrupt_then_disable(
    rank: int, world: int, directory: str | None = None, budget_gib: float | None = None, restore: bool = True
) -> dict:
    """Ctrl-C reaches rank 1 inside block 1 of a call (torch runs no end hook for it) while
    rank 0 finishes the call; then each rank disables, as leaving `with dlo.enable(...)` does
    (`restore` False: disable(restore=False), no gather; the model then refuses calls).
    With `directory` and `budget_gib`: loaded from that checkpoint, shards beyond the budget
    read from disk (the rest of rank 1's call reads them as disable() begins)."""
    reference = TINY_MODELS["sd3"].build(seed=1)
    config = dlo.OffloadConfig(use_allgather=True, host_budget_gib=budget_gib)
    if directory is None:
        model = copy.deepcopy(reference)
        handle = dlo.enable(model, "cpu", config)
    else:
        model, plan = dlo.load_transformer(directory, config)
        handle = dlo.enable(model, "cpu", config, plan=plan)
        assert handle.stats().disk is not None
    outcome = "ok"
    if rank == 1:

        def interrupt(module, args):
            raise KeyboardInterrupt

        model.transformer_blocks[1].register_forward_pre_hook(interrupt)
    try:
        _tiny_outputs(model, "sd3", [0])
    except KeyboardInterrupt:
        outcome = "interrupted"
    handle.disable(restore=restore)
    if not restore:
        try:
            _tiny_outputs(model, "sd3", [0])
        except dlo.StreamingError as refused:
            return dict(outcome=outcome, refused=str(refused))
        return dict(outcome=outcome, refused=None)
    restored = all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values()))
    return dict(outcome=outcome, restored=restored)


SCENARIOS["interrupt_then_disable"] = interrupt_then_disable


def extra_block(rank: int, world: int) -> list:
    """Rank 1 runs block 0 again from the last block's forward hook in its second call
    (nothing is left to load there, the last block still counts as running): that call fails
    on rank 1 only, the third on every rank, and disable() still gathers in step."""
    model = TINY_MODELS["sd3"].build(seed=1)
    handle = dlo.enable(model, "cpu", dlo.OffloadConfig(use_allgather=True))
    blocks = model.transformer_blocks
    captured: dict = {}
    blocks[0].register_forward_pre_hook(lambda module, args, kwargs: captured.update(a=args, k=kwargs), with_kwargs=True)
    outcomes: list = []
    for call in range(3):
        replay = None
        if rank == 1 and call == 1:
            replay = blocks[-1].register_forward_hook(lambda module, args, output: blocks[0](*captured["a"], **captured["k"]))
        try:
            with torch.inference_mode():
                model(**TINY_MODELS["sd3"].inputs(call))
            outcomes.append("ok")
        except dlo.StreamingError as err:
            outcomes.append(f"StreamingError: {err}")
        if replay is not None:
            replay.remove()
    handle.disable()
    return outcomes


SCENARIOS["extra_block"] = extra_block


def cuda_schedule_breaks(rank: int, world: int) -> dict:
    """One GPU per rank and an NCCL group, tiny Flux in bf16: rank 1 breaks the schedule three
    ways (an error inside a block, Ctrl-C inside a block, a block run from inside the last
    one), each on a fresh enable(). What each rank's calls raised, and whether disable()
    gave back the weights exactly (its gathers paired with the peer's: no hang, no mix-up)."""
    device, nccl, _ = _nccl_tiny_flux(rank, world)
    built = TINY_MODELS["flux"].build(seed=1, dtype=torch.bfloat16)
    results = {}

    def run(model):  # one forward a call: every rank calls the model as often as its peers
        with torch.inference_mode():
            model(**TINY_MODELS["flux"].inputs(rank, torch.bfloat16, device))

    for how in ("error", "ctrl-c", "extra block"):
        model = copy.deepcopy(built)
        handle = dlo.enable(model, device, dlo.OffloadConfig(use_allgather=True), groups=dlo.ParallelGroups(dp=nccl))
        blocks = model.transformer_blocks
        captured: dict = {}
        blocks[0].register_forward_pre_hook(lambda module, args, kwargs: captured.update(a=args, k=kwargs), with_kwargs=True)
        outcomes = []
        for call in range(3):
            hook = None
            if rank == 1 and call == 1:
                if how == "extra block":
                    hook = model.single_transformer_blocks[-1].register_forward_hook(
                        lambda module, args, output: blocks[0](*captured["a"], **captured["k"])
                    )
                else:

                    def fail(module, args, exception=KeyboardInterrupt if how == "ctrl-c" else ValueError):
                        raise exception("test: rank 1 stops here")

                    hook = blocks[1].register_forward_pre_hook(fail)
            try:
                run(model)
                outcomes.append("ok")
            except (dlo.StreamingError, ValueError, KeyboardInterrupt) as err:
                outcomes.append(f"{type(err).__name__}: {err}")
            if hook is not None:
                hook.remove()
        handle.disable()
        restored = all(
            torch.equal(a, b.cpu()) for a, b in zip(built.state_dict().values(), model.state_dict().values())
        )
        results[how] = dict(outcomes=outcomes, restored=restored)
    return results


SCENARIOS["cuda_schedule_breaks"] = cuda_schedule_breaks


def _sd3_run_with_sigint(rank: int, reference, interrupt_after: int | None) -> tuple[str, int, bool]:
    """Enable a copy of `reference`, run two calls and disable. In the second call rank 1 gets
    a real SIGINT right after its load number `interrupt_after` (counted from that call's
    start, its end hook's first loads of the next call included) returns. Returns (how the
    second call ended, the loads it issued, whether disable() restored every weight)."""
    model = copy.deepcopy(reference)
    handle = dlo.enable(model, "cpu", dlo.OffloadConfig(use_allgather=True))
    runtime = handle._runtime
    counted = []
    armed = False

    def counting(real_load):
        def load(index):
            real_load(index)
            if armed:
                counted.append(index)
                if rank == 1 and len(counted) - 1 == interrupt_after:
                    os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler at its next bytecode

        return load

    for queue in runtime.queues:
        queue.load = counting(queue.load)
    _tiny_outputs(model, "sd3", [0])
    armed = True
    try:
        _tiny_outputs(model, "sd3", [1])
        outcome = "ok"
    except KeyboardInterrupt:
        outcome = "interrupted"
    armed = False
    handle.disable()
    restored = all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values()))
    return outcome, len(counted), restored


def sigint_between_collectives(rank: int, world: int) -> list:
    """Ctrl-C (a real SIGINT, Python's own handler) reaches rank 1 right after each of a call's
    load collectives in turn, one enable() per point: the call stops there, and disable()
    still gathers in step with rank 0, who finished the call."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a torchrun rank
    reference = TINY_MODELS["sd3"].build(seed=1)
    _, loads, _ = _sd3_run_with_sigint(rank, reference, None)  # the same count on every rank
    return [_sd3_run_with_sigint(rank, reference, point) for point in range(loads)]


SCENARIOS["sigint_between_collectives"] = sigint_between_collectives


def _unmerge_block_layers(model) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        for layer in [m for m in blocks.modules() if isinstance(m, BaseTunerLayer)]:
            layer.unmerge()


def weight_changes(
    rank: int, world: int, lora: str, stream_dtype: str | None = None, directory: str | None = None, cache_dir: str | None = None
) -> dict:
    """Every rank makes the same weight changes in step (see [Note: editing a streamed block]):
    load_state_dict of other weights, then a LoRA loaded, fused and unfused, tiny Flux streamed
    by all-gather (from private shards, or with `cache_dir` from shards viewing the node's cache
    entry of `directory`). Each call against the resident model making the same changes (with
    `stream_dtype`, requantized as dlo requantizes), and the state after disable()."""
    import warnings

    from lora_files import float8_weights, requantize_changed

    warnings.simplefilter("ignore")
    config = dlo.OffloadConfig(use_allgather=True, stream_dtype=stream_dtype)
    plan = None
    if cache_dir is not None:
        import diffusers

        config = dataclasses.replace(config, host_weight_cache=True, cache_dir=cache_dir)
        reference = diffusers.FluxTransformer2DModel.from_pretrained(directory).eval()
        ordinary_tensors(reference)
        model, plan = dlo.load_transformer(directory, config)
    else:
        reference = TINY_MODELS["flux"].build(seed=1)
        model = copy.deepcopy(reference)
    dlo.quantize_resident(reference, config)
    seeds = iter(range(10 * rank, 10 * rank + 10))
    identical = []

    def compare():
        seed = [next(seeds)]
        identical.append(torch.equal(_tiny_outputs(reference, "flux", seed)[0], _tiny_outputs(model, "flux", seed)[0]))

    def change(reference_change, streamed_change):
        before = float8_weights(reference, config) if stream_dtype else {}
        reference_change()
        requantize_changed(reference, before, config)
        streamed_change()
        compare()

    handle = dlo.enable(model, "cpu", config, plan=plan)
    views = all(block.source.views_entry for block in handle._runtime.blocks)
    compare()
    other = {k: v * 1.5 for k, v in TINY_MODELS["flux"].build(seed=3).state_dict().items() if "single" in k}
    change(lambda: reference.load_state_dict(other, strict=False), lambda: model.load_state_dict(other, strict=False))
    for m in (reference, model):
        m.load_lora_adapter(lora, adapter_name="a", prefix="transformer")
    compare()
    change(lambda: reference.fuse_lora(lora_scale=0.7), lambda: handle.fuse_lora(lora_scale=0.7))
    change(reference.unfuse_lora, handle.unfuse_lora)
    stats = handle.stats()
    private = all(not block.source.views_entry for block in handle._runtime.blocks)
    # diffusers' own: the model's fuse_lora (dlo's while enabled), then a pipeline's unfuse,
    # each streamed layer's unmerge() (one gather per layer, in the same order on every rank)
    change(reference.fuse_lora, model.fuse_lora)
    change(*(functools.partial(_unmerge_block_layers, m) for m in (reference, model)))
    target = Path(tempfile.mkdtemp()) / "saved"
    try:  # a rank holds half of each block: refused before anything is written
        model.save_pretrained(target)
        save_refused = ""
    except dlo.StreamingError as err:
        save_refused = str(err) if not target.exists() else "written anyway"
    handle.disable()
    state, expected = model.state_dict(), reference.state_dict()
    return dict(
        identical=identical,
        identical_after_disable=state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state),
        save_refused=save_refused,
        views_before=views,
        private_after=private,
        rewritten_blocks=stats.rewritten_blocks,
        copied_on_write_bytes=stats.copied_on_write_bytes,
        host_bytes=stats.host_bytes,
        blocks=stats.streamed_blocks,
    )


SCENARIOS["weight_changes"] = weight_changes


def disk_shards(
    rank: int,
    world: int,
    directory: str,
    budget_gib: float,
    reference: str | None = None,
    gather_chunk_mib: float = 64.0,
    cache_dir: str | None = None,
) -> dict:
    """All-gather under a host memory budget (See [Note: shards read from disk]): tiny Flux
    from `directory` (a checkpoint, or with `cache_dir` the node's cache entry of it), the
    blocks beyond the budget read per use, each rank its shard only. Calls against the
    resident model (`reference`: a safetensors file of its state, else `directory`'s
    weights), then a change of a block on disk's biases (its shard copied on write), then
    disable()."""
    import diffusers
    from safetensors.torch import load_file

    from dlo.host.block_sources import DiskShardSource

    dtype = torch.float32
    if reference is None:
        resident = diffusers.FluxTransformer2DModel.from_pretrained(directory).eval()
        ordinary_tensors(resident)
    else:
        from fp8_checkpoints import resident_from

        resident, dtype = resident_from(load_file(reference)), torch.bfloat16
    config = dlo.OffloadConfig(use_allgather=True, host_budget_gib=budget_gib, gather_chunk_mib=gather_chunk_mib)
    if cache_dir is not None:
        config = dataclasses.replace(config, host_weight_cache=True, cache_dir=cache_dir)
    model, plan = dlo.load_transformer(directory, config)
    seeds = iter(range(10 * rank, 10 * rank + 10))

    def same() -> bool:
        chosen = [next(seeds), next(seeds)]
        return all(
            torch.equal(a, b)
            for a, b in zip(_tiny_outputs(resident, "flux", chosen, dtype), _tiny_outputs(model, "flux", chosen, dtype))
        )

    handle = dlo.enable(model, "cpu", config, plan=plan)
    identical = same()
    stats = handle.stats()
    blocks = handle._runtime.blocks
    payload = {b.name: b.source.reads.payload_bytes for b in blocks if isinstance(b.source, DiskShardSource)}
    changed_block = stats.disk.blocks[0]
    # Biases: float8 checkpoints store the weights float8, which a change would requantize.
    other = {
        k: v * 1.5 for k, v in resident.state_dict().items() if k.startswith(f"{changed_block}.") and k.endswith("bias")
    }
    resident.load_state_dict(other, strict=False)
    model.load_state_dict(other, strict=False)
    identical_after_change = same()
    kinds = {b.name: type(b.source).__name__ for b in handle._runtime.blocks}
    handle.disable()
    state, expected = model.state_dict(), resident.state_dict()
    return dict(
        identical=identical,
        identical_after_change=identical_after_change,
        identical_after_disable=state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state),
        disk_blocks=stats.disk.blocks,
        payload=payload,
        reads=stats.disk.reads,
        held_bytes=stats.host_bytes + stats.disk.read_buffer_bytes,
        budget_bytes=stats.disk.budget_bytes,
        choice=stats.disk.choice.state,
        changed_block=changed_block,
        kinds=kinds,
    )


SCENARIOS["disk_shards"] = disk_shards


def shard_read_fails(rank: int, world: int, directories: list[str], budget_gib: float, stay_alive_s: float) -> dict:
    """Each rank streams from its own copy of one checkpoint under a budget; after a call,
    rank 1's copy is cut short, so its next shard read fails before that load's collective.
    Rank 1 then stays alive (a server that caught the error) while its peers wait in the
    collective it will never issue: they must be told which rank is gone."""
    import time

    from test_disk_tier import drop_pages

    config = dlo.OffloadConfig(use_allgather=True, host_budget_gib=budget_gib)
    model, plan = dlo.load_transformer(directories[rank], config)
    dlo.enable(model, "cpu", config, plan=plan)
    _tiny_outputs(model, "flux", [1])
    if rank == 1:
        paths = sorted(Path(directories[rank]).glob("*.safetensors"))
        for path in paths:
            with open(path, "r+b") as file:
                file.truncate(path.stat().st_size // 8)
        drop_pages(paths)
    started = time.monotonic()
    try:
        _tiny_outputs(model, "flux", [1])
        outcome = ("ran", "")
    except dlo.StreamingError as err:
        outcome = ("raised", str(err))
    elapsed = time.monotonic() - started
    if rank == 1:
        time.sleep(stay_alive_s)
    return dict(outcome=outcome, elapsed_s=elapsed)


SCENARIOS["shard_read_fails"] = shard_read_fails
