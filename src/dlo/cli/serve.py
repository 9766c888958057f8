"""`dlo serve`: the command line of dlo.serve, an OpenAI-style image or video server whose
replicas stream one pipeline with dlo.

Checks run before anything loads (the flags, `--devices`, the pipeline directory, its
components); then dlo.serve.server binds the port, starts the replicas (by default through the
host weight cache, so a node's replicas map one copy of the blocks) and serves.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path

import torch

from dlo.cli.config_flags import device_and_dtype
from dlo.cli.flag_checks import serve_config
from dlo.cli.model_source import check_gguf_kernels, checked_weight_files, is_hub_id, resolve_model
from dlo.cli.model_target import build_on_meta, check_config_for_model, checked_components, plan_from_configs
from dlo.pipelines.call_rules import read_call_rules
from dlo.pipelines.loading import check_components, pipeline_class
from dlo.serve.devices import replica_devices
from dlo.serve.replica import ReplicaSpec


def served_name(target: str) -> str:
    """The model's name in /v1/models and video objects: the hub id, or the directory's own
    name (`dlo serve .` too; a hub snapshot's directory is named by its commit)."""
    return target if is_hub_id(target) else Path(target).expanduser().resolve().name


def run(args: argparse.Namespace) -> int:
    """After flag_checks.check_serve (main runs it; the [serve] extra imports)."""
    devices = replica_devices(args.devices, args.device, args.replicas)
    model_name = served_name(args.model_dir)
    model_dir = resolve_model(args.model_dir, "dlo serve does not download")
    cls, index = pipeline_class(model_dir)
    device, dtype = device_and_dtype(args)
    config = serve_config(args)
    transformer = build_on_meta(str(model_dir))
    check_config_for_model(transformer, config, "the transformer", dtype, device)
    check_components(model_dir, index)
    streamed = checked_components(model_dir, cls, index, dtype, args.components)
    if config.hbm_budget_gib is not None:  # each replica plans for the pipeline's default size
        plan_from_configs(model_dir, cls, index, dtype, config, streamed=streamed)
    transformer_file, loras = checked_weight_files(
        args.transformer, args.lora, cls, transformer, "dlo serve does not download", args.converter_option
    )
    if args.gguf_kernels:
        check_gguf_kernels(transformer_file, device)
    rules = read_call_rules(model_dir, cls)
    # FastAPI and uvicorn: only for this command (flag_checks.check_serve_extra ran first).
    from dlo.serve.requests import Limits
    from dlo.serve.server import ServerSpec, serve

    limits = Limits(
        max_images=args.max_images,
        max_steps=args.max_steps,
        max_tokens=args.max_tokens,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        timeout_s=args.timeout_s,
    )
    spec = ReplicaSpec(
        str(model_dir), str(device), dtype, config, loras, str(transformer_file) if transformer_file else None,
        args.gguf_kernels, args.components, tuple(args.converter_option or ()),
    )
    specs = [dataclasses.replace(spec, device=d) for d in devices] if devices else [spec] * args.replicas
    server = ServerSpec(
        replicas=tuple(specs),
        model_name=model_name,
        rules=rules,
        limits=limits,
        parameters=frozenset(inspect.signature(cls.__call__).parameters),
        host=args.host,
        port=args.port,
        max_queue=args.max_queue,
        stall_s=args.stall_timeout_s,
        keep_videos=args.keep_videos,
        keep_videos_s=args.keep_videos_s,
        log_level=args.log_level,
        lora_scales=tuple((lora.name, lora.scale) for lora in loras),
    )
    placement = ", ".join(devices) if devices else str(device)
    serve(server, f"{cls.__name__} from {model_dir}, {args.replicas} replica(s) on {placement}")
    return 0
