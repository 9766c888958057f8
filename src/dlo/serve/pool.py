"""`dlo serve`'s replica pool: replica processes (replica.py) that take jobs from one
bounded FIFO, and the metrics they feed.

The pool holds at most `replicas + max_queue` jobs (beyond that QueueFull, with a Retry-After
derived from recent job times); a job can be forgotten (its requester left: dropped if still
queued) or cancelled (dropped if queued, else its replica stops between two steps). A replica
that dies fails only the job it was running, saying so, and is restarted; once every replica
is given up (it failed to load `_FAILED_STARTS` times in a row) the queued jobs fail and new
ones are refused (Unavailable), as they are once the server stops admitting (SIGTERM's drain).
"""

from __future__ import annotations

import itertools
import logging
import math
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as connection_wait

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dlo.errors import ConfigError
from dlo.pipelines.lora_adapters import Adapters
from dlo.serve.replica import Cancel, Done, Job, Progress, Ready, ReplicaSpec, VideoFile, replica_main

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class Unavailable(Exception):
    """The pool takes no new jobs (draining, or no replica can run them); the text says why."""


_FAILED_STARTS = 3  # restarts in a row that never became ready before a replica is given up
_RECENT_JOBS = 8  # Retry-After: the mean time of this many last completed jobs


def retry_after_s(mean_job_s: float, position: int, replicas: int) -> int:
    """Seconds until a refused request would likely find a place: `position` jobs (the queue,
    and itself) ahead of it, run `replicas` at a time, each taking `mean_job_s`; at least 1."""
    return max(1, math.ceil(mean_job_s * position / max(replicas, 1)))


class Metrics:
    """What GET /metrics exposes (Prometheus text format), in a registry of the app's own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.queued = Gauge("dlo_serve_queue_depth", "requests waiting for a replica", registry=self.registry)
        self.busy = Gauge("dlo_serve_busy_replicas", "replicas running a request", registry=self.registry)
        self.requests = Counter(
            "dlo_serve_requests", "requests answered, by HTTP status", ["status"], registry=self.registry
        )
        self.latency = Histogram(
            "dlo_serve_request_seconds", "seconds from accepting a request to its answer (status 200)",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600), registry=self.registry,
        )
        self.steps = Counter("dlo_serve_steps", "denoising steps run", registry=self.registry)
        self.restarts = Counter(
            "dlo_serve_replica_restarts", "replicas started again after dying", registry=self.registry
        )
        self.streamed = Gauge(
            "dlo_serve_replica_bytes_streamed", "bytes dlo streamed in a replica since it started", ["replica"],
            registry=self.registry,
        )
        self.pss = Gauge(
            "dlo_serve_replica_host_pss_bytes", "a replica's host Pss (shared pages split among their users)",
            ["replica"], registry=self.registry,
        )


@dataclass
class _Replica:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    ready: bool = False
    job_id: int | None = None  # the job it runs
    failed_starts: int = 0  # restarts in a row that never became ready
    given_up: bool = False  # dead, and not started again
    heard: float | None = None  # while its job reports every step: when it last did (time.monotonic)
    stalled: bool = False  # killed for making no progress


class ReplicaPool:
    """One replica process per spec (replica i on `specs[i]`'s device), each on a pipe of its
    own. Jobs wait in one FIFO here and go to whichever replica is idle. One thread reads every pipe: a result resolves its job's
    future; a replica that died (its pipe closed) fails only the job it was running, with an
    error that says so, and is started again (given up after `_FAILED_STARTS` restarts in a
    row that never became ready). A future is resolved only if nobody cancelled it."""

    def __init__(
        self, specs: list[ReplicaSpec], max_queue: int, metrics: Metrics, ready_timeout_s: float = 600,
        stall_s: float = 0,
    ) -> None:
        """`stall_s`: a replica whose job reports every step but made none for that long is
        hung (alive, never answering): it is killed, which fails its job and restarts it. 0: never."""
        self._context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._specs = specs
        self._stall_s = stall_s
        self.metrics = metrics
        self.restarts = 0
        self._capacity = len(specs) + max_queue
        self._futures: dict[int, Future[Done]] = {}
        self._on_progress: dict[int, Callable[[int], None]] = {}
        self._started: dict[int, float] = {}  # a running job's dispatch time (time.monotonic)
        self._recent_s: deque[float] = deque(maxlen=_RECENT_JOBS)  # times of the last completed jobs
        self._queue: deque[Job] = deque()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closing = threading.Event()
        self._refusal: str | None = None  # why submit refuses every job; None: it admits them
        self._load_error = ""  # why a restarted replica last failed to load
        self._replicas: list[_Replica] = []
        try:  # Ctrl-C while the replicas load, or any failure: none is left running
            for index in range(len(specs)):  # one by one: close() reaches each started one
                self._replicas.append(self._start(index))
            failures = []
            for index, replica in enumerate(self._replicas):
                error = self._await_ready(replica, ready_timeout_s)
                if error:
                    failures.append(f"replica {index}: {error}")
                else:
                    logger.info("dlo serve: replica %d ready (pid %d)", index, replica.process.pid)
            if failures:
                raise ConfigError("dlo serve: the replicas could not load the pipeline: " + "; ".join(failures))
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="dlo-serve-replicas", daemon=True)
        self._thread.start()

    def _start(self, index: int) -> _Replica:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=replica_main, args=(self._specs[index], theirs, os.getpid()), daemon=True)
        process.start()
        theirs.close()  # the child's end: only the child holds it, so its death closes the pipe
        logger.info("dlo serve: replica %d started (pid %d, %s): loading the pipeline", index, process.pid,
                    self._specs[index].device)
        return _Replica(process, ours)

    @staticmethod
    def _await_ready(replica: _Replica, timeout_s: float) -> str:
        try:
            if not replica.conn.poll(timeout_s):
                return f"not ready in {timeout_s:.0f} s"
            ready = replica.conn.recv()
        except (EOFError, OSError):
            replica.process.join(5)
            return f"exited while loading (exit code {replica.process.exitcode})"
        replica.ready = not ready.error
        return ready.error

    @property
    def replicas(self) -> int:
        return sum(r.ready for r in self._replicas)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._futures)

    def pids(self) -> list[int | None]:
        return [r.process.pid for r in self._replicas]

    @property
    def refusal(self) -> str | None:
        """Why every new job is refused (Unavailable), or None while jobs are admitted."""
        return self._refusal

    def stop_admitting(self, reason: str) -> None:
        """From now on submit raises Unavailable(reason). Under the lock submit takes: a job is
        either held (counted in `pending`) before this returns, or refused."""
        with self._lock:
            self._refusal = reason

    def submit(
        self, kwargs: dict, seed: int, n: int, video: VideoFile | None = None,
        on_progress: Callable[[int], None] | None = None, adapters: Adapters = (),
    ) -> tuple[int, Future[Done]]:
        """Queue a job, or raise QueueFull or Unavailable. `on_progress(steps)` is called (on
        the pool's thread) when a replica starts the job (0) and after each of its steps;
        `adapters`: the LoRAs it runs with (see replica.Job)."""
        with self._lock:
            if self._refusal is not None:
                raise Unavailable(self._refusal)
            if len(self._futures) >= self._capacity:
                mean_s = sum(self._recent_s) / len(self._recent_s) if self._recent_s else 0.0
                raise QueueFull(retry_after_s(mean_s, len(self._queue) + 1, self.replicas))
            job = Job(next(self._ids), kwargs, seed, n, video, adapters)
            future: Future[Done] = Future()
            self._futures[job.job_id] = future
            if on_progress is not None:
                self._on_progress[job.job_id] = on_progress
            self._queue.append(job)
            self._dispatch()
        return job.job_id, future

    def forget(self, job_id: int) -> None:
        """The request gave up (timed out, or its client left): drop its job if no replica
        took it yet."""
        with self._lock:
            self._drop_queued(job_id)

    def cancel(self, job_id: int) -> None:
        """Stop a job: if still queued it is dropped and its future resolves as cancelled;
        if running, its replica stops between two steps and answers cancelled (then takes the
        next job)."""
        with self._lock:
            future = self._drop_queued(job_id)
            for replica in self._replicas:
                if replica.job_id == job_id:
                    try:
                        replica.conn.send(Cancel(job_id))
                    except OSError:  # its end of file restarts it and fails the job
                        pass
        _resolve(future, Done(job_id, cancelled=True))

    def _drop_queued(self, job_id: int) -> Future[Done] | None:
        """Under the lock: remove a queued job; its future, or None if it was not queued."""
        if not any(job.job_id == job_id for job in self._queue):
            return None
        self._queue = deque(job for job in self._queue if job.job_id != job_id)
        self._on_progress.pop(job_id, None)
        self.metrics.queued.set(len(self._queue))
        return self._futures.pop(job_id, None)

    def _dispatch(self) -> None:
        """Under the lock: hand queued jobs to idle replicas, oldest first. A replica whose
        pipe broke keeps no job: it goes back to the front of the queue, and the replica's
        end of file (read by `_serve`) restarts it."""
        for replica in self._replicas:
            if self._queue and replica.ready and replica.job_id is None and not replica.stalled:
                job = self._queue.popleft()
                try:
                    replica.conn.send(job)
                except OSError:
                    replica.ready = False
                    self._queue.appendleft(job)
                    continue
                replica.job_id = job.job_id
                self._started[job.job_id] = time.monotonic()
        self.metrics.queued.set(len(self._queue))
        self.metrics.busy.set(sum(r.job_id is not None for r in self._replicas))

    def _serve(self) -> None:
        while not self._closing.is_set():
            conns = {r.conn: r for r in self._replicas if not r.conn.closed}
            for conn in connection_wait(list(conns), timeout=0.2):
                try:
                    self._receive(conns[conn])
                except Exception:  # this thread serves every replica: it must outlive any one bug
                    logger.exception("dlo serve: handling a replica's message failed")
            if self._stall_s:
                self._kill_stalled()

    def _kill_stalled(self) -> None:
        """Kill a replica whose job made no step for `stall_s`: its end of file then fails the
        job (saying why) and restarts it, as for any replica that dies."""
        now = time.monotonic()
        for index, replica in enumerate(self._replicas):
            if replica.stalled or replica.heard is None or now - replica.heard <= self._stall_s:
                continue
            if replica.conn.poll():  # it has answered meanwhile: read that first
                continue
            logger.error("dlo serve: replica %d made no progress for %g s (--stall-timeout-s): killing it", index, self._stall_s)
            replica.stalled = True  # from now on it takes no job: its end of file restarts it
            replica.process.kill()

    def _receive(self, replica: _Replica) -> None:
        try:
            message = replica.conn.recv()
        except (EOFError, OSError):
            if not self._closing.is_set():
                self._restart(replica)
            return
        if isinstance(message, Progress):
            replica.heard = time.monotonic() if message.per_step else None
            on_progress = self._on_progress.get(message.job_id)
            if on_progress is not None:
                on_progress(message.steps)
            return
        with self._lock:
            if isinstance(message, Ready):  # a restarted replica
                replica.ready = not message.error
                replica.failed_starts = 0 if replica.ready else replica.failed_starts
                if not message.error:
                    logger.info("dlo serve: replica %d ready (pid %d)", self._replicas.index(replica), replica.process.pid)
                if message.error:  # it exits next: its end of file restarts it or gives it up
                    self._load_error = message.error
                    logger.error(
                        "dlo serve: replica %d could not load the pipeline: %s", self._replicas.index(replica),
                        message.error,
                    )
            else:
                replica.job_id, replica.heard = None, None
                started = self._started.pop(message.job_id, None)
                if started is not None and not (message.error or message.cancelled):
                    self._recent_s.append(time.monotonic() - started)
                self._on_progress.pop(message.job_id, None)
                index = str(self._replicas.index(replica))
                self.metrics.steps.inc(message.steps)
                self.metrics.streamed.labels(index).set(message.bytes_streamed)
                if message.host_pss is not None:
                    self.metrics.pss.labels(index).set(message.host_pss)
            self._dispatch()
            if isinstance(message, Done):  # after the gauges: a client that has its answer sees them current
                _resolve(self._futures.pop(message.job_id, None), message)

    def _restart(self, dead: _Replica) -> None:
        dead.process.join(5)
        dead.conn.close()
        index = self._replicas.index(dead)
        with self._lock:
            job_id, dead.job_id, dead.heard = dead.job_id, None, None  # a given-up one stays listed: never timed
            future = self._futures.pop(job_id, None) if job_id is not None else None
            self._started.pop(job_id, None)
            self._on_progress.pop(job_id, None)
            failed_starts = dead.failed_starts + (not dead.ready)
            if not self._closing.is_set():
                doing = f"running job {job_id}" if job_id is not None else "idle" if dead.ready else "loading"
                logger.warning("dlo serve: replica %d (pid %s) died (exit code %s) while %s", index, dead.process.pid,
                               dead.process.exitcode, doing)
            unanswerable: list[tuple[int, Future[Done] | None]] = []
            refusal = ""
            if self._closing.is_set() or failed_starts >= _FAILED_STARTS:
                logger.error("dlo serve: replica %d exited (code %s); not started again", index, dead.process.exitcode)
                dead.ready, dead.given_up = False, True
                if all(r.given_up for r in self._replicas) and not self._closing.is_set():
                    self._refusal = refusal = (
                        f"no replica can run jobs: each failed to load the pipeline {_FAILED_STARTS} times in a row "
                        f"(the last: {self._load_error or 'it exited while loading'}); fix that and restart dlo serve"
                    )
                    logger.error("dlo serve: %s", refusal)
                    # No replica will take the queued jobs: they fail now (answered, and not pending).
                    unanswerable = [(job.job_id, self._drop_queued(job.job_id)) for job in list(self._queue)]
            else:
                logger.info("dlo serve: restarting replica %d (restart %d)", index, self.restarts + 1)
                self._replicas[index] = self._start(index)  # it reports Ready on its pipe, read by this thread
                self._replicas[index].failed_starts = failed_starts
                self.restarts += 1
                self.metrics.restarts.inc()
            self._dispatch()
        if job_id is not None:
            again = "it was restarted" if self._replicas[index] is not dead else "it was not started again"
            how = (
                f"made no progress for {self._stall_s:g} s (--stall-timeout-s) and was killed" if dead.stalled
                else f"died (exit code {dead.process.exitcode})"
            )
            error = f"replica {index} {how} while running it; {again}"
            _resolve(future, Done(job_id, error=error))
        for queued_id, queued in unanswerable:
            _resolve(queued, Done(queued_id, error=refusal))

    def close(self) -> None:
        """Stop reading, ask every ready replica to stop (after its current job), kill the ones
        still loading, and wait for them."""
        self._closing.set()
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join()
        with self._lock:
            replicas = list(self._replicas)
        for replica in replicas:
            if not replica.ready:  # loading (it reads its pipe only once loaded) or dying: it holds no job
                replica.process.kill()
                continue
            try:
                replica.conn.send(None)
            except OSError:  # already gone
                pass
        deadline = time.monotonic() + 30
        for replica in replicas:
            replica.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if replica.process.is_alive():
                replica.process.kill()
            replica.conn.close()


def _resolve(future: Future[Done] | None, done: Done) -> None:
    if future is not None and future.set_running_or_notify_cancel():
        future.set_result(done)
