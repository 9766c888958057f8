"""Spawning N ranks of one `dlo` command on this machine (`--nproc N`): Gloo on cpu, NCCL with
one GPU per rank on cuda, what `torchrun --nproc-per-node N` would start, plus one-line Ctrl-C.

The parent starts the ranks, collects one report per rank (a picklable dict, or an error with
its traceback) and ends every rank if one fails or the user presses Ctrl-C: a rank blocked in a
collective on a peer that is gone would otherwise wait for its process group's timeout.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dlo.errors import ConfigError

# How often the parent looks for a rank that died without reporting.
_POLL_S = 1.0


@dataclass(frozen=True)
class RankPlace:
    """Where one spawned rank runs."""

    rank: int
    world: int
    device: torch.device


# A rank's work: (its place, the command's payload) -> its report.
RankTarget = Callable[[RankPlace, object], dict]


def rank_context() -> multiprocessing.context.BaseContext:
    """Fresh interpreters: a forked copy of a parent that may have touched CUDA cannot use it."""
    return multiprocessing.get_context("spawn")


def check_rank_devices(device_type: str, nproc: int) -> None:
    if device_type == "cuda" and nproc > torch.cuda.device_count():
        raise ConfigError(f"--nproc {nproc} on cuda needs {nproc} GPUs, {torch.cuda.device_count()} visible")


def _rank_main(
    target: RankTarget, rank: int, world: int, device_type: str, rendezvous: str, timeout_s: float, payload: object, results
) -> None:
    try:
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        results.put((rank, target(RankPlace(rank, world, device), payload)))
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


def _collect(ranks: list, results) -> dict[int, dict]:
    """Every rank's report, or those up to the first failed rank's (a rank that died without a
    word counts as failed)."""
    reports: dict[int, dict] = {}
    while len(reports) < len(ranks):
        try:
            rank, report = results.get(timeout=_POLL_S)
        except queue_module.Empty:
            dead = [r for r, p in enumerate(ranks) if r not in reports and p.exitcode is not None]
            if not dead:
                continue
            try:  # a rank that reported flushed its report into the pipe before it exited: look again
                rank, report = results.get(timeout=_POLL_S)
            except queue_module.Empty:
                rank, report = dead[0], dict(error=f"ended with status {ranks[dead[0]].exitcode} without reporting")
        reports[rank] = report
        if "error" in report:
            break
    return reports


def _terminate(ranks: list) -> None:
    for process in ranks:
        if process.is_alive():
            process.terminate()


def launch_ranks(target: RankTarget, payload: object, nproc: int, device_type: str, timeout_s: float) -> dict[int, dict]:
    """Run `target(place, payload)` in `nproc` new processes joined in one process group
    (collective timeout `timeout_s`); their reports by rank. At the first failed rank the others
    are ended: the reports then stop at the failure's."""
    check_rank_devices(device_type, nproc)
    context = rank_context()
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="dlo-ranks-") as scratch:
        rendezvous = str(Path(scratch) / "rendezvous")
        ranks = [
            context.Process(target=_rank_main, args=(target, r, nproc, device_type, rendezvous, timeout_s, payload, results))
            for r in range(nproc)
        ]
        _start(ranks)
        interrupted = False
        try:
            reports = _collect(ranks, results)
            if len(reports) < nproc:  # one failed: its peers may wait on it in a collective
                _terminate(ranks)
        except BaseException as err:  # Ctrl-C (the ranks ignore it): end them now
            _terminate(ranks)
            interrupted = isinstance(err, KeyboardInterrupt)
            raise
        finally:
            for process in ranks:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
            if interrupted:  # a rank ended mid-line (a progress bar): the caller's last word gets its own
                print(file=sys.stderr)
    return reports


def print_rank_errors(reports: dict[int, dict]) -> bool:
    """Print each failed rank's error to stderr; whether any failed."""
    errors = {r: rep["error"] for r, rep in reports.items() if "error" in rep}
    for rank, text in sorted(errors.items()):
        print(f"rank {rank} failed: {text}", file=sys.stderr)
    return bool(errors)
