"""A T5 encoder on CUDA whose token embedding looks its rows up on the host (See [Note: token
embeddings looked up on the host]): equal to the encoder run resident on the device, bf16 and
fp32, and the embedding's table never allocated on the device."""

import copy
import sys
from pathlib import Path

import pytest
import torch

import dlo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_host_lookups import EMBEDDING, PLAN, t5_encoder  # noqa: E402

VOCAB = 320


def encode(model, seed, device):
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed)).to(device)
    with torch.inference_mode():
        return model(ids).last_hidden_state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_embedding_looked_up_on_the_host_equals_the_encoder_resident_on_cuda(dtype):
    weights = t5_encoder().to(dtype)
    resident = copy.deepcopy(weights).to("cuda")
    expected = [encode(resident, seed, "cuda") for seed in range(3)]
    del resident
    torch.cuda.empty_cache()
    table = weights.get_submodule(EMBEDDING).weight
    table_bytes = table.numel() * table.element_size()

    model = copy.deepcopy(weights)
    with dlo.enable(model, "cuda", plan=PLAN) as handle:
        seen = []  # where the lookup ran, and where its output went
        model.get_submodule(EMBEDDING).register_forward_hook(lambda module, args, out: seen.append((module.weight.device, out.device)))
        got = [encode(model, seed, "cuda") for seed in range(3)]
        slots = [queue.state.size for queue in handle._runtime.queues]
        pinned = [block.source.pinned for block in handle._runtime.blocks]
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert pinned == [False] + [True] * (len(pinned) - 1)  # the table never crosses the link: not page-locked
    assert seen == [(torch.device("cpu"), torch.device("cpu"))] * 3  # the rows go to the device with the layers' inputs
    assert max(slots) < table_bytes  # no slot was ever sized for the table


def test_with_single_blocks_of_a_pipeline_encoder_on_cuda_looks_its_embedding_up_on_the_host():
    """The plan dlo.enable_pipeline makes for a streamed text encoder, on CUDA: the bytes that
    crossed the link are the layers' alone."""
    from dlo.planning.offload_plan import with_single_blocks

    weights = t5_encoder()
    expected = encode(copy.deepcopy(weights).to("cuda"), 0, "cuda")
    model = copy.deepcopy(weights)
    plan = with_single_blocks(model, dlo.OffloadPlan(block_lists=("encoder.block",)), min_bytes=1)
    assert plan.host_lookups == (EMBEDDING,)
    with dlo.enable(model, "cuda", plan=plan) as handle:
        encode(model, 0, "cuda")  # the first call also prefetches the next call's first layer
        before = handle.stats().bytes_streamed
        got = encode(model, 0, "cuda")
        copied = handle.stats().bytes_streamed - before
        runtime = handle._runtime
        layers = sum(runtime.loads.link_bytes(i) for i, block in enumerate(runtime.blocks) if not block.on_host)
    assert torch.equal(got, expected)
    assert copied == layers
