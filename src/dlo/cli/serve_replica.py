"""One `dlo serve` replica: a worker process holding one pipeline streamed by dlo on its device.

It loads the pipeline the way `dlo generate` does (the transformer through `dlo.load_transformer`,
so with the host weight cache every replica of a node maps the one published entry), says it is
ready, then runs the jobs it takes from the shared inbox, one at a time, until it takes None.
Jobs and results are plain picklable values: a job is (job id, pipeline keyword arguments
without the generator, seed, n); a result is (job id, PNG bytes of each image) or (job id, the
error's one-line text).
"""

from __future__ import annotations

import io
import traceback
from dataclasses import dataclass
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
    job_id: int
    kwargs: dict[str, Any]
    seed: int
    n: int


@dataclass(frozen=True)
class Done:
    job_id: int
    images: tuple[bytes, ...] = ()
    error: str = ""


def replica_main(index: int, spec: ReplicaSpec, inbox, outbox, ready) -> None:
    try:
        pipe, handle = _load(spec)
    except BaseException as err:  # reported to the server, which refuses to start
        ready.put((index, f"{type(err).__name__}: {err}"))
        return
    ready.put((index, ""))
    try:
        while (job := inbox.get()) is not None:
            outbox.put(_run(pipe, job))
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
        return Done(job.job_id, tuple(images))
    except Exception as err:  # the request fails, the replica serves the next one
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        return Done(job.job_id, error=last)
