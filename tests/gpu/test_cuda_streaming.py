"""The same parity checks on CUDA, with the real copy stream, events and pinned memory."""

import copy
import gc

import pytest
import torch
from torch import nn

import dlo
from dlo.host import pinned_buffer
from dlo.models.tiny import TINY_MODELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def outputs(model, entry, seeds, dtype, **extra):
    with torch.inference_mode():
        return [model(**entry.inputs(seed, dtype, "cuda"), **extra)[0] for seed in seeds]


def pair(name, dtype):
    entry = TINY_MODELS[name]
    reference = entry.build(seed=0, dtype=dtype)
    return reference.cuda(), copy.deepcopy(reference).cpu(), entry


@pytest.mark.parametrize("name", ["wan", "flux", "sd3", "qwenimage", "hunyuanvideo", "ltx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_slots", "resident_layers"), [(2, 0), (3, 1)])
def test_streamed_matches_resident_on_cuda(name, dtype, num_slots, resident_layers):
    reference, streamed, entry = pair(name, dtype)
    seeds = [1, 2, 3, 4]
    expected = outputs(reference, entry, seeds, dtype)
    config = dlo.OffloadConfig(num_slots=num_slots, resident_layers=resident_layers)
    with dlo.enable(streamed, "cuda", config) as handle:
        got = outputs(streamed, entry, seeds, dtype)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.pinned and stats.demand_loads == 1
    assert 0 <= stats.exposed_copy_s <= stats.copy_s + 1e-3


def page_locked(tensor):
    """What the driver says of the memory. torch 2.11's Tensor.is_pinned() answers False for
    memory locked with cudaHostRegister (it only knows its own pinned allocator), so ask the
    driver directly."""
    runtime = pytest.importorskip("cuda.bindings.runtime")
    err, attributes = runtime.cudaPointerGetAttributes(tensor.data_ptr())
    assert err == runtime.cudaError_t.cudaSuccess
    return attributes.type == runtime.cudaMemoryType.cudaMemoryTypeHost


def test_host_buffers_are_page_locked_while_enabled_and_released_by_disable():
    _, streamed, entry = pair("wan", torch.float32)
    handle = dlo.enable(streamed, "cuda")
    assert all(page_locked(block.source.host.tensor) for block in handle._runtime.blocks)
    outputs(streamed, entry, [1], torch.float32)
    handle.disable()
    weight = streamed.blocks[0].attn1.to_q.weight
    assert weight.device.type == "cpu" and weight.numel() > 0 and not page_locked(weight)


def test_host_buffers_of_a_module_dropped_without_disable_are_unpinned():
    _, streamed, entry = pair("wan", torch.float32)
    handle = dlo.enable(streamed, "cuda")
    buffers = [block.source.host.tensor for block in handle._runtime.blocks]
    outputs(streamed, entry, [1], torch.float32)
    del handle, streamed
    gc.collect()  # the module and its handle go; the finalizer unpins, the buffers outlive it here
    assert buffers and not any(page_locked(buffer) for buffer in buffers)


def test_pageable_host_memory_streams_identically():
    reference, streamed, entry = pair("flux", torch.bfloat16)
    with dlo.enable(streamed, "cuda", dlo.OffloadConfig(pin_memory=False)) as handle:
        assert torch.equal(outputs(streamed, entry, [3], torch.bfloat16)[0], outputs(reference, entry, [3], torch.bfloat16)[0])
        assert not handle.stats().pinned


def test_skipped_layers_on_cuda():
    reference, streamed, entry = pair("sd3", torch.bfloat16)
    calls = [None, [1], [1, 2], None, [0]]

    def run(model):
        with torch.inference_mode():
            return [model(**entry.inputs(i, torch.bfloat16, "cuda"), skip_layers=s)[0] for i, s in enumerate(calls)]

    expected = run(reference)
    with dlo.enable(streamed, "cuda"):
        assert all(torch.equal(a, b) for a, b in zip(expected, run(streamed)))


def test_compute_on_a_side_stream():
    reference, streamed, entry = pair("wan", torch.bfloat16)
    expected = outputs(reference, entry, [1, 2], torch.bfloat16)
    side = torch.cuda.Stream()
    with dlo.enable(streamed, "cuda"), torch.cuda.stream(side):
        got = outputs(streamed, entry, [1, 2], torch.bfloat16)
    side.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


class _Heavy(nn.Module):
    """Blocks whose compute takes far longer than their copy: a copy that overwrote a slot
    still in use would corrupt the output."""

    def __init__(self, depth=6, width=2048):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            for _ in range(8):
                x = block(x) / 8
        return x


def streamed_five_times(model_class):
    """Five calls of a streamed copy of a fresh `model_class`, each equal to the resident
    model's output; returns the stats and the slots' and blocks' sizes before disable()."""
    torch.manual_seed(0)
    reference = model_class().half()
    streamed = copy.deepcopy(reference)
    reference.cuda()
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.half)
    with torch.inference_mode():
        expected = reference(x)
    with dlo.enable(streamed, "cuda") as handle, torch.inference_mode():
        for _ in range(5):
            assert torch.equal(streamed(x), expected)
        runtime = handle._runtime
        sizes = {slot.buffer.numel() for slot in runtime.slots}, {b.slot_bytes for b in runtime.blocks}
        return handle.stats(), sizes


def test_slot_reuse_never_races_with_compute():
    stats, _ = streamed_five_times(_Heavy)
    assert stats.copies == 6 * 5 + 1


class _Alternating(nn.Module):
    """Blocks of two sizes in turn, so every load changes a slot's size class: the slot's
    buffer goes back to the allocator and a new one is taken each time, while the previous
    block's kernels still run and the activations take whatever memory was freed."""

    def __init__(self, depth=8, width=2048):
        super().__init__()
        inner = [width * (4 if i % 2 == 0 else 1) for i in range(depth)]
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, n), nn.GELU(), nn.Linear(n, width)) for n in inner
        )

    def forward(self, x):
        for block in self.blocks:
            for _ in range(4):
                x = block(x) / 8
        return x


def test_slots_changing_size_class_at_every_block_never_race_with_compute():
    _, (slot_sizes, block_sizes) = streamed_five_times(_Alternating)
    # At the end of a call, one slot of each class: the buffers did change.
    assert slot_sizes == block_sizes and len(block_sizes) == 2


class _FailingDriver:
    """The real CUDA runtime, except that the third cudaHostRegister is refused."""

    def __init__(self, real):
        self._real = real
        self.cudaError = real.cudaError
        self.registered = 0

    def cudaHostRegister(self, ptr, size, flags):
        self.registered += 1
        if self.registered == 3:
            return 2  # cudaErrorMemoryAllocation
        return self._real.cudaHostRegister(ptr, size, flags)

    def cudaHostUnregister(self, ptr):
        return self._real.cudaHostUnregister(ptr)


def test_refused_pinning_midway_rolls_back(monkeypatch):
    reference, streamed, entry = pair("wan", torch.float32)
    driver = _FailingDriver(torch.cuda.cudart())
    monkeypatch.setattr(pinned_buffer, "_driver", lambda: driver)
    with pytest.raises(dlo.EnableError, match="block 'blocks.2': cudaHostRegister .* failed"):
        dlo.enable(streamed, "cuda")
    assert all(p.numel() > 0 and not page_locked(p) for p in streamed.blocks.parameters())
    monkeypatch.undo()
    with dlo.enable(streamed, "cuda"):
        assert torch.equal(outputs(streamed, entry, [2], torch.float32)[0], outputs(reference, entry, [2], torch.float32)[0])


def test_enable_twice_in_one_process_and_stats_after_disable():
    reference, streamed, entry = pair("flux", torch.bfloat16)
    expected = outputs(reference, entry, [7], torch.bfloat16)[0]
    for num_slots in (2, 3):
        handle = dlo.enable(streamed, "cuda", dlo.OffloadConfig(num_slots=num_slots))
        assert torch.equal(outputs(streamed, entry, [7], torch.bfloat16)[0], expected)
        final = handle.disable()
        assert final.copies > 0 and final.bytes_streamed > 0 and final.peak_device_bytes > 0
        assert handle.stats() == final


def test_a_cuda_graph_capture_of_a_streamed_block_is_refused():
    """A replay would reuse the capture's weight addresses, while dlo moves weights between slots."""
    model = TINY_MODELS["wan"].build(seed=0)
    inputs = TINY_MODELS["wan"].inputs(0, torch.float32, "cuda")
    with dlo.enable(model, "cuda"), torch.inference_mode():
        model(**inputs)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(dlo.StreamingError, match="CUDA graph capture"):
            with torch.cuda.graph(graph):
                model(**inputs)
