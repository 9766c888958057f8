"""resident_layers='auto': the planner's model and search (integers), and residency changed
between calls on real diffusers models, bit-identical. See [Note: automatic residency]"""

import copy
import gc
import itertools
import random
import weakref

import pytest
import torch

import dlo
from dlo.planning.plan_summary import summarize
from dlo.planning.residency import BlockCost, choose_residency, device_bytes, simulate
from dlo.planning.slot_planner import SlotPlanner

GIB = 2**30


def uniform(n, nbytes=4, compute_s=1.0):
    return [BlockCost(nbytes, compute_s) for _ in range(n)]


def test_a_resident_model_costs_its_compute():
    costs = [BlockCost(4, 1.0), BlockCost(4, 2.0), BlockCost(8, 3.0)]
    assert simulate(costs, {0, 1, 2}, 2, bytes_per_s=1.0, between_s=0.5) == 6.5


def test_compute_bound_streaming_costs_its_compute():
    # Copies of 0.1 s behind 1 s blocks: hidden, once the first call filled the slots.
    assert simulate(uniform(6, nbytes=1), (), 2, bytes_per_s=10.0) == pytest.approx(6.0)


def test_transfer_bound_streaming_costs_its_copies():
    # 2 s copies, 0.1 s blocks: the copy engine never idles, one copy per streamed block.
    assert simulate(uniform(6, nbytes=2, compute_s=0.1), (), 2, bytes_per_s=1.0) == pytest.approx(12.0)


def test_on_a_device_whose_copies_do_not_overlap_every_copy_adds():
    costs = uniform(5, nbytes=2, compute_s=1.0)
    assert simulate(costs, {0}, 2, bytes_per_s=1.0, overlap=False) == pytest.approx(5.0 + 4 * 2.0)


def test_streamed_blocks_that_fit_the_slots_are_copied_once():
    assert simulate(uniform(4, nbytes=100), {0, 1}, 2, bytes_per_s=1.0) == 4.0


def test_device_bytes_are_the_resident_blocks_and_slots_of_the_largest_streamed_block():
    costs = [BlockCost(8, 1.0), BlockCost(4, 1.0), BlockCost(4, 1.0), BlockCost(4, 1.0)]
    assert device_bytes(costs, {0}, 2) == 8 + 2 * 4
    assert device_bytes(costs, {1}, 3) == 4 + 3 * 8
    assert device_bytes(costs, {0, 1, 2, 3}, 2) == 20  # nothing streamed: no slots


def planner_timeline(costs, resident, num_slots, bytes_per_s, between_s, calls=4):
    """Seconds of the last of `calls` calls when the real SlotPlanner decides every load: a
    copy starts once the copy engine is free and its slot's last block finished; a block
    computes once its copy landed and the previous block finished."""
    planner = SlotPlanner(len(costs), num_slots)
    for block in resident:
        planner.promote(block)
    copy_free = done = call_start = 0.0
    landed = [0.0] * num_slots
    released = [0.0] * num_slots
    for _ in range(calls):
        call_start = done
        done += between_s
        for block, cost in enumerate(costs):
            if planner.is_resident(block):
                done += cost.compute_s
                continue
            start = planner.decide(block)
            planner.commit(start)
            for load in ([start.demand] if start.demand else []) + list(start.prefetch):
                copy_free = max(copy_free, released[load.slot]) + costs[load.block].nbytes / bytes_per_s
                landed[load.slot] = copy_free
            done = max(done, landed[start.slot]) + cost.compute_s
            planner.end(block)
            released[start.slot] = done
    return done - call_start


@pytest.mark.parametrize("seed", range(3))
def test_the_model_predicts_what_the_slot_planner_schedules(seed):
    randomness = random.Random(seed)
    for _ in range(80):
        n = randomness.randint(2, 9)
        costs = [BlockCost(randomness.choice([2, 4, 8]), float(randomness.randint(1, 6))) for _ in range(n)]
        resident = {i for i in range(n) if randomness.random() < 0.3}
        slots = randomness.choice([2, 3, 4])
        rate = randomness.choice([0.5, 1.0, 4.0])
        between_s = randomness.choice([0.0, 3.0])
        expected = planner_timeline(costs, resident, slots, rate, between_s)
        assert simulate(costs, resident, slots, rate, between_s) == pytest.approx(expected), (costs, resident, slots)


def brute_force(costs, bytes_per_s, budget, between_s, slot_counts=(2, 3, 4)):
    best = None
    for count in range(len(costs) + 1):
        for resident in itertools.combinations(range(len(costs)), count):
            for slots in slot_counts:
                if device_bytes(costs, resident, slots) <= budget:
                    seconds = simulate(costs, resident, slots, bytes_per_s, between_s)
                    best = seconds if best is None else min(best, seconds)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_the_choice_is_as_fast_as_the_best_of_every_subset_and_slot_count(seed):
    randomness = random.Random(seed)
    checked = 0
    for _ in range(60):
        n = randomness.randint(2, 8)
        sizes = [randomness.choice([4, 8]) for _ in range(2)]
        seconds = {size: float(randomness.randint(1, 10)) for size in sizes}
        costs = [BlockCost(size, seconds[size]) for size in (randomness.choice(sizes) for _ in range(n))]
        rate = randomness.choice([0.5, 1.0, 2.0, 4.0])
        between_s = randomness.choice([0.0, 2.0, 5.0])
        budget = randomness.randint(8, sum(c.nbytes for c in costs) + 16)
        choice = choose_residency(costs, rate, budget, between_s)
        best = brute_force(costs, rate, budget, between_s)
        if best is None:
            assert choice is None
            continue
        checked += 1
        assert choice.device_bytes <= budget
        assert choice.call_s == pytest.approx(best)
    assert checked > 40


def test_spread_residents_beat_the_leading_ones_where_copies_need_compute_around_them():
    # Copies of 1.5 s behind 1 s blocks: alone, a copy cannot hide behind one block.
    costs = uniform(8, nbytes=3, compute_s=1.0)
    budget = 2 * 3 + 2 * 3  # two resident blocks and two slots
    choice = choose_residency(costs, 2.0, budget, slot_counts=(2,))
    prefix = simulate(costs, {0, 1}, 2, 2.0)
    assert choice.call_s < prefix
    assert choice.resident != {0, 1}


def test_residents_are_chosen_among_the_candidates_only():
    costs = uniform(6, nbytes=2, compute_s=0.1)
    choice = choose_residency(costs, 1.0, budget_bytes=100, candidates=[1, 4])
    assert choice.resident <= {1, 4}


def test_the_slots_charged_are_the_slots_allocated():
    # No resident candidates: 5 blocks stream through at most 5 slots, never the 8 offered,
    # and one streamed block still takes the 2 slots the planner needs.
    choice = choose_residency(uniform(5, nbytes=10), 1.0, budget_bytes=80, slot_counts=(2, 3, 4, 8), candidates=[])
    assert choice.num_slots <= 5 and choice.device_bytes == choice.num_slots * 10 <= 80
    one_streamed = choose_residency(uniform(4, nbytes=10), 1.0, budget_bytes=40, candidates=[0, 1, 2])
    # Three resident and one streamed would be 30 + 2 slots of 10 > 40.
    assert len(one_streamed.resident) == 2 and one_streamed.num_slots == 2 and one_streamed.device_bytes == 40


def test_a_budget_below_two_slots_has_no_choice():
    assert choose_residency(uniform(4, nbytes=10), 1.0, budget_bytes=19) is None


# --- on real models ---------------------------------------------------------------------


def outputs(model, entry, calls=4):
    with torch.inference_mode():
        return [model(**entry.inputs(seed, torch.float32, "cpu"))[0] for seed in range(calls)]


@pytest.mark.parametrize("name", ["wan", "flux"])
def test_auto_residency_plans_after_the_measured_call_and_stays_bit_identical(tiny_pair, name):
    reference, streamed, entry = tiny_pair(name)
    expected = outputs(reference, entry)
    summary = summarize(streamed, dlo.discover(streamed))
    smallest = min(block.nbytes for block in summary.blocks)
    # Room for what streaming needs and about one more block (the planner keeps 2 % free).
    budget = (summary.device_weight_bytes + 1.5 * smallest) / 0.98
    config = dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=budget / GIB)
    with dlo.enable(streamed, "cpu", config) as handle:
        with torch.inference_mode():
            first = [streamed(**entry.inputs(seed, torch.float32, "cpu"))[0] for seed in range(2)]
            assert handle.stats().residency.state == "planned"  # at the end of the second call
            rest = [streamed(**entry.inputs(seed, torch.float32, "cpu"))[0] for seed in range(2, 4)]
        stats = handle.stats()
        buffers = [slot.buffer for slot in handle._runtime.slots]
        slots = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers]
        for name in stats.residency.resident:  # their own memory, in no slot
            for param in streamed.get_submodule(name).parameters():
                assert param.numel() > 0 and not any(lo <= param.data_ptr() < hi for lo, hi in slots)
    assert all(torch.equal(a, b) for a, b in zip(expected, first + rest))
    residency = stats.residency
    assert 1 <= len(residency.resident) < len(summary.blocks)
    assert stats.resident_blocks == len(residency.resident)
    assert stats.device_weight_bytes <= budget
    assert len(residency.block_compute_s) == len(summary.blocks)
    assert residency.predicted_call_s > 0 and residency.measured_call_s > 0


def test_what_another_phase_holds_beside_the_module_limits_its_resident_blocks(tiny_pair):
    """A pipeline's decode holds memory outside the module's calls, which its measured peak
    never sees: handed over with hold_beside(), the blocks and slots fit beside it."""
    reference, streamed, entry = tiny_pair("wan")
    expected = outputs(reference, entry)
    summary = summarize(streamed, dlo.discover(streamed))
    smallest = min(block.nbytes for block in summary.blocks)
    budget = (summary.device_weight_bytes + 2.5 * smallest) / 0.98
    config = dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=budget / GIB)
    resident = {}
    for beside in (0, summary.non_block_bytes + 2 * smallest):
        with dlo.enable(copy.deepcopy(streamed), "cpu", config) as handle:
            handle.hold_beside(lambda: beside)
            assert all(torch.equal(a, b) for a, b in zip(expected, outputs(handle.module, entry, 4)))
            stats = handle.stats()
        resident[beside] = sum(b.nbytes for b in summary.blocks if b.name in stats.residency.resident)
        assert stats.residency.state == "planned"
        # Every phase inside the budget: the other one (beside the non-block parts it includes)
        # with the resident blocks and the slots.
        assert max(beside, summary.non_block_bytes) + resident[beside] + stats.slot_bytes <= int(budget * 0.98)
    assert resident[0] >= 2 * smallest and resident[summary.non_block_bytes + 2 * smallest] < resident[0]


@pytest.mark.parametrize(
    "resident",
    [(), (0,), (0, 2), (1, 2, 3), (0, 1, 2, 3)],
    ids=["none", "one", "every-other", "all-but-one", "all"],
)
def test_any_resident_set_is_bit_identical_before_and_after_it_changes(tiny_pair, resident):
    reference, streamed, entry = tiny_pair("wan")
    expected = outputs(reference, entry, calls=3)
    with dlo.enable(streamed, "cpu") as handle:
        runtime = handle._runtime
        got = outputs(streamed, entry, calls=1)
        for index in resident:
            runtime.promote(index)
        if len(resident) == len(runtime.blocks):
            runtime.replace_slots(0, 0)
        got += outputs(streamed, entry, calls=1)
        if len(resident) == len(runtime.blocks):
            runtime.replace_slots(3, runtime.blocks[0].layout.nbytes)
        for index in resident:
            runtime.demote(index)
        got += outputs(streamed, entry, calls=1)
        stats = handle.stats()
    assert all(torch.equal(expected[0], g) for g in got)
    assert stats.resident_blocks == 0


@pytest.mark.parametrize("when", ["enable", "replace_slots"])
def test_slots_made_under_inference_mode_take_copies_in_later_no_grad_calls(tiny_pair, when):
    """A CUDA load copies into the slots and the views made of them with torch's `copy_`,
    which refuses inference tensors outside inference mode: made in a call under
    inference_mode (enable() there, or automatic residency replacing the slots in a hook),
    they must still take copies in a later call under no_grad."""
    reference, streamed, entry = tiny_pair("wan")
    expected = outputs(reference, entry, calls=1)
    with torch.inference_mode():
        handle = dlo.enable(streamed, "cpu")
        runtime = handle._runtime
        if when == "replace_slots":
            runtime.replace_slots(3, runtime.blocks[0].layout.nbytes)
    with handle, torch.no_grad():
        for slot, views in ((queue.state.slot, queue.state.views) for queue in runtime.queues):
            slot.buffer.copy_(torch.full_like(slot.buffer, 7))
            for view in filter(None, views):
                for tensor in view:
                    tensor.copy_(torch.zeros_like(tensor))
        got = streamed(**entry.inputs(0, torch.float32, "cpu"))[0]
    assert torch.equal(expected[0], got)


def test_a_budget_below_what_streaming_needs_is_refused_before_anything_moves(tiny_pair):
    _, streamed, _ = tiny_pair("flux")
    before = {name: p.data_ptr() for name, p in streamed.named_parameters()}
    config = dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=100_000 / GIB)
    refused = r"hbm_budget_gib=.*below the 0\.00 GiB that streaming .* raise hbm_budget_gib"
    with pytest.raises(dlo.ConfigError, match=refused):
        dlo.enable(streamed, "cpu", config)
    assert {name: p.data_ptr() for name, p in streamed.named_parameters()} == before


def test_auto_residency_on_the_cpu_needs_a_budget(tiny_pair):
    _, streamed, _ = tiny_pair("wan")
    with pytest.raises(dlo.ConfigError, match="on the CPU needs hbm_budget_gib"):
        dlo.enable(streamed, "cpu", dlo.OffloadConfig(resident_layers="auto"))


def auto_everything(streamed):
    """A budget where every block fits: the plan drops the slots and promotes every block."""
    summary = summarize(streamed, dlo.discover(streamed))
    return dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=summary.total_bytes * 4 / GIB)


def call(model, entry, seed):
    with torch.inference_mode():
        return model(**entry.inputs(seed, torch.float32, "cpu"))[0]


@pytest.mark.parametrize(
    "failure", [torch.OutOfMemoryError("out of memory here"), RuntimeError("boom")], ids=["oom", "other"]
)
def test_a_plan_that_fails_midway_is_undone_and_streaming_goes_on(tiny_pair, monkeypatch, failure):
    """The second of five promotions fails, after the slots were dropped and one block was
    promoted: the promoted block is demoted, slots of the old shape come back."""
    reference, streamed, entry = tiny_pair("flux")
    expected = outputs(reference, entry, calls=5)
    with dlo.enable(streamed, "cpu", auto_everything(streamed)) as handle:
        runtime = handle._runtime
        shape = [slot.buffer.numel() for slot in runtime.slots]
        promote, promotions = runtime.promote, []

        def second_fails(index):
            promotions.append(index)
            if len(promotions) == 2:
                raise failure
            return promote(index)

        monkeypatch.setattr(runtime, "promote", second_fails)
        got = [call(streamed, entry, 0)]
        if isinstance(failure, torch.OutOfMemoryError):
            got.append(call(streamed, entry, 1))
            assert handle.stats().residency.state == "kept"
            assert "out of memory here" in handle.stats().residency.note
        else:  # not what a plan may run into: raised to the caller (the call's work is done)
            with pytest.raises(RuntimeError, match="boom"):
                call(streamed, entry, 1)
        assert [slot.buffer.numel() for slot in runtime.slots] == shape
        assert not runtime.promoted
        if not isinstance(failure, torch.OutOfMemoryError):  # measured again, planned this time
            got.append(call(streamed, entry, 1))
        got += [call(streamed, entry, seed) for seed in (2, 3, 4)]
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    if isinstance(failure, RuntimeError) and not isinstance(failure, torch.OutOfMemoryError):
        assert stats.residency.state == "planned" and stats.resident_blocks == 5  # the retry succeeded


@pytest.mark.parametrize("name", ["wan", "flux"])  # flux: after a call, a slot holds its smaller class's buffer
def test_slots_that_cannot_be_allocated_again_leave_a_clear_error(tiny_pair, monkeypatch, name):
    reference, streamed, entry = tiny_pair(name)
    expected = outputs(reference, entry, calls=2)
    with dlo.enable(streamed, "cpu") as handle:
        runtime = handle._runtime
        allocate = runtime.executor.allocate_slot
        shape = [runtime.slot_capacity] * len(runtime.slots)
        assert torch.equal(call(streamed, entry, 1), expected[1])
        attempts = []

        def full_once(nbytes):  # the new slots fail; the old shape is allocated again
            attempts.append(nbytes)
            if len(attempts) == 1:
                raise torch.OutOfMemoryError("full")
            return allocate(nbytes)

        monkeypatch.setattr(runtime.executor, "allocate_slot", full_once)
        with pytest.raises(torch.OutOfMemoryError):
            runtime.replace_slots(3, shape[0])
        assert [slot.buffer.numel() for slot in runtime.slots] == shape
        assert torch.equal(call(streamed, entry, 0), expected[0])

        def full(nbytes):
            raise torch.OutOfMemoryError("full")

        monkeypatch.setattr(runtime.executor, "allocate_slot", full)
        with pytest.raises(dlo.StreamingError, match="no block can stream until disable"):
            runtime.replace_slots(3, shape[0])
        with pytest.raises(dlo.StreamingError, match="slots were dropped"):
            call(streamed, entry, 1)


def test_calls_that_raise_are_measured_again_then_given_up(tiny_pair):
    reference, streamed, entry = tiny_pair("wan")
    expected = outputs(reference, entry, calls=2)

    def not_now(module, args):
        raise ValueError("not now")

    with dlo.enable(streamed, "cpu", auto_everything(streamed)) as handle:
        call(streamed, entry, 0)  # the warm-up call
        hook = streamed.blocks[2].register_forward_pre_hook(not_now)
        for _ in range(3):  # blocks 2 and 3 never finish: nothing to plan with
            with pytest.raises(ValueError, match="not now"):
                call(streamed, entry, 0)
            assert handle.stats().resident_blocks == 0
        hook.remove()
        got = [call(streamed, entry, seed) for seed in range(2)]
        stats = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert stats.residency.state == "kept" and "did not run" in stats.residency.note
    assert stats.resident_blocks == 0


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(hbm_budget_gib=4.0), "set resident_layers='auto'"),
        (dict(resident_layers="all"), "an int >= 0 or 'auto'"),
        (dict(resident_layers="auto", hbm_budget_gib=-1.0), "hbm_budget_gib must be a finite number > 0"),
        (dict(resident_layers="auto", use_allgather=True), "needs rank-local mode"),
    ],
)
def test_config_rules_for_auto_residency(kwargs, named):
    with pytest.raises(dlo.ConfigError, match=named):
        dlo.OffloadConfig(**kwargs)


def test_disable_frees_the_promoted_blocks_and_slots_while_the_handle_is_kept(tiny_pair):
    """The handle outlives disable() (its final stats are read from it): nothing of the
    runtime, whose slots and promoted blocks are device memory, may stay reachable from it."""
    _, streamed, entry = tiny_pair("wan")
    summary = summarize(streamed, dlo.discover(streamed))
    config = dlo.OffloadConfig(resident_layers="auto", hbm_budget_gib=summary.total_bytes * 4 / GIB)
    handle = dlo.enable(streamed, "cpu", config)
    outputs(streamed, entry, calls=3)
    assert handle.stats().resident_blocks == len(summary.blocks)
    runtime = weakref.ref(handle._runtime)
    promoted = [weakref.ref(memory) for memory in handle._runtime.promoted.values()]
    handle.disable()
    gc.collect()
    assert runtime() is None and all(memory() is None for memory in promoted)
    assert handle.stats().residency.state == "planned"



def _all_promoted_without_slots(runtime) -> None:
    for index in range(len(runtime.blocks)):
        runtime.promote(index)
    runtime.replace_slots(0, 0)


def test_landing_buffers_go_with_the_slots_and_come_back_with_them(tiny_pair):
    """float8 blocks land in a landing buffer before their slot: with every block promoted and
    no slots left, the landing buffers are freed too, and they return with slots."""
    reference, streamed, entry = tiny_pair("wan")
    config = dlo.OffloadConfig(stream_dtype="fp8")
    dlo.quantize_resident(reference, config)
    expected = outputs(reference, entry, calls=1)
    with dlo.enable(streamed, "cpu", config) as handle:
        runtime = handle._runtime
        landing = runtime.executor.landings[0].numel()
        _all_promoted_without_slots(runtime)
        assert runtime.executor.landings == () and handle.stats().device_weight_bytes == (
            sum(memory.numel() for memory in runtime.promoted.values()) + handle._device_weight_bytes
        )
        resident = outputs(streamed, entry, calls=1)
        for index in range(len(runtime.blocks)):
            runtime.demote(index)
        runtime.replace_slots(2, max(block.layout.nbytes for block in runtime.blocks))
        assert [buffer.numel() for buffer in runtime.executor.landings] == [landing]
        streamed_again = outputs(streamed, entry, calls=1)
    assert torch.equal(expected[0], resident[0]) and torch.equal(expected[0], streamed_again[0])


def test_slots_that_cannot_be_allocated_leave_no_landing_buffer_behind(tiny_pair, monkeypatch):
    from dlo.hotpath.executors import CpuExecutor

    _, streamed, _ = tiny_pair("wan")
    with dlo.enable(streamed, "cpu", dlo.OffloadConfig(stream_dtype="fp8")) as handle:
        runtime = handle._runtime
        _all_promoted_without_slots(runtime)
        for index in range(len(runtime.blocks)):
            runtime.demote(index)

        def out_of_memory(self, nbytes):
            raise torch.OutOfMemoryError("fake device out of memory")

        monkeypatch.setattr(CpuExecutor, "allocate_slot", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            runtime.replace_slots(2, max(block.layout.nbytes for block in runtime.blocks))
        assert runtime.executor.landings == () and runtime.slots == []
        monkeypatch.undo()
        runtime.replace_slots(2, max(block.layout.nbytes for block in runtime.blocks))  # disable() streams them back


def test_slots_lost_for_good_take_the_landing_buffers_with_them(tiny_pair, monkeypatch):
    from dlo.hotpath.executors import CpuExecutor

    _, streamed, _ = tiny_pair("wan")
    with dlo.enable(streamed, "cpu", dlo.OffloadConfig(stream_dtype="fp8")) as handle:
        runtime = handle._runtime
        assert runtime.executor.landings  # streaming through 2 slots

        def out_of_memory(self, nbytes):
            raise torch.OutOfMemoryError("fake device out of memory")

        monkeypatch.setattr(CpuExecutor, "allocate_slot", out_of_memory)
        with pytest.raises(dlo.StreamingError, match="and so did allocating the 2 slots of before"):
            runtime.replace_slots(3, max(block.layout.nbytes for block in runtime.blocks))
        assert runtime.executor.landings == () and runtime.slots == []
        monkeypatch.undo()
        runtime.replace_slots(2, max(block.layout.nbytes for block in runtime.blocks))  # disable() streams them back
