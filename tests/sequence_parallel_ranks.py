"""The reference for `dlo generate --parallel sp`: a tiny pipeline under diffusers' own context
parallelism, without dlo, in one Gloo rank (started by tests/test_generate_ranks.py)."""

from __future__ import annotations

import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from ordinary_tensors import ordinary_tensors


def reference_rank(rank: int, world: int, rendezvous: str, directory: str, name: str, seed: int, results) -> None:
    import diffusers

    from dlo.models.tiny_pipelines import GENERATE_DEFAULTS

    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        torch.accelerator.device_count = lambda: 1  # diffusers divides by it; 0 on a CPU-only machine
        pipe = diffusers.DiffusionPipeline.from_pretrained(directory)
        ordinary_tensors(*pipe.components.values())
        pipe.transformer.enable_parallelism(config=diffusers.ContextParallelConfig(ulysses_degree=world))
        with torch.inference_mode():
            result = pipe("a red cube", num_inference_steps=2, generator=torch.Generator().manual_seed(seed),
                          **GENERATE_DEFAULTS[name])
        results.put((rank, result.frames[0] if name == "wan" else result.images[0]))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
