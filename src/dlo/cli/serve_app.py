"""`dlo serve`'s HTTP side: an OpenAI-style image endpoint (FastAPI) in front of replica
processes (serve_replica.py) that take jobs from one bounded queue.

A request is validated before it is queued (a 400 JSON error naming the field); the server
holds at most `replicas + max_queue` requests, beyond that a request gets 429 with
Retry-After; a request waits at most `timeout_s` (504; the job itself still runs to its end).
A client that hangs up stops waiting too: its job is dropped if still queued (logged as 499).
A replica that dies fails only the request it was running (500, saying so) and is restarted.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import re
import multiprocessing
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as connection_wait
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from dlo.cli.call_rules import CallRequest, CallRuleError, CallRules, validate_call
from dlo.cli.serve_replica import Done, Job, Ready, ReplicaSpec, replica_main
from dlo.errors import ConfigError

logger = logging.getLogger(__name__)


class ImageRequest(BaseModel):
    """POST /v1/images/generations: OpenAI's fields, and the pipeline's own as extensions."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=10_000)
    model: str | None = None  # one model per server: accepted, not checked
    user: str | None = None  # accepted and ignored, as quality and style
    quality: str | None = None
    style: str | None = None
    n: int = Field(default=1, ge=1)
    size: str | None = None  # "WxH"; unset or "auto": the pipeline's default
    response_format: Literal["b64_json"] = "b64_json"
    negative_prompt: str | None = None
    seed: int = Field(default=0, ge=0, le=2**63 - 1 - 1024)  # image k uses seed + k
    num_inference_steps: int = Field(default=28, ge=1)
    guidance_scale: float | None = None
    max_sequence_length: int | None = Field(default=None, ge=1)


@dataclass(frozen=True)
class Limits:
    max_images: int
    max_steps: int
    max_tokens: int
    dtype_bytes: int
    timeout_s: float


class RequestError(Exception):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


_SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")


def pipeline_kwargs(request: ImageRequest, rules: CallRules, limits: Limits, parameters: frozenset[str]) -> dict:
    """The pipeline's arguments for `request`, or a RequestError naming the field. `parameters`:
    the names the pipeline's __call__ takes."""
    if request.n > limits.max_images:
        raise RequestError("n", f"n={request.n}: at most {limits.max_images} images per request")
    if request.num_inference_steps > limits.max_steps:
        raise RequestError("num_inference_steps", f"at most {limits.max_steps} steps per request")
    height = width = None
    if request.size not in (None, "auto"):
        match = _SIZE.fullmatch(request.size.lower())
        if match is None:
            raise RequestError("size", f"size={request.size!r}: give WIDTHxHEIGHT in pixels, e.g. 1024x1024")
        width, height = int(match[1]), int(match[2])
    try:
        call = validate_call(
            rules, CallRequest(height, width, None, request.max_sequence_length), limits.max_tokens, limits.dtype_bytes
        )
    except CallRuleError as err:
        field = {"height": "size", "width": "size"}.get(err.field, err.field)
        raise RequestError(field, f"{field}={err.value}: {err.allowed}") from None
    wanted = {
        "prompt": request.prompt,
        "negative_prompt": request.negative_prompt,
        "num_inference_steps": request.num_inference_steps,
        "height": call.height,
        "width": call.width,
        "guidance_scale": request.guidance_scale,
        "max_sequence_length": call.max_sequence_length,
    }
    given = {k: v for k, v in wanted.items() if v is not None}
    for name in given:
        if name not in parameters:
            raise RequestError(name, f"{name}: {rules.pipeline} does not take it")
    return given


class QueueFull(Exception):
    pass


_FAILED_STARTS = 3  # restarts in a row that never became ready before a replica is given up


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


class ReplicaPool:
    """`count` replica processes, each on a pipe of its own. Jobs wait in one FIFO here and go
    to whichever replica is idle. One thread reads every pipe: a result resolves its job's
    future; a replica that died (its pipe closed) fails only the job it was running, with an
    error that says so, and is started again (given up after `_FAILED_STARTS` restarts in a
    row that never became ready). A future is resolved only if nobody cancelled it."""

    def __init__(
        self, spec: ReplicaSpec, count: int, max_queue: int, metrics: Metrics, ready_timeout_s: float = 600
    ) -> None:
        self._context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._spec = spec
        self.metrics = metrics
        self.restarts = 0
        self._capacity = count + max_queue
        self._futures: dict[int, Future[Done]] = {}
        self._queue: deque[Job] = deque()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closing = threading.Event()
        self._replicas: list[_Replica] = []
        try:  # Ctrl-C while the replicas load, or any failure: none is left running
            self._replicas = [self._start() for _ in range(count)]
            failures = []
            for index, replica in enumerate(self._replicas):
                error = self._await_ready(replica, ready_timeout_s)
                if error:
                    failures.append(f"replica {index}: {error}")
            if failures:
                raise ConfigError("dlo serve: the replicas could not load the pipeline: " + "; ".join(failures))
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="dlo-serve-replicas", daemon=True)
        self._thread.start()

    def _start(self) -> _Replica:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=replica_main, args=(self._spec, theirs), daemon=True)
        process.start()
        theirs.close()  # the child's end: only the child holds it, so its death closes the pipe
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

    def submit(self, kwargs: dict, seed: int, n: int) -> tuple[int, Future[Done]]:
        with self._lock:
            if len(self._futures) >= self._capacity:
                raise QueueFull
            job = Job(next(self._ids), kwargs, seed, n)
            future: Future[Done] = Future()
            self._futures[job.job_id] = future
            self._queue.append(job)
            self._dispatch()
        return job.job_id, future

    def forget(self, job_id: int) -> None:
        """The request gave up (timed out, or its client left): drop its job if no replica
        took it yet."""
        with self._lock:
            if any(job.job_id == job_id for job in self._queue):
                self._queue = deque(job for job in self._queue if job.job_id != job_id)
                self._futures.pop(job_id, None)
                self.metrics.queued.set(len(self._queue))

    def _dispatch(self) -> None:
        """Under the lock: hand queued jobs to idle replicas, oldest first. A replica whose
        pipe broke keeps no job: it goes back to the front of the queue, and the replica's
        end of file (read by `_serve`) restarts it."""
        for replica in self._replicas:
            if self._queue and replica.ready and replica.job_id is None:
                job = self._queue.popleft()
                try:
                    replica.conn.send(job)
                except OSError:
                    replica.ready = False
                    self._queue.appendleft(job)
                    continue
                replica.job_id = job.job_id
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

    def _receive(self, replica: _Replica) -> None:
        try:
            message = replica.conn.recv()
        except (EOFError, OSError):
            if not self._closing.is_set():
                self._restart(replica)
            return
        with self._lock:
            if isinstance(message, Ready):  # a restarted replica
                replica.ready = not message.error
                replica.failed_starts = 0 if replica.ready else replica.failed_starts
            else:
                replica.job_id = None
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
            job_id, dead.job_id = dead.job_id, None
            future = self._futures.pop(job_id, None) if job_id is not None else None
            failed_starts = dead.failed_starts + (not dead.ready)
            if self._closing.is_set() or failed_starts >= _FAILED_STARTS:
                logger.error("dlo serve: replica %d exited (code %s); not started again", index, dead.process.exitcode)
                dead.ready = False
            else:
                self._replicas[index] = self._start()  # it reports Ready on its pipe, read by this thread
                self._replicas[index].failed_starts = failed_starts
                self.restarts += 1
                self.metrics.restarts.inc()
            self._dispatch()
        if job_id is not None:
            again = "it was restarted" if self._replicas[index] is not dead else "it was not started again"
            error = f"replica {index} died (exit code {dead.process.exitcode}) while running it; {again}"
            _resolve(future, Done(job_id, error=error))

    def close(self) -> None:
        """Stop reading, ask every replica to stop (after its current job), and wait for them."""
        self._closing.set()
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join()
        with self._lock:
            replicas = list(self._replicas)
        for replica in replicas:
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


async def _hung_up(connection: Request) -> None:
    """Returns once the client closed its connection. The request's body was read: the
    server's next message for it is the disconnect (`is_disconnected()` only polls, and
    through the counting middleware it never sees one)."""
    while (await connection.receive())["type"] != "http.disconnect":
        pass


def _error(status: int, param: str | None, message: str, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error"}}
    if param is not None:
        body["error"]["param"] = param
    return JSONResponse(status_code=status, content=body, headers=headers)


def make_app(
    pool: ReplicaPool, rules: CallRules, limits: Limits, parameters: frozenset[str], model_name: str
) -> FastAPI:
    app = FastAPI(title="dlo serve")

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err: RequestValidationError) -> JSONResponse:
        """FastAPI's 422 as OpenAI's 400, naming the first field that is wrong (None: the body
        is not JSON)."""
        first = err.errors()[0]
        loc = first.get("loc") or ()
        param = loc[-1] if loc and isinstance(loc[-1], str) and loc[-1] != "body" else None
        return _error(400, param, f"{param or 'body'}: {first.get('msg', 'invalid')}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, err: StarletteHTTPException) -> JSONResponse:
        return _error(err.status_code, None, str(err.detail))

    metrics = pool.metrics

    @app.middleware("http")
    async def count(request, call_next):
        response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            metrics.requests.labels(str(response.status_code)).inc()
        return response

    @app.post("/v1/images/generations")
    async def generations(request: ImageRequest, connection: Request):
        received = time.perf_counter()
        try:
            kwargs = pipeline_kwargs(request, rules, limits, parameters)
        except RequestError as err:
            return _error(400, err.param, str(err))
        try:
            job_id, future = pool.submit(kwargs, request.seed, request.n)
        except QueueFull:
            return _error(429, None, "the queue is full; retry later", headers={"Retry-After": "1"})
        result = asyncio.ensure_future(asyncio.wrap_future(future))
        hung_up = asyncio.ensure_future(_hung_up(connection))
        finished, _ = await asyncio.wait({result, hung_up}, timeout=limits.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        hung_up.cancel()
        if result not in finished:
            result.cancel()  # the replica's answer, if it comes, is dropped
            pool.forget(job_id)  # still queued: dropped; already running: it runs to its end
            if hung_up in finished:  # nobody reads this answer: it counts in /metrics
                return _error(499, None, "the client closed the connection")
            return _error(504, None, f"no result in {limits.timeout_s:g} s")
        done = result.result()
        if done.error:
            return _error(500, None, f"the replica failed on this request: {done.error}")
        data = [{"b64_json": base64.b64encode(png).decode("ascii")} for png in done.images]
        metrics.latency.observe(time.perf_counter() - received)
        return {"created": int(time.time()), "data": data}

    @app.get("/metrics")
    async def metrics_text():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "dlo"}]}

    @app.get("/health")
    async def health():
        if pool.replicas == 0:
            return _error(503, None, "no replica is ready")
        return {"status": "ok", "replicas": pool.replicas, "pending": pool.pending, "restarts": pool.restarts,
                "replica_pids": pool.pids()}

    return app
