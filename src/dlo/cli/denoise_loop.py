"""The demo's denoising-style loop, shared by `dlo demo` and its ranks (`--nproc`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dlo.pipelines.media_output import check_finite
from dlo.models.tiny import TinyModel


@dataclass(frozen=True)
class Trajectory:
    outputs: list[torch.Tensor]
    step_s: list[float]
    device_bytes: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def denoise(
    model: nn.Module, entry: TinyModel, steps: int, dtype: torch.dtype, device: torch.device, prompt_seed: int = 1,
    after_step: Callable[[int], None] | None = None,
) -> Trajectory:
    """A denoising-style loop: each step feeds the model's output back into the latent.
    `after_step(step)` runs after each step, outside its timing."""
    inputs = entry.inputs(seed=prompt_seed, dtype=dtype, device=device)
    latent = inputs.pop("hidden_states")
    outputs, step_s = [], []
    with torch.inference_mode():
        for step in range(steps):
            timestep = torch.full((1,), 1000.0 * (1 - step / steps), device=device)
            _sync(device)
            started = time.perf_counter()
            velocity = model(hidden_states=latent, **{**inputs, "timestep": timestep})[0]
            _sync(device)
            step_s.append(time.perf_counter() - started)
            latent = latent - velocity / steps
            outputs.append(velocity.cpu())
            if after_step is not None:
                after_step(step)
    return Trajectory(outputs, step_s, 0)


def check_trajectory(run: str, trajectory: Trajectory) -> None:
    """Refuse a run whose outputs hold NaN or infinity (NonFiniteOutput), naming the first such
    step: two such runs are never equal (NaN != NaN), and neither says anything about dlo."""
    for step, output in enumerate(trajectory.outputs, start=1):
        check_finite(f"the {run} run's output at step {step}", output)
