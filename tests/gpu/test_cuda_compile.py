"""torch.compile with streaming on CUDA (inductor, Triton kernels, the real copy stream): the
same parity and no-recompile checks as tests/test_compile.py. See [Note: compiled blocks]"""

import copy

import pytest
import torch
import torch._dynamo
import torch._inductor.config

import dlo
from dlo.hotpath.compiled_call import CompileWatch, isolate
from dlo.models.tiny import TINY_MODELS
from dlo.planning.offload_plan import resolve_blocks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SEEDS = [1, 2]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Inductor in deterministic mode: otherwise two compilations of one model may pick
    different kernels by timing them (Triton configs of reductions, max-autotune's GEMMs) and
    round differently (seen: max-autotune Wan fp32 failed one run in two), and the comparison
    would be of the autotuner, not of dlo."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(deterministic=True):
        yield
    torch._dynamo.reset()


def outputs(model, entry, dtype):
    with torch.inference_mode():
        return [model(**entry.inputs(seed, dtype, "cuda"))[0] for seed in SEEDS]


def identical(expected, got):
    return len(expected) == len(got) and all(torch.equal(a, b) for a, b in zip(expected, got))


def counts(watch):
    watch.poll()
    return watch.graphs, watch.recompiles, watch.graph_breaks


@pytest.mark.parametrize("name", ["wan", "flux"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_regional_compile_streamed_matches_compiled_resident_on_cuda(name, dtype, mode):
    entry = TINY_MODELS[name]
    reference = entry.build(seed=0, dtype=dtype)
    streamed = copy.deepcopy(reference)
    watch = CompileWatch()
    reference.cuda().compile_repeated_blocks(fullgraph=True, mode=mode)
    expected = outputs(reference, entry, dtype)
    resident_counts = counts(watch)
    torch._dynamo.reset()

    with dlo.enable(streamed, "cuda") as handle:
        streamed.compile_repeated_blocks(fullgraph=True, mode=mode)
        got = outputs(streamed, entry, dtype)
        stats = handle.stats()
    assert identical(expected, got)
    assert (stats.compile.graphs, stats.compile.recompiles, stats.compile.graph_breaks) == resident_counts
    assert stats.pinned and stats.demand_loads == 1
    # After disable(): still compiled; streamed blocks hold CPU tensors again, moved back to run resident.
    assert identical(expected, outputs(streamed.cuda(), entry, dtype))


@pytest.mark.parametrize("name", ["wan", "flux"])
def test_whole_model_compile_streamed_matches_resident_compiled_with_the_same_boundaries_on_cuda(name):
    entry = TINY_MODELS[name]
    reference = entry.build(seed=0, dtype=torch.bfloat16)
    streamed = copy.deepcopy(reference)
    isolate([ref.module for ref in resolve_blocks(reference, dlo.discover(reference))])
    watch = CompileWatch()
    expected = outputs(torch.compile(reference.cuda()), entry, torch.bfloat16)
    resident_counts = counts(watch)
    torch._dynamo.reset()

    compiled = torch.compile(streamed)
    with dlo.enable(streamed, "cuda") as handle:
        got = outputs(compiled, entry, torch.bfloat16)
        stats = handle.stats()
    assert identical(expected, got)
    assert (stats.compile.graphs, stats.compile.recompiles, stats.compile.graph_breaks) == resident_counts


def test_cuda_graphs_are_refused_on_cuda():
    entry = TINY_MODELS["wan"]
    streamed = entry.build(seed=0, dtype=torch.bfloat16)
    with dlo.enable(streamed, "cuda"):
        streamed.compile_repeated_blocks(fullgraph=True, mode="reduce-overhead")
        with pytest.raises(dlo.StreamingError, match="reduce-overhead"):
            outputs(streamed, entry, torch.bfloat16)
