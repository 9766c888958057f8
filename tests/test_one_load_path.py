"""One writer per slot, and a planner that commits or rolls back: loads of every kind share
slots in any order, and an interrupt at any step of a call leaves the next call exact.
See [Note: one writer per slot] in dlo.hotpath.slot_queue."""

import copy
import functools
import linecache
import random
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import dlo
from dlo.hotpath.block_loads import BlockLoads, PerBlock
from dlo.hotpath.executors import CpuExecutor
from dlo.hotpath.slot_queue import SlotQueue
from dlo.models.tiny import TINY_MODELS
from dlo.planning.slot_planner import SlotPlanner

SD3 = TINY_MODELS["sd3"]
FLUX = TINY_MODELS["flux"]
# Block 2 stays as the checkpoint has it, mapped and packed on every load by the stager's
# thread; the others are quantized into private buffers at enable(): two kinds of load in turn.
MIXED_FP8 = dict(stream_dtype="fp8", fp8_skip=(r"^transformer_blocks\.2\.",))


def sd3_call(model, seed, skip_layers):
    with torch.inference_mode():
        return model(**SD3.inputs(seed), skip_layers=skip_layers)[0]


@pytest.fixture
def slow_packing(monkeypatch):
    """Every staged block takes 30 ms to pack, on the stager's thread: a staged load still
    packing when the caller queues a newer load into the same slot."""
    real = BlockLoads.pack_tasks

    def slow(self, index, staging):
        assert threading.current_thread() is not threading.main_thread()
        time.sleep(0.03)
        return real(self, index, staging)

    monkeypatch.setattr(BlockLoads, "pack_tasks", slow)


def mixed_sd3(tmp_path, **fields):
    directory = tmp_path / "sd3"
    SD3.build(seed=3).save_pretrained(directory)
    config = dlo.OffloadConfig(**MIXED_FP8, **fields)
    reference = SD3.build(seed=3)
    dlo.quantize_resident(reference, config)
    model, plan = dlo.load_transformer(directory, config)
    return reference, model, plan, config


def test_skip_layer_guidance_over_packed_and_staged_blocks_equals_resident(tmp_path, slow_packing):
    """The review's reproduction: calls alternating skip_layers [1], [], [2, 3] make the
    prefetched block of one call the wrong one for the next, so a packed load is queued into a
    slot whose staged load is still packing. The staged load must never land after it."""
    reference, model, plan, config = mixed_sd3(tmp_path)
    paths = [[1], [], [2, 3]] * 2
    expected = [sd3_call(reference, seed, skip) for seed, skip in enumerate(paths)]
    with dlo.enable(model, "cpu", config, plan=plan) as handle:
        assert handle.stats().staging_bytes > 0  # the mapped block is staged by the thread
        got = [sd3_call(model, seed, skip) for seed, skip in enumerate(paths)]
    assert [torch.equal(a, b) for a, b in zip(expected, got)] == [True] * len(paths)


class Nested(nn.Module):
    """Blocks of two sizes; `path` says which run, in which order, and `inside` which block
    runs from inside which (a pre-hook of block i's first layer runs block j)."""

    def __init__(self, depth=6):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 64 if i % 2 else 8), nn.GELU(), nn.Linear(64 if i % 2 else 8, 8))
            for i in range(depth)
        )
        self.inside: dict[int, int] = {}
        for i, block in enumerate(self.blocks):
            block[0].register_forward_pre_hook(lambda module, args, i=i: self._nest(i, args))

    def _nest(self, outer, args):
        inner = self.inside.get(outer)
        return None if inner is None else (self.blocks[inner](args[0]),)

    def forward(self, x, path):
        x = self.inp(x)
        for i in path:
            x = self.blocks[i](x)
        return x


def random_path(rng, depth):
    path = [i for i in range(depth) if rng.random() > 0.25]  # blocks skipped
    for _ in range(rng.randrange(3)):  # blocks repeated
        path.insert(rng.randrange(len(path) + 1), rng.randrange(depth))
    inside = {}
    outer = rng.choice(path) if path and rng.random() < 0.5 else None
    if outer is not None:
        inside[outer] = rng.choice([i for i in range(depth) if i != outer])
    return path, inside


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("fields", [{}, dict(stream_dtype="fp8", fp8_skip=(r"^blocks\.[03]\.",))], ids=["packed", "fp8-landed"])
def test_random_execution_paths_equal_resident_call_by_call(seed, fields):
    """Skipped, repeated and nested blocks, blocks promoted and demoted between calls, in
    random order: every call equals the resident model's."""
    rng = random.Random(seed)
    config = dlo.OffloadConfig(num_slots=3, **fields)
    reference = Nested()
    torch.manual_seed(seed)
    for p in reference.parameters():
        nn.init.normal_(p, std=0.3)
    model = copy.deepcopy(reference)
    if fields:
        dlo.quantize_resident(reference, config)
    with dlo.enable(model, "cpu", config) as handle, torch.no_grad():
        runtime = handle._runtime
        for call in range(12):
            path, inside = random_path(rng, len(model.blocks))
            reference.inside = model.inside = inside
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(call))
            assert torch.equal(model(x, path), reference(x, path)), (call, path, inside)
            index = rng.randrange(len(model.blocks))
            if index in runtime.promoted:
                runtime.demote(index)
            elif rng.random() < 0.3:
                runtime.promote(index)


@pytest.mark.parametrize("registered", [False, True], ids=["staged", "direct"])
@pytest.mark.parametrize("seed", range(2))
def test_random_skip_paths_over_every_source_of_one_model_equal_resident(tmp_path, request, seed, registered):
    """One SD3 model whose blocks are resident (block 0), packed float8 (1, 3), and mapped
    (block 2: staged by the thread, or, registered with the fake driver, copied directly),
    with blocks promoted and demoted between calls: random skip_layers paths equal resident."""
    if registered:
        request.getfixturevalue("driver")
    rng = random.Random(seed)
    reference, model, plan, config = mixed_sd3(tmp_path, resident_layers=1)
    with dlo.enable(model, "cpu", config, plan=plan) as handle:
        runtime = handle._runtime
        assert (handle.stats().staging_bytes > 0) != registered
        random_skip_calls(rng, model, reference, runtime)


def random_skip_calls(rng, model, reference, runtime, check=lambda: None):
    """10 calls on random skip_layers paths, each equal to resident; after each a random block
    promoted or demoted, then `check()`."""
    for call in range(10):
        skip = sorted(rng.sample(range(1, 4), rng.randrange(3)))
        assert torch.equal(sd3_call(model, call, skip), sd3_call(reference, call, skip)), (call, skip)
        index = rng.randrange(len(runtime.blocks))
        if index in runtime.promoted:
            runtime.demote(index)
        elif rng.random() < 0.3:
            runtime.promote(index)
        check()


@pytest.mark.parametrize("seed", range(2))
def test_random_skip_paths_over_disk_and_kept_blocks_equal_resident(tmp_path, seed):
    """SD3 under a host budget of 85 % of its checkpoint: blocks read from disk per use and
    kept ones (private copies), promoted and demoted between calls (a promoted disk block is
    packed from the mapping once): random skip_layers paths equal resident."""
    rng = random.Random(seed)
    reference = SD3.build(seed=3)
    reference.save_pretrained(tmp_path / "sd3")
    size = (tmp_path / "sd3" / "diffusion_pytorch_model.safetensors").stat().st_size
    model, plan = dlo.load_transformer(tmp_path / "sd3")
    config = dlo.OffloadConfig(host_budget_gib=0.85 * size / 2**30)
    with dlo.enable(model, "cpu", config, plan=plan) as handle:
        runtime = handle._runtime
        on_disk = set(handle.stats().disk.blocks)
        assert 0 < len(on_disk) < len(runtime.blocks)

        def promoted_blocks_are_not_read():
            promoted = {runtime.blocks[i].name for i in runtime.promoted}
            assert set(handle.stats().disk.blocks) == on_disk - promoted

        random_skip_calls(rng, model, reference, runtime, promoted_blocks_are_not_read)


@pytest.mark.parametrize("first", ["inference_mode", "no_grad"])
def test_views_made_in_one_grad_mode_serve_calls_in_the_other(tmp_path, first):
    """A slot's views are made at a block's first load, inside a call: one made under inference
    mode must still take a float8 weight dequantized into it in a later call under no_grad, and
    the other way round. Equal to the quantized resident model."""
    reference, model, plan, config = mixed_sd3(tmp_path)
    modes = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}
    order = [first, "no_grad" if first == "inference_mode" else "inference_mode"]

    def call(module, seed, mode):
        with modes[mode]():
            return module(**SD3.inputs(seed))[0]

    expected = [call(reference, seed, "inference_mode") for seed in (0, 1)]
    with dlo.enable(model, "cpu", config, plan=plan):
        got = [call(model, seed, mode) for seed, mode in zip((0, 1), order)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def flux_outputs(model, seeds):
    with torch.inference_mode():
        return [model(**FLUX.inputs(seed))[0] for seed in seeds]


def _interrupt_point(monkeypatch, owner, name, at, after=False):
    """Raise KeyboardInterrupt in the main thread at the `at`-th call of `owner.name` (before
    it runs, or `after` it ran); returns the list of calls seen."""
    real = getattr(owner, name)
    calls = []

    def interrupted(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return real(*args, **kwargs)
        calls.append(name)
        if len(calls) == at and not after:
            raise KeyboardInterrupt
        result = real(*args, **kwargs)
        if len(calls) == at:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(owner, name, interrupted)
    return calls


# Inside the planner's decision; between a load queued and its commit (the copy issued, the
# planner not told); inside a slot refit (the old buffer retired, the new one not yet taken;
# the new one taken, its state not yet made); before a block's views or copies in a new buffer
# are made, and right after; the preload's record.
POINTS = [
    (SlotPlanner, "decide", False),
    (SlotPlanner, "commit", False),
    (CpuExecutor, "run", True),
    (CpuExecutor, "allocate_slot", False),
    (BlockLoads, "state_of", False),
    (PerBlock, "__getitem__", False),
    (PerBlock, "__getitem__", True),
    (SlotQueue, "settle", False),
]


# Staged loads run on the stager's thread, where no Ctrl-C lands.
CASES = [
    pytest.param(backing, *point, id=f"{backing}-{point[0].__name__}.{point[1]}{'-after' if point[2] else ''}")
    for backing in ("packed", "staged")
    for point in POINTS
    if (backing, point[1]) != ("staged", "run")
]


@pytest.mark.parametrize(("backing", "owner", "name", "after"), CASES)
def test_ctrl_c_at_every_step_of_a_call_leaves_the_next_calls_exact(tmp_path, monkeypatch, owner, name, after, backing):
    """A KeyboardInterrupt at each invocation of each step of a call (tiny Flux: two block
    sizes, so slots are refitted), caught as a notebook would: the next calls equal resident."""
    reference = FLUX.build(seed=1)
    expected = flux_outputs(reference, [0, 1])
    if backing == "staged":
        reference.save_pretrained(tmp_path / "flux")
    count_calls = _interrupt_point(monkeypatch, owner, name, at=0)
    fresh = (lambda: dlo.load_transformer(tmp_path / "flux")) if backing == "staged" else (lambda: (copy.deepcopy(reference), None))
    model, plan = fresh()
    with dlo.enable(model, "cpu", plan=plan):
        flux_outputs(model, [0])
        count_calls.clear()
        flux_outputs(model, [0])
        invocations = len(count_calls)  # how often one call runs the step
    assert invocations > 0
    monkeypatch.undo()
    for at in range(1, invocations + 1):
        model, plan = fresh()
        with dlo.enable(model, "cpu", plan=plan):
            flux_outputs(model, [0])
            with monkeypatch.context() as patch:
                _interrupt_point(patch, owner, name, at, after)
                with pytest.raises(KeyboardInterrupt):
                    flux_outputs(model, [0])
            assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled(), at  # the caller's modes back
            assert [torch.equal(a, b) for a, b in zip(flux_outputs(model, [0, 1]), expected)] == [True, True], at


@pytest.mark.parametrize("host_budget", [None, 0.4], ids=["staged", "disk-tier"])
def test_interrupts_at_random_instants_never_leave_a_wrong_output(tmp_path, host_budget):
    """An alarm raising KeyboardInterrupt at a random instant of a call (the way a reviewer
    found the bricked slot): after each caught interrupt, a whole call equals resident. With
    a host budget of 40 % of the checkpoint, most blocks are read from disk per use (See
    [Note: the disk tier]), the rest kept as private copies."""
    reference = FLUX.build(seed=1)
    expected = flux_outputs(reference, [0])[0]
    reference.save_pretrained(tmp_path / "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    size = (tmp_path / "flux" / "diffusion_pytorch_model.safetensors").stat().st_size
    config = dlo.OffloadConfig(host_budget_gib=host_budget and host_budget * size / 2**30)
    rng = random.Random(0)

    def alarm(sig, frame):
        raise KeyboardInterrupt("alarm")

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        with dlo.enable(model, "cpu", config, plan=plan) as handle:
            assert (handle.stats().disk is not None) == (host_budget is not None)
            started = time.perf_counter()
            flux_outputs(model, [0])
            call_s = time.perf_counter() - started
            interrupted = 0
            for _ in range(40):
                try:  # an alarm that fires after the call returned, while it is disarmed, is caught here too
                    signal.setitimer(signal.ITIMER_REAL, rng.uniform(0, call_s))
                    try:
                        flux_outputs(model, [0])
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                except KeyboardInterrupt:
                    interrupted += 1
                assert torch.equal(flux_outputs(model, [0])[0], expected)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert interrupted > 0


def test_a_failed_step_in_all_gather_mode_breaks_off_instead_of_guessing():
    """All-gather mode (a group of one here) cannot forget its slots as rank-local mode does:
    its loads must stay the peers'. A step cut midway makes every later call raise 'restart
    the job', never run on what the slots may hold."""
    reference = SD3.build(seed=1)
    model = copy.deepcopy(reference)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(use_allgather=True)):
        assert torch.equal(sd3_call(model, 0, []), sd3_call(reference, 0, []))
        with pytest.MonkeyPatch.context() as patch:
            _interrupt_point(patch, SlotPlanner, "commit", at=2)
            with pytest.raises(KeyboardInterrupt):
                sd3_call(model, 0, [])
        with pytest.raises(dlo.StreamingError, match="restart the job"):
            sd3_call(model, 0, [])


PACKAGE = Path(dlo.__file__).parent
TRACED = (str(PACKAGE / "hotpath"), str(PACKAGE / "planning" / "slot_planner.py"))


@functools.cache
def _opens_a_with(filename, lineno):
    return linecache.getline(filename, lineno).lstrip().startswith(("with ", "async with "))


class _LineInterrupt:
    """Raise KeyboardInterrupt at the `at`-th line the main thread runs in dlo's hot path or
    its planner (from a trace function: not a signal, so nothing holds it back, the way a second Ctrl-C
    is not held). `at=None` only counts.

    A `with` line is neither counted nor cut: Python reports it again just before the context's
    `__exit__` is called, past the statement's protection, where a trace function's exception
    would skip the exit (a lock never released) but a signal cannot land. A signal can land at
    the entry of an `__exit__` written in Python (threading.Condition's, contextlib's): those
    called from the traced code are counted and cut at their call."""

    def __init__(self, at, functions=None, files=TRACED, as_signal=False):
        """`functions`: count only the lines of functions of these names; `files`: the
        source paths (prefixes) traced; `as_signal`: send SIGINT there instead (a first
        Ctrl-C: held back inside a held step, raised as it ends)."""
        self.at, self.lines, self.functions, self.files, self.as_signal = at, 0, functions, files, as_signal

    def __enter__(self):
        main = threading.main_thread()

        def cut() -> None:
            self.lines += 1
            if self.lines == self.at:
                if self.as_signal:
                    signal.raise_signal(signal.SIGINT)
                else:
                    raise KeyboardInterrupt(f"line {self.at}")

        def local(frame, event, arg):
            if event == "line" and not _opens_a_with(frame.f_code.co_filename, frame.f_lineno):
                cut()
            return local

        def calls(frame, event, arg):
            if threading.current_thread() is not main:
                return None
            if frame.f_code.co_filename.startswith(self.files):
                return local if self.functions is None or frame.f_code.co_name in self.functions else calls
            caller = frame.f_back
            if frame.f_code.co_name == "__exit__" and caller is not None and caller.f_code.co_filename.startswith(self.files):
                if self.functions is None or caller.f_code.co_name in self.functions:
                    cut()  # where a signal lands: the entry of an __exit__ written in Python
            return None

        sys.settrace(calls)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)


@pytest.mark.parametrize("backing", ["packed", "staged"])
def test_an_interrupt_at_any_line_of_the_hot_path_leaves_the_next_calls_exact(tmp_path, backing):
    """KeyboardInterrupt at sampled lines of everything the hot path runs in one call (tiny
    Flux, fp8: landing buffers, two block sizes: refits), even where a held signal could not
    land: the caller catches it, and the next calls equal resident."""
    config = dlo.OffloadConfig(stream_dtype="fp8", fp8_skip=(r"^transformer_blocks\.0\.",))
    reference = FLUX.build(seed=1)
    model_weights = copy.deepcopy(reference)
    dlo.quantize_resident(reference, config)
    expected = flux_outputs(reference, [0, 1])
    if backing == "staged":
        model_weights.save_pretrained(tmp_path / "flux")

    def fresh():
        return dlo.load_transformer(tmp_path / "flux", config) if backing == "staged" else (copy.deepcopy(model_weights), None)

    model, plan = fresh()
    with dlo.enable(model, "cpu", config, plan=plan):
        flux_outputs(model, [0])
        counts = []
        for _ in range(3):
            with _LineInterrupt(None) as counted:
                flux_outputs(model, [0])
            counts.append(counted.lines)
    # With a staging thread the main thread's waits run more or fewer lines from one call to the
    # next: sample below the fewest seen, and say so where a call still ran fewer.
    rng = random.Random(backing)
    for at in sorted(rng.sample(range(1, min(counts) + 1), 16)):
        model, plan = fresh()
        with dlo.enable(model, "cpu", config, plan=plan):
            flux_outputs(model, [0])
            interrupted = _LineInterrupt(at)
            try:
                with interrupted:
                    flux_outputs(model, [0])
            except KeyboardInterrupt:
                pass
            else:
                assert backing == "staged" and interrupted.lines < at, f"line {at} of {counts} was never cut"
            got = flux_outputs(model, [0, 1])
        assert [torch.equal(a, b) for a, b in zip(got, expected)] == [True, True], at


def test_an_interrupt_at_any_line_of_a_slot_replacement_leaves_streaming_exact():
    """replace_slots() (automatic residency's step) cut at each of its lines: the runtime never
    stays without slots, and every later call equals resident."""
    config = dlo.OffloadConfig(num_slots=2, stream_dtype="fp8", fp8_skip=(r"^blocks\.[03]\.",))
    reference = Nested()
    for p in reference.parameters():
        nn.init.normal_(p, std=0.3)
    weights = copy.deepcopy(reference)
    dlo.quantize_resident(reference, config)
    x = torch.randn(3, 8)
    path = list(range(len(reference.blocks)))
    with torch.no_grad():
        expected = reference(x, path)

    def replaced(at):
        model = copy.deepcopy(weights)
        with dlo.enable(model, "cpu", config) as handle, torch.no_grad():
            runtime = handle._runtime
            model(x, path)
            with _LineInterrupt(at, {"replace_slots", "_replace_slots", "_allocate_slots"}) as counted:
                try:
                    runtime.replace_slots(3, runtime.slot_capacity)
                except KeyboardInterrupt:
                    pass
            assert [torch.equal(model(x, path), expected) for _ in range(2)] == [True, True], at
        return counted.lines

    for at in range(1, replaced(None) + 1):
        replaced(at)


@pytest.mark.parametrize("restore", [True, False])
def test_an_interrupt_at_any_line_of_disable_then_disable_again_ends_it_exactly(tmp_path, restore):
    """disable() of a mapped model cut at each of its lines (a KeyboardInterrupt raised there,
    as a second Ctrl-C is: nothing holds it back), then disable() again: it ends, and the
    module either equals the resident model or, once the first call had chosen restore=False,
    refuses calls. (Cut after the mapping closed, the second call used to restore the blocks
    from the closed mapping, a TypeError on every later disable().)"""
    FLUX.build(seed=1).save_pretrained(tmp_path / "flux")
    expected = flux_outputs(FLUX.build(seed=1), [0])
    handle_file = (str(PACKAGE / "backend" / "handle.py"),)

    def cut(at):
        model, plan = dlo.load_transformer(tmp_path / "flux")
        handle = dlo.enable(model, "cpu", plan=plan)
        flux_outputs(model, [0])
        with _LineInterrupt(at, {"disable"}, handle_file) as counted:
            try:
                handle.disable(restore=restore)
            except KeyboardInterrupt:
                pass
        final = handle.disable()
        assert handle.disable() is final and handle.state is dlo.HandleState.DISABLED
        if restore or handle._restored_with:  # the first call cut before choosing: the second chose
            assert torch.equal(flux_outputs(model, [0])[0], expected[0]), at
        else:
            with pytest.raises(dlo.StreamingError, match="disabled with restore=False"):
                flux_outputs(model, [0])
        return counted.lines

    for at in range(1, cut(None) + 1):
        cut(at)


def test_a_ctrl_c_at_any_line_of_an_edit_leaves_the_edit_in_the_next_calls():
    """`handle.editing(block)` of a streamed block, a Ctrl-C (SIGINT) at each line dlo's weight
    changes run: once the edit ran it is kept (what the resident model would have), and the
    next calls stream it, never refused as a write that missed the weights. (Between a block's
    stand-ins coming back and their versions being recorded, an interrupt made the next call
    refuse.)"""
    changes_file = (str(PACKAGE / "backend" / "weight_changes.py"),)
    reference = FLUX.build(seed=1)
    unedited = flux_outputs(reference, [0])[0]
    with torch.no_grad():
        reference.transformer_blocks[1].attn.to_q.weight.mul_(2)
    edited = flux_outputs(reference, [0])[0]

    def cut(at):
        model = FLUX.build(seed=1)
        ran = False
        with dlo.enable(model, "cpu") as handle:
            flux_outputs(model, [0])
            block = model.transformer_blocks[1]
            with _LineInterrupt(at, files=changes_file, as_signal=True) as counted:
                try:
                    with handle.editing(block), torch.no_grad():
                        block.attn.to_q.weight.mul_(2)
                        ran = True
                except KeyboardInterrupt:
                    pass
            assert torch.equal(flux_outputs(model, [0])[0], edited if ran else unedited), at
        return counted.lines

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    for at in range(1, cut(None) + 1):
        cut(at)


@pytest.mark.parametrize("change", ["fuse", "unmerge each layer"])
def test_a_ctrl_c_at_any_line_of_a_lora_fuse_or_unmerge_leaves_each_layers_weights_as_it_lists_them(tiny_loras, change):
    """diffusers' fuse_lora() (the handle's while enabled) and a pipeline's unfuse (each merged
    layer's unmerge(), which dlo replaces), a Ctrl-C (SIGINT) at sampled lines of dlo's fusion
    and weight-change code and of PEFT's LoRA layer: every layer's weights hold what it lists
    merged, so the next call equals a resident model whose layers hold what the streamed ones
    list, and is not refused. (PEFT changes a weight and its merged list in two steps; cut
    between them, a layer would apply its LoRA on top of a fused weight, or none.)"""
    from peft.tuners.lora import layer as lora_layer
    from peft.tuners.tuners_utils import BaseTunerLayer

    files = (str(PACKAGE / "backend" / "lora_fusion.py"), str(PACKAGE / "backend" / "weight_changes.py"), lora_layer.__file__)
    lora = tiny_loras("flux")["a"]

    def loaded():
        model = FLUX.build(seed=1)
        model.load_lora_adapter(lora, adapter_name="a", prefix="transformer")
        return model

    def layers(model):
        return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]

    def cut(at):
        model = loaded()
        with dlo.enable(model, "cpu"):
            flux_outputs(model, [0])
            if change != "fuse":
                model.fuse_lora()
            with _LineInterrupt(at, files=files, as_signal=True) as counted:
                try:
                    if change == "fuse":
                        model.fuse_lora()
                    else:  # the layers of streamed blocks: PEFT's own unmerge elsewhere is as resident
                        for layer in layers(model.transformer_blocks) + layers(model.single_transformer_blocks):
                            layer.unmerge()
                except KeyboardInterrupt:
                    pass
            reference = loaded()
            if change != "fuse":
                reference.fuse_lora()
            for mine, theirs in zip(layers(reference), layers(model)):
                if theirs.merged != mine.merged:
                    mine.merge() if theirs.merged else mine.unmerge()
            assert torch.equal(flux_outputs(model, [0])[0], flux_outputs(reference, [0])[0]), at
        return counted.lines

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    lines = cut(None)
    for at in sorted(random.Random(change).sample(range(1, lines + 1), min(24, lines))):
        cut(at)


def test_a_staged_load_submitted_as_its_step_was_cut_is_waited_for(tmp_path, monkeypatch):
    """Cut between the stager taking a job and the slot's queue recording it (a second Ctrl-C
    may land there): the job still lands, 0.3 s later, over whatever its slot holds by then;
    the next step waits for it first, so none of the calls during those 0.3 s is wrong (they
    skip the staged block, so no other wait for the stager orders them after it)."""
    from dlo.hotpath import slot_queue

    reference, model, plan, config = mixed_sd3(tmp_path)
    expected = [sd3_call(reference, seed, []) for seed in range(2)]
    skipping = sd3_call(reference, 1, [2])  # the packed blocks only: nothing waits for the stager
    real_job, real_pack, orphan = slot_queue._Job, BlockLoads.pack_tasks, {}

    def job(*args):
        if orphan.pop("cut", False):
            raise KeyboardInterrupt("between submit and the queue's record")
        return real_job(*args)

    def pack(self, index, staging):
        if orphan.pop("slow", False):
            time.sleep(0.3)
        return real_pack(self, index, staging)

    monkeypatch.setattr(slot_queue, "_Job", job)
    monkeypatch.setattr(BlockLoads, "pack_tasks", pack)
    equal = []
    with dlo.enable(model, "cpu", config, plan=plan):
        for _ in range(4):  # the orphan lands at a moment of its own each time
            assert torch.equal(sd3_call(model, 0, []), expected[0])
            orphan.update(cut=True, slow=True)
            with pytest.raises(KeyboardInterrupt):
                sd3_call(model, 1, [])
            started = time.perf_counter()
            while time.perf_counter() - started < 0.5:
                equal.append(torch.equal(sd3_call(model, 1, [2]), skipping))
    assert equal and all(equal)


def test_a_failed_staged_load_found_by_stats_and_cut_before_its_slot_is_forgotten(tmp_path):
    """stats() finds the next call's first load failed, and is cut before the planner forgets
    that slot: the block must be loaded again, not run from the slot's old bytes."""
    directory = tmp_path / "sd3"
    SD3.build(seed=3).save_pretrained(directory)
    reference = SD3.build(seed=3).to(torch.bfloat16)
    model, plan = dlo.load_transformer(directory, torch_dtype=torch.bfloat16)  # a cast: every block is staged

    def call(m, seed):
        with torch.inference_mode():
            return m(**SD3.inputs(seed, torch.bfloat16))[0]

    expected = [call(reference, seed) for seed in range(3)]
    real_pack, real_forget, armed = BlockLoads.pack_tasks, SlotPlanner.forget, {}

    def pack(self, index, staging):
        if armed.get("pack") and index == 0:
            armed["pack"] = False
            raise OSError("read error (test)")
        return real_pack(self, index, staging)

    def forget(self, *slots):
        if armed.pop("forget", False):
            raise KeyboardInterrupt
        return real_forget(self, *slots)

    # Armed once the call's third block ran: the last block's start prefetches the next call's block 0.
    model.transformer_blocks[2].register_forward_hook(lambda *_: armed.update(pack=armed.get("pack", True)))
    with dlo.enable(model, "cpu", plan=plan) as handle, pytest.MonkeyPatch.context() as patch:
        patch.setattr(BlockLoads, "pack_tasks", pack)
        patch.setattr(SlotPlanner, "forget", forget)
        assert torch.equal(call(model, 0), expected[0])
        armed["forget"] = True
        with pytest.raises((KeyboardInterrupt, OSError)):
            handle.stats()
        assert [torch.equal(call(model, seed), expected[seed]) for seed in (1, 2)] == [True, True]


def test_an_interrupt_at_any_line_of_a_call_with_a_host_lookup_leaves_the_next_calls_exact():
    """A T5 encoder whose embedding looks its rows up on the host (See [Note: token embeddings
    looked up on the host]), cut at sampled lines of everything the hot path runs in one call:
    the next calls equal resident."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    reference = T5EncoderModel(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=3, num_heads=4)).eval()
    plan = dlo.OffloadPlan(block_lists=("encoder.embed_tokens", "encoder.block"), host_lookups=("encoder.embed_tokens",))
    ids = [torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(seed)) for seed in range(2)]

    def encode(model, seed):
        with torch.inference_mode():
            return model(ids[seed]).last_hidden_state

    expected = [encode(reference, seed) for seed in range(2)]
    model = copy.deepcopy(reference)
    with dlo.enable(model, "cpu", plan=plan):
        encode(model, 0)
        with _LineInterrupt(None) as counted:
            encode(model, 0)
    for at in sorted(random.Random(0).sample(range(1, counted.lines + 1), 24)):
        model = copy.deepcopy(reference)
        with dlo.enable(model, "cpu", plan=plan):
            encode(model, 0)
            with pytest.raises(KeyboardInterrupt):
                with _LineInterrupt(at):
                    encode(model, 0)
            assert [torch.equal(encode(model, seed), expected[seed]) for seed in range(2)] == [True, True], at
