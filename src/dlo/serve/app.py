"""`dlo serve`'s HTTP side (FastAPI): OpenAI-style image and video endpoints in front of the
replica pool (pool.py).

A request is validated before it is queued (a 400 JSON error naming the field); the server
holds at most `replicas + max_queue` jobs, beyond that a request gets 429 with a Retry-After
from recent job times. An image request waits at most `timeout_s` (504; the job itself still
runs to its end). A client that hangs up stops waiting too: its job is dropped if still queued
(logged as 499). A video request answers at once with a job (videos.py) to poll, fetch,
cancel or delete. A replica that dies fails only the job it was running (saying so) and is
restarted. While the pool refuses jobs (SIGTERM's drain, or no replica left), new jobs get 503.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from dlo.pipelines.call_rules import CallRules
from dlo.pipelines.media_output import has_mp4_encoder
from dlo.serve.pool import QueueFull, ReplicaPool, Unavailable
from dlo.serve.replica import VideoFile, VideoFormat
from dlo.serve.requests import ImageRequest, Limits, RequestError, VideoRequest, chosen_adapters, pipeline_kwargs
from dlo.serve.videos import VideoJobs, VideoShape, VideoStatus


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


def _queue_full(full: QueueFull) -> JSONResponse:
    return _error(429, None, str(full), headers={"Retry-After": str(full.retry_after_s)})


def _unknown_video(video_id: str) -> JSONResponse:
    return _error(404, "video_id", f"no video job {video_id} (never made, deleted, or expired)")


_JOB_PATHS = frozenset({"/v1/images/generations", "/v1/videos"})
# The openai client's videos.create sends multipart form data (for a reference image, which dlo
# does not take); the fields' types are JSON's.
_SEND_JSON = (
    "body: send the request as JSON (Content-Type: application/json), not multipart form data; with the openai "
    "client: client.post('/videos', body={...}, cast_to=openai.types.Video) instead of client.videos.create"
)

# One line per request, in uvicorn's access log's form, with the seconds it took and the job it
# made (the pool's job id: what the replicas' lines name; and a video's id).
access_log = logging.getLogger("dlo.serve.access")


def _log_access(request: Request, status: int, seconds: float) -> None:
    client = f"{request.client.host}:{request.client.port}" if request.client else "-"
    line = f"{request.method} {request.url.path} HTTP/{request.scope.get('http_version', '1.1')}"
    job = getattr(request.state, "job", None)
    access_log.info('%s - "%s" %d %.3f s%s', client, line, status, seconds, f" {job}" if job else "")


def make_app(
    pool: ReplicaPool, videos: VideoJobs, rules: CallRules, limits: Limits, parameters: frozenset[str],
    model_name: str, lora_scales: dict[str, float] | None = None,
) -> FastAPI:
    """`parameters`: the names the pipeline's __call__ takes; `lora_scales`: the replicas'
    LoRAs by name, at their --lora scales."""
    lora_scales = lora_scales or {}
    app = FastAPI(title="dlo serve")
    video_format = "mp4" if has_mp4_encoder() else "webp"  # for a video request without `format`

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err: RequestValidationError) -> JSONResponse:
        """FastAPI's 422 as OpenAI's 400, naming the first field that is wrong (None: the body
        is not JSON)."""
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            return _error(400, None, _SEND_JSON)
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
        started = time.perf_counter()
        # Before the body is read; a refusal that comes later is the pool's, in submit.
        refusal = pool.refusal
        # Only the job endpoints: polls, fetches and deletes still work, unknown paths stay 404.
        if refusal is not None and request.method == "POST" and request.url.path in _JOB_PATHS:
            response = _error(503, None, refusal)
        else:
            response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            metrics.requests.labels(str(response.status_code)).inc()
        _log_access(request, response.status_code, time.perf_counter() - started)
        return response

    @app.post("/v1/images/generations")
    async def generations(request: ImageRequest, connection: Request):
        received = time.perf_counter()
        try:
            kwargs = pipeline_kwargs(request, rules, limits, parameters)
            adapters = chosen_adapters(request, lora_scales)
        except RequestError as err:
            return _error(400, err.param, str(err))
        try:
            job_id, future = pool.submit(kwargs, request.seed, request.n, adapters=adapters)
        except QueueFull as full:
            return _queue_full(full)
        except Unavailable as refused:
            return _error(503, None, str(refused))
        connection.state.job = f"job {job_id}"  # for the access log line
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
        data = [{"b64_json": base64.b64encode(png).decode("ascii")} for png in done.files]
        metrics.latency.observe(time.perf_counter() - received)
        return {"created": int(time.time()), "data": data}

    @app.post("/v1/videos")
    async def create_video(request: VideoRequest, connection: Request):
        try:
            kwargs = pipeline_kwargs(request, rules, limits, parameters)
            adapters = chosen_adapters(request, lora_scales)
        except RequestError as err:
            return _error(400, err.param, str(err))
        height, width, frames = rules.default_size
        shape = VideoShape(
            width=kwargs.get("width", width), height=kwargs.get("height", height),
            num_frames=kwargs.get("num_frames", frames), seed=request.seed,
            file=VideoFile(VideoFormat(request.format or video_format), request.fps),
        )
        try:
            video = videos.submit(kwargs, shape, adapters)
        except QueueFull as full:
            return _queue_full(full)
        except Unavailable as refused:
            return _error(503, None, str(refused))
        connection.state.job = f"job {videos.pool_job(video['id'])} {video['id']}"  # for the access log line
        return video

    @app.get("/v1/videos")
    async def list_videos(limit: int = Query(20, ge=1, le=100), after: str | None = None,
                          order: Literal["asc", "desc"] = "desc"):
        page = videos.page(limit, after, descending=order == "desc")
        return page if page is not None else _unknown_video(after)

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str):
        video = videos.get(video_id)
        return video if video is not None else _unknown_video(video_id)

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str):
        found = videos.content(video_id)
        if found is None:
            return _unknown_video(video_id)
        status, content, media_type = found
        if status is not VideoStatus.COMPLETED:
            return _error(409, None, f"video {video_id} is {status.value}: its content exists once it is completed")
        return Response(content, media_type=media_type)

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str):
        answer = videos.delete(video_id)
        return answer if answer is not None else _unknown_video(video_id)

    @app.get("/metrics")
    async def metrics_text():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "dlo"}]}

    @app.get("/health")
    async def health():
        refusal = pool.refusal
        if refusal is not None:
            return _error(503, None, refusal)
        if pool.replicas == 0:
            return _error(503, None, "no replica is ready")
        return {"status": "ok", "replicas": pool.replicas, "pending": pool.pending, "restarts": pool.restarts,
                "replica_pids": pool.pids()}

    return app
