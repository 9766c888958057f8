"""`dlo serve`: an OpenAI-style image server whose replicas stream one pipeline with dlo.

Checks run before anything loads (the pipeline directory, its components, an image pipeline);
then the replicas load (by default through the host weight cache, so a node's replicas map
one copy of the blocks), and uvicorn serves the app until interrupted.
"""

from __future__ import annotations

import argparse
import inspect

import torch

from dlo.cli.call_rules import read_call_rules
from dlo.cli.config_flags import config_from_flags, device_and_dtype
from dlo.cli.generate import pipeline_class
from dlo.cli.model_source import resolve_model
from dlo.cli.model_target import build_on_meta, check_resident_layers
from dlo.cli.pipeline_loading import check_components
from dlo.cli.serve_replica import ReplicaSpec
from dlo.errors import ConfigError


def run(args: argparse.Namespace) -> int:
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue {args.max_queue}: give 0 or more")
    if not args.timeout_s > 0 or args.timeout_s == float("inf"):
        raise ConfigError(f"--timeout-s {args.timeout_s}: give a number of seconds > 0")
    model_dir = resolve_model(args.model_dir, "dlo serve does not download")
    cls, index = pipeline_class(model_dir)
    if "num_frames" in inspect.signature(cls.__call__).parameters:
        raise ConfigError(f"{cls.__name__} makes videos; dlo serve has no video endpoints yet (use dlo generate)")
    device, dtype = device_and_dtype(args)
    config = config_from_flags(args)
    check_resident_layers(build_on_meta(str(model_dir)), config, "the transformer", dtype, device)
    check_components(model_dir, index)
    rules = read_call_rules(model_dir, cls)
    from dlo.cli.serve_app import Limits, Metrics, ReplicaPool, make_app  # FastAPI: only for this command

    limits = Limits(
        max_images=args.max_images,
        max_steps=args.max_steps,
        max_tokens=args.max_tokens,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        timeout_s=args.timeout_s,
    )
    parameters = frozenset(inspect.signature(cls.__call__).parameters)
    spec = ReplicaSpec(str(model_dir), str(device), dtype, config)
    pool = ReplicaPool(spec, args.replicas, args.max_queue, Metrics())
    try:
        import uvicorn

        print(f"dlo serve: {cls.__name__} from {model_dir}, {args.replicas} replica(s) on {device}; "
              f"http://{args.host}:{args.port}/v1/images/generations", flush=True)
        # Ctrl-C or SIGTERM: uvicorn stops accepting and waits for the requests in flight; then
        # the replicas are stopped (finally).
        app = make_app(pool, rules, limits, parameters, model_dir.name)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        pool.close()
    return 0
