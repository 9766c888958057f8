"""`dlo demo --nproc N`: all-gather mode across N spawned ranks (Gloo on cpu, NCCL on cuda).

Each rank runs its own prompt (a data-parallel wave: same steps, different inputs), resident
and then streamed with OffloadConfig(use_allgather=True), and reports whether its outputs are
bit-identical and how many host bytes it holds: about 1/N of the streamed blocks.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import multiprocessing
import queue as queue_module
import signal
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import dlo
from dlo.cli.denoise_loop import denoise
from dlo.cli.format import human_bytes, table
from dlo.models.tiny import TINY_MODELS

_TIMEOUT_S = 300


def _as_bytes(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _rank(rank: int, nproc: int, rendezvous: str, args: tuple, results) -> None:
    model_name, device_type, config, steps, dtype, keep_outputs = args
    try:
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"file://{rendezvous}", rank=rank, world_size=nproc, timeout=timedelta(seconds=120)
        )
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
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
        results.put((rank, dict(identical=identical, host_bytes=stats.host_bytes, block_bytes=block_bytes,
                                collectives=stats.collectives, group=stats.gather_group_size, outputs=outputs)))
    except BaseException as err:
        results.put((rank, dict(error=f"{type(err).__name__}: {err}\n{traceback.format_exc()}")))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _start(ranks: list) -> None:
    """Start the ranks with Ctrl-C ignored (a spawned interpreter keeps an ignored SIGINT ignored):
    the terminal's SIGINT reaches the whole process group, and only the parent should react (it
    ends the ranks), else every rank prints its own traceback."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for process in ranks:
            process.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def run_ranks(model_name: str, device_type: str, nproc: int, config: dlo.OffloadConfig, steps: int,
              dtype: torch.dtype, save_path: str | None = None) -> int:
    """`save_path`: torch.save each rank's outputs there, {"resident": {rank: [...]}, "streamed": {...}}."""
    if device_type == "cuda" and nproc > torch.cuda.device_count():
        raise dlo.ConfigError(f"--nproc {nproc} on cuda needs {nproc} GPUs, {torch.cuda.device_count()} visible")
    config = dataclasses.replace(config, use_allgather=True)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="dlo-ranks-") as scratch:
        rendezvous = str(Path(scratch) / "rendezvous")
        args = (model_name, device_type, config, steps, dtype, save_path is not None)
        ranks = [context.Process(target=_rank, args=(r, nproc, rendezvous, args, results)) for r in range(nproc)]
        _start(ranks)
        reports: dict[int, dict] = {}
        try:
            while len(reports) < nproc:
                rank, report = results.get(timeout=_TIMEOUT_S)
                reports[rank] = report
        except queue_module.Empty:
            raise dlo.StreamingError(f"ranks {sorted(set(range(nproc)) - set(reports))} did not report") from None
        except BaseException:  # Ctrl-C: the ranks ignore it, end them now
            for process in ranks:
                process.terminate()
            raise
        finally:
            for process in ranks:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
    errors = {r: rep["error"] for r, rep in reports.items() if "error" in rep}
    if errors:
        for rank, text in sorted(errors.items()):
            print(f"rank {rank} failed: {text}", file=sys.stderr)
        return 1
    if save_path is not None:
        outputs = {rank: torch.load(io.BytesIO(rep["outputs"])) for rank, rep in reports.items()}
        torch.save({kind: {rank: out[kind] for rank, out in outputs.items()} for kind in ("resident", "streamed")}, save_path)
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
