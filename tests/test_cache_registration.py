"""Registering a host weight cache mapping at enable() (docs/guides/host-weight-cache.md), on CPU with a fake driver:
direct copies instead of staging, every fallback, and the teardown order around the mapping."""

import enum
import gc
import logging
import sys

import pytest
import torch

import dlo
from dlo.backend import cuda_registration
from dlo.host.registration import READ_ONLY, RegistrationCleanupError
from dlo.hotpath.executors import CpuExecutor
from dlo.models.tiny import TINY_MODELS

diffusers = pytest.importorskip("diffusers")


def config(tmp_path, **fields):
    return dlo.OffloadConfig(host_weight_cache=True, cache_dir=str(tmp_path / "cache"), **fields)


@pytest.fixture
def wan(tmp_path):
    """(directory of a saved tiny Wan, its resident outputs)."""
    directory = tmp_path / "wan"
    TINY_MODELS["wan"].build(seed=3).save_pretrained(directory)
    reference = diffusers.WanTransformer3DModel.from_pretrained(directory).eval()
    return directory, run(reference)


def run(model, seeds=(1, 2)):
    with torch.inference_mode():
        return [model(**TINY_MODELS["wan"].inputs(seed))[0] for seed in seeds]


def load(tmp_path, directory, **fields):
    model, plan = dlo.load_transformer(directory, config(tmp_path, **fields))
    assert plan is not None and plan.backing == "host_weight_cache"
    return model, plan


def entry_files(tmp_path):
    return sorted((tmp_path / "cache" / "v1").glob("*/*.safetensors"))


def mapped(path):
    """Whether this process maps `path` (as /proc/self/maps lists it)."""
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


@pytest.fixture
def direct_loads(monkeypatch):
    """The source addresses of the copies each direct load issued (one list per load). Only
    addresses: views of a mapping must not outlive it (pytest would print them on failure)."""
    loads = []
    issue = CpuExecutor.run

    def record(self, load):
        if load.finish is None and load.gather is None:
            loads.append([task.source.data_ptr() for task in load.copies(0)])
        return issue(self, load)

    monkeypatch.setattr(CpuExecutor, "run", record)
    return loads


def test_a_registered_mapping_streams_directly_and_exactly(tmp_path, wan, driver, direct_loads):
    directory, expected = wan
    model, plan = load(tmp_path, directory)
    with dlo.enable(model, "cpu", config(tmp_path), plan=plan) as handle:
        got = run(model)
        stats = handle.stats()
        # Every load went straight from the registered pages, as one copy: the entry holds the
        # block laid out like its slot.
        assert all(driver.is_registered(address) for addresses in direct_loads for address in addresses)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert len(direct_loads) == stats.copies and {len(addresses) for addresses in direct_loads} == {1}
    registers = [c for c in driver.calls if c[0] == "register"]
    files = entry_files(tmp_path)
    # One range per entry file: its tensors are contiguous, so they coalesce into the pages
    # from the first tensor's to the end of the file.
    assert len(registers) == len(files) == stats.registered_ranges
    assert all(flags == READ_ONLY for *_, flags in registers)
    assert stats.registered_bytes == sum(nbytes for _, _, nbytes, _ in registers)
    assert stats.registration_fallback == "" and stats.staging_bytes == 0 and stats.pinned
    assert driver.registered == {}  # disable() unregistered every range


def test_disable_unregisters_while_hooks_and_mapping_remain_then_unmaps(tmp_path, wan, driver):
    directory, _ = wan
    model, plan = load(tmp_path, directory)
    (path,) = entry_files(tmp_path)
    seen = []
    driver.on_unregister = lambda address: seen.append((len(model._forward_pre_hooks), mapped(path)))
    handle = dlo.enable(model, "cpu", config(tmp_path), plan=plan)
    run(model, seeds=(1,))
    handle.disable()
    assert seen == [(1, True)]  # the root hook was still installed and the file still mapped
    gc.collect()  # views held by dropped objects go, then the mapping with them
    assert not mapped(path) and not model._forward_pre_hooks


def test_a_refused_registration_keeps_the_staging_path_and_exact_outputs(tmp_path, wan, driver, caplog):
    directory, expected = wan
    driver.fail_register_at = 0
    model, plan = load(tmp_path, directory)
    with caplog.at_level(logging.WARNING, logger="dlo"):
        with dlo.enable(model, "cpu", config(tmp_path), plan=plan) as handle:
            got = run(model)
            stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.registered_bytes == 0 and "fake error 2" in stats.registration_fallback
    assert driver.registered == {} and driver.cleared == [2]
    assert "host registration not used" in caplog.text


def test_the_ceiling_refuses_before_any_driver_call(tmp_path, wan, driver):
    directory, expected = wan
    model, plan = load(tmp_path, directory, pin_limit_gib=1e-6)
    with dlo.enable(model, "cpu", config(tmp_path, pin_limit_gib=1e-6), plan=plan) as handle:
        got = run(model)
        assert "exceeds the registration ceiling" in handle.stats().registration_fallback
    assert driver.calls == [] and all(torch.equal(a, b) for a, b in zip(expected, got))


def test_pin_memory_off_registers_nothing(tmp_path, wan, driver):
    directory, _ = wan
    model, plan = load(tmp_path, directory)
    with dlo.enable(model, "cpu", config(tmp_path, pin_memory=False), plan=plan) as handle:
        assert handle.stats().registration_fallback == "OffloadConfig.pin_memory=False"
    assert driver.calls == []


def test_on_the_cpu_registration_does_not_apply(tmp_path, wan, caplog):
    directory, _ = wan
    model, plan = load(tmp_path, directory)
    with caplog.at_level(logging.INFO, logger="dlo"):
        with dlo.enable(model, "cpu", config(tmp_path), plan=plan) as handle:
            stats = handle.stats()
    assert stats.registration_fallback == "" and stats.registered_bytes == 0
    assert "registration" not in caplog.text


def test_a_driver_that_fails_to_load_falls_back_to_staging(tmp_path, wan, monkeypatch):
    directory, expected = wan

    def broken(device):
        raise RuntimeError("cudaErrorInsufficientDriver")

    monkeypatch.setattr(cuda_registration, "registration_driver", broken)
    model, plan = load(tmp_path, directory)
    with dlo.enable(model, "cpu", config(tmp_path), plan=plan) as handle:
        got = run(model)
        assert "cudaErrorInsufficientDriver" in handle.stats().registration_fallback
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_tiny_positive_ceiling_is_still_a_ceiling(tmp_path, wan, driver):
    directory, _ = wan
    model, plan = load(tmp_path, directory, pin_limit_gib=1e-12)  # 0.001 bytes: rounds up to 1, not to 0
    with dlo.enable(model, "cpu", config(tmp_path, pin_limit_gib=1e-12), plan=plan) as handle:
        assert "exceeds the registration ceiling" in handle.stats().registration_fallback
    assert driver.calls == []


def test_a_failed_unregister_keeps_the_mapping_open_and_the_module_usable(tmp_path, wan, driver):
    directory, expected = wan
    model, plan = load(tmp_path, directory)
    (path,) = entry_files(tmp_path)
    handle = dlo.enable(model, "cpu", config(tmp_path), plan=plan)
    driver.stuck = True  # the first attempt and the retry when the mapping would close
    with pytest.raises(dlo.EnableError, match="fake error 1.*the mapping stays open"):
        handle.disable()
    gc.collect()
    assert mapped(path) and len(driver.registered) == 1
    assert all(torch.equal(a, b) for a, b in zip(expected, run(model)))  # private tensors now


def test_a_failed_rollback_aborts_enable_and_keeps_the_mapping(tmp_path, wan, driver):
    directory, _ = wan
    model, plan = load(tmp_path, directory)
    (path,) = entry_files(tmp_path)
    first_tensor = next(iter(model.parameters())).data_ptr()
    driver.unpinned = {first_tensor}  # a tensor that does not read as pinned: roll back...
    driver.stuck = True  # ...which fails
    with pytest.raises(RegistrationCleanupError, match="could not unregister"):
        dlo.enable(model, "cpu", config(tmp_path), plan=plan)
    gc.collect()
    assert mapped(path) and len(driver.registered) == 1


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "4"])
def test_pin_limit_must_be_a_finite_number_at_least_zero(bad):
    with pytest.raises(dlo.ConfigError, match="pin_limit_gib must be a finite number >= 0"):
        dlo.OffloadConfig(host_weight_cache=True, pin_limit_gib=bad)


def test_a_pin_limit_needs_the_cache():
    with pytest.raises(dlo.ConfigError, match="pin_limit_gib=2.0 .* needs checkpoint_mmap=True or host_weight_cache=True"):
        dlo.OffloadConfig(pin_limit_gib=2.0, checkpoint_mmap=False)
    assert dlo.OffloadConfig(pin_limit_gib=0).pin_limit_gib == 0


def test_without_cuda_bindings_registration_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # makes the import fail
    reason = cuda_registration.registration_driver(torch.device("cuda", 0))
    assert reason == "cuda-bindings is not installed (pip install cuda-bindings)"


class FakeRuntime:
    """The few cuda-bindings runtime calls the CUDA driver makes, on CPU (a fake cudart)."""

    class cudaError_t(enum.IntEnum):
        cudaSuccess = 0
        cudaErrorInvalidValue = 1
        cudaErrorMemoryAllocation = 2

    class cudaDeviceAttr(enum.IntEnum):
        cudaDevAttrHostRegisterReadOnlySupported = 113

    class cudaMemoryType(enum.IntEnum):
        cudaMemoryTypeUnregistered = 0
        cudaMemoryTypeHost = 1

    def __init__(self):
        self.device = 0
        self.pending = self.cudaError_t.cudaSuccess
        self.log = []

    def cudaGetDevice(self):
        return self.cudaError_t.cudaSuccess, self.device

    def cudaSetDevice(self, index):
        self.device = index
        return (self.cudaError_t.cudaSuccess,)

    def cudaDeviceGetAttribute(self, attribute, index):
        self.log.append(("attribute", int(attribute), index))
        return self.cudaError_t.cudaSuccess, 1

    def cudaHostRegister(self, address, nbytes, flags):
        self.log.append(("register", self.device, flags))
        self.pending = self.cudaError_t.cudaErrorMemoryAllocation
        return (self.pending,)

    def cudaHostUnregister(self, address):
        self.log.append(("unregister", self.device))
        return (self.cudaError_t.cudaSuccess,)

    def cudaPeekAtLastError(self):
        return (self.pending,)

    def cudaGetLastError(self):
        pending, self.pending = self.pending, self.cudaError_t.cudaSuccess
        return (pending,)

    def cudaGetErrorName(self, error):
        return self.cudaError_t.cudaSuccess, error.name.encode()


def test_the_cuda_driver_calls_on_the_target_device_and_clears_only_its_own_error():
    runtime = FakeRuntime()
    driver = cuda_registration.CudaRegistrationDriver(runtime, device_index=1)
    assert driver.read_only_supported() and runtime.log[-1] == ("attribute", 113, 1)
    code = driver.register(0x1000, 4096, READ_ONLY)
    assert runtime.log[-1] == ("register", 1, READ_ONLY) and runtime.device == 0  # restored
    assert driver.error_name(code) == "cudaErrorMemoryAllocation"
    driver.clear_error(1)  # not the pending error: left for whoever caused it
    assert runtime.pending == runtime.cudaError_t.cudaErrorMemoryAllocation
    driver.clear_error(code)
    assert runtime.pending == runtime.cudaError_t.cudaSuccess
    assert driver.unregister(0x1000) == 0 and runtime.log[-1] == ("unregister", 1)


def test_resident_blocks_are_read_from_the_registered_mapping_too(tmp_path, wan, driver, monkeypatch):
    from dlo.host.tensor_source import TensorSource

    directory, expected = wan
    model, plan = load(tmp_path, directory)
    private_copies = []
    materialize = TensorSource.materialize
    monkeypatch.setattr(TensorSource, "materialize", lambda self, c: private_copies.append(self) or materialize(self, c))
    handle = dlo.enable(model, "cpu", config(tmp_path, resident_layers=2), plan=plan)
    assert private_copies == []  # resident blocks came straight from the registered pages
    with handle:
        got = run(model)
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.resident_blocks == 2 and stats.registered_bytes > 0


def test_a_module_dropped_without_disable_still_unregisters_before_unmapping(tmp_path, wan, driver):
    directory, _ = wan
    model, plan = load(tmp_path, directory)
    (path,) = entry_files(tmp_path)
    seen = []
    driver.on_unregister = lambda address: seen.append(mapped(path))
    dlo.enable(model, "cpu", config(tmp_path), plan=plan)
    run(model, seeds=(1,))
    del model, plan  # the handle lives as long as the module (its hooks hold it)
    gc.collect()
    assert seen == [True] and driver.registered == {}
    gc.collect()
    assert not mapped(path)


def test_a_dropped_handle_whose_device_fails_keeps_its_memory(tmp_path, wan, driver, monkeypatch):
    directory, _ = wan
    model, plan = load(tmp_path, directory)
    (path,) = entry_files(tmp_path)
    dlo.enable(model, "cpu", config(tmp_path), plan=plan)

    def broken_device(self):  # the device faulted: copies from the mapping may be in flight
        raise RuntimeError("cudaErrorLaunchFailure")

    monkeypatch.setattr(CpuExecutor, "synchronize", broken_device)
    del model, plan
    gc.collect()
    gc.collect()
    assert len(driver.registered) == 1 and mapped(path)  # nothing unregistered, nothing unmapped
