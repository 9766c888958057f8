"""The schedule alone, with integers: which slot each block runs from and what is copied."""

import pytest

from dlo.errors import StreamingError
from dlo.planning.slot_planner import BlockStart, Load, SlotPlanner


def begin(planner, block):
    start = planner.decide(block)
    planner.commit(start)
    return start


def preload(planner, block):
    loads, after = planner.decide_preload(block)
    planner.record(after)
    return loads


def run(planner, order):
    starts = []
    for block in order:
        starts.append(begin(planner, block))
        planner.end(block)
    return starts


def test_two_slots_ring_prefetches_next_block_and_wraps():
    planner = SlotPlanner(num_blocks=3, num_slots=2)
    assert run(planner, [0, 1, 2]) == [
        BlockStart(slot=0, demand=Load(0, 0), prefetch=(Load(1, 1),)),
        BlockStart(slot=1, demand=None, prefetch=(Load(2, 0),)),
        # the ring wraps: block 0 of the next call goes into the slot block 1 used
        BlockStart(slot=0, demand=None, prefetch=(Load(0, 1),)),
    ]
    assert run(planner, [0, 1, 2]) == [
        BlockStart(slot=1, demand=None, prefetch=(Load(1, 0),)),
        BlockStart(slot=0, demand=None, prefetch=(Load(2, 1),)),
        BlockStart(slot=1, demand=None, prefetch=(Load(0, 0),)),
    ]
    assert planner.demand_loads == 1


def test_three_slots_copy_two_blocks_ahead():
    planner = SlotPlanner(num_blocks=4, num_slots=3)
    starts = run(planner, [0, 1, 2, 3])
    assert starts[0] == BlockStart(0, Load(0, 0), (Load(1, 1), Load(2, 2)))
    assert starts[1] == BlockStart(1, None, (Load(3, 0),))
    assert starts[2] == BlockStart(2, None, (Load(0, 1),))
    assert starts[3] == BlockStart(0, None, (Load(1, 2),))


def test_fewer_blocks_than_slots_stay_loaded():
    planner = SlotPlanner(num_blocks=2, num_slots=3)
    run(planner, [0, 1])
    assert run(planner, [0, 1, 0, 1]) == [BlockStart(0, None, ()), BlockStart(1, None, ())] * 2


def test_skipped_block_is_learned_and_never_served_stale():
    planner = SlotPlanner(num_blocks=4, num_slots=2)
    run(planner, [0, 1, 2, 3])
    # Block 1 prefetched block 2, but this call skips 2: block 3 was not predicted.
    starts = run(planner, [0, 1, 3])
    assert starts[2].demand is not None and starts[2].demand.block == 3
    # The next call predicts 1 -> 3 and copies nothing on demand.
    starts = run(planner, [0, 1, 3])
    assert [s.demand for s in starts] == [None, None, None]
    assert starts[1].prefetch == (Load(3, starts[0].slot),)


def test_block_called_twice_in_a_row_is_not_copied_again():
    planner = SlotPlanner(num_blocks=3, num_slots=2)
    run(planner, [0, 1, 2])
    starts = run(planner, [0, 0, 1, 2])
    assert starts[1].demand is None and starts[1].slot == starts[0].slot


def test_running_slot_is_never_evicted():
    planner = SlotPlanner(num_blocks=3, num_slots=2)
    outer = begin(planner, 0)
    inner = begin(planner, 2)  # nested: block 2 runs inside block 0
    assert inner.slot != outer.slot
    assert all(load.slot != outer.slot for load in inner.prefetch)
    with pytest.raises(StreamingError, match="num_slots"):
        begin(planner, 1)


def test_reentering_a_running_block_is_an_error():
    planner = SlotPlanner(num_blocks=2, num_slots=2)
    begin(planner, 0)
    with pytest.raises(StreamingError, match="entered again"):
        begin(planner, 0)


def test_end_of_a_block_that_never_started_is_ignored():
    planner = SlotPlanner(num_blocks=2, num_slots=2)
    assert planner.end(1) is None


def test_lockstep_keeps_the_static_order_and_stops_at_the_last_block():
    planner = SlotPlanner(num_blocks=3, num_slots=2, lockstep=True)
    assert preload(planner, 0) == (Load(0, 0), Load(1, 1))
    starts = run(planner, [0, 1, 2])
    assert starts == [
        BlockStart(0, None, ()),
        BlockStart(1, None, (Load(2, 0),)),
        BlockStart(0, None, ()),  # no wrap: the next call's first load waits for its agreement
    ]

    skipping = SlotPlanner(num_blocks=4, num_slots=2, lockstep=True)
    run(skipping, [0, 2, 3])  # block 1 skipped: the transition 0 -> 2 is not learned
    assert [load.block for load in begin(skipping, 0).prefetch] == [1]


def test_preload_fills_every_slot_from_the_first_block():
    planner = SlotPlanner(num_blocks=5, num_slots=3)
    assert preload(planner, 0) == (Load(0, 0), Load(1, 1), Load(2, 2))
    assert run(planner, [0, 1]) == [BlockStart(0, None, ()), BlockStart(1, None, (Load(3, 0),))]


def test_a_promoted_block_is_never_loaded_and_prefetch_passes_over_it():
    planner = SlotPlanner(num_blocks=4, num_slots=2)
    run(planner, [0, 1, 2, 3])  # block 0 is now prefetched into slot 1 for the next call
    planner.promote(0)
    assert planner.is_resident(0) and not planner.is_resident(1)
    # The next call runs 1, 2, 3 (0 runs from its own memory, without begin): block 1 is
    # loaded on demand (0's prefetch was dropped with it), and the ring then wraps past 0.
    assert run(planner, [1, 2, 3]) == [
        BlockStart(slot=0, demand=Load(1, 0), prefetch=(Load(2, 1),)),
        BlockStart(slot=1, demand=None, prefetch=(Load(3, 0),)),
        BlockStart(slot=0, demand=None, prefetch=(Load(1, 1),)),
    ]


def test_with_every_block_promoted_nothing_is_prefetched():
    planner = SlotPlanner(num_blocks=3, num_slots=2)
    run(planner, [0, 1, 2])
    for block in (1, 2):
        planner.promote(block)
    assert begin(planner, 0) == BlockStart(slot=planner.slot_of(0), demand=None, prefetch=())
    planner.end(0)
    planner.promote(0)
    assert preload(planner, 0) == ()


def test_a_running_block_cannot_be_promoted_nor_any_block_in_lockstep():
    planner = SlotPlanner(num_blocks=3, num_slots=2)
    begin(planner, 0)
    with pytest.raises(StreamingError, match="running"):
        planner.promote(0)
    with pytest.raises(StreamingError, match="all-gather"):
        SlotPlanner(num_blocks=3, num_slots=2, lockstep=True).promote(1)


def test_a_decision_changes_nothing_until_it_is_committed():
    planner = SlotPlanner(num_blocks=4, num_slots=2)
    run(planner, [0, 1, 2, 3])
    dropped = planner.decide(2)  # not the predicted block: a demand load
    assert dropped.demand is not None
    planner.decide_preload(3)  # never recorded either
    # As if neither decision was made: the same choices, the same record.
    assert planner.decide(2) == dropped
    assert planner.slot_of(0) is not None and planner.slot_of(2) is None
    assert not planner.is_running(2) and planner.demand_loads == 1
    committed = begin(planner, 2)
    assert planner.is_running(2) and planner.slot_of(2) == committed.slot and planner.demand_loads == 2


def test_a_decision_learns_the_transition_it_starts():
    planner = SlotPlanner(num_blocks=3, num_slots=3)
    run(planner, [0, 1, 2])
    # 2 -> 0 is predicted; starting 1 after 2 instead learns 2 -> 1, and the chain after 1
    # (1 -> 2 -> 1) stops at 2 instead of wrapping on to 0.
    start = begin(planner, 1)
    assert [load.block for load in start.prefetch] == []
    assert planner._successor[2] == 1
