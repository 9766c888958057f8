"""One `dlo serve` replica: a worker process holding one pipeline streamed by dlo on its device.

It loads the pipeline the way `dlo generate` does (the transformer through `dlo.load_transformer`,
so with the host weight cache every replica of a node maps the one published entry), sends
`Ready`, then runs the jobs the server sends on its own pipe, one at a time, answering each with
`Done`, until it receives None. While a job runs it sends `Progress` after each denoising step
and, between steps, reads a `Cancel` of that job (it then stops at once and answers `Done` with
`cancelled`). A pipe per replica, not a queue shared by all: a replica killed while holding a
shared queue's lock would block every other replica for good. A replica whose server is gone
(killed, even with SIGKILL) exits within a second, also while it loads or runs a job: it would
otherwise hold its device and host memory until the load or the step ended.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import io
import os
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dlo.pipelines.lora_adapters import Adapters, LoraFile, load_loras, use_adapters
from dlo.pipelines.media_output import ARRAY_OUTPUT, finite_media


@dataclass(frozen=True)
class ReplicaSpec:
    model_dir: str
    device: str
    dtype: torch.dtype
    config: Any  # dlo.OffloadConfig
    loras: tuple[LoraFile, ...] = ()  # loaded at the start; each job picks among them
    transformer_file: str | None = None  # --transformer: a .gguf or single-file checkpoint instead of MODEL's
    gguf_kernels: bool = False  # --gguf-kernels: its GGUF weights dequantize with dlo's Triton kernels
    components: tuple[str, ...] | str = ()  # --components: streamed beside the transformer ("auto", or names)
    converter_options: tuple[tuple[str, str], ...] = ()  # --converter-option: for transformer_file's converter


class VideoFormat(enum.Enum):
    MP4 = "mp4"  # H.264 through imageio-ffmpeg: lossy
    WEBP = "webp"  # animated, lossless: the frames as generated


@dataclass(frozen=True)
class VideoFile:
    """How a video job's frames are written."""

    format: VideoFormat
    fps: int


@dataclass(frozen=True)
class Job:
    """Pipeline keyword arguments without the generator; image k uses seed + k. `video`: the
    pipeline makes videos (n is 1) and its frames are written so."""

    job_id: int
    kwargs: dict[str, Any]
    seed: int
    n: int
    video: VideoFile | None = None
    adapters: Adapters = ()  # the LoRAs the job runs with, and their scales; none: the base model


@dataclass(frozen=True)
class Cancel:
    job_id: int


@dataclass(frozen=True)
class Progress:
    job_id: int
    steps: int  # denoising steps done; 0: the replica has started the job
    per_step: bool = True  # a Progress follows every step (False: the pipeline reports none)


@dataclass(frozen=True)
class Ready:
    error: str = ""  # why the pipeline could not be loaded


@dataclass(frozen=True)
class Done:
    job_id: int
    files: tuple[bytes, ...] = ()  # one PNG per image, or the one video file
    error: str = ""  # the one-line text of what failed
    cancelled: bool = False  # stopped between two steps by a Cancel
    steps: int = 0  # denoising steps run, those of a cancelled or failed job too
    bytes_streamed: int = 0  # by dlo since the replica started, every streamed component
    host_pss: int | None = None  # the replica's Pss (smaps_rollup) after the job


_SERVER_CHECK_S = 0.5  # how often a replica checks that its server still runs


def _exit_with_server(server_pid: int) -> None:
    """Ends this process once its parent is no longer `server_pid` (the server died and the
    replica was re-parented). A thread, not PR_SET_PDEATHSIG: that fires when the *thread*
    that started the replica ends, and the pool restarts replicas from a thread of its own."""
    while os.getppid() == server_pid:
        time.sleep(_SERVER_CHECK_S)
    line = f"dlo serve: replica {os.getpid()}: its server (pid {server_pid}) is gone; exiting\n".encode()
    # stderr may be a pipe that died with the server (an error) or that nobody reads (a write that
    # blocks): the exit must not wait for it.
    saying = threading.Thread(target=_write_stderr, args=(line,), daemon=True)
    saying.start()
    saying.join(_SERVER_CHECK_S)
    os._exit(1)


def _write_stderr(line: bytes) -> None:
    with contextlib.suppress(OSError):
        os.write(2, line)


def replica_main(spec: ReplicaSpec, conn, server_pid: int) -> None:
    # Ctrl-C reaches the terminal's whole process group: the server stops, then sends None.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_server, args=(server_pid,), name="dlo-replica-watch", daemon=True).start()
    try:
        pipe, handle = _load(spec)
    except BaseException as err:  # reported to the server, which refuses to start
        conn.send(Ready(f"{type(err).__name__}: {err}"))
        return
    conn.send(Ready())
    inbox = _Inbox(conn)
    adapters = _AdapterSwitch(pipe, bool(spec.loras))
    try:
        while (job := inbox.next_job()) is not None:
            done = _run(pipe, job, inbox, adapters)
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
        handle.disable(restore=False)  # the replica exits: no private copies of the mapped blocks


class _AdapterSwitch:
    """Switches the pipeline's active LoRAs when a job asks for others than the last one ran
    with (a few module attributes: no weight moves, nothing reloads)."""

    def __init__(self, pipe, has_loras: bool) -> None:
        self.pipe = pipe
        self.active: Adapters | None = None if has_loras else ()  # None: not known yet

    def use(self, adapters: Adapters) -> None:
        if adapters != self.active:
            self.active = None  # a failed switch leaves it unknown: the next job sets it again
            use_adapters(self.pipe, adapters)
            self.active = adapters


class _Cancelled(Exception):
    """Raised between two denoising steps of a cancelled job: the pipeline call unwinds there."""


class _Inbox:
    """The server's messages on this replica's pipe: a Job when the replica is idle; while a
    job runs, a Cancel (of that job, or a stale one of a job already over) or None (stop after
    this job). Read between jobs, and between the steps of a job without blocking."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self._stopping = False

    def next_job(self) -> Job | None:
        while not self._stopping:
            message = self.conn.recv()
            if message is None or isinstance(message, Job):
                return message
        return None

    def cancels(self, job_id: int) -> bool:
        while self.conn.poll():
            message = self.conn.recv()
            if message is None:
                self._stopping = True
            elif message.job_id == job_id:
                return True
        return False


def _load(spec: ReplicaSpec):
    import dlo
    from dlo.pipelines.loading import load_pipeline, pipeline_class
    from dlo.pipelines.single_file import load_single_file

    model_dir = Path(spec.model_dir)
    cls, _ = pipeline_class(model_dir)
    if spec.transformer_file is not None:
        transformer, plan = load_single_file(
            Path(spec.transformer_file), model_dir, spec.dtype, spec.config, "--transformer", spec.converter_options
        )
        if spec.gguf_kernels:
            dlo.use_gguf_kernels(transformer)
    else:
        transformer, plan = dlo.load_transformer(model_dir / "transformer", spec.config, torch_dtype=spec.dtype)
    pipe = load_pipeline(model_dir, cls, spec.dtype, transformer=transformer)
    handle = dlo.enable_pipeline(pipe, spec.device, spec.config, plans={"transformer": plan}, components=spec.components)
    load_loras(pipe, spec.loras)  # after enable: the plan names the transformer's tensors as loaded
    pipe.set_progress_bar_config(disable=True)  # one bar per request and replica would fill the server's log
    return pipe, handle


def _run(pipe, job: Job, inbox: _Inbox, adapters: _AdapterSwitch) -> Done:
    kwargs = dict(job.kwargs)
    counted = "callback_on_step_end" in inspect.signature(type(pipe).__call__).parameters
    inbox.conn.send(Progress(job.job_id, 0, per_step=counted))
    steps_run = 0  # with the callback: counted step by step; without, each image's full count once made

    if counted:

        def step_end(pipe, step: int, timestep, tensors: dict) -> dict:
            nonlocal steps_run
            steps_run += 1
            if inbox.cancels(job.job_id):
                raise _Cancelled
            inbox.conn.send(Progress(job.job_id, step + 1))
            return {}

        kwargs["callback_on_step_end"] = step_end
    try:
        adapters.use(job.adapters)
        files = []
        for k in range(job.n):  # image k of a request is seed + k: the same as n requests of one image
            generator = torch.Generator(device="cpu").manual_seed(job.seed + k)
            with torch.inference_mode():
                result = pipe(**kwargs, **ARRAY_OUTPUT, generator=generator)
            media = finite_media(result, job.video is not None)  # NonFiniteOutput fails the job, naming it
            files.append(_video_file(media, job.video) if job.video else _png(media))
            steps_run += 0 if counted else job.kwargs.get("num_inference_steps", 0)
        return Done(job.job_id, tuple(files), steps=steps_run)
    except _Cancelled:
        return Done(job.job_id, cancelled=True, steps=steps_run)
    except Exception as err:  # the request fails, the replica serves the next one
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        return Done(job.job_id, error=last, steps=steps_run)


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _video_file(frames, video: VideoFile) -> bytes:
    from dlo.pipelines.media_output import write_video

    with tempfile.TemporaryDirectory(prefix="dlo-serve-") as directory:
        path = Path(directory) / f"video.{video.format.value}"
        write_video(frames, path, video.fps)
        return path.read_bytes()
