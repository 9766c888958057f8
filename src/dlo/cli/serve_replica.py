"""One `dlo serve` replica: a worker process holding one pipeline streamed by dlo on its device.

It loads the pipeline the way `dlo generate` does (the transformer through `dlo.load_transformer`,
so with the host weight cache every replica of a node maps the one published entry), sends
`Ready`, then runs the jobs the server sends on its own pipe, one at a time, answering each with
`Done`, until it receives None. A pipe per replica, not a queue shared by all: a replica killed
while holding a shared queue's lock would block every other replica for good.
"""

from __future__ import annotations

import io
import signal
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class ReplicaSpec:
    model_dir: str
    device: str
    dtype: torch.dtype
    config: Any  # dlo.OffloadConfig


@dataclass(frozen=True)
class Job:
    """Pipeline keyword arguments without the generator; image k uses seed + k."""

    job_id: int
    kwargs: dict[str, Any]
    seed: int
    n: int


@dataclass(frozen=True)
class Ready:
    error: str = ""  # why the pipeline could not be loaded


@dataclass(frozen=True)
class Done:
    job_id: int
    images: tuple[bytes, ...] = ()  # PNG bytes
    error: str = ""  # the one-line text of what failed
    steps: int = 0  # denoising steps run
    bytes_streamed: int = 0  # by dlo since the replica started, every streamed component
    host_pss: int | None = None  # the replica's Pss (smaps_rollup) after the job


def replica_main(spec: ReplicaSpec, conn) -> None:
    # Ctrl-C reaches the terminal's whole process group: the server stops, then sends None.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pipe, handle = _load(spec)
    except BaseException as err:  # reported to the server, which refuses to start
        conn.send(Ready(f"{type(err).__name__}: {err}"))
        return
    conn.send(Ready())
    try:
        while (job := conn.recv()) is not None:
            done = _run(pipe, job)
            stats = handle.stats()  # synchronizes the device: the job is over anyway
            memory = next(iter(stats.values())).host_memory if stats else None
            conn.send(
                replace(
                    done,
                    bytes_streamed=sum(s.bytes_streamed for s in stats.values()),
                    host_pss=memory.pss if memory is not None else None,
                )
            )
    except EOFError:  # the server is gone
        pass
    finally:
        handle.disable()


def _load(spec: ReplicaSpec):
    import dlo
    from dlo.cli.generate import pipeline_class
    from dlo.cli.pipeline_loading import load_pipeline

    model_dir = Path(spec.model_dir)
    cls, _ = pipeline_class(model_dir)
    transformer, plan = dlo.load_transformer(model_dir / "transformer", spec.config, torch_dtype=spec.dtype)
    pipe = load_pipeline(model_dir, cls, spec.dtype, transformer=transformer)
    handle = dlo.enable_pipeline(pipe, spec.device, spec.config, plans={"transformer": plan})
    pipe.set_progress_bar_config(disable=True)  # one bar per request and replica would fill the server's log
    return pipe, handle


def _run(pipe, job: Job) -> Done:
    try:
        images = []
        for k in range(job.n):  # image k of a request is seed + k: the same as n requests of one image
            generator = torch.Generator(device="cpu").manual_seed(job.seed + k)
            with torch.inference_mode():
                image = pipe(**job.kwargs, generator=generator).images[0]
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            images.append(buffer.getvalue())
        return Done(job.job_id, tuple(images), steps=job.n * job.kwargs.get("num_inference_steps", 0))
    except Exception as err:  # the request fails, the replica serves the next one
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        return Done(job.job_id, error=last)
