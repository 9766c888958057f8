"""The HTTP server of `dlo serve`: bind the port, start the replica pool, serve the app.

The port is bound before the replicas start, so a port in use is refused before anything
loads; it listens only once they are ready. Then uvicorn serves the app on that socket until
interrupted, or until SIGTERM's drain is over (drain.py). SIGTERM while the replicas load stops
them, as Ctrl-C does.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
import uvicorn.logging

from dlo.errors import ConfigError
from dlo.pipelines.call_rules import CallRules
from dlo.serve.app import make_app
from dlo.serve.drain import DrainingServer
from dlo.serve.pool import Metrics, ReplicaPool
from dlo.serve.replica import ReplicaSpec
from dlo.serve.requests import Limits
from dlo.serve.videos import VideoJobs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSpec:
    """What one server serves: its replicas, the pipeline's rules, and the HTTP side's settings
    (each one a `dlo serve` flag)."""

    replicas: tuple[ReplicaSpec, ...]
    model_name: str
    rules: CallRules
    limits: Limits
    parameters: frozenset[str]  # the pipeline __call__'s argument names
    host: str
    port: int
    max_queue: int
    stall_s: float
    keep_videos: int
    keep_videos_s: float
    log_level: str = "info"  # of dlo serve's own lines and uvicorn's: debug, info, warning or error
    lora_scales: tuple[tuple[str, float], ...] = ()  # the replicas' LoRAs (each spec's loras), by name


def _refused_port(host: str, port: int, err: OSError) -> ConfigError:
    return ConfigError(
        f"--host {host} --port {port}: cannot serve there ({err.strerror or err}); give a free --port, "
        "or a --host address of this machine"
    )


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound (as uvicorn binds its own), or a ConfigError naming
    --host/--port. Not listening yet: connections during the load are refused at once rather
    than left waiting through it (see `listen`)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise _refused_port(host, port, err) from None
    return sock


def listen(sock: socket.socket, host: str, port: int) -> None:
    """Listen on the bound socket (uvicorn then serves it), or a ConfigError naming
    --host/--port: with SO_REUSEADDR, as servers set it, a second server binds a port the
    first has bound but not yet listened on, so the later one is refused only here."""
    try:
        sock.listen()
    except OSError as err:
        raise _refused_port(host, port, err) from None


def _interrupt(sig: int, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside (until uvicorn's own handlers take over): the
    pool's start unwinds and kills the replicas still loading, instead of this process dying
    and leaving them to load on."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def log_like_uvicorn(level: str) -> None:
    """dlo serve's own lines (the logger `dlo.serve`: one per request, the replicas' starts,
    deaths and restarts, the drain) printed as uvicorn prints its own, `INFO:     ...`, from
    `level` up; other libraries stay as quiet as the command line keeps them."""
    handler = logging.StreamHandler()
    handler.setFormatter(uvicorn.logging.DefaultFormatter("%(levelprefix)s %(message)s"))
    served = logging.getLogger("dlo.serve")
    served.handlers[:] = [handler]
    served.setLevel(level.upper())
    served.propagate = False  # not twice, through the command line's handler


def serve(spec: ServerSpec, description: str) -> None:
    """Serve until interrupted or drained; `description` (what is served, where) opens the line
    printed once the server listens."""
    log_like_uvicorn(spec.log_level)
    with bind(spec.host, spec.port) as sock, _sigterm_interrupts():
        pool = ReplicaPool(list(spec.replicas), spec.max_queue, Metrics(), stall_s=spec.stall_s)
        try:
            listen(sock, spec.host, spec.port)
            endpoint = "/v1/videos" if "num_frames" in spec.parameters else "/v1/images/generations"
            print(f"dlo serve: {description}; http://{spec.host}:{spec.port}{endpoint}", flush=True)
            videos = VideoJobs(pool, spec.model_name, spec.keep_videos, spec.keep_videos_s)
            app = make_app(
                pool, videos, spec.rules, spec.limits, spec.parameters, spec.model_name, dict(spec.lora_scales)
            )
            # uvicorn's access log off: the app logs each request with its seconds and job (app.py).
            config = uvicorn.Config(app, host=spec.host, port=spec.port, log_level=spec.log_level, access_log=False)
            server = DrainingServer(config, pool)
            try:
                server.run(sockets=[sock])
            except KeyboardInterrupt:  # uvicorn raises Ctrl-C again once it has stopped: it was handled
                pass
        finally:
            pool.close()
            logger.info("dlo serve: stopped; the replicas have exited")
