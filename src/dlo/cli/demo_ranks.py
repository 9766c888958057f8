"""`dlo demo --nproc N`: all-gather mode across N spawned ranks (Gloo on cpu, NCCL on cuda).

Each rank runs its own prompt (a data-parallel wave: same steps, different inputs), resident
and then streamed with OffloadConfig(use_allgather=True), and reports whether its outputs are
bit-identical and how many host bytes it holds: about 1/N of the streamed blocks.
"""

from __future__ import annotations

import copy
import dataclasses
import io
from pathlib import Path

import torch

import dlo
from dlo.cli.denoise_loop import denoise
from dlo.cli.format import human_bytes, table
from dlo.cli.rank_launch import RankPlace, launch_ranks, print_rank_errors
from dlo.models.tiny import TINY_MODELS
from dlo.pipelines.output_path import published

_TIMEOUT_S = 120  # of each collective: the demo's ranks start and run in step


def _as_bytes(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _rank(place: RankPlace, args: tuple) -> dict:
    model_name, config, steps, dtype, keep_outputs = args
    rank, device = place.rank, place.device
    entry = TINY_MODELS[model_name]
    reference = entry.build(seed=0, dtype=dtype)
    streamed = copy.deepcopy(reference)
    block_bytes = sum(t.numel() * t.element_size() for ref in dlo.discover(reference).block_lists
                      for t in reference.get_submodule(ref).parameters())
    resident = denoise(reference.to(device), entry, steps, dtype, device, prompt_seed=rank)
    with dlo.enable(streamed, device, config) as handle:
        run = denoise(streamed, entry, steps, dtype, device, prompt_seed=rank)
        stats = handle.stats()
    identical = all(torch.equal(a, b) for a, b in zip(resident.outputs, run.outputs))
    # As bytes: a tensor put on a multiprocessing queue travels as a file descriptor of shared
    # memory, which is gone once this rank exits, possibly before the parent reads it.
    outputs = _as_bytes(dict(resident=resident.outputs, streamed=run.outputs)) if keep_outputs else b""
    return dict(identical=identical, host_bytes=stats.host_bytes, block_bytes=block_bytes,
                collectives=stats.collectives, group=stats.gather_group_size, outputs=outputs)


def run_ranks(model_name: str, device_type: str, nproc: int, config: dlo.OffloadConfig, steps: int,
              dtype: torch.dtype, save_path: str | None = None) -> int:
    """`save_path`: torch.save each rank's outputs there, {"resident": {rank: [...]}, "streamed": {...}}."""
    config = dataclasses.replace(config, use_allgather=True)
    args = (model_name, config, steps, dtype, save_path is not None)
    reports = launch_ranks(_rank, args, nproc, device_type, _TIMEOUT_S)
    if print_rank_errors(reports):
        return 1
    if save_path is not None:
        outputs = {rank: torch.load(io.BytesIO(rep["outputs"])) for rank, rep in reports.items()}
        with published(Path(save_path).expanduser()) as partial:
            torch.save({kind: {rank: out[kind] for rank, out in outputs.items()} for kind in ("resident", "streamed")}, partial)
    rows = [
        [rank, human_bytes(rep["host_bytes"]), human_bytes(rep["block_bytes"] / nproc), rep["collectives"],
         "bit-identical" if rep["identical"] else "DIFFERENT"]
        for rank, rep in sorted(reports.items())
    ]
    print(f"dlo demo: {TINY_MODELS[model_name].class_name} ({model_name}), all-gather across {nproc} ranks "
          f"({'nccl' if device_type == 'cuda' else 'gloo'}), {steps} steps, a different prompt per rank")
    print()
    print(table(["rank", "host bytes (shards)", "blocks / N", "collectives", "outputs vs resident"], rows))
    return 0 if all(rep["identical"] for rep in reports.values()) else 1
