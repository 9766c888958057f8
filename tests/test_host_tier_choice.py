"""Which blocks stay in host memory under host_budget_gib, chosen from a measured call: the
model and the search (integers), then blocks moved between host memory and disk between
calls on a real file system, bit-identical. See [Note: which blocks stay in RAM]"""

import itertools
import random
import time

import pytest
import torch

import dlo
from dlo.host.block_sources import DiskSource, PackedSource
from dlo.backend import host_tier_choice
from dlo.planning import host_tier
from dlo.planning.host_tier import TierBlock, TierChoice, TierModel, choose_tier, simulate_tier
from dlo.planning.residency import BlockCost, simulate
from test_disk_tier import budget_gib, call_cut_by_a_timer, ordinary, outputs, save
from test_one_load_path import PACKAGE, _LineInterrupt

pytest.importorskip("diffusers")


def test_with_every_block_in_host_memory_it_is_the_device_model():
    randomness = random.Random(0)
    for _ in range(200):
        n = randomness.randint(2, 8)
        blocks = [
            TierBlock(8, 8, randomness.choice([2, 4, 8]), float(randomness.randint(1, 6)), randomness.random() > 0.2)
            for _ in range(n)
        ]
        slots, rate, between_s = randomness.choice([2, 3]), randomness.choice([0.5, 1.0, 4.0]), randomness.choice([0.0, 3.0])
        resident = {i for i, b in enumerate(blocks) if not b.streamed}
        costs = [BlockCost(b.load_bytes, b.compute_s) for b in blocks]
        for overlap in (True, False):
            expected = simulate(costs, resident, slots, rate, between_s, overlap)
            assert simulate_tier(blocks, (), TierModel(slots, rate, 1.0, 2, between_s, overlap)) == pytest.approx(expected)


def test_a_disk_bound_call_costs_its_reads_and_a_compute_bound_one_its_compute():
    idle = [TierBlock(10, 10, 1, 0.0) for _ in range(6)]
    # 1 s reads, copies of 0.01 s, nothing to compute: the reader never idles.
    assert simulate_tier(idle, range(6), TierModel(2, 100.0, 10.0, 2)) == pytest.approx(6.0)
    assert simulate_tier(idle, (0, 2, 4), TierModel(2, 100.0, 10.0, 2)) == pytest.approx(3.0)
    busy = [TierBlock(10, 10, 1, 5.0) for _ in range(6)]
    # 5 s blocks hide every 1 s read behind them.
    assert simulate_tier(busy, range(6), TierModel(2, 100.0, 10.0, 2)) == pytest.approx(30.0)


def test_one_read_buffer_waits_for_the_copy_out_of_it():
    blocks = [TierBlock(10, 10, 10, 0.0) for _ in range(4)]
    # 1 s reads and 1 s copies: with two buffers each read overlaps the copy of the block
    # before it (the reader never idles); with one, reads and copies take turns.
    two = simulate_tier(blocks, range(4), TierModel(2, 10.0, 10.0, 2))
    one = simulate_tier(blocks, range(4), TierModel(2, 10.0, 10.0, 1))
    assert two == pytest.approx(4.0) and one == pytest.approx(8.0)


def brute_force(blocks, room, model):
    readable = [i for i, b in enumerate(blocks) if b.read_bytes is not None]
    best = None
    for count in range(len(readable) + 1):
        for on_disk in itertools.combinations(readable, count):
            if sum(blocks[i].host_bytes for i in readable if i not in on_disk) <= room:
                seconds = simulate_tier(blocks, on_disk, model)
                best = seconds if best is None else min(best, seconds)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_the_choice_is_as_fast_as_the_best_of_every_subset(seed):
    randomness = random.Random(seed)
    for _ in range(80):
        n = randomness.randint(2, 8)
        kinds = [(randomness.choice([4, 8]), float(randomness.randint(0, 6))) for _ in range(2)]
        blocks = []
        for _ in range(n):
            nbytes, compute_s = randomness.choice(kinds)
            in_file = randomness.random() > 0.1
            blocks.append(TierBlock(nbytes, nbytes if in_file else None, nbytes, compute_s, randomness.random() > 0.15))
        model = TierModel(
            randomness.choice([2, 3]), randomness.choice([1.0, 4.0, 16.0]), randomness.choice([0.5, 1.0, 4.0]),
            randomness.choice([1, 2]), randomness.choice([0.0, 3.0]),
        )
        room = randomness.randint(0, sum(b.host_bytes for b in blocks))
        readable = [i for i, b in enumerate(blocks) if b.read_bytes is not None]
        choice = choose_tier(blocks, room, readable, model, min_gain=0.0)
        assert choice is not None
        assert sum(blocks[i].host_bytes for i in readable if i not in choice.on_disk) <= room
        assert choice.call_s == pytest.approx(simulate_tier(blocks, choice.on_disk, model))
        assert choice.call_s <= brute_force(blocks, room, model) * (1 + 1e-9), (blocks, room, model)


def test_on_a_tie_fewer_bytes_are_read_then_nothing_moves():
    # Compute-bound: any choice hides its reads. The big block stays (fewer bytes read) ...
    blocks = [TierBlock(8, 8, 8, 10.0), TierBlock(4, 4, 4, 10.0), TierBlock(4, 4, 4, 10.0)]
    assert choose_tier(blocks, 8, (0, 1), TierModel(2, 100.0, 100.0, 2)).on_disk == (1, 2)
    # ... and of two choices alike, the one in place now.
    alike = [TierBlock(4, 4, 4, 10.0) for _ in range(4)]
    assert choose_tier(alike, 8, (0, 3), TierModel(2, 100.0, 100.0, 2)).on_disk == (0, 3)
    assert choose_tier(alike, 8, (1, 2), TierModel(2, 100.0, 100.0, 2)).on_disk == (1, 2)


def test_blocks_move_only_for_a_gain_beyond_the_models_error():
    blocks = [TierBlock(4, 4, 4, s) for s in (0.25, 2.0, 1.5, 1.0, 0.75, 4.25)]
    model = TierModel(2, 1.0, 1.0, 1, 1.0)
    in_place, other = (0, 2, 3, 4), (0, 2, 4, 5)
    assert simulate_tier(blocks, in_place, model) == 32.25 and simulate_tier(blocks, other, model) == 32.0
    # Two blocks fit in host memory. The other split is 0.8 % faster: not worth a move.
    assert choose_tier(blocks, 8, in_place, model).on_disk == in_place
    assert choose_tier(blocks, 8, in_place, model, min_gain=0.0).on_disk == other


def test_a_block_not_in_a_file_stays_and_a_budget_nothing_fits_in_has_no_choice():
    blocks = [TierBlock(4, None, 4, 1.0), TierBlock(4, 4, 4, 1.0)]
    assert choose_tier(blocks, 0, (1,), TierModel(2, 1.0, 1.0, 2)).on_disk == (1,)
    assert choose_tier([TierBlock(4, 4, 4, 1.0)], -1, (0,), TierModel(2, 1.0, 1.0, 2)) is None


def test_too_many_block_classes_to_search_keep_the_blocks_as_they_are(monkeypatch):
    blocks = [TierBlock(4 + i, 4 + i, 4, 1.0) for i in range(5)]  # five classes: 2**5 choices
    monkeypatch.setattr(host_tier, "MAX_CHOICES", 31)
    assert choose_tier(blocks, 100, (0,), TierModel(2, 1.0, 1.0, 2)) is None
    monkeypatch.setattr(host_tier, "MAX_CHOICES", 32)
    assert choose_tier(blocks, 100, (0,), TierModel(2, 1.0, 1.0, 2)) is not None


# The tiny Flux's blocks at 0.9 of its files: enable() spreads four of five blocks onto disk
# and keeps a single block (77 KB) in host memory; a double block (157 KB) fits where it was,
# and reading it from disk costs more than reading the single block.
FRACTION = 0.9
DOUBLE_KEPT = (1, 2, 3, 4)  # transformer_blocks.0 in host memory, the other blocks on disk


@pytest.fixture
def double_kept(monkeypatch):
    """The choice made from the measured call is DOUBLE_KEPT whatever the timings were (the
    tiny model's calls take milliseconds, where reads and compute are alike and the choice
    may go either way): the tests using it are about the moves, the tests above about the
    choice."""

    def choose(blocks, room, current, model, **options):
        return TierChoice(DOUBLE_KEPT, simulate_tier(blocks, DOUBLE_KEPT, model), 0)

    monkeypatch.setattr(host_tier_choice, "choose_tier", choose)


def test_blocks_chosen_from_a_measured_call_move_between_host_memory_and_disk_exactly(tmp_path, double_kept):
    files = save(tmp_path / "flux", "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    seeds = (1, 2, 3, 4, 5)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, FRACTION)), plan=plan) as handle:
        spread = handle.stats()
        assert spread.disk.choice.state == "measuring"
        got = outputs(model, "flux", seeds[:3])  # a warm-up, the measured call, the first on the choice
        chosen = handle.stats()
        got += outputs(model, "flux", seeds[3:])
        after = handle.stats()
    assert all(torch.equal(a, b) for a, b in zip(got, outputs(ordinary(tmp_path / "flux", "flux"), "flux", seeds)))
    choice = chosen.disk.choice
    assert choice.state == "chosen" and choice.moved_to_disk == ("single_transformer_blocks.0",)
    assert choice.moved_to_ram == ("transformer_blocks.0",), choice
    assert set(chosen.disk.blocks) == set(spread.disk.blocks) - {"transformer_blocks.0"} | {"single_transformer_blocks.0"}
    assert choice.predicted_call_s > 0 and choice.measured_call_s > 0 and choice.disk_gbps > 0
    # The single block's private copy was released: host memory holds the double block alone.
    def nbytes(name):
        return sum(t.numel() * t.element_size() for t in model.get_submodule(name).state_dict().values())

    assert nbytes("transformer_blocks.0") <= chosen.host_bytes < nbytes("transformer_blocks.0") + nbytes(
        "single_transformer_blocks.0"
    )
    assert chosen.host_bytes + chosen.disk.read_buffer_bytes <= chosen.disk.budget_bytes
    # From then on each call reads each block on disk once (the reads ahead shift, not add).
    assert after.disk.blocks == chosen.disk.blocks
    assert abs((after.disk.reads - chosen.disk.reads) - 2 * len(chosen.disk.blocks)) <= 2


def test_a_block_a_weight_change_rewrote_is_not_moved_to_disk(tmp_path, double_kept):
    """The choice puts single_transformer_blocks.0 on disk, but it holds an edit its file does
    not have: it stays in host memory (moved, the next calls would run the file's weights)."""
    files = save(tmp_path / "flux", "flux")
    reference = ordinary(tmp_path / "flux", "flux")
    model, plan = dlo.load_transformer(tmp_path / "flux")
    weight = "single_transformer_blocks.0.proj_out.weight"
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, FRACTION)), plan=plan) as handle:
        outputs(model, "flux", (1,))  # the warm-up call
        with handle.editing(model.single_transformer_blocks[0]), torch.no_grad():
            model.get_parameter(weight).mul_(0.5)
        got = outputs(model, "flux")
        stats = handle.stats()
    with torch.no_grad():
        reference.get_parameter(weight).mul_(0.5)
    assert all(torch.equal(a, b) for a, b in zip(got, outputs(reference, "flux")))
    choice = stats.disk.choice
    assert choice.state == "chosen" and not choice.moved_to_disk  # (the stand-in choice ignores the room it takes)
    assert "single_transformer_blocks.0" not in stats.disk.blocks


def test_a_move_that_fails_keeps_what_was_moved_and_the_calls_stay_exact(tmp_path, caplog, double_kept):
    """The file is cut short during the measured call, after every block was read: the read
    of the block moving to host memory fails; the single block already moved to disk stays
    there, and once the file is whole again every call is exact."""
    files = save(tmp_path / "flux", "flux")
    (path,) = files
    content = path.read_bytes()
    expected = outputs(ordinary(tmp_path / "flux", "flux"), "flux", (1, 2, 3))
    model, plan = dlo.load_transformer(tmp_path / "flux")
    calls = 0

    def cut_in_the_measured_call(module, args):
        if calls == 1:
            with open(path, "r+b") as handle:
                handle.truncate(len(content) // 8)

    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, FRACTION)), plan=plan) as handle:
        hook = model.norm_out.register_forward_pre_hook(cut_in_the_measured_call)
        with torch.inference_mode(), caplog.at_level("WARNING", logger="dlo"):
            for seed in (1, 2):
                model(**dlo.models.tiny.TINY_MODELS["flux"].inputs(seed, torch.float32))
                calls += 1
        hook.remove()
        path.write_bytes(content)
        stats = handle.stats()
        got = outputs(model, "flux", (1, 2, 3))
    choice = stats.disk.choice
    assert choice.state == "kept" and "moving blocks between host memory and disk failed" in choice.note
    assert "single_transformer_blocks.0" in stats.disk.blocks and "transformer_blocks.0" in stats.disk.blocks
    assert any("moving blocks" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("seed", range(6))
def test_ctrl_c_at_any_instant_of_the_measured_call_leaves_every_later_call_exact(tmp_path, seed, double_kept):
    """A timer raises KeyboardInterrupt at a random instant of the measured call, moves
    included: the next calls are exact and disable() releases everything."""
    files = save(tmp_path / "flux", "flux")
    expected = outputs(ordinary(tmp_path / "flux", "flux"), "flux", (1, 2, 3))
    model, plan = dlo.load_transformer(tmp_path / "flux")
    inputs = dlo.models.tiny.TINY_MODELS["flux"].inputs(1, torch.float32)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, FRACTION)), plan=plan) as handle:
        with torch.inference_mode():
            model(**inputs)  # the warm-up call
            started = time.perf_counter()
            model(**inputs)
            measured_s = time.perf_counter() - started
        handle.disable()
    model, plan = dlo.load_transformer(tmp_path / "flux")
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, FRACTION)), plan=plan) as handle:
        with torch.inference_mode():
            model(**inputs)
        call_cut_by_a_timer(model, inputs, random.Random(seed).uniform(0.0, 1.5) * measured_s)
        got = outputs(model, "flux", (1, 2, 3, 1, 2, 3))
        stats = handle.stats()
        assert_nothing_left_behind(handle)
    assert all(torch.equal(a, b) for a, b in zip(got, expected + expected))
    assert stats.disk.choice.state == "chosen"  # an interrupted choice is measured and made again
    assert stats.host_bytes + stats.disk.read_buffer_bytes <= stats.disk.budget_bytes


def assert_nothing_left_behind(handle):
    """Every private copy kept alive streams for its block, and only disk blocks are read."""
    runtime = handle._runtime
    sources = [block.source for block in runtime.blocks]
    kept = [release.__self__ for release in handle._releases if isinstance(getattr(release, "__self__", None), PackedSource)]
    assert all(any(copy is source for source in sources) for copy in kept)
    assert all(isinstance(sources[i], DiskSource) for i in runtime.read_ahead.blocks)


# What a move runs, traced line by line.
MOVES = (
    {"_choose", "_to_disk", "_to_ram", "read", "replace_source", "add", "forget", "remember", "use_block"},
    tuple(str(PACKAGE / p) for p in ("backend/host_tier_choice.py", "backend/disk_tier.py", "hotpath/runtime.py",
                                     "hotpath/read_ahead.py", "hotpath/block_loads.py")),
)


def test_an_interrupt_at_any_line_of_the_moves_leaves_the_next_calls_exact(tmp_path, double_kept):
    """KeyboardInterrupt at sampled lines of the choice and its moves, even inside held steps
    (as a second Ctrl-C): the caller catches it, and the next calls equal resident."""
    files = save(tmp_path / "flux", "flux")
    expected = outputs(ordinary(tmp_path / "flux", "flux"), "flux", (1, 2, 3))
    inputs = dlo.models.tiny.TINY_MODELS["flux"].inputs(1, torch.float32)
    config = dlo.OffloadConfig(host_budget_gib=budget_gib(files, FRACTION))

    def measured_call(at):
        model, plan = dlo.load_transformer(tmp_path / "flux")
        with dlo.enable(model, "cpu", config, plan=plan) as handle, torch.inference_mode():
            model(**inputs)  # the warm-up call
            with _LineInterrupt(at, *MOVES) as traced:
                try:
                    model(**inputs)
                except KeyboardInterrupt:
                    pass
            got = outputs(model, "flux", (1, 2, 3))
            assert handle.stats().disk.choice.state == "chosen", at
            assert_nothing_left_behind(handle)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), at
        return traced.lines

    lines = measured_call(None)
    assert lines > 50
    for at in sorted(random.Random(0).sample(range(1, lines + 1), 40)):
        measured_call(at)


def test_blocks_alike_are_one_class_whatever_their_alignment_in_the_file(tmp_path, monkeypatch):
    """The tiny Flux's single blocks read 69632 or 65536 bytes (where they sit in the file):
    as one class, two classes of blocks make 3 x 4 = 12 splits to search, within the limit."""
    files = save(tmp_path / "flux", "flux")
    monkeypatch.setattr(host_tier, "MAX_CHOICES", 12)
    model, plan = dlo.load_transformer(tmp_path / "flux")
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, FRACTION)), plan=plan) as handle:
        outputs(model, "flux", (1, 2))
        assert handle.stats().disk.choice.state == "chosen"
    monkeypatch.setattr(host_tier, "MAX_CHOICES", 11)
    model, plan = dlo.load_transformer(tmp_path / "flux")
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, FRACTION)), plan=plan) as handle:
        outputs(model, "flux", (1, 2))
        choice = handle.stats().disk.choice
    assert choice.state == "kept" and "too many block classes" in choice.note


def test_a_call_that_never_runs_clean_keeps_the_blocks_of_enable(tmp_path):
    """Three measured calls in a row raise in the second block (the later blocks never run):
    the blocks stay as enable() spread them, and stats say why; the calls after are exact."""
    files = save(tmp_path / "flux", "flux")
    expected = outputs(ordinary(tmp_path / "flux", "flux"), "flux", (1, 2))
    model, plan = dlo.load_transformer(tmp_path / "flux")

    def fail(module, args):
        raise ValueError("a failing step")

    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib(files, FRACTION)), plan=plan) as handle:
        spread = handle.stats().disk.blocks
        outputs(model, "flux", (1,))  # the warm-up call
        hook = model.transformer_blocks[1].register_forward_pre_hook(fail)
        for _ in range(3):
            with pytest.raises(ValueError, match="a failing step"):
                outputs(model, "flux", (1,))
        hook.remove()
        got = outputs(model, "flux", (1, 2))
        stats = handle.stats()
    choice = stats.disk.choice
    assert choice.state == "kept" and "no clean call to measure in 3 tries" in choice.note
    assert stats.disk.blocks == spread
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
