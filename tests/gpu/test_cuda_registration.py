"""Registering a real host weight cache mapping with the CUDA driver (docs/guides/host-weight-cache.md): direct copies
from the shared pages, exact outputs, unregistered by disable(), a second enable, and a
failed registration that falls back to staging with identical outputs."""

import gc

import pytest
import torch

import dlo
from dlo.backend import cuda_registration
from dlo.models.tiny import TINY_MODELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
diffusers = pytest.importorskip("diffusers")
runtime = pytest.importorskip("cuda.bindings.runtime")


def registered(address):
    """What the driver says of the address (torch's is_pinned() does not see registrations
    made outside its own allocator; see cuda_registration)."""
    err, attributes = runtime.cudaPointerGetAttributes(address)
    return err == runtime.cudaError_t.cudaSuccess and attributes.type == runtime.cudaMemoryType.cudaMemoryTypeHost


def config(tmp_path, **fields):
    return dlo.OffloadConfig(
        host_weight_cache=True, cache_dir=str(tmp_path / "cache"), cache_allow_any_filesystem=True, **fields
    )


@pytest.fixture
def wan(tmp_path):
    """(directory of a saved tiny Wan, the resident model's outputs on CUDA)."""
    directory = tmp_path / "wan"
    TINY_MODELS["wan"].build(seed=4).save_pretrained(directory)
    reference = diffusers.WanTransformer3DModel.from_pretrained(directory).eval().cuda()
    return directory, run(reference)


def run(model, seeds=(1, 2, 3)):
    with torch.inference_mode():
        return [model(**TINY_MODELS["wan"].inputs(seed, torch.float32, "cuda"))[0] for seed in seeds]


def mapped_addresses(model):
    """Every streamed tensor's address in the cache mapping (a cache plan's model holds views
    of the mapping until enable() takes them)."""
    return [p.data_ptr() for p in model.blocks.parameters()]


def test_a_real_cache_entry_is_registered_streamed_exactly_and_unregistered(tmp_path, wan):
    directory, expected = wan
    model, plan = dlo.load_transformer(directory, config(tmp_path))
    addresses = mapped_addresses(model)
    with dlo.enable(model, "cuda", config(tmp_path), plan=plan) as handle:
        assert all(registered(a) for a in addresses)
        got = run(model)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.registered_bytes > 0 and stats.registered_ranges >= 1 and stats.staging_bytes == 0
    assert stats.registration_fallback == "" and stats.pinned and stats.bytes_streamed > 0
    assert not any(registered(a) for a in addresses)


def test_a_second_enable_in_the_same_process_registers_again(tmp_path, wan):
    directory, expected = wan
    for _ in range(2):  # the second load is a warm start from the same entry
        model, plan = dlo.load_transformer(directory, config(tmp_path))
        with dlo.enable(model, "cuda", config(tmp_path), plan=plan) as handle:
            got = run(model)
            assert handle.stats().registered_bytes > 0
        assert all(torch.equal(a, b) for a, b in zip(expected, got))


class RefusingProbes:
    """The real CUDA driver, except that one tensor never reads as registered: the real
    registration is then rolled back with real unregister calls."""

    def __init__(self, driver, address):
        self._driver = driver
        self._address = address

    def __getattr__(self, name):
        return getattr(self._driver, name)

    def is_registered(self, address):
        return address != self._address and self._driver.is_registered(address)


def test_a_failed_registration_falls_back_to_staging_with_identical_outputs(tmp_path, wan, monkeypatch):
    directory, expected = wan
    model, plan = dlo.load_transformer(directory, config(tmp_path))
    addresses = mapped_addresses(model)
    real = cuda_registration.registration_driver(torch.device("cuda", 0))
    monkeypatch.setattr(cuda_registration, "registration_driver", lambda device: RefusingProbes(real, addresses[0]))
    with dlo.enable(model, "cuda", config(tmp_path), plan=plan) as handle:
        assert not any(registered(a) for a in addresses)  # rolled back
        got = run(model)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert "do not read as pinned" in stats.registration_fallback
    assert stats.registered_bytes == 0 and stats.staging_bytes > 0


def test_the_ceiling_keeps_staging_on_cuda(tmp_path, wan):
    directory, expected = wan
    model, plan = dlo.load_transformer(directory, config(tmp_path))
    with dlo.enable(model, "cuda", config(tmp_path, pin_limit_gib=1e-6), plan=plan) as handle:
        got = run(model)
        assert "ceiling" in handle.stats().registration_fallback
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_resident_blocks_copy_straight_from_the_registered_mapping(tmp_path, wan):
    directory, expected = wan
    model, plan = dlo.load_transformer(directory, config(tmp_path))
    with dlo.enable(model, "cuda", config(tmp_path, resident_layers=2), plan=plan) as handle:
        got = run(model)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.resident_blocks == 2 and stats.registered_bytes > 0


def test_a_module_dropped_without_disable_gives_its_registration_back(tmp_path, wan):
    directory, _ = wan
    model, plan = dlo.load_transformer(directory, config(tmp_path))
    addresses = mapped_addresses(model)
    dlo.enable(model, "cuda", config(tmp_path), plan=plan)
    run(model, seeds=(1,))  # ends with the next call's first block prefetched: a copy in flight
    assert all(registered(a) for a in addresses)
    del model, plan
    gc.collect()
    assert not any(registered(a) for a in addresses)
