"""`dlo serve` as a real process on 127.0.0.1: a tiny Flux pipeline, one replica through the
host weight cache, requests over real HTTP (urllib), images compared with the plain pipeline."""

import base64
import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image

from dlo.models.tiny_pipelines import GENERATE_DEFAULTS
from nan_weights import poison
from plain_pipeline import plain_pipeline
from serve_process import call as _call
from serve_process import running_server

FLUX = GENERATE_DEFAULTS["flux"]
REQUEST = {
    "prompt": "a red cube",
    "size": f"{FLUX['width']}x{FLUX['height']}",
    "num_inference_steps": 2,
    "max_sequence_length": FLUX["max_sequence_length"],
    "guidance_scale": FLUX["guidance_scale"],
}
SLOW_STEPS = 400  # a request still in its denoising loop when the replica is killed (about 9 s here)
TIMEOUT_S = 5  # the server's --timeout-s: ordinary requests (under load too) do not time out


def _flags(max_queue: int, timeout_s: float) -> list[str]:
    return [
        "--max-queue", str(max_queue), "--max-images", "2", "--max-steps", str(SLOW_STEPS),
        "--timeout-s", str(timeout_s),
    ]


@pytest.fixture(scope="module")
def server_log_dir(tmp_path_factory):
    """Where the module's server writes its log (serve.log)."""
    return tmp_path_factory.mktemp("serve-log")


@pytest.fixture(scope="module")  # one server: under xdist the module runs on one worker (conftest.py)
def server(tiny_flux_dir, tiny_flux_loras, server_log_dir, tmp_path_factory):
    """Its replica holds three LoRAs: "style" and "speed", and "damaged", a copy of "style"
    with 8 bytes of NaN (test_an_image_from_non_finite_values_...); a request without a `lora`
    field runs the base model. --log-level warning: no line per request."""
    cache = tmp_path_factory.mktemp("serve-cache")
    damaged = tmp_path_factory.mktemp("damaged-lora") / "pytorch_lora_weights.safetensors"
    shutil.copyfile(tiny_flux_loras["a"], damaged)
    poison(damaged, "transformer.proj_out.lora_B.weight")  # the output projection's first channel: NaN
    loras = [
        "--lora", f"style={tiny_flux_loras['a']}:0.7", "--lora", f"speed={tiny_flux_loras['b'].parent}",
        "--lora", f"damaged={damaged}",
    ]
    flags = _flags(0, TIMEOUT_S) + loras + ["--log-level", "warning"]
    with running_server(tiny_flux_dir, cache, server_log_dir, flags) as running:
        yield running.base, cache


@pytest.fixture(scope="module")
def queue_server(server, tiny_flux_dir, tmp_path_factory):
    """A second server, with a queue place and a long timeout, on a copy of the pipeline (its
    last test breaks it), started as `dlo serve .` in that directory, on the first one's cache."""
    directory = tmp_path_factory.mktemp("pipelines") / "flux-copy"
    shutil.copytree(tiny_flux_dir, directory)
    log_dir = tmp_path_factory.mktemp("serve-queue-log")
    with running_server(".", server[1], log_dir, _flags(max_queue=1, timeout_s=120), cwd=directory) as running:
        yield running, directory


@pytest.fixture(scope="module")
def plain(tiny_flux_dir):
    """The plain pipeline, loaded once for the module's two comparisons (it is only called)."""
    return plain_pipeline(tiny_flux_dir)


def _image(item: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))).convert("RGB"))


def test_each_request_runs_the_loras_it_names_at_their_scales_and_unknown_ones_are_400(server, tiny_flux_dir, tiny_flux_loras):
    """Switched per job in one replica, without reloading: each image equals the plain
    pipeline with the same adapters; none named: the base model."""
    import warnings

    base, _ = server
    asked = [
        [{"name": "style"}, {"name": "speed", "scale": 0.4}],  # style at its --lora scale, 0.7
        [],
        [{"name": "speed"}],
        None,  # no field: the base model, after a job with a LoRA
    ]
    got = []
    for lora in asked:
        status, body, _ = _call(f"{base}/v1/images/generations", {**REQUEST, **({} if lora is None else {"lora": lora})})
        assert status == 200, body
        got.append(_image(body["data"][0]))
    pipe = plain_pipeline(tiny_flux_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.load_lora_weights(str(tiny_flux_loras["a"]), adapter_name="style")
        pipe.load_lora_weights(str(tiny_flux_loras["b"]), adapter_name="speed")

    def plain_with(adapters):
        if adapters:
            pipe.enable_lora()
            pipe.set_adapters([name for name, _ in adapters], [scale for _, scale in adapters])
        else:
            pipe.disable_lora()
        with torch.inference_mode():
            return np.asarray(pipe("a red cube", num_inference_steps=2, generator=torch.Generator().manual_seed(0), **FLUX).images[0])

    expected = [plain_with([("style", 0.7), ("speed", 0.4)]), plain_with([]), plain_with([("speed", 1.0)]), plain_with([])]
    assert not np.array_equal(expected[0], expected[1]) and not np.array_equal(expected[2], expected[1])
    assert [np.array_equal(a, b) for a, b in zip(got, expected)] == [True] * 4
    for lora, says in [
        ([{"name": "sharp"}], "lora: no LoRA named 'sharp' on this server; it has style, speed, damaged"),
        ([{"name": "style"}, {"name": "style", "scale": 0.1}], "lora: 'style' is given twice"),
        ([{"name": "style", "scale": 101.0}], "scale: Input should be less than or equal to 100"),
    ]:
        status, body, _ = _call(f"{base}/v1/images/generations", {**REQUEST, "lora": lora})
        assert status == 400 and body["error"]["param"] in ("lora", "scale") and says in body["error"]["message"], body


def test_images_equal_the_plain_pipeline_seed_by_seed(server, plain):
    base, cache = server
    status, body, _ = _call(f"{base}/v1/images/generations", {**REQUEST, "n": 2, "seed": 5})
    assert status == 200 and len(body["data"]) == 2
    pipe = plain
    for k, item in enumerate(body["data"]):
        with torch.inference_mode():
            expected = pipe(
                "a red cube", num_inference_steps=2, generator=torch.Generator().manual_seed(5 + k), **FLUX
            ).images[0]
        assert np.array_equal(_image(item), np.asarray(expected))
    assert len(list((cache / "v1").iterdir())) == 1  # the replica loaded through the cache


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (dict(prompt=None), "prompt"),
        (dict(size="63x64"), "size"),
        (dict(size="big"), "size"),
        (dict(n=3), "n"),
        (dict(n="two"), "n"),
        (dict(n="2"), "n"),  # strict: a string is no number, a boolean no count
        (dict(n=True), "n"),
        (dict(seed=2**64), "seed"),  # dlo generate's maximum, 2**64 - 1, plus one
        (dict(seed=2**64 - 1, n=2), "seed"),  # image 1 would use seed + 1
        (dict(num_inference_steps=SLOW_STEPS + 1), "num_inference_steps"),
        (dict(size="²x64"), "size"),
        (dict(seed=-1), "seed"),
        (dict(colour="red"), "colour"),
        (dict(guidance_scale=float("nan")), "guidance_scale"),  # json.dumps writes NaN, as json.loads reads it
        (dict(guidance_scale=float("-inf")), "guidance_scale"),
        (dict(guidance_scale=1e308), "guidance_scale"),
        (dict(negative_prompt="x" * 10_001), "negative_prompt"),
    ],
    ids=[
        "no-prompt", "size-multiple", "size-format", "n-over-max", "n-type", "n-string", "n-bool", "seed-over-max",
        "seed-plus-n-over-max", "steps-over-max", "size-unicode-digit",
        "seed-negative", "unknown-field", "guidance-nan", "guidance-minus-inf", "guidance-huge", "negative-prompt-long",
    ],
)
def test_bad_requests_are_400_naming_the_field(server, change, param):
    base, _ = server
    body = {k: v for k, v in {**REQUEST, **change}.items() if v is not None}
    status, answer, _ = _call(f"{base}/v1/images/generations", body)
    assert status == 400 and answer["error"]["param"] == param and answer["error"]["message"]


def test_a_size_refusal_names_the_size_asked_and_which_side_is_wrong(server):
    base, _ = server
    status, answer, _ = _call(f"{base}/v1/images/generations", {**REQUEST, "size": "65x64"})
    assert status == 400 and answer["error"]["param"] == "size"
    assert answer["error"]["message"] == (
        "size=65x64: the width 65: FluxPipeline takes positive multiples of 16 (16, 32, ...)"
    )


def test_the_largest_seed_and_a_null_response_format_are_taken(server):
    base, _ = server
    body = {**REQUEST, "seed": 2**64 - 1, "response_format": None, "num_inference_steps": 1}
    status, answer, _ = _call(f"{base}/v1/images/generations", body)
    assert status == 200 and len(answer["data"]) == 1, answer


def _start(base: str, body: dict) -> tuple[threading.Thread, dict]:
    """A request in a thread, returned once the server holds it (with one idle replica: once a
    replica has it)."""
    answer: dict = {}

    def call():
        answer["answer"] = _call(f"{base}/v1/images/generations", body)

    worker = threading.Thread(target=call)
    worker.start()
    deadline = time.monotonic() + 60
    while _call(f"{base}/health")[1]["pending"] == 0:
        assert time.monotonic() < deadline, "the request never reached the server"
        time.sleep(0.05)
    return worker, answer


def _resume_and_wait_idle(base, replica):
    """SIGCONT the stopped replica and wait until it finished its job (whose result is dropped)."""
    os.kill(replica, signal.SIGCONT)
    deadline = time.monotonic() + 120
    while _call(f"{base}/health")[1]["pending"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_full_queue_answers_429_and_a_timed_out_request_frees_its_slot_when_done(server):
    base, _ = server
    replica = _call(f"{base}/health")[1]["replica_pids"][0]
    # The replica is stopped (SIGSTOP) while it holds the request: the request outlasts the
    # timeout however fast the machine is, and nobody waits for a long job to finish.
    os.kill(replica, signal.SIGSTOP)
    try:
        worker, held = _start(base, REQUEST)
        status, answer, headers = _call(f"{base}/v1/images/generations", REQUEST)  # one replica, no queue
        assert status == 429 and int(headers["Retry-After"]) >= 1 and "queue is full" in answer["error"]["message"]
        # Checked before queueing: a bad request is a 400 even when there is no place for it.
        status, answer, _ = _call(f"{base}/v1/images/generations", {**REQUEST, "size": "63x64"})
        assert status == 400 and answer["error"]["param"] == "size"
        worker.join(timeout=120)
        assert held["answer"][0] == 504 and f"no result in {TIMEOUT_S} s" in held["answer"][1]["error"]["message"]
        # Timed out, but the replica still has the job: it keeps its place until done.
        assert _call(f"{base}/health")[1]["pending"] == 1
        assert _call(f"{base}/v1/images/generations", REQUEST)[0] == 429
    finally:
        _resume_and_wait_idle(base, replica)
    status, body, _ = _call(f"{base}/v1/images/generations", REQUEST)
    assert status == 200 and len(body["data"]) == 1


def _metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _send_raw(base: str, body: dict) -> socket.socket:
    """POST `body` over a socket of its own, left open: the caller hangs up by closing it."""
    host, port = base.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = f"POST /v1/images/generations HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    client = socket.create_connection((host, int(port)))
    client.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return client


def _wait_for_pending(base: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while _call(f"{base}/health")[1]["pending"] != count:
        assert time.monotonic() < deadline, f"pending never became {count}"
        time.sleep(0.05)


def test_a_client_that_hangs_up_stops_its_request_waiting(server):
    """The client closes its connection while the (stopped) replica holds its job: the
    server stops waiting at once (499 in /metrics, not a 504 after --timeout-s), and the
    job's result is dropped when the replica finishes it."""
    base, _ = server
    replica = _call(f"{base}/health")[1]["replica_pids"][0]
    before = _metrics(base)
    os.kill(replica, signal.SIGSTOP)
    try:
        client = _send_raw(base, REQUEST)
        _wait_for_pending(base, 1)
        client.close()
        deadline = time.monotonic() + 60
        while _metrics(base).get('dlo_serve_requests_total{status="499"}', 0) == before.get(
            'dlo_serve_requests_total{status="499"}', 0
        ):
            assert time.monotonic() < deadline, "the server never noticed the client left"
            time.sleep(0.05)
        after = _metrics(base)
        assert after.get('dlo_serve_requests_total{status="504"}', 0) == before.get('dlo_serve_requests_total{status="504"}', 0)
    finally:
        _resume_and_wait_idle(base, replica)
    assert _call(f"{base}/v1/images/generations", REQUEST)[0] == 200


def test_a_queued_request_whose_client_hangs_up_leaves_the_queue(queue_server):
    """The replica (stopped) holds one request, a second waits in the queue, its client hangs
    up, and the queue is empty again while the first request is still held."""
    (base, _, _), _ = queue_server
    replica = _call(f"{base}/health")[1]["replica_pids"][0]
    before = _metrics(base).get('dlo_serve_requests_total{status="499"}', 0)
    os.kill(replica, signal.SIGSTOP)
    try:
        worker, held = _start(base, REQUEST)
        client = _send_raw(base, REQUEST)
        _wait_for_pending(base, 2)
        assert _metrics(base)["dlo_serve_queue_depth"] == 1
        client.close()
        _wait_for_pending(base, 1)
        values = _metrics(base)
        assert values["dlo_serve_queue_depth"] == 0 and values['dlo_serve_requests_total{status="499"}'] == before + 1
    finally:
        os.kill(replica, signal.SIGCONT)
    worker.join(timeout=120)
    assert held["answer"][0] == 200


def test_models_names_the_directory_served_as_dot(queue_server):
    (base, _, _), directory = queue_server
    status, body, _ = _call(f"{base}/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [directory.name]


def test_metrics_count_requests_steps_and_what_each_replica_streams(server):
    """Deltas over one request (the module's server has served others): counted once each."""
    base, _ = server
    before = _metrics(base)
    assert _call(f"{base}/v1/images/generations", REQUEST)[0] == 200
    values = _metrics(base)

    def delta(name: str) -> float:
        return values.get(name, 0) - before.get(name, 0)

    assert delta('dlo_serve_requests_total{status="200"}') == 1
    assert delta("dlo_serve_steps_total") == REQUEST["num_inference_steps"]
    assert delta("dlo_serve_request_seconds_count") == 1
    assert delta('dlo_serve_replica_bytes_streamed{replica="0"}') > 0
    assert values['dlo_serve_replica_host_pss_bytes{replica="0"}'] > 0
    assert values["dlo_serve_queue_depth"] == 0 and values["dlo_serve_busy_replicas"] == 0


def test_models_lists_the_pipeline(server, tiny_flux_dir):
    base, _ = server
    status, body, _ = _call(f"{base}/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [tiny_flux_dir.name]


def _in_thread(base: str, body: dict) -> tuple[threading.Thread, dict]:
    """An image request in a thread; its (status, body, headers) in answer["answer"] once joined."""
    answer: dict = {}
    worker = threading.Thread(target=lambda: answer.update(answer=_call(f"{base}/v1/images/generations", body)))
    worker.start()
    return worker, answer


@contextlib.contextmanager
def _killed_at_the_end(replica: int):
    """The replica is stopped (SIGSTOP) inside, so the jobs it takes wait there, and killed
    (SIGKILL) at the end, also when the block fails (a stopped replica would hang the teardown)."""
    os.kill(replica, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(replica, signal.SIGKILL)


def test_a_replica_killed_mid_request_fails_only_that_request_and_comes_back(queue_server):
    """The replica (stopped) holds one request, a second is queued; the replica is killed: the
    first gets 500 saying so, the queued one waits for the restarted replica and gets its image."""
    (base, _, _), _ = queue_server
    before = _call(f"{base}/health")[1]
    with _killed_at_the_end(before["replica_pids"][0]):
        running, killed = _in_thread(base, REQUEST)
        _wait_for_pending(base, 1)
        queued, survivor = _in_thread(base, {**REQUEST, "seed": 3})
        _wait_for_pending(base, 2)
    running.join(timeout=120)
    status, answer, _ = killed["answer"]
    assert status == 500 and f"replica 0 died (exit code {-signal.SIGKILL})" in answer["error"]["message"]
    # Restarted: /health says 503 until the new replica has loaded.
    deadline = time.monotonic() + 120
    while (health := _call(f"{base}/health"))[0] != 200:
        assert health[0] == 503 and time.monotonic() < deadline
        time.sleep(0.2)
    assert health[1]["restarts"] == before["restarts"] + 1
    assert health[1]["replica_pids"][0] != before["replica_pids"][0]
    queued.join(timeout=120)
    status, body, _ = survivor["answer"]
    assert status == 200 and len(body["data"]) == 1
    # The log, in uvicorn's form: the death with its exit code and the job it took down (the
    # access lines name the same job ids), the restart, the new replica ready, each request.
    (_, _, log), _ = queue_server
    text = log.read_text()
    killed_job = re.search(r'"POST /v1/images/generations HTTP/1.1" 500 [\d.]+ s job (\d+)\n', text).group(1)
    old_pid, new_pid = before["replica_pids"][0], health[1]["replica_pids"][0]
    assert (f"WARNING:  dlo serve: replica 0 (pid {old_pid}) died (exit code {-signal.SIGKILL}) while running job "
            f"{killed_job}\n") in text
    assert f"INFO:     dlo serve: restarting replica 0 (restart {health[1]['restarts']})\n" in text
    assert f"INFO:     dlo serve: replica 0 ready (pid {new_pid})\n" in text
    assert re.search(r'INFO:     127\.0\.0\.1:\d+ - "POST /v1/images/generations HTTP/1\.1" 200 [\d.]+ s job \d+\n', text)


def test_once_every_replica_is_given_up_jobs_fail_and_are_refused_and_sigterm_exits(queue_server):
    """The queue server's last test. Its pipeline directory loses model_index.json, so every
    restart fails to load; the replica (stopped) holds one request, a second is queued, and
    the replica is killed. After 3 failed restarts: the queued request gets 500 saying no
    replica can run it, a new one 503, /health 503; the log says why the loads failed; and
    SIGTERM (nothing left to drain) exits 0."""
    (base, process, log), directory = queue_server
    (directory / "model_index.json").rename(directory / "model_index.json.away")
    with _killed_at_the_end(_call(f"{base}/health")[1]["replica_pids"][0]):
        running, killed = _in_thread(base, REQUEST)
        _wait_for_pending(base, 1)
        queued, refused = _in_thread(base, REQUEST)
        _wait_for_pending(base, 2)
    running.join(timeout=120)
    assert killed["answer"][0] == 500 and "it was restarted" in killed["answer"][1]["error"]["message"]
    queued.join(timeout=120)
    status, answer, _ = refused["answer"]
    assert status == 500 and "no replica can run jobs: each failed to load the pipeline 3 times" in answer["error"]["message"]
    status, answer, _ = _call(f"{base}/v1/images/generations", REQUEST)
    assert status == 503 and "no replica can run jobs" in answer["error"]["message"]
    assert _call(f"{base}/health")[0] == 503
    assert _call(f"{base}/v1/no-such-endpoint", REQUEST)[0] == 404  # only the job endpoints are refused
    assert "replica 0 could not load the pipeline:" in log.read_text()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


def test_a_field_the_pipeline_does_not_take_is_refused_naming_it(tiny_flux_dir):
    import diffusers

    from dlo.pipelines.call_rules import read_call_rules
    from dlo.serve.requests import ImageRequest, Limits, RequestError, pipeline_kwargs

    rules = read_call_rules(tiny_flux_dir, diffusers.FluxPipeline)
    limits = Limits(max_images=1, max_steps=100, max_tokens=2**17, dtype_bytes=4, timeout_s=1.0)
    request = ImageRequest(prompt="a red cube", negative_prompt="blurry")
    taken = {"prompt", "num_inference_steps", "height", "width", "max_sequence_length"}  # no negative_prompt
    with pytest.raises(RequestError, match="negative_prompt: FluxPipeline does not take it") as refused:
        pipeline_kwargs(request, rules, limits, frozenset(taken))
    assert refused.value.param == "negative_prompt"
    assert pipeline_kwargs(ImageRequest(prompt="a"), rules, limits, frozenset(taken)) == {
        "prompt": "a", "num_inference_steps": 28
    }


def test_max_sequence_length_is_bounded_where_the_pipeline_gives_no_default(tiny_flux_dir):
    """Flux's signature bounds it at 512; a pipeline whose default is None (HunyuanDiT) has
    only the request's own bound, the largest default of any diffusers pipeline (4096)."""
    import dataclasses

    import diffusers
    from pydantic import ValidationError

    from dlo.pipelines.call_rules import read_call_rules
    from dlo.serve.requests import ImageRequest, Limits, pipeline_kwargs

    rules = dataclasses.replace(read_call_rules(tiny_flux_dir, diffusers.FluxPipeline), max_sequence_length=None)
    limits = Limits(max_images=1, max_steps=100, max_tokens=2**17, dtype_bytes=4, timeout_s=1.0)
    taken = frozenset({"prompt", "num_inference_steps", "max_sequence_length"})
    request = ImageRequest(prompt="a", max_sequence_length=4096)
    assert pipeline_kwargs(request, rules, limits, taken)["max_sequence_length"] == 4096
    with pytest.raises(ValidationError, match="max_sequence_length"):
        ImageRequest(prompt="a", max_sequence_length=4097)


def test_the_openai_client_gets_the_plain_pipelines_image(server, tiny_flux_dir, plain):
    import openai

    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    answer = client.images.generate(
        model=tiny_flux_dir.name, prompt="a red cube", size=REQUEST["size"], n=1, response_format="b64_json",
        extra_body={"seed": 11, "num_inference_steps": 2, "max_sequence_length": FLUX["max_sequence_length"],
                    "guidance_scale": FLUX["guidance_scale"]},
    )
    with torch.inference_mode():
        expected = plain(
            "a red cube", num_inference_steps=2, generator=torch.Generator().manual_seed(11), **FLUX
        ).images[0]
    assert len(answer.data) == 1 and np.array_equal(_image({"b64_json": answer.data[0].b64_json}), np.asarray(expected))


def test_devices_are_assigned_round_robin():
    from dlo.serve.devices import round_robin

    assert round_robin([0, 1], 5) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert round_robin([2, 0, 1], 2) == ["cuda:2", "cuda:0"]


@pytest.mark.parametrize(
    ("flags", "cuda_devices", "message"),
    [
        (["--devices", "0,1"], 0, "--devices 0,1: this torch sees no CUDA device; leave --devices out"),
        (["--devices", "0,2"], 2, "--devices 0,2: there are 2 CUDA device(s), indices 0 to 1"),
        (["--devices", "0,x"], 2, "--devices '0,x': give CUDA device indices separated by commas"),
        (["--devices", "0", "--device", "cpu"], 2, "--devices 0 with --device cpu: give one of them"),
        (["--devices", "0,1,2,3"], 4, "--devices 0,1,2,3 with --replicas 3: 1 listed device(s) would get no replica"),
    ],
    ids=["no-cuda", "index-too-high", "not-indices", "with-device", "more-devices-than-replicas"],
)
def test_devices_that_cannot_be_honoured_are_refused_before_anything_loads(
    flags, cuda_devices, message, monkeypatch, capsys, tmp_path
):
    """The model directory does not exist: the refusal names --devices, so it came first."""
    from dlo.cli.main import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_devices)
    assert main(["serve", str(tmp_path / "missing"), "--replicas", "3", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_an_image_from_non_finite_values_fails_its_request_naming_it_and_log_level_quiets_the_log(
    server, server_log_dir
):
    """A request with the module server's "damaged" LoRA (8 bytes of NaN in its weights, as a
    bad disk or copy leaves them; formerly a server of its own on a transformer file so
    damaged): the request gets 500 naming the non-finite values (not a black PNG), and the
    replica serves on. With --log-level warning the log has no line per request."""
    base, _ = server
    status, answer, _ = _call(f"{base}/v1/images/generations", {**REQUEST, "lora": [{"name": "damaged"}]})
    assert status == 500
    assert "NonFiniteOutput: the generated image has 12288 non-finite values (NaN or infinity) of 12288" in (
        answer["error"]["message"]
    )
    assert _call(f"{base}/health")[0] == 200  # the replica serves on
    assert _call(f"{base}/v1/images/generations", REQUEST)[0] == 200
    text = (server_log_dir / "serve.log").read_text()
    assert "POST /v1/images/generations" not in text and "dlo serve: replica 0 ready" not in text
