"""Child processes for the tests: forked from a server process that has already imported
torch, safetensors, diffusers' tiny-model classes and dlo, so a child starts in a fraction of a
second instead of importing them again (5-8 s each on 2 cores, most of the suite's time before).

The children are still separate processes started fresh from a process that has run nothing
(multiprocessing's "forkserver" start method): their own pid, address space, descriptors,
flocks, signals and Gloo endpoints. The server is started once per test process, with the
sys.path of its first use; a module that fails to import there is imported by each child.

Not for tests that measure a child's memory (tests/test_page_sharing.py spawns): a forked child
shares the server's imported modules copy-on-write, and touching them turns those pages into
its Private_Dirty.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context

PRELOAD = [
    "torch",
    "torch.distributed",
    "safetensors.torch",
    "diffusers.models.transformers.transformer_wan",
    "diffusers.models.transformers.transformer_flux",
    "diffusers.pipelines.flux.pipeline_flux",
    "diffusers.pipelines.wan.pipeline_wan",
    "dlo",
    "dlo.models.tiny",
    "allgather_ranks",
    "cache_writers",
    "failed_enables",
    "sequence_parallel_ranks",
    "dlo.cli.generate_ranks",
    "dlo.cli.demo_ranks",
]


def child_context() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context
