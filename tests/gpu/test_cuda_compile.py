"""torch.compile with streaming on CUDA (inductor, Triton kernels, the real copy stream): the
same parity and no-recompile checks as tests/test_compile.py. See [Note: compiled blocks]"""

import copy

import pytest
import torch
import torch._dynamo
import torch._inductor.config

import dlo
from dlo.hotpath.compiled_call import CompileWatch, isolate
from dlo.models.tiny import TINY_MODELS, TinyModel
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


def regional_runs(entry, dtype, mode):
    """Compiled regionally with `mode`: the resident model's outputs and compile counts, then the
    streamed model's outputs and stats (compiled after enable()), and the streamed model."""
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
    expected, resident_counts, got, stats, streamed = regional_runs(TINY_MODELS[name], dtype, "default")
    assert identical(expected, got)
    assert (stats.compile.graphs, stats.compile.recompiles, stats.compile.graph_breaks) == resident_counts
    assert stats.pinned and stats.demand_loads == 1
    # After disable(): still compiled; streamed blocks hold CPU tensors again, moved back to run resident.
    assert identical(expected, outputs(streamed.cuda(), TINY_MODELS[name], dtype))


def _flux_width_inputs(g, dtype, device):
    """1024² of Flux latents (64 x 64 tokens) and 512 text tokens, as in docs/benchmarks.md."""
    image_ids = torch.zeros(64, 64, 3)
    image_ids[..., 1] = torch.arange(64)[:, None]
    image_ids[..., 2] = torch.arange(64)[None, :]
    return dict(
        hidden_states=torch.randn(1, 4096, 64, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(1, 512, 256, generator=g).to(device, dtype),
        pooled_projections=torch.randn(1, 64, generator=g).to(device, dtype),
        timestep=torch.rand(1, generator=g).to(device),
        img_ids=image_ids.reshape(-1, 3).to(device),
        txt_ids=torch.zeros(512, 3, device=device),
        return_dict=False,
    )


# Flux's block width (24 heads x 128) and sequence, one block of each kind: at this size inductor
# chose a fused RMSNorm kernel's R0_BLOCK by timing, differently from one compilation to the next.
FLUX_WIDTH = TinyModel(
    "flux-width",
    "FluxTransformer2DModel",
    dict(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=256, pooled_projection_dim=64, axes_dims_rope=(16, 56, 56),
    ),
    _flux_width_inputs,
)


@pytest.fixture
def deterministic_kernels(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        with torch._inductor.config.patch(deterministic=True):
            yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_regional_compile_at_flux_width_matches_compiled_resident_with_deterministic_kernels(deterministic_kernels):
    """The README's condition for bit identity at full width: kernels not chosen by timing."""
    expected, resident_counts, got, stats, _ = regional_runs(FLUX_WIDTH, torch.bfloat16, "default")
    assert identical(expected, got)
    assert (stats.compile.graphs, stats.compile.recompiles, stats.compile.graph_breaks) == resident_counts


@pytest.mark.parametrize("name", ["wan", "flux"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_autotune_streams_with_the_resident_graphs_but_not_bit_identically_on_cuda(name, dtype):
    """mode="max-autotune-no-cudagraphs": the same graphs, no recompile, outputs within rounding,
    but not torch.equal to the compiled resident model (H200, torch 2.11, 2026-11-30: 1 of 4 cases
    differed in one run, 3 of 4 in another run under inductor's deterministic mode; the cause is
    not known). Issue 14."""
    expected, resident_counts, got, stats, _ = regional_runs(TINY_MODELS[name], dtype, "max-autotune-no-cudagraphs")
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
