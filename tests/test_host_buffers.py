"""Page-locked host buffers: all or nothing, retried unpins, and the teardown order of a
module dropped without disable(). The CUDA runtime is a fake on the CPU."""

import pytest

from dlo.backend import handle as handle_module
from dlo.errors import EnableError
from dlo.host import pinned_buffer
from dlo.host.pinned_buffer import HostBuffer, host_buffers


class FakeCudart:
    """torch.cuda.cudart()'s register/unregister; fails the calls it is told to."""

    class cudaError:  # noqa: N801 (the runtime's own name)
        success = 0

    def __init__(self, fail_register_at=None, fail_unregisters=0):
        self.registered = set()
        self.registers = 0
        self.fail_register_at = fail_register_at
        self.fail_unregisters = fail_unregisters
        self.unregister_calls = 0

    def cudaHostRegister(self, address, nbytes, flags):  # noqa: N802
        index, self.registers = self.registers, self.registers + 1
        if index == self.fail_register_at:
            return 2
        self.registered.add(address)
        return 0

    def cudaHostUnregister(self, address):  # noqa: N802
        self.unregister_calls += 1
        if self.fail_unregisters:
            self.fail_unregisters -= 1
            return 1
        self.registered.remove(address)
        return 0


@pytest.fixture
def cudart(monkeypatch):
    def install(**kwargs):
        fake = FakeCudart(**kwargs)
        monkeypatch.setattr(pinned_buffer, "_driver", lambda: fake)
        return fake

    return install


def test_a_failed_unregister_keeps_the_buffer_pinned_so_a_retry_unpins_it(cudart):
    fake = cudart(fail_unregisters=1)
    buffer = HostBuffer(10_000, pin=True)
    with pytest.raises(EnableError, match="cudaHostUnregister failed"):
        buffer.unpin()
    assert buffer.pinned and fake.registered == {buffer.tensor.data_ptr()}
    buffer.unpin()
    assert not buffer.pinned and fake.registered == set()
    buffer.unpin()  # idempotent: nothing left to unregister
    assert fake.unregister_calls == 2


def test_buffers_that_cannot_all_be_pinned_unpin_the_ones_before_the_failure(cudart):
    fake = cudart(fail_register_at=2)
    with pytest.raises(EnableError, match="cudaHostRegister"):
        host_buffers(3, 4096, pin=True)
    assert fake.registers == 3 and fake.registered == set()  # two pinned, then both unpinned


def test_buffers_that_all_pin_stay_pinned(cudart):
    fake = cudart()
    buffers = host_buffers(2, 4096, pin=True)
    assert all(b.pinned for b in buffers) and len(fake.registered) == 2


def test_a_dropped_handle_stops_the_stager_then_synchronizes_then_releases():
    order = []

    class Spy:
        def __init__(self, name):
            self.name = name

        def stop(self):
            order.append(f"{self.name}.stop")

        def synchronize(self):
            order.append(f"{self.name}.synchronize")

        def close(self):
            order.append(f"{self.name}.close")
            return []

    handle_module._abandoned(
        executor=Spy("device"),
        stager=Spy("stager"),
        registration=Spy("registration"),
        releases=[lambda: order.append("unpin block"), lambda: order.append("unpin staging")],
        checkpoint=None,
    )
    assert order == ["stager.stop", "device.synchronize", "registration.close", "unpin block", "unpin staging"]


def test_a_dropped_handle_whose_device_fails_releases_nothing():
    order = []

    class BrokenDevice:
        def synchronize(self):
            raise RuntimeError("device lost")

    handle_module._abandoned(
        executor=BrokenDevice(), stager=None, registration=None, releases=[lambda: order.append("unpin")], checkpoint=None
    )
    assert order == []


def test_a_block_whose_weights_cannot_be_quantized_leaves_nothing_page_locked(cudart):
    """The host buffer is pinned, then packing refuses a NaN weight: it is unpinned before
    the error propagates (no undo is registered for a block that was never bound)."""
    import torch

    from dlo.backend.block_binding import bind_block, collect_block, placeholders
    from dlo.config import OffloadConfig
    from dlo.models.tiny import TINY_MODELS
    from dlo.planning.fp8_selection import fp8_format, quantized_tensors
    from dlo.planning.offload_plan import discover, resolve_blocks

    fake = cudart()
    model = TINY_MODELS["flux"].build(seed=0)
    with torch.no_grad():
        model.transformer_blocks[1].ff.net[2].weight[0, 0] = float("nan")
    config = OffloadConfig(stream_dtype="fp8")
    ref = resolve_blocks(model, discover(model))[1]
    block = collect_block(ref, quantized_tensors(model, ref, config))
    with pytest.raises(EnableError, match=r"'\^transformer_blocks\\\\.1\\\\.ff\\\\.net\\\\.2\\\\.weight\$'"):
        bind_block(block, None, True, placeholders([block], torch.device("cpu")), fp8_format(config))
    assert fake.registers == 1 and fake.registered == set()


def test_ctrl_c_once_a_block_is_pinned_is_held_until_its_undo_can_unpin_it(cudart, monkeypatch):
    """A real SIGINT after a block's host buffer was pinned and packed, before bind_block()
    returned: enable()'s binding step holds it until the block's undo is registered, so the
    rollback unpins the buffer (raised there, it would stay pinned for good)."""
    import contextlib
    import signal

    import torch

    from dlo.backend import block_binding
    from dlo.backend.block_binding import collect_block
    from dlo.backend.enable import _bind_blocks
    from dlo.models.tiny import TINY_MODELS
    from dlo.planning.offload_plan import discover, resolve_blocks

    fake = cudart()
    model = TINY_MODELS["wan"].build(seed=0)
    blocks = [collect_block(ref, frozenset()) for ref in resolve_blocks(model, discover(model))]
    real_streamed = block_binding._streamed

    def interrupted(*args):
        signal.raise_signal(signal.SIGINT)  # Python raises KeyboardInterrupt at its next bytecode
        return real_streamed(*args)

    monkeypatch.setattr(block_binding, "_streamed", interrupted)
    with pytest.raises(KeyboardInterrupt), contextlib.ExitStack() as undo:
        _bind_blocks(blocks, None, None, True, torch.device("cpu"), None, undo, 0, converted=False)
    assert fake.registers == 1 and fake.registered == set()
