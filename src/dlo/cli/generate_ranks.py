"""`dlo generate --nproc N --parallel {dp,sp}`: the ranks, each running `generate` (see
parallel_run for what differs between them), and the parent's report."""

from __future__ import annotations

import threading
from pathlib import Path

from tqdm import tqdm

from dlo.cli.generate_job import GenerateJob, components_text, generate, render_stats, write_output
from dlo.cli.parallel_run import Parallel, ParallelRun
from dlo.cli.rank_launch import RankPlace, launch_ranks, print_rank_errors
from dlo.pipelines.library_noise import quiet_other_libraries

# Of each collective. Ranks meet in every streamed block, but before the first one each loads
# the whole pipeline, which can take one rank minutes longer than another (a cold page cache).
_TIMEOUT_S = 1800


def _rank(place: RankPlace, payload: tuple) -> dict:
    job, parallel, seed, output, verbose = payload
    quiet_other_libraries(verbose)  # a fresh interpreter: the parent's settings are not inherited
    # Progress bars (diffusers', transformers') lock with a multiprocessing RLock by default: a
    # named semaphore that the parent's resource tracker reports as leaked on the terminal when
    # the parent ends this rank (Ctrl-C). Only this process writes its bars: a thread lock does.
    tqdm.set_lock(threading.RLock())
    seed = parallel.seed(seed, place.rank)
    generated = generate(job, place.device, seed, parallel, progress=place.rank == 0)
    path = parallel.output(output, place.rank)
    if path is not None:
        write_output(job, generated.media, path)
    return dict(stats=generated.stats, seconds=generated.seconds, placement=generated.placement, seed=seed,
                output=path, device=str(place.device), sequence_ranks=generated.sequence_ranks,
                before_last_step=generated.before_last_step)


def run_ranks(job: GenerateJob, parallel: ParallelRun, device_type: str, seed: int, output: Path, verbose: bool) -> int:
    reports = launch_ranks(_rank, (job, parallel, seed, output, verbose), parallel.nproc, device_type, _TIMEOUT_S)
    if print_rank_errors(reports):
        return 1
    if parallel.mode is Parallel.SP:
        degrees = f"ulysses {parallel.ulysses_degree} x ring {parallel.ring_degree}"
        print(f"sequence parallel across {parallel.nproc} ranks ({degrees}), seed {seed}")
    else:
        print(f"data parallel across {parallel.nproc} ranks, rank r with seed {seed} + r")
    for rank, report in sorted(reports.items()):
        share = f"1/{report['sequence_ranks']} of the sequence" if report["sequence_ranks"] > 1 else f"seed {report['seed']}"
        stats = render_stats(report["stats"], job.steps, report["seconds"], report["device"], report["before_last_step"])
        print(f"\nrank {rank} ({share}): {stats}")
    print("\n" + components_text(job, reports[0]["placement"]))
    for report in reports.values():
        if report["output"] is not None:
            print(f"wrote {report['output']}" + (f" (seed {report['seed']})" if parallel.mode is Parallel.DP else ""))
    return 0
