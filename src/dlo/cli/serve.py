"""`dlo serve`: an OpenAI-style image or video server whose replicas stream one pipeline with dlo.

Checks run before anything loads (the flags, `--devices`, the pipeline directory, its
components); then the replicas load (by default through the host weight cache, so a node's
replicas map one copy of the blocks), and uvicorn serves the app until interrupted, or until
SIGTERM's drain is over (serve_drain.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import threading

import torch

from dlo.cli.call_rules import read_call_rules
from dlo.cli.config_flags import config_from_flags, device_and_dtype
from dlo.cli.generate import pipeline_class
from dlo.cli.model_source import resolve_model
from dlo.cli.model_target import build_on_meta, check_resident_layers
from dlo.cli.pipeline_loading import check_components
from dlo.cli.serve_devices import replica_devices
from dlo.cli.serve_replica import ReplicaSpec
from dlo.errors import ConfigError


def run(args: argparse.Namespace) -> int:
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue {args.max_queue}: give 0 or more")
    if not args.timeout_s > 0 or args.timeout_s == float("inf"):
        raise ConfigError(f"--timeout-s {args.timeout_s}: give a number of seconds > 0")
    if not args.keep_videos_s > 0:
        raise ConfigError(f"--keep-videos-s {args.keep_videos_s}: give a number of seconds > 0")
    devices = replica_devices(args.devices, args.device, args.replicas)
    model_dir = resolve_model(args.model_dir, "dlo serve does not download")
    cls, index = pipeline_class(model_dir)
    device, dtype = device_and_dtype(args)
    config = config_from_flags(args)
    check_resident_layers(build_on_meta(str(model_dir)), config, "the transformer", dtype, device)
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
    pool = ReplicaPool(specs, args.max_queue, Metrics())
    try:
        endpoint = "/v1/videos" if "num_frames" in parameters else "/v1/images/generations"
        placement = ", ".join(devices) if devices else str(device)
        print(f"dlo serve: {cls.__name__} from {model_dir}, {args.replicas} replica(s) on {placement}; "
              f"http://{args.host}:{args.port}{endpoint}", flush=True)
        draining = threading.Event()
        videos = VideoJobs(pool, model_dir.name, args.keep_videos, args.keep_videos_s)
        app = make_app(pool, videos, rules, limits, parameters, model_dir.name, draining)
        http_config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
        server = DrainingServer(http_config, pool, draining)
        try:
            server.run()
        except KeyboardInterrupt:  # uvicorn raises Ctrl-C again once it has stopped: it was handled
            pass
    finally:
        pool.close()
    return 0
