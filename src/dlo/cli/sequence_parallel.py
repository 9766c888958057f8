"""`dlo generate --parallel sp`: what diffusers' context parallelism can split, checked from
configs before anything loads, and turning it on in each rank before dlo streams."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from dlo.backend.pipeline import STREAMED_COMPONENTS
from dlo.cli.parallel_run import Parallel, ParallelRun
from dlo.errors import ConfigError
from dlo.host.checkpoint import read_json_object
from dlo.pipelines.call_rules import CallRequest, CallRules, requested_size, size_text, tokens


def _splits_text(cp_plan: dict) -> bool:
    """Whether a transformer's context-parallel plan splits the text sequence too (Flux's does)."""
    return any(isinstance(inputs, dict) and "encoder_hidden_states" in inputs for inputs in cp_plan.values())


def check_sequence_split(run: ParallelRun, model_dir: Path, index: dict, rules: CallRules, request: CallRequest) -> None:
    """Refuse, naming the flag to change, an SP run diffusers' context parallelism cannot split:
    ring attention on an attention backend without log-sum-exp, a transformer without a
    context-parallel plan, heads Ulysses cannot divide, or a sequence (image tokens, and text
    tokens where the plan splits them) not a multiple of the ranks."""
    if run.mode is not Parallel.SP:
        return
    import diffusers

    backend = os.environ.get("DIFFUSERS_ATTN_BACKEND", "native")
    if run.ring_degree > 1 and backend == "native":
        raise ConfigError(
            f"--ring {run.ring_degree}: ring attention merges partial results by their log-sum-exp, which diffusers' "
            "default attention backend (native, torch SDPA) does not return; set DIFFUSERS_ATTN_BACKEND (e.g. "
            "_native_cudnn or flash on cuda) or use --ulysses"
        )
    for name in STREAMED_COMPONENTS:
        if not index.get(name) or index[name][1] is None:
            continue
        class_name = index[name][1]
        plan = getattr(getattr(diffusers, class_name, None), "_cp_plan", None)
        if plan is None:
            raise ConfigError(
                f"--parallel sp: {class_name} ({name}) has no context-parallel plan in diffusers "
                f"{diffusers.__version__}, so enable_parallelism cannot split its sequence; use --parallel dp"
            )
        heads = read_json_object(model_dir / name / "config.json").get("num_attention_heads")
        if run.ulysses_degree > 1 and isinstance(heads, int) and heads % run.ulysses_degree:
            raise ConfigError(
                f"Ulysses over {run.ulysses_degree} ranks (--ulysses, default --nproc): {class_name} has {heads} "
                f"attention heads and Ulysses gives each rank an equal share; use a --ulysses that divides {heads} "
                "(with --ring for the rest of --nproc), or --ring alone"
            )
        if _splits_text(plan):
            text = request.max_sequence_length or rules.max_sequence_length
            if text is not None and text % run.nproc:
                raise ConfigError(
                    f"--max-sequence-length {text}: {class_name} splits the text tokens across the {run.nproc} ranks "
                    f"too; use a multiple of {run.nproc}"
                )
    height, width, frames = requested_size(rules, request)
    image = tokens(rules, height, width, frames)
    if image % run.nproc:
        flags = "--height/--width" + ("/--frames" if rules.temporal_multiple else "")
        raise ConfigError(
            f"{flags} {size_text(rules, height, width, frames)}: {image} transformer tokens do not split evenly across "
            f"{run.nproc} ranks; choose a size whose token count is a multiple of {run.nproc}"
        )


def enable_context_parallel(pipe: object, run: ParallelRun, device: torch.device) -> None:
    """diffusers' context parallelism on every transformer of `pipe`, before dlo streams it:
    dlo then all-gathers each block over its sequence-parallel group."""
    import diffusers

    if device.type == "cpu" and torch.accelerator.device_count() == 0:
        # diffusers 0.42's enable_parallelism puts rank r on device r % device_count(): a
        # division by zero without an accelerator. This process is one rank of a CPU run.
        torch.accelerator.device_count = lambda: 1
    for name in STREAMED_COMPONENTS:
        module = getattr(pipe, name, None)
        if isinstance(module, nn.Module):
            config = diffusers.ContextParallelConfig(ulysses_degree=run.ulysses_degree, ring_degree=run.ring_degree)
            module.enable_parallelism(config=config)
