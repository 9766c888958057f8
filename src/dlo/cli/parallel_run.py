"""`dlo generate --nproc N --parallel {dp,sp}`: the flags' rules, checked from configs alone
before anything loads, and what each rank does differently.

dp: every rank runs the whole call, rank r with seed + r, and writes its own output.
sp: every rank runs the same call on its slice of the transformer's sequence (diffusers'
context parallelism: Ulysses and/or ring attention over all N ranks); rank 0 writes the output.
"""

from __future__ import annotations

import argparse
import enum
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dlo.backend.pipeline import STREAMED_COMPONENTS
from dlo.errors import ConfigError
from dlo.host.checkpoint import read_json_object
from dlo.pipelines.call_rules import CallRequest, CallRules, requested_size, size_text, tokens


class Parallel(enum.Enum):
    DP = "dp"
    SP = "sp"


@dataclass(frozen=True)
class ParallelRun:
    """How many ranks and how they split the work; `mode` None: one process."""

    nproc: int = 1
    mode: Parallel | None = None
    ulysses_degree: int = 1
    ring_degree: int = 1

    def seed(self, seed: int, rank: int) -> int:
        """DP ranks make different outputs; SP ranks share one call, so one seed."""
        return seed + rank if self.mode is Parallel.DP else seed

    def output(self, output: Path, rank: int) -> Path | None:
        """Where `rank` writes: its own file in DP (`out.rank1.png`), only rank 0 in SP."""
        if self.mode is Parallel.DP:
            return output.with_name(f"{output.stem}.rank{rank}{output.suffix}")
        return output if rank == 0 else None

    def outputs(self, output: Path) -> list[Path]:
        return [path for rank in range(self.nproc) if (path := self.output(output, rank)) is not None]


def parallel_run_from_flags(args: argparse.Namespace) -> ParallelRun:
    """The run `--nproc`, `--parallel`, `--ulysses` and `--ring` ask for, or the first broken rule."""
    nproc, ulysses, ring = args.nproc, args.ulysses, args.ring
    mode = Parallel(args.parallel) if args.parallel else None
    given = " ".join(f"{flag} {value}" for flag, value in (("--ulysses", ulysses), ("--ring", ring)) if value)
    if given and mode is not Parallel.SP:
        raise ConfigError(f"{given}: the degrees of sequence parallelism need --parallel sp")
    if nproc > 1 and mode is None:
        raise ConfigError(
            f"--nproc {nproc}: say how the ranks split the work, --parallel dp (an output per rank, seed + rank) "
            "or --parallel sp (one output, the sequence split across the ranks)"
        )
    if mode is not None and nproc < 2:
        raise ConfigError(f"--parallel {mode.value} needs --nproc N with N >= 2 ranks")
    if mode is not Parallel.SP:
        return ParallelRun(nproc, mode)
    if not given:
        ulysses = nproc  # Ulysses over every rank: one all-to-all per attention, no ring passes
    ulysses, ring = ulysses or 1, ring or 1
    if ulysses * ring != nproc:
        raise ConfigError(f"{given}: the sequence-parallel degrees multiply to {ulysses * ring}, not --nproc {nproc}")
    return ParallelRun(nproc, mode, ulysses, ring)


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
