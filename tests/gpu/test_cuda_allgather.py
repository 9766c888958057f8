"""All-gather mode on one GPU: with NCCL initialized and a group of one, it behaves as
rank-local streaming and issues no collective. (Several GPUs: a separate validation.)"""

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import dlo
from dlo.models.tiny import TINY_MODELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def nccl_world_of_one(tmp_path):
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["wan", "flux"])
def test_group_of_one_is_rank_local_without_collectives(nccl_world_of_one, name):
    entry = TINY_MODELS[name]
    reference = entry.build(seed=1, dtype=torch.bfloat16)
    streamed = copy.deepcopy(reference)
    reference.cuda()
    with torch.inference_mode():
        expected = [reference(**entry.inputs(s, torch.bfloat16, "cuda"))[0] for s in (1, 2, 3)]
    config = dlo.OffloadConfig(use_allgather=True, num_slots=3)
    with dlo.enable(streamed, "cuda", config) as handle, torch.inference_mode():
        got = [streamed(**entry.inputs(s, torch.bfloat16, "cuda"))[0] for s in (1, 2, 3)]
        stats = handle.stats()
        assert handle._runtime.gather.comm_stream is None  # no communication stream either
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.gather_group_size == 1 and stats.collectives == 0 and stats.copies > 0
