"""Where the host waits in the hot path (README "Where the host waits"): the pinned and the
registered paths never synchronize the host with the device, per block or per call. Under
`torch.cuda.set_sync_debug_mode("error")` every synchronizing torch call raises."""

import copy
from contextlib import contextmanager

import pytest
import torch

import dlo
from dlo.models.tiny import TINY_MODELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@contextmanager
def synchronizing_calls_raise():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def calls(model, inputs):
    with torch.inference_mode():
        return [model(**kwargs)[0] for kwargs in inputs]


@pytest.mark.parametrize("name", ["wan", "flux"])
def test_streaming_from_pinned_memory_never_synchronizes_the_host(name):
    entry = TINY_MODELS[name]
    reference = entry.build(seed=0).cuda()
    streamed = copy.deepcopy(reference).cpu()
    inputs = [entry.inputs(seed, torch.float32, "cuda") for seed in (1, 2, 3)]  # made before: H2D of inputs
    with synchronizing_calls_raise():
        expected = calls(reference, inputs)  # the model itself is free of host syncs
    handle = dlo.enable(streamed, "cuda", dlo.OffloadConfig(num_slots=3))
    with synchronizing_calls_raise():
        got = calls(streamed, inputs)  # first call: demand load, probe; then steady calls
    handle.disable()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_streaming_from_a_registered_cache_never_synchronizes_the_host(tmp_path):
    pytest.importorskip("cuda.bindings.runtime")
    diffusers = pytest.importorskip("diffusers")
    entry = TINY_MODELS["wan"]
    entry.build(seed=4).save_pretrained(tmp_path / "wan")
    reference = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "wan").eval().cuda()
    config = dlo.OffloadConfig(
        host_weight_cache=True, cache_dir=str(tmp_path / "cache"), cache_allow_any_filesystem=True
    )
    model, plan = dlo.load_transformer(tmp_path / "wan", config)
    inputs = [entry.inputs(seed, torch.float32, "cuda") for seed in (1, 2, 3)]
    expected = calls(reference, inputs)
    handle = dlo.enable(model, "cuda", config, plan=plan)
    assert handle.stats().registered_bytes > 0
    with synchronizing_calls_raise():
        got = calls(model, inputs)
    handle.disable()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_the_guard_catches_a_host_sync():
    """What the tests above rely on: a synchronizing call raises under the guard."""
    value = torch.ones(4, device="cuda")
    with synchronizing_calls_raise(), pytest.raises(RuntimeError, match="synchroniz"):
        value.sum().item()


def test_fp8_streaming_never_synchronizes_the_host():
    """Float8 blocks: copies into the landing buffers, the dequantization stream's waits and
    kernels (compiled at enable()) are all enqueued without the host waiting."""
    entry = TINY_MODELS["flux"]
    model = entry.build(seed=0, dtype=torch.bfloat16)
    config = dlo.OffloadConfig(stream_dtype="fp8", num_slots=3)
    reference = copy.deepcopy(model).cuda()
    dlo.quantize_resident(reference, config)
    inputs = [entry.inputs(seed, torch.bfloat16, "cuda") for seed in (1, 2, 3)]
    with torch.inference_mode():
        expected = [reference(**kwargs)[0] for kwargs in inputs]
    handle = dlo.enable(model, "cuda", config)
    with synchronizing_calls_raise(), torch.inference_mode():
        got = [model(**kwargs)[0] for kwargs in inputs]
    handle.disable()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
