"""`dlo serve`: an OpenAI-style image or video server whose replicas stream one pipeline with dlo.

Checks run before anything loads (the flags, `--devices`, the pipeline directory, its
components, then the port: bound before the replicas start); then the replicas load (by
default through the host weight cache, so a node's replicas map one copy of the blocks), and
uvicorn serves the app on that socket until interrupted, or until SIGTERM's drain is over
(serve_drain.py). SIGTERM while the replicas load stops them, as Ctrl-C does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import torch

from dlo.cli.call_rules import read_call_rules
from dlo.cli.config_flags import config_from_flags, device_and_dtype
from dlo.cli.generate import pipeline_class
from dlo.cli.model_source import is_hub_id, resolve_model
from dlo.cli.model_target import build_on_meta, check_config_for_model
from dlo.cli.pipeline_loading import check_components
from dlo.cli.serve_devices import replica_devices
from dlo.cli.serve_replica import ReplicaSpec
from dlo.errors import ConfigError


def served_name(target: str) -> str:
    """The model's name in /v1/models and video objects: the hub id, or the directory's own
    name (`dlo serve .` too; a hub snapshot's directory is named by its commit)."""
    return target if is_hub_id(target) else Path(target).expanduser().resolve().name


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


def run(args: argparse.Namespace) -> int:
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue {args.max_queue}: give 0 or more")
    if not args.timeout_s > 0 or args.timeout_s == float("inf"):
        raise ConfigError(f"--timeout-s {args.timeout_s}: give a number of seconds > 0")
    if not args.keep_videos_s > 0:
        raise ConfigError(f"--keep-videos-s {args.keep_videos_s}: give a number of seconds > 0")
    if not 0 <= args.stall_timeout_s < float("inf"):
        raise ConfigError(f"--stall-timeout-s {args.stall_timeout_s}: give a number of seconds > 0, or 0 for never")
    devices = replica_devices(args.devices, args.device, args.replicas)
    model_name = served_name(args.model_dir)
    model_dir = resolve_model(args.model_dir, "dlo serve does not download")
    cls, index = pipeline_class(model_dir)
    device, dtype = device_and_dtype(args)
    config = config_from_flags(args)
    check_config_for_model(build_on_meta(str(model_dir)), config, "the transformer", dtype, device)
    check_components(model_dir, index)
    rules = read_call_rules(model_dir, cls)
    # FastAPI and uvicorn: only for this command.
    import uvicorn

    from dlo.cli.serve_app import make_app
    from dlo.cli.serve_drain import DrainingServer
    from dlo.cli.serve_pool import Metrics, ReplicaPool
    from dlo.cli.serve_requests import Limits
    from dlo.cli.serve_videos import VideoJobs

    limits = Limits(
        max_images=args.max_images,
        max_steps=args.max_steps,
        max_tokens=args.max_tokens,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        timeout_s=args.timeout_s,
    )
    parameters = frozenset(inspect.signature(cls.__call__).parameters)
    spec = ReplicaSpec(str(model_dir), str(device), dtype, config)
    specs = [dataclasses.replace(spec, device=d) for d in devices] if devices else [spec] * args.replicas
    with bind(args.host, args.port) as sock, _sigterm_interrupts():
        pool = ReplicaPool(specs, args.max_queue, Metrics(), stall_s=args.stall_timeout_s)
        try:
            listen(sock, args.host, args.port)
            endpoint = "/v1/videos" if "num_frames" in parameters else "/v1/images/generations"
            placement = ", ".join(devices) if devices else str(device)
            print(f"dlo serve: {cls.__name__} from {model_dir}, {args.replicas} replica(s) on {placement}; "
                  f"http://{args.host}:{args.port}{endpoint}", flush=True)
            videos = VideoJobs(pool, model_name, args.keep_videos, args.keep_videos_s)
            app = make_app(pool, videos, rules, limits, parameters, model_name)
            server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"), pool)
            try:
                server.run(sockets=[sock])
            except KeyboardInterrupt:  # uvicorn raises Ctrl-C again once it has stopped: it was handled
                pass
        finally:
            pool.close()
    return 0
