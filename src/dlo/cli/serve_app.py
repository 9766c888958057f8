"""`dlo serve`'s HTTP side: an OpenAI-style image endpoint (FastAPI) in front of replica
processes (serve_replica.py) that share one bounded queue.

A request is validated before it is queued (the field it names, a 4xx JSON error); the queue
holds at most `replicas + max_queue` requests, beyond that a request gets 429 with
Retry-After; a request waits at most `timeout_s` (504; the job itself still runs to its end).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import multiprocessing
import queue as queue_module
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from dlo.cli.call_rules import CallRequest, CallRuleError, CallRules, validate_call
from dlo.cli.serve_replica import Done, Job, ReplicaSpec, replica_main
from dlo.errors import ConfigError


class ImageRequest(BaseModel):
    """POST /v1/images/generations: OpenAI's fields, and the pipeline's own as extensions."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(default=1, ge=1)
    size: str | None = None  # "WxH"; unset: the pipeline's default
    response_format: Literal["b64_json"] = "b64_json"
    negative_prompt: str | None = None
    seed: int = 0
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


def pipeline_kwargs(request: ImageRequest, rules: CallRules, limits: Limits) -> dict:
    """The pipeline's arguments for `request`, or a RequestError naming the field."""
    if request.n > limits.max_images:
        raise RequestError("n", f"n={request.n}: at most {limits.max_images} images per request")
    if request.num_inference_steps > limits.max_steps:
        raise RequestError("num_inference_steps", f"at most {limits.max_steps} steps per request")
    height = width = None
    if request.size is not None:
        parts = request.size.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise RequestError("size", f"size={request.size!r}: give WIDTHxHEIGHT in pixels, e.g. 1024x1024")
        width, height = int(parts[0]), int(parts[1])
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
    return {k: v for k, v in wanted.items() if v is not None}


class QueueFull(Exception):
    pass


class ReplicaPool:
    """`count` replica processes taking jobs from one inbox; a reader thread hands each
    result to the future of its job."""

    def __init__(self, spec: ReplicaSpec, count: int, max_queue: int, ready_timeout_s: float = 600) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._inbox = context.Queue()
        self._outbox = context.Queue()
        ready = context.Queue()
        self._processes = [
            context.Process(target=replica_main, args=(i, spec, self._inbox, self._outbox, ready), daemon=True)
            for i in range(count)
        ]
        for process in self._processes:
            process.start()
        failures = []
        for _ in range(count):
            try:
                index, error = ready.get(timeout=ready_timeout_s)
            except queue_module.Empty:
                failures.append(f"no replica was ready in {ready_timeout_s:.0f} s")
                break
            if error:
                failures.append(f"replica {index}: {error}")
        if failures:
            self.close()
            raise ConfigError("dlo serve: the replicas could not load the pipeline: " + "; ".join(failures))
        self.replicas = count
        self._capacity = count + max_queue
        self._futures: dict[int, Future[Done]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read, name="dlo-serve-results", daemon=True)
        self._reader.start()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._futures)

    def submit(self, kwargs: dict, seed: int, n: int) -> Future[Done]:
        with self._lock:
            if len(self._futures) >= self._capacity:
                raise QueueFull
            job_id = next(self._ids)
            future: Future[Done] = Future()
            self._futures[job_id] = future
        self._inbox.put(Job(job_id, kwargs, seed, n))
        return future

    def _read(self) -> None:
        while (done := self._outbox.get()) is not None:
            with self._lock:
                future = self._futures.pop(done.job_id, None)
            if future is not None:
                future.set_result(done)

    def close(self) -> None:
        for _ in self._processes:
            self._inbox.put(None)
        for process in self._processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        self._outbox.put(None)


def _error(status: int, param: str | None, message: str, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error"}}
    if param is not None:
        body["error"]["param"] = param
    return JSONResponse(status_code=status, content=body, headers=headers)


def make_app(pool: ReplicaPool, rules: CallRules, limits: Limits, model_name: str) -> FastAPI:
    app = FastAPI(title="dlo serve")

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err: RequestValidationError) -> JSONResponse:
        """FastAPI's 422 as OpenAI's 400, naming the first field that is wrong."""
        first = err.errors()[0]
        param = str(first["loc"][-1]) if first.get("loc") else None
        return _error(400, param, f"{param}: {first.get('msg', 'invalid')}")

    @app.post("/v1/images/generations")
    async def generations(request: ImageRequest):
        try:
            kwargs = pipeline_kwargs(request, rules, limits)
        except RequestError as err:
            return _error(400, err.param, str(err))
        try:
            future = pool.submit(kwargs, request.seed, request.n)
        except QueueFull:
            return _error(429, None, "the queue is full; retry later", headers={"Retry-After": "1"})
        try:
            done = await asyncio.wait_for(asyncio.wrap_future(future), timeout=limits.timeout_s)
        except asyncio.TimeoutError:
            return _error(504, None, f"no result in {limits.timeout_s:g} s")
        if done.error:
            return _error(500, None, f"the replica failed on this request: {done.error}")
        data = [{"b64_json": base64.b64encode(png).decode("ascii")} for png in done.images]
        return {"created": int(time.time()), "data": data}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "dlo"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "replicas": pool.replicas, "pending": pool.pending}

    return app
