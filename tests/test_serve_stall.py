"""A replica hung mid-job (alive, never answering): with a stall timeout the pool kills it,
fails only its job saying why, and restarts it. Real replica processes, no HTTP."""

import os
import signal
import threading

import torch

import dlo
from dlo.models.tiny_pipelines import GENERATE_DEFAULTS
from dlo.serve.pool import Metrics, ReplicaPool
from dlo.serve.replica import ReplicaSpec

STALL_S = 3.0  # far beyond a tiny step, even on a loaded machine (0.06 s idle, ~1 s under load); the test waits it out


def test_a_replica_that_stops_making_steps_is_killed_its_job_failed_and_it_is_restarted(tiny_flux_dir, tmp_path):
    config = dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(tmp_path / "cache"), cache_allow_any_filesystem=True)
    spec = ReplicaSpec(str(tiny_flux_dir), "cpu", torch.float32, config)
    pool = ReplicaPool([spec], max_queue=1, metrics=Metrics(), stall_s=STALL_S)
    try:
        kwargs = {"prompt": "a lighthouse", "num_inference_steps": 1000, **GENERATE_DEFAULTS["flux"]}
        stepped = threading.Event()
        stalled_pid = pool.pids()[0]

        def on_progress(steps: int) -> None:  # on the pool's thread: the replica is between two steps
            if steps >= 1 and not stepped.is_set():
                os.kill(stalled_pid, signal.SIGSTOP)  # hung: alive, never answering again
                stepped.set()

        _, hung = pool.submit(kwargs, seed=1, n=1, on_progress=on_progress)
        done = hung.result(timeout=120)
        assert stepped.is_set()
        assert done.error == (
            f"replica 0 made no progress for {STALL_S:g} s (--stall-timeout-s) and was killed while running it; "
            "it was restarted"
        )
        assert pool.restarts == 1 and pool.pids()[0] != stalled_pid
        _, next_job = pool.submit({**kwargs, "num_inference_steps": 2}, seed=1, n=1)
        finished = next_job.result(timeout=120)
        assert not finished.error and len(finished.files) == 1 and finished.steps == 2
    finally:
        pool.close()
