"""`dlo serve` of a video pipeline as a real process on 127.0.0.1: a tiny Wan pipeline, two
replicas through the host weight cache, the /v1/videos jobs over real HTTP, videos compared
frame by frame with the plain pipeline."""

import inspect
import io
import os
import signal
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dlo.models.tiny_pipelines import GENERATE_DEFAULTS
from plain_pipeline import plain_pipeline
from serve_process import call, fetch, post_in_two_parts, running_server

WAN = {**GENERATE_DEFAULTS["wan"], "guidance_scale": 1.0}  # 1: one transformer pass a step, no guidance
VIDEO = {
    "prompt": "a red cube",
    "size": f"{WAN['width']}x{WAN['height']}",
    "num_frames": WAN["num_frames"],
    "num_inference_steps": 2,
    "max_sequence_length": WAN["max_sequence_length"],
    "guidance_scale": WAN["guidance_scale"],
    "format": "webp",  # lossless: the frames compare exactly
}
ENDLESS_STEPS = 100_000  # a job that only a cancel ends within the test's deadlines
MAX_QUEUE = 2
# The tiny Wan transformer made wider: 12 blocks of 4_207_104 float32 parameters (16.8 MB), 201.9 MB
# of blocks in all (tests/test_page_sharing.py counts them): far above a replica's private noise.
WIDE = dict(num_attention_heads=8, attention_head_dim=64, ffn_dim=2048, num_layers=12)
MB = 1e6


@pytest.fixture(scope="module")  # one server: under xdist the module runs on one worker (conftest.py)
def server(tiny_wan_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve-video-cache")
    flags = ["--replicas", "2", "--max-queue", str(MAX_QUEUE), "--max-steps", str(ENDLESS_STEPS)]
    with running_server(tiny_wan_dir, cache, tmp_path_factory.mktemp("serve-video-log"), flags) as running:
        yield running  # its last test drains it: it has exited by the teardown


@pytest.fixture(scope="module")
def wide_wan(tiny_wan_dir, tmp_path_factory) -> tuple[Path, int]:
    """(the tiny Wan pipeline with its transformer made WIDE, the bytes of that transformer's blocks)."""
    from diffusers import WanTransformer3DModel

    directory = tmp_path_factory.mktemp("pipelines") / "wide-wan"
    shutil.copytree(tiny_wan_dir, directory, ignore=shutil.ignore_patterns("transformer"))
    torch.manual_seed(0)
    config = WanTransformer3DModel.load_config(tiny_wan_dir / "transformer")
    transformer = WanTransformer3DModel.from_config({**config, **WIDE})
    transformer.save_pretrained(directory / "transformer")
    return directory, sum(p.numel() * p.element_size() for p in transformer.blocks.parameters())


@pytest.fixture(scope="module")
def reference(tiny_wan_dir):
    """seed -> the plain pipeline's frames (uint8, as the server writes them) for VIDEO."""
    pipe = plain_pipeline(tiny_wan_dir)
    pipe.set_progress_bar_config(disable=True)
    frames = {}

    def of(seed: int) -> np.ndarray:
        if seed not in frames:
            with torch.inference_mode():
                video = pipe(
                    "a red cube", num_inference_steps=VIDEO["num_inference_steps"],
                    generator=torch.Generator().manual_seed(seed), **WAN,
                ).frames[0]
            frames[seed] = (np.clip(video, 0.0, 1.0) * 255).round().astype(np.uint8)
        return frames[seed]

    return of


def _webp_frames(data: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    frames = []
    for index in range(image.n_frames):
        image.seek(index)
        frames.append(np.asarray(image.convert("RGB")))
    return np.stack(frames)


def _wait_for(base: str, video_id: str, done, what: str, poll_s: float = 0.05) -> dict:
    """Polls the job until `done(job)`; returns it."""
    deadline = time.monotonic() + 120
    while not done(job := call(f"{base}/v1/videos/{video_id}")[1]):
        assert time.monotonic() < deadline, f"the job never {what}: {job}"
        time.sleep(poll_s)
    return job


def _idle(base: str) -> None:
    deadline = time.monotonic() + 60
    while call(f"{base}/health")[1]["pending"]:
        assert time.monotonic() < deadline, "the server still holds a job"
        time.sleep(0.05)


def _metric(base: str, name: str) -> float:
    status, text, _ = fetch(f"{base}/metrics")
    values = dict(line.rsplit(" ", 1) for line in text.decode().splitlines() if line and not line.startswith("#"))
    return float(values[name])


def _stopped(pids):
    """Context: the replicas are stopped (SIGSTOP) inside, so the jobs they hold wait there."""
    class Stopped:
        def __enter__(self):
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)

        def __exit__(self, *exc):
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

    return Stopped()


def test_retry_after_grows_with_the_observed_job_time(server):
    """Retry-After = max(1, ceil(mean of the last 8 job times x (queued + 1) / replicas)).
    On a fresh server no job has finished: 1. The 2 jobs the replicas took then, stopped for
    HOLD_S seconds, each take at least HOLD_S: once the 4 jobs are done the mean is >= 2 x HOLD_S
    / 4, and a full queue (2 queued) gives Retry-After >= ceil(HOLD_S / 2 x 3 / 2) = 3."""
    base = server.base
    assert _metric(base, "dlo_serve_steps_total") == 0, "this test needs the module's server fresh: run it first"
    pids = call(f"{base}/health")[1]["replica_pids"]
    HOLD_S = 3
    headers = []
    for hold_s in (HOLD_S, 0):
        with _stopped(pids):
            jobs = [call(f"{base}/v1/videos", {**VIDEO, "seed": k}) for k in range(2 + MAX_QUEUE)]
            assert [status for status, _, _ in jobs] == [200] * 4
            status, answer, refused = call(f"{base}/v1/videos", VIDEO)
            assert status == 429 and "queue is full" in answer["error"]["message"]
            headers.append(int(refused["Retry-After"]))
            time.sleep(hold_s)  # the running jobs last at least this long
        _idle(base)
    assert headers[0] == 1 and headers[1] >= 3


def test_a_video_job_runs_to_completion_and_equals_the_plain_pipeline(server, reference):
    base = server.base
    status, job, _ = call(f"{base}/v1/videos", {**VIDEO, "seed": 7})
    assert status == 200 and job["status"] in ("queued", "running") and job["steps_total"] == 2
    seen = []
    job = _wait_for(base, job["id"], lambda j: seen.append(j["steps_done"]) or j["status"] == "completed", "completed")
    assert seen == sorted(seen) and job["steps_done"] == 2 and job["progress"] == 100 and job["error"] is None
    status, content, headers = fetch(f"{base}/v1/videos/{job['id']}/content")
    assert status == 200 and headers["content-type"] == "image/webp"
    frames = _webp_frames(content)
    assert frames.shape == (WAN["num_frames"], WAN["height"], WAN["width"], 3)
    assert np.array_equal(frames, reference(7))
    # Delete: the job and its file are gone.
    status, answer, _ = call(f"{base}/v1/videos/{job['id']}", method="DELETE")
    assert status == 200 and answer["deleted"] is True
    assert call(f"{base}/v1/videos/{job['id']}")[0] == 404
    assert fetch(f"{base}/v1/videos/{job['id']}/content")[0] == 404


def test_without_a_format_the_video_is_an_mp4_of_the_frames_asked(server, tmp_path):
    import imageio

    base = server.base
    body = {k: v for k, v in VIDEO.items() if k != "format"}
    status, job, _ = call(f"{base}/v1/videos", body)
    job = _wait_for(base, job["id"], lambda j: j["status"] == "completed", "completed")
    status, content, headers = fetch(f"{base}/v1/videos/{job['id']}/content")
    assert status == 200 and headers["content-type"] == "video/mp4" and job["format"] == "mp4"
    path = tmp_path / "video.mp4"
    path.write_bytes(content)
    with imageio.get_reader(path) as reader:
        frames = [frame for frame in reader]
    assert len(frames) == WAN["num_frames"] and frames[0].shape == (WAN["height"], WAN["width"], 3)


def test_cancelling_a_running_job_frees_its_replica(server, reference):
    """The job would run ENDLESS_STEPS steps: only the cancel ends it within the deadlines."""
    base = server.base
    steps_before = _metric(base, "dlo_serve_steps_total")
    status, job, _ = call(f"{base}/v1/videos", {**VIDEO, "num_inference_steps": ENDLESS_STEPS})
    assert status == 200
    _wait_for(base, job["id"], lambda j: j["status"] == "running" and j["steps_done"] >= 2, "made progress")
    status, cancelled, _ = call(f"{base}/v1/videos/{job['id']}", method="DELETE")
    assert status == 200 and cancelled["status"] == "cancelled"
    _idle(base)  # the replica stopped between two steps
    assert _metric(base, "dlo_serve_busy_replicas") == 0
    # The steps it ran count, cancelled or not (at least those it reported before the cancel).
    assert _metric(base, "dlo_serve_steps_total") - steps_before >= cancelled["steps_done"] >= 2
    assert call(f"{base}/v1/videos/{job['id']}")[1]["status"] == "cancelled"
    assert fetch(f"{base}/v1/videos/{job['id']}/content")[0] == 409
    status, job, _ = call(f"{base}/v1/videos", {**VIDEO, "seed": 3})
    job = _wait_for(base, job["id"], lambda j: j["status"] == "completed", "completed")
    assert np.array_equal(_webp_frames(fetch(f"{base}/v1/videos/{job['id']}/content")[1]), reference(3))


def test_cancelling_a_queued_job_drops_it(server):
    base = server.base
    pids = call(f"{base}/health")[1]["replica_pids"]
    with _stopped(pids):
        ids = [call(f"{base}/v1/videos", VIDEO)[1]["id"] for _ in range(3)]  # 2 running, 1 queued
        assert _metric(base, "dlo_serve_queue_depth") == 1
        assert call(f"{base}/v1/videos/{ids[2]}", method="DELETE")[1]["status"] == "cancelled"
        assert _metric(base, "dlo_serve_queue_depth") == 0
    for video_id in ids[:2]:
        _wait_for(base, video_id, lambda j: j["status"] == "completed", "completed")
    assert call(f"{base}/v1/videos/{ids[2]}")[1]["status"] == "cancelled"


def test_sixteen_clients_on_two_replicas_all_get_their_video(server, reference):
    """16 threads post at once while the replicas are stopped: 4 fit (2 replicas + a queue of
    2), 12 get 429. Then every client retries until accepted, polls and fetches: each video
    equals the plain pipeline's for its seed."""
    base = server.base
    pids = call(f"{base}/health")[1]["replica_pids"]
    clients = 16
    first_round = threading.Barrier(clients + 1)
    statuses, videos = [None] * clients, [None] * clients

    def client(k: int) -> None:
        status, job, _ = call(f"{base}/v1/videos", {**VIDEO, "seed": k % 4})
        statuses[k] = status
        first_round.wait(timeout=60)
        for _ in range(600):  # bounded: a lost request fails the test, never hangs it
            if status == 200:
                break
            time.sleep(0.3)
            status, job, _ = call(f"{base}/v1/videos", {**VIDEO, "seed": k % 4})
        job = _wait_for(base, job["id"], lambda j: j["status"] in ("completed", "failed"), "finished", poll_s=0.3)
        videos[k] = _webp_frames(fetch(f"{base}/v1/videos/{job['id']}/content")[1])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    with _stopped(pids):
        for thread in threads:
            thread.start()
        first_round.wait(timeout=60)
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(statuses) == [200] * 4 + [429] * 12
    for k, frames in enumerate(videos):
        assert frames is not None and np.array_equal(frames, reference(k % 4)), f"client {k}"


def test_video_requests_are_checked_before_they_are_queued(server):
    base = server.base
    for change, param in [
        (dict(num_frames=6), "num_frames"), (dict(fps=0), "fps"), (dict(format="gif"), "format"),
        (dict(size="30x32"), "size"), (dict(num_inference_steps=ENDLESS_STEPS + 1), "num_inference_steps"),
    ]:
        status, answer, _ = call(f"{base}/v1/videos", {**VIDEO, **change})
        assert status == 400 and answer["error"]["param"] == param, change
    status, answer, _ = call(f"{base}/v1/images/generations", {"prompt": "a red cube"})
    assert status == 400 and "WanPipeline makes videos, not images: use POST /v1/videos" in answer["error"]["message"]
    assert call(f"{base}/v1/videos/video_nonexistent")[0] == 404


def test_get_videos_lists_the_jobs_kept_newest_first_in_pages(server):
    """What the openai client's videos.list() reads: data, has_more, last_id (its next page's `after`)."""
    base = server.base
    made = [call(f"{base}/v1/videos", {**VIDEO, "seed": 100 + k})[1]["id"] for k in range(3)]
    status, page, _ = call(f"{base}/v1/videos?limit=2")
    assert status == 200 and page["object"] == "list" and [v["id"] for v in page["data"]] == made[::-1][:2]
    assert page["has_more"] is True and page["last_id"] == made[1] and page["data"][0]["object"] == "video"
    status, rest, _ = call(f"{base}/v1/videos?limit=2&after={page['last_id']}")
    assert status == 200 and rest["data"][0]["id"] == made[0]
    status, oldest_first, _ = call(f"{base}/v1/videos?order=asc&limit=100")
    assert [v["id"] for v in oldest_first["data"]][-3:] == made and oldest_first["has_more"] is False
    assert call(f"{base}/v1/videos?after=video_nonexistent")[0] == 404
    status, answer, _ = call(f"{base}/v1/videos?limit=0")
    assert status == 400 and answer["error"]["param"] == "limit"
    for video_id in made:
        call(f"{base}/v1/videos/{video_id}", method="DELETE")
    _idle(base)


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the client marks videos.create so
def test_a_multipart_video_request_is_told_to_send_json(server):
    """The openai client's videos.create sends multipart form data."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(BadRequestError) as refused:
        client.videos.create(prompt="a red cube", size="32x32", extra_body={"num_frames": 5})
    assert "send the request as JSON (Content-Type: application/json), not multipart form data" in str(refused.value)
    assert call(f"{server.base}/health")[1]["pending"] == 0


def test_a_job_without_a_size_beyond_the_transformers_positions_is_refused_before_it_is_queued(server):
    """WanPipeline's default 832x480 is 52 latent patches across, the tiny Wan's RoPE tables
    cover 32: refused at once naming the limit, not failed at run time with a shape error."""
    status, answer, _ = call(f"{server.base}/v1/videos", {"prompt": "a red cube", "num_inference_steps": 2})
    assert status == 400 and answer["error"]["param"] == "size"
    assert answer["error"]["message"].startswith(
        "size=auto (480x832x81, height x width x frames): WanTransformer3DModel places at most 32 latent patches per "
        "side (rope_max_seq_len 32 in its config): height and width up to 512, frames up to 125; ask for a smaller "
        "size (this is WanPipeline's default)"
    )
    assert call(f"{server.base}/health")[1]["pending"] == 0  # no job was made


class _FakePool:
    """The pool's side of VideoJobs: jobs whose futures the test resolves."""

    def __init__(self):
        self.futures = []

    def submit(self, kwargs, seed, n, video, on_progress, adapters=()):
        from concurrent.futures import Future

        self.futures.append(Future())
        return len(self.futures) - 1, self.futures[-1]

    def cancel(self, job_id):
        pass


def test_at_most_keep_finished_video_jobs_stay_the_oldest_finished_goes_first():
    from dlo.serve.replica import Done, VideoFile, VideoFormat
    from dlo.serve.videos import VideoJobs, VideoShape

    pool = _FakePool()
    jobs = VideoJobs(pool, "tiny", keep=2, keep_s=3600)
    shape = VideoShape(32, 32, 5, 0, VideoFile(VideoFormat.WEBP, 16))
    ids = [jobs.submit({"num_inference_steps": 2}, shape)["id"] for _ in range(4)]
    for job_id in (2, 0, 1):  # finishing order: the third job, then the first, then the second
        pool.futures[job_id].set_result(Done(job_id, files=(b"video %d" % job_id,)))
    assert jobs.get(ids[2]) is None  # finished first: gone once 3 are finished
    assert [jobs.get(i)["status"] for i in (ids[0], ids[1], ids[3])] == ["completed", "completed", "queued"]
    assert jobs.content(ids[1])[1] == b"video 1"
    assert jobs.delete(ids[0]) == {"id": ids[0], "object": "video.deleted", "deleted": True}
    assert jobs.get(ids[0]) is None


def test_a_video_request_to_an_image_pipeline_is_refused_naming_the_endpoint(tiny_flux_dir):
    import diffusers

    from dlo.pipelines.call_rules import read_call_rules
    from dlo.serve.requests import Limits, RequestError, VideoRequest, pipeline_kwargs

    rules = read_call_rules(tiny_flux_dir, diffusers.FluxPipeline)
    limits = Limits(max_images=1, max_steps=100, max_tokens=2**17, dtype_bytes=4, timeout_s=1.0)
    parameters = frozenset(inspect.signature(diffusers.FluxPipeline.__call__).parameters)
    with pytest.raises(RequestError, match="FluxPipeline makes images, not videos: use POST /v1/images/generations"):
        pipeline_kwargs(VideoRequest(prompt="a red cube"), rules, limits, parameters)


def _mappings(pid: int) -> list[dict]:
    """/proc/PID/smaps: each mapping's file ("path", "" if anonymous) and its sizes in bytes."""
    mappings: list[dict] = []
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping's header: range perms offset dev inode [path]
            mappings.append({"path": fields[5] if len(fields) > 5 else ""})
        elif len(fields) == 3 and fields[2] == "kB":
            mappings[-1][fields[0][:-1]] = int(fields[1]) * 1024
    return mappings


def _private_dirty(pid: int) -> int:
    return sum(mapping["Private_Dirty"] for mapping in _mappings(pid))


def test_two_replicas_map_one_copy_of_the_blocks_from_the_cache(server, wide_wan, tmp_path):
    """A server of the WIDE pipeline, 2 replicas through the host weight cache, each runs a job.

    Private_Dirty (what a process wrote itself: where a private copy of the blocks would be)
    of each wide replica, over a baseline: the most of the module's server's replicas, which
    run the same pipeline class, text encoder and VAE (same imports), with blocks of KBs:
        extra = Private_Dirty(wide replica) - max Private_Dirty(tiny replica)
    A replica that maps the blocks adds its 2 slots (2 x 16.8 MB), wider activations and
    allocator noise: extra measured 40-50 MB. One that holds its own copy adds every block
    as well (201.9 MB; extra measured 240-250 MB with --no-host-weight-cache
    --no-checkpoint-mmap). The bound is half the blocks: extra < blocks / 2 (101 MB).
    And per mapping (/proc/PID/smaps): the cache entry's file mapping of each replica holds
    every block page as Shared_Clean, i.e. pages the other replica maps too: one copy, two
    mappings (with --no-host-weight-cache no replica maps the cache, and this fails)."""
    directory, block_bytes = wide_wan
    baseline = max(_private_dirty(pid) for pid in call(f"{server.base}/health")[1]["replica_pids"])
    cache = tmp_path / "cache"
    with running_server(directory, cache, tmp_path, ["--replicas", "2", "--max-queue", "0"]) as (base, _, _):
        pids = call(f"{base}/health")[1]["replica_pids"]
        with _stopped(pids):  # both replicas idle at the 2 submits: one job each
            ids = [call(f"{base}/v1/videos", {**VIDEO, "seed": k})[1]["id"] for k in range(2)]
        for video_id in ids:
            job = _wait_for(base, video_id, lambda j: j["status"] not in ("queued", "running"), "finished")
            assert job["status"] == "completed"
        entries = [str(entry) for entry in (cache / "v1").iterdir()] if (cache / "v1").is_dir() else []
        for pid in pids:
            extra = _private_dirty(pid) - baseline
            assert extra < block_bytes / 2, (
                f"replica {pid}: Private_Dirty {extra / MB:.1f} MB over the baseline; the blocks are "
                f"{block_bytes / MB:.1f} MB: it holds a private copy"
            )
            shared = sum(m["Shared_Clean"] for m in _mappings(pid) if any(m["path"].startswith(e) for e in entries))
            assert shared >= block_bytes, (
                f"replica {pid}: {shared / MB:.1f} MB of the cache entry {entries} shared with the other replica; "
                f"the blocks are {block_bytes / MB:.1f} MB"
            )


def test_sigterm_drains_the_held_jobs_then_exits_0(server):
    """The module's last test: it stops the module's server. Both replicas stopped, 3 jobs
    held (2 running, 1 queued), a 4th request's headers sent (there is a place for it), then
    SIGTERM: once /health is 503 the 4th request's body comes, and it is refused 503 naming the
    drain (admission is the pool's, not decided at its headers), as is any new POST.
    Replica 0 resumes: its job and the queued one complete and can be fetched, while the
    server waits for replica 1's; that one resumes too, and the server exits 0 by itself."""
    base, process, _ = server
    pids = call(f"{base}/health")[1]["replica_pids"]
    with _stopped(pids[1:]):
        with _stopped(pids[:1]):
            ids = [call(f"{base}/v1/videos", {**VIDEO, "seed": k})[1]["id"] for k in range(3)]
            send_body = post_in_two_parts(base, "/v1/videos", VIDEO)
            time.sleep(0.5)  # the headers are read: the app has started on the request
            process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while call(f"{base}/health")[0] != 503:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            status, answer = send_body()
            assert status == 503 and "draining" in answer["error"]["message"]
            status, answer, _ = call(f"{base}/v1/videos", VIDEO)
            assert status == 503 and "draining" in answer["error"]["message"]
        deadline = time.monotonic() + 120
        while (done := [i for i in ids if call(f"{base}/v1/videos/{i}")[1]["status"] == "completed"]) != ids[::2]:
            assert len(done) < 2 and time.monotonic() < deadline, done
            time.sleep(0.1)
        assert fetch(f"{base}/v1/videos/{ids[0]}/content")[0] == 200
        assert process.poll() is None  # replica 1 still holds a job
    assert process.wait(timeout=60) == 0
    text = server.log.read_text()
    drain = [line for line in text.splitlines() if "dlo serve: SIGTERM" in line or "dlo serve: drained" in line
             or "dlo serve: stopped" in line]
    assert drain == [
        "INFO:     dlo serve: SIGTERM: draining: the 3 job(s) held finish, new jobs get 503",
        "INFO:     dlo serve: drained: every job held has finished; stopping",
        "INFO:     dlo serve: stopped; the replicas have exited",
    ]
