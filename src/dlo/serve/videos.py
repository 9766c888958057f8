"""`dlo serve`'s video jobs: what `POST /v1/videos` queued, by id, until their result expires.

A job is queued (in the replica pool), running (a replica reported it started; its progress
is the steps done of the steps asked), then completed (its video file is kept here), failed
(the error), or cancelled (`DELETE` while queued or running). A finished job stays at most
`keep_s` seconds after it finished, and at most `keep` finished jobs stay (the oldest finished
goes first); `DELETE` of a finished job removes it and its file at once.
"""

from __future__ import annotations

import enum
import threading
import time
import uuid
from dataclasses import dataclass

from dlo.pipelines.lora_adapters import Adapters
from dlo.serve.pool import QueueFull, ReplicaPool, Unavailable
from dlo.serve.replica import Done, VideoFile, VideoFormat

MEDIA_TYPES = {VideoFormat.MP4: "video/mp4", VideoFormat.WEBP: "image/webp"}


class VideoStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


_LIVE = (VideoStatus.QUEUED, VideoStatus.RUNNING)


@dataclass(frozen=True)
class VideoShape:
    """What the video will be, as the job object shows it (the pipeline's defaults resolved)."""

    width: int
    height: int
    num_frames: int
    seed: int
    file: VideoFile


@dataclass
class _Video:
    id: str
    shape: VideoShape
    steps_total: int
    created_at: int  # Unix time
    job_id: int | None = None  # the pool's, once submitted
    status: VideoStatus = VideoStatus.QUEUED
    steps_done: int = 0
    error: str | None = None
    content: bytes | None = None
    finished: float | None = None  # time.monotonic() when it left QUEUED/RUNNING
    completed_at: int | None = None  # Unix time, likewise


class VideoJobs:
    def __init__(self, pool: ReplicaPool, model_name: str, keep: int, keep_s: float) -> None:
        self._pool = pool
        self._model_name = model_name
        self._keep = keep
        self._keep_s = keep_s
        self._videos: dict[str, _Video] = {}
        self._lock = threading.Lock()

    def submit(self, kwargs: dict, shape: VideoShape, adapters: Adapters = ()) -> dict:
        """Queue a video job (with the LoRAs `adapters`) and return its object; QueueFull or
        Unavailable (from the pool)."""
        video = _Video(f"video_{uuid.uuid4().hex}", shape, kwargs["num_inference_steps"], int(time.time()))
        with self._lock:  # before the pool has the job: its first progress finds the record
            self._prune()
            self._videos[video.id] = video
        try:
            video.job_id, future = self._pool.submit(
                kwargs, shape.seed, 1, shape.file, on_progress=lambda steps: self._progressed(video.id, steps),
                adapters=adapters,
            )
        except (QueueFull, Unavailable):
            with self._lock:
                del self._videos[video.id]
            raise
        future.add_done_callback(lambda done: self._finished(video.id, done.result()))
        with self._lock:
            return self._view(video)

    def page(self, limit: int, after: str | None, descending: bool) -> dict | None:
        """GET /v1/videos: up to `limit` jobs kept (newest first when `descending`), those after
        the job `after` (the previous page's last_id); None if `after` is unknown."""
        with self._lock:
            self._prune()
            ordered = list(self._videos.values())  # in creation order: the dict's insertion order
            if descending:
                ordered.reverse()
            ids = [video.id for video in ordered]
            if after is not None and after not in ids:
                return None
            start = ids.index(after) + 1 if after is not None else 0
            shown = [self._view(video) for video in ordered[start : start + limit]]
            return {
                "object": "list", "data": shown, "has_more": start + limit < len(ordered),
                "first_id": shown[0]["id"] if shown else None, "last_id": shown[-1]["id"] if shown else None,
            }

    def pool_job(self, video_id: str) -> int | None:
        """The pool's id of the job making `video_id` (what the replicas' log lines name)."""
        with self._lock:
            video = self._videos.get(video_id)
            return video.job_id if video is not None else None

    def get(self, video_id: str) -> dict | None:
        with self._lock:
            self._prune()
            video = self._videos.get(video_id)
            return self._view(video) if video else None

    def content(self, video_id: str) -> tuple[VideoStatus, bytes | None, str] | None:
        """(status, the file if completed, its media type), None for an unknown id."""
        with self._lock:
            self._prune()
            video = self._videos.get(video_id)
            if video is None:
                return None
            return video.status, video.content, MEDIA_TYPES[video.shape.file.format]

    def delete(self, video_id: str) -> dict | None:
        """Cancel a queued or running job (its object, now cancelled, stays like any finished
        one), or remove a finished one; None for an unknown id."""
        with self._lock:
            self._prune()
            video = self._videos.get(video_id)
            if video is None:
                return None
            if video.status not in _LIVE:
                del self._videos[video_id]
                return {"id": video_id, "object": "video.deleted", "deleted": True}
            self._finish(video, VideoStatus.CANCELLED)
            view = self._view(video)
        self._pool.cancel(video.job_id)  # outside the lock: a queued job's future resolves at once
        return view

    def _progressed(self, video_id: str, steps: int) -> None:
        with self._lock:
            video = self._videos.get(video_id)
            if video is not None and video.status in _LIVE:
                video.status, video.steps_done = VideoStatus.RUNNING, steps

    def _finished(self, video_id: str, done: Done) -> None:
        with self._lock:
            video = self._videos.get(video_id)
            if video is None or video.status not in _LIVE:  # deleted or cancelled: the result is dropped
                return
            if done.cancelled:
                self._finish(video, VideoStatus.CANCELLED)
            elif done.error:
                video.error = done.error
                self._finish(video, VideoStatus.FAILED)
            else:
                video.content, video.steps_done = done.files[0], video.steps_total
                self._finish(video, VideoStatus.COMPLETED)
            self._prune()

    @staticmethod
    def _finish(video: _Video, status: VideoStatus) -> None:
        video.status, video.finished, video.completed_at = status, time.monotonic(), int(time.time())

    def _prune(self) -> None:
        """Under the lock: drop finished jobs older than keep_s, then the oldest finished ones
        beyond `keep`."""
        now = time.monotonic()
        finished = sorted((v for v in self._videos.values() if v.finished is not None), key=lambda v: v.finished)
        for index, video in enumerate(finished):
            if now - video.finished > self._keep_s or len(finished) - index > self._keep:
                del self._videos[video.id]

    def _view(self, video: _Video) -> dict:
        shape = video.shape
        return {
            "id": video.id,
            "object": "video",
            "model": self._model_name,
            "status": video.status.value,
            "progress": 100 * video.steps_done // video.steps_total,
            "steps_done": video.steps_done,
            "steps_total": video.steps_total,
            "created_at": video.created_at,
            "completed_at": video.completed_at,
            "size": f"{shape.width}x{shape.height}",
            "num_frames": shape.num_frames,
            "fps": shape.file.fps,
            "format": shape.file.format.value,
            "seed": shape.seed,
            "error": {"message": video.error} if video.error else None,
        }
