"""Bad input to enable() and misuse of an enabled module: each a named error, nothing lost."""

from concurrent.futures import Future

import pytest
import torch
from torch import nn

import dlo


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return self.linear(x)


class Stack(nn.Module):
    def __init__(self, depth=3):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(depth)])

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("gpu", "is not a device"),
        ("cuda:x", "is not a device"),
        (3.5, "is not a device"),
        ("meta", "'meta' is not supported"),
        ("mps", "'mps' is not supported"),
    ],
)
def test_wrong_device_strings(device, message):
    with pytest.raises(dlo.ConfigError, match=message):
        dlo.enable(Stack(), device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_says_so():
    with pytest.raises(dlo.ConfigError, match="no usable CUDA device"):
        dlo.enable(Stack(), "cuda")


def test_config_and_plan_types_are_checked():
    with pytest.raises(dlo.ConfigError, match="config must be a dlo.OffloadConfig"):
        dlo.enable(Stack(), "cpu", config={"num_slots": 2})
    with pytest.raises(dlo.ConfigError, match="plan must be a dlo.OffloadPlan"):
        dlo.enable(Stack(), "cpu", plan=("blocks",))


def test_resident_layers_beyond_the_blocks():
    with pytest.raises(dlo.ConfigError, match="resident_layers=4 but Stack has 3 blocks"):
        dlo.enable(Stack(), "cpu", dlo.OffloadConfig(resident_layers=4))


def test_resident_layers_outside_eligible_lists():
    model = Stack()
    model.extra = nn.ModuleList([Block(), Block()])
    plan = dlo.OffloadPlan(block_lists=("extra", "blocks"), resident_eligible=("blocks",))
    with pytest.raises(dlo.ConfigError, match="would keep 'extra.0' resident"):
        dlo.enable(model, "cpu", dlo.OffloadConfig(resident_layers=1), plan=plan)


def test_enabling_an_enabled_module_again():
    model = Stack()
    with dlo.enable(model, "cpu"):
        with pytest.raises(dlo.EnableError, match="already under dlo"):
            dlo.enable(model, "cpu")
        wrapper = nn.Module()
        wrapper.inner = model
        with pytest.raises(dlo.EnableError, match="its submodule 'inner'"):
            dlo.enable(wrapper, "cpu", plan=dlo.OffloadPlan(block_lists=("inner.blocks",)))
    with dlo.enable(model, "cpu"):  # fine once disabled
        pass


def test_replaced_parameter_after_enable_is_detected():
    model = Stack()
    with dlo.enable(model, "cpu"):
        model.blocks[1].linear.weight = nn.Parameter(torch.zeros(8, 8))
        with torch.inference_mode(), pytest.raises(dlo.StreamingError, match=r"'weight' of streamed block 'blocks.1'"):
            model(torch.ones(1, 8))


def test_replaced_buffer_after_enable_is_detected():
    model = Stack()
    model.blocks[0].register_buffer("scale", torch.ones(8))
    with dlo.enable(model, "cpu"):
        model.blocks[0].scale = torch.zeros(8)
        with torch.inference_mode(), pytest.raises(dlo.StreamingError, match="buffer 'scale'"):
            model(torch.ones(1, 8))


def test_calls_with_autograd_enabled_are_refused():
    model = Stack()
    with dlo.enable(model, "cpu"):
        with pytest.raises(dlo.StreamingError, match="inference only"):
            model(torch.ones(1, 8))
        with torch.no_grad():  # the failed call left the slots usable
            model(torch.ones(1, 8))


def test_meta_weights_are_refused_before_anything_changes():
    with torch.device("meta"):
        model = Stack()
    with pytest.raises(dlo.EnableError, match="meta device"):
        dlo.enable(model, "cpu")


def test_weights_tied_across_blocks_are_refused_and_untouched():
    model = Stack()
    model.blocks[2].linear.weight = model.blocks[0].linear.weight
    before = model.blocks[0].linear.weight.detach().clone()
    with pytest.raises(dlo.EnableError, match="blocks.2.linear.weight is the same tensor as 'blocks.0.linear.weight'"):
        dlo.enable(model, "cpu")
    assert torch.equal(model.blocks[0].linear.weight, before)
    dlo.enable(model, "cpu", dlo.OffloadConfig(resident_layers=3)).disable()  # resident: fine


def test_weight_shared_with_a_non_streamed_part_is_refused():
    model = Stack()
    model.inp.weight = model.blocks[1].linear.weight
    with pytest.raises(dlo.EnableError, match="same tensor as 'inp.weight'"):
        dlo.enable(model, "cpu")


def test_weights_tied_inside_one_block_stream_once():
    model = Stack()
    block = model.blocks[1]
    block.twin = nn.Linear(8, 8)
    block.twin.weight = block.linear.weight
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    with dlo.enable(model, "cpu"), torch.no_grad():
        assert torch.equal(model(x), expected)
        assert model.blocks[1].twin.weight is model.blocks[1].linear.weight


def test_tensor_subclasses_are_refused():
    class Tagged(torch.Tensor):
        pass

    model = Stack()
    model.blocks[0].register_buffer("tag", torch.ones(2).as_subclass(Tagged))
    with pytest.raises(dlo.EnableError, match="plain dense tensors"):
        dlo.enable(model, "cpu")


def test_generic_module_streams_bit_identically():
    model = Stack(depth=5)
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(num_slots=3)), torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), expected)


def test_failure_midway_through_packing_loses_nothing():
    """Block 0 is packed (its weights moved to a host buffer) before block 1's host buffer
    cannot be allocated: enable() fails and block 0 gets its weights back."""
    model = Stack()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    # A zero-stride view of one float that claims 2**48 elements: 1 PiB, more than any
    # address space, so the host allocation fails on every machine.
    model.blocks[1].register_buffer("huge", torch.zeros(1).expand(2**48), persistent=False)
    with pytest.raises(dlo.EnableError, match=r"block 'blocks.1': cannot allocate \d+ bytes of host memory"):
        dlo.enable(model, "cpu")
    assert model.blocks[0].linear.weight.numel() == 64
    del model.blocks[1].huge
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    with dlo.enable(model, "cpu"), torch.no_grad():
        assert torch.equal(model(x), expected)


def test_a_slot_that_cannot_be_allocated_puts_every_placed_tensor_back(monkeypatch):
    """The device runs out of memory for the slots after the non-block parts and a resident
    block were placed: enable() fails and every placed tensor holds its original storage
    again (on "cpu" placing copies, so the storage says where a tensor is); streamed blocks
    get their packed weights back."""
    from dlo.hotpath.executors import CpuExecutor

    model = Stack(depth=4)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    placed = {name: t for name, t in model.state_dict(keep_vars=True).items() if name.startswith(("inp.", "blocks.0."))}
    storage = {name: t.data_ptr() for name, t in placed.items()}

    def out_of_memory(self, nbytes):
        raise torch.OutOfMemoryError("fake device out of memory")

    monkeypatch.setattr(CpuExecutor, "allocate_slot", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        dlo.enable(model, "cpu", dlo.OffloadConfig(resident_layers=1))
    assert {name: t.data_ptr() for name, t in placed.items()} == storage
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(resident_layers=1)), torch.no_grad():
        assert torch.equal(model(x), expected)


def _hook_registrations(monkeypatch, interrupt_at=None) -> list[str]:
    """Count nn.Module hook registrations from now on (enable()'s block calls, probes and root
    hooks); with `interrupt_at`, Ctrl-C arrives as that one is about to be made."""
    made: list[str] = []
    for name in ("register_forward_pre_hook", "register_forward_hook"):
        original = getattr(nn.Module, name)

        def counted(module, *args, _original=original, _name=name, **kwargs):
            if len(made) == interrupt_at:
                raise KeyboardInterrupt
            made.append(_name)
            return _original(module, *args, **kwargs)

        monkeypatch.setattr(nn.Module, name, counted)
    return made


def test_an_interrupt_at_any_hook_enable_installs_leaves_the_module_as_it_was(monkeypatch):
    """Ctrl-C as any of enable()'s hooks is installed (a block's streamed call, a probe, the
    root's hooks as the handle takes over): every step is undone, the one it interrupted
    included, so the module runs as before, is not registered as managed, and can be enabled
    again."""
    from dlo.backend.handle import _MANAGED
    from dlo.hotpath.compiled_call import StreamedCall

    x = torch.randn(2, 8)
    made = _hook_registrations(monkeypatch)
    with dlo.enable(Stack(depth=4), "cpu"):
        pass
    monkeypatch.undo()
    assert made.count("register_forward_hook") == 1 and len(made) > 8  # block calls, probes, root
    for interrupt_at in range(len(made)):
        model = Stack(depth=4)
        with torch.no_grad():
            expected = model(x)
        hooks_before = {name: (len(sub._forward_pre_hooks), len(sub._forward_hooks)) for name, sub in model.named_modules()}
        _hook_registrations(monkeypatch, interrupt_at)
        with pytest.raises(KeyboardInterrupt):
            dlo.enable(model, "cpu")
        monkeypatch.undo()
        assert not any(type(block._compiled_call_impl) is StreamedCall for block in model.blocks)
        hooks_after = {name: (len(sub._forward_pre_hooks), len(sub._forward_hooks)) for name, sub in model.named_modules()}
        assert hooks_after == hooks_before, interrupt_at
        assert model not in _MANAGED
        with torch.no_grad():
            assert torch.equal(model(x), expected)
        with dlo.enable(model, "cpu"), torch.no_grad():
            assert torch.equal(model(x), expected)


def test_a_failed_copy_never_leaves_a_stale_slot(monkeypatch):
    """The copy engine fails once mid-call: that call raises, and every later call is exact
    (the planner forgets the slots whose copies may not have happened)."""
    from dlo.hotpath.executors import CpuExecutor

    model = Stack(depth=5)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    real_run = CpuExecutor.run
    calls = {"n": 0}

    def failing_once(self, load):
        calls["n"] += 1
        if calls["n"] == 9:  # 7 loads in the first call; the 2nd prefetch of the second
            raise RuntimeError("copy engine failure")
        return real_run(self, load)

    monkeypatch.setattr(CpuExecutor, "run", failing_once)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(num_slots=3)), torch.no_grad():
        assert torch.equal(model(x), expected)
        with pytest.raises(RuntimeError, match="copy engine failure"):
            model(x)
        for _ in range(3):
            assert torch.equal(model(x), expected)


def test_a_keyboard_interrupt_inside_a_block_leaves_the_next_call_exact():
    model = Stack(depth=4)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    interrupt = {"armed": True}

    def ctrl_c(module, args):
        if interrupt.pop("armed", False):
            raise KeyboardInterrupt

    model.blocks[2].linear.register_forward_pre_hook(ctrl_c)
    with dlo.enable(model, "cpu"), torch.no_grad():
        with pytest.raises(KeyboardInterrupt):
            model(x)
        for _ in range(2):
            assert torch.equal(model(x), expected)


def test_a_keyboard_interrupt_after_a_block_started_releases_its_slot_at_the_next_call(monkeypatch):
    """Ctrl-C between the block's start and its call (the compute mark of a recorded
    timeline): nothing ends the block, so it still counts as running, and the next call
    must release its slot (else, with 2 slots, a later block finds no slot to load into)."""
    from dlo.hotpath.executors import CpuExecutor

    model = Stack(depth=4)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(record_timeline=True)), torch.no_grad():
        assert torch.equal(model(x), expected)
        marks = {"n": 0}
        real_mark = CpuExecutor.mark

        def interrupted(self, *args):
            marks["n"] += 1
            if marks["n"] == 1:
                raise KeyboardInterrupt
            return real_mark(self, *args)

        monkeypatch.setattr(CpuExecutor, "mark", interrupted)
        with pytest.raises(KeyboardInterrupt):
            model(x)
        monkeypatch.setattr(CpuExecutor, "mark", real_mark)
        for _ in range(2):
            assert torch.equal(model(x), expected)


class _WaitedFuture(Future):
    """A staged job's future that records whether anyone waited for it."""

    waited = False

    def exception(self, timeout=None):
        self.waited = True
        return super().exception(timeout)


def test_a_failed_staged_load_waits_for_the_slots_other_staged_loads():
    """Two staged loads queued for one slot, the first failed: the second may still run on the
    stager thread and would write the slot later, so it is waited for before the error."""
    from dlo.hotpath.slot_queue import _Job

    model = Stack(depth=4)
    with dlo.enable(model, "cpu") as handle:
        queue = handle._runtime.queues[0]
        failed, other = Future(), _WaitedFuture()
        failed.set_exception(RuntimeError("packing failed"))
        other.set_exception(RuntimeError("cancelled"))
        queue._jobs = [_Job("blocks.0", 1, failed), _Job("blocks.1", 1, other)]
        with pytest.raises(RuntimeError, match="packing failed"):
            queue.settle()
        assert other.waited


@pytest.mark.parametrize("waiter", ["stats", "promote"])
def test_a_staged_load_that_failed_where_no_block_waits_leaves_its_slot_empty(waiter):
    """A failed staged load seen by drain() (stats, disable, residency changes) or superseded
    by promote(), not by the block's start: the slot was never written, so the block must be
    loaded again, not run from the slot's old bytes."""
    from dlo.hotpath.slot_queue import _Job

    reference = Stack(depth=4)
    model = Stack(depth=4)
    model.load_state_dict(reference.state_dict())
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = reference(x)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(num_slots=2)) as handle, torch.no_grad():
        runtime = handle._runtime
        assert torch.equal(model(x), expected)
        slot = runtime.planner.slot_of(0)  # block 0 waits in a slot for the next call
        assert slot is not None
        runtime.slots[slot].buffer.zero_()  # what a load that never ran leaves there
        failed = Future()
        failed.set_exception(RuntimeError("packing failed"))
        runtime.queues[slot]._jobs = [_Job("blocks.0", 1, failed)]
        if waiter == "stats":
            with pytest.raises(RuntimeError, match="packing failed"):
                handle.stats()
        else:  # block 0 gets memory of its own, packed from its source: the slot's failure is moot
            runtime.promote(0)
        assert torch.equal(model(x), expected)


def test_a_dropped_handle_still_guards_the_module_and_a_dropped_module_is_freed():
    import gc
    import weakref

    from dlo.backend.handle import _MANAGED

    gc.collect()
    before = len(_MANAGED)
    model = Stack()
    dlo.enable(model, "cpu")  # handle not kept: the module keeps it alive
    gc.collect()
    with pytest.raises(dlo.EnableError, match="already under dlo"):
        dlo.enable(model, "cpu")
    with torch.no_grad():
        model(torch.ones(1, 8))
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None and len(_MANAGED) == before  # no leak through the registry


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_ctrl_c_while_a_block_is_pointed_at_its_placeholders_is_undone(monkeypatch, fp8):
    """A real SIGINT after a block's first tensor was repointed: its undo was registered before
    the module changed, so the module runs as before and can be enabled again."""
    import signal

    from dlo.hotpath.streamed_block import StreamedBlock

    model = Stack(depth=4)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    config = dlo.OffloadConfig(stream_dtype="fp8" if fp8 else None)
    real_point_at = StreamedBlock.point_at
    interrupted = []

    def point_then_interrupt(block, views):
        if interrupted:
            return real_point_at(block, views)
        interrupted.append(block.name)
        block.tensors[0].data = views[0]
        signal.raise_signal(signal.SIGINT)  # Python raises KeyboardInterrupt at its next bytecode
        real_point_at(block, views)

    monkeypatch.setattr(StreamedBlock, "point_at", point_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        dlo.enable(model, "cpu", config)
    monkeypatch.undo()
    assert interrupted == ["blocks.0"]
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    with dlo.enable(model, "cpu"), torch.no_grad():
        assert torch.equal(model(x), expected)
