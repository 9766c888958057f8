"""torch.compile with streaming on CUDA (inductor, Triton kernels, the real copy stream): the
same parity and no-recompile checks as tests/test_compile.py. See [Note: compiled blocks]"""

import copy

import pytest
import torch
import torch._dynamo

import dlo
from dlo.hotpath.compiled_call import CompileWatch, isolate
from dlo.models.tiny import TINY_MODELS
from dlo.planning.offload_plan import resolve_blocks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SEEDS = [1, 2]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
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


def regional_runs(name, dtype, mode):
    """Compiled regionally with `mode`: the resident model's outputs and compile counts, then the
    streamed model's outputs and stats (compiled after enable()), and the streamed model."""
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
    return expected, resident_counts, got, stats, streamed


@pytest.mark.parametrize("name", ["wan", "flux"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_regional_compile_streamed_matches_compiled_resident_on_cuda(name, dtype):
    expected, resident_counts, got, stats, streamed = regional_runs(name, dtype, "default")
    assert identical(expected, got)
    assert (stats.compile.graphs, stats.compile.recompiles, stats.compile.graph_breaks) == resident_counts
    assert stats.pinned and stats.demand_loads == 1
    # After disable(): still compiled; streamed blocks hold CPU tensors again, moved back to run resident.
    assert identical(expected, outputs(streamed.cuda(), TINY_MODELS[name], dtype))


@pytest.mark.parametrize("name", ["wan", "flux"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_autotune_streams_with_the_resident_graphs_but_not_bit_identically_on_cuda(name, dtype):
    """mode="max-autotune-no-cudagraphs": the same graphs, no recompile, outputs within rounding,
    but not torch.equal to the compiled resident model (H200, torch 2.11, 2026-11-30: 1 of 4 cases
    differed in one run, 3 of 4 in another run under inductor's deterministic mode; the cause is
    not known). Issue 14."""
    expected, resident_counts, got, stats, _ = regional_runs(name, dtype, "max-autotune-no-cudagraphs")
    tolerance = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    assert all(torch.allclose(a, b, **tolerance) for a, b in zip(expected, got))
    assert (stats.compile.graphs, stats.compile.recompiles, stats.compile.graph_breaks) == resident_counts


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
