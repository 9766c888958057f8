"""A `dlo serve` process on 127.0.0.1 for the serve tests, and calls to it over real HTTP."""

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def call(url: str, body: dict | None = None, method: str | None = None) -> tuple[int, dict, object]:
    """(status, JSON body, headers: case-insensitive) of a GET (or `method`), or of a POST of `body`."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers


def fetch(url: str) -> tuple[int, bytes, object]:
    """(status, body bytes, headers) of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            return response.status, response.read(), response.headers
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers


def post_in_two_parts(base: str, path: str, body: dict):
    """POST `body` to `path` over a socket of its own: the headers now; returns send_body(),
    which sends the body and returns (status, JSON body) of the answer."""
    host, port = base.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    client = socket.create_connection((host, int(port)))
    client.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
    )

    def send_body() -> tuple[int, dict]:
        with client:
            client.sendall(payload)
            response = http.client.HTTPResponse(client)
            response.begin()
            return response.status, json.loads(response.read())

    return send_body


class Server(NamedTuple):
    base: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log: Path  # its stdout and stderr


def wait_healthy(process: subprocess.Popen, base: str, timeout_s: float) -> bool:
    """Whether the server at `base` answered /health with 200 before `process` exited or
    `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if call(f"{base}/health")[0] == 200:
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


@contextlib.contextmanager
def running_server(pipeline_dir, cache, log_dir, flags: list[str], cwd=None):
    """A `dlo serve` process (on the CPU, through the host weight cache in `cache`, with
    `flags`, in `cwd`); yields it once /health says 200, and stops it with Ctrl-C (exit status
    0) unless it has exited already."""
    port = free_port()
    argv = [
        sys.executable, "-m", "dlo.cli.main", "serve", str(pipeline_dir), "--device", "cpu", "--port", str(port),
        "--cache-dir", str(cache), "--cache-allow-any-filesystem", *flags,
    ]
    # Elsewhere than here, a relative PYTHONPATH (PYTHONPATH=src) would name nothing.
    paths = [str(Path(entry).resolve()) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    log = open(log_dir / "serve.log", "w+")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd, env=env)
    base = f"http://127.0.0.1:{port}"
    if not wait_healthy(process, base, timeout_s=180):
        log.seek(0)
        process.kill()
        pytest.fail(f"dlo serve did not come up (exit {process.poll()}):\n{log.read()}")
    try:
        yield Server(base, process, log_dir / "serve.log")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)  # uvicorn shuts down; the replicas are stopped
        assert process.wait(timeout=60) == 0
        log.close()
