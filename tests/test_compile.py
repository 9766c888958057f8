"""torch.compile with streaming: compiled + streamed output is bit-identical to the same model
compiled the same way and resident, blocks of one class share one graph whichever slot they
sit in, and what dlo cannot serve is refused. See [Note: compiled blocks]"""

import copy
import logging

import pytest
import torch
from torch import nn
import torch._dynamo
from torch._dynamo.testing import CompileCounter

import dlo
from dlo.hotpath.compiled_call import CompileWatch, StreamedCall, isolate

SEEDS = [1, 2]  # two calls with different inputs


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch, on one thread: inductor's CPU kernels spin in OpenMP
    barriers on a shared machine, seconds per tiny call."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def outputs(model, entry, seeds=SEEDS):
    with torch.inference_mode():
        return [model(**entry.inputs(seed))[0] for seed in seeds]


def identical(expected, got):
    return len(expected) == len(got) and all(torch.equal(a, b) for a, b in zip(expected, got))


def streamed_blocks(model):
    return [block for block in model.modules() if isinstance(block._compiled_call_impl, StreamedCall)]


def compile_counts(watch):
    watch.poll()
    return watch.graphs, watch.recompiles, watch.graph_breaks


def regional_streamed(model, entry, compile_first):
    """Outputs, stats, and the user's compiled callables, of `model` streamed and regionally
    compiled in the given order."""
    if compile_first:
        model.compile_repeated_blocks(fullgraph=True)  # fullgraph: a graph break in a block raises
    with dlo.enable(model, "cpu") as handle:
        if not compile_first:
            model.compile_repeated_blocks(fullgraph=True)
        got = outputs(model, entry)
        stats = handle.stats()
        compiled = [block._compiled_call_impl.compiled for block in streamed_blocks(model)]
    return got, stats, compiled


@pytest.mark.parametrize("name", ["wan", "flux"])
def test_regional_compile_streamed_matches_compiled_resident_in_both_orders(tiny_pair, name):
    reference, enable_first, entry = tiny_pair(name)
    compile_first = copy.deepcopy(enable_first)
    watch = CompileWatch()
    reference.compile_repeated_blocks(fullgraph=True)
    expected = outputs(reference, entry)
    resident_counts = compile_counts(watch)

    torch._dynamo.reset()  # the streamed models compile their own graphs (the same, from inductor's cache)
    for model, order in ((enable_first, False), (compile_first, True)):
        got, stats, user_compiled = regional_streamed(model, entry, order)
        assert identical(expected, got)
        if not order:
            # Streaming every block through 2 slots over 2 calls compiles exactly what the
            # resident model compiles: one graph per block class (Flux: double- and
            # single-stream, plus the recompile the resident model has too: its first
            # single-stream block gets a differently-strided input), nothing per block or slot.
            assert (stats.compile.graphs, stats.compile.recompiles, stats.compile.graph_breaks) == resident_counts
            assert stats.compile.graphs <= 3 and stats.streamed_blocks > 2
        else:  # another model's blocks, other slots: the graphs compiled above serve it as they are
            assert (stats.compile.graphs, stats.compile.recompiles) == (0, 0)
        # After disable(): the blocks keep the user's compiled callables and run resident.
        blocks = [block for block in model.modules() if type(block).__name__ in model._repeated_blocks]
        assert [block._compiled_call_impl for block in blocks] == user_compiled
        assert identical(expected, outputs(model, entry))


def test_whole_model_compile_streamed_matches_resident_compiled_with_the_same_boundaries(tiny_pair):
    reference, streamed, entry = tiny_pair("wan")
    boundaries = isolate(list(reference.blocks))
    watch = CompileWatch()
    expected = outputs(torch.compile(reference), entry)
    resident_counts = compile_counts(watch)
    for boundary in boundaries:
        boundary.remove()
    torch._dynamo.reset()

    compiled = torch.compile(streamed)  # compile, then enable the module it wraps
    with dlo.enable(streamed, "cpu") as handle:
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = outputs(compiled, entry)
        stats = handle.stats()
    assert identical(expected, got)
    assert (stats.compile.graphs, stats.compile.recompiles, stats.compile.graph_breaks) == resident_counts
    assert stats.compile.recompiles == 0
    assert identical(expected, outputs(compiled, entry))  # after disable(): resident, same graphs


@pytest.mark.parametrize("num_slots", [2, 3])
def test_blocks_of_one_class_share_one_graph_whichever_slot_they_are_in(tiny_pair, num_slots):
    """Four Wan blocks, three calls. Two slots: blocks 0 and 2 run from slot 0, 1 and 3 from
    slot 1. Three slots: the ring moves every block to the next slot each call, so each runs
    from all three. The block frame is traced once and never again."""
    _, streamed, entry = tiny_pair("wan")
    counter = CompileCounter()
    with dlo.enable(streamed, "cpu", dlo.OffloadConfig(num_slots=num_slots)) as handle:
        for block in streamed.blocks:
            block.compile(backend=counter, fullgraph=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            outputs(streamed, entry, seeds=[1, 2, 3])
        stats = handle.stats()
    assert counter.frame_count == 1
    assert stats.copies >= 3 * len(streamed.blocks)  # every block was copied into a slot every call
    assert stats.compile.recompiles == 0


def test_blocks_compiled_after_enable_are_wrapped_again_before_the_next_call(tiny_pair):
    reference, streamed, entry = tiny_pair("wan")
    expected = outputs(reference, entry, seeds=[1])
    counter = CompileCounter()
    with dlo.enable(streamed, "cpu"):
        assert identical(expected, outputs(streamed, entry, seeds=[1]))  # eager through the record
        for block in streamed.blocks:
            block.compile(backend=counter, fullgraph=True)  # replaces dlo's record
        assert identical(expected, outputs(streamed, entry, seeds=[1]))  # the backend is eager: same bits
        assert all(type(block._compiled_call_impl) is StreamedCall for block in streamed.blocks)
    assert counter.frame_count == 1


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(mode="reduce-overhead"), "reduce-overhead"),
        (dict(options={"freezing": True}), "freezing"),
        (dict(backend="cudagraphs"), "backend='cudagraphs'"),
    ],
    ids=["cuda-graphs", "freezing", "cudagraphs-backend"],
)
def test_regional_compile_modes_dlo_cannot_serve_are_refused(tiny_pair, options, named):
    _, streamed, entry = tiny_pair("wan")
    with dlo.enable(streamed, "cpu"):
        streamed.compile_repeated_blocks(**options)
        with pytest.raises(dlo.StreamingError, match=named):
            outputs(streamed, entry, seeds=[1])


def test_cuda_graphs_are_refused_where_the_compiled_callable_does_not_know_its_config(tiny_pair):
    """torch 2.11's compiled callables answer None from get_compiler_config (seen on the H200);
    the refusal must then come from the backend of the compile context they close over."""
    _, streamed, entry = tiny_pair("wan")
    with dlo.enable(streamed, "cpu"):
        streamed.compile_repeated_blocks(mode="reduce-overhead")
        for block in streamed.blocks:
            block._compiled_call_impl.get_compiler_config = lambda: None
        with pytest.raises(dlo.StreamingError, match="reduce-overhead"):
            outputs(streamed, entry, seeds=[1])


@pytest.mark.parametrize(
    ("options", "named"),
    [(dict(mode="reduce-overhead"), "reduce-overhead"), (dict(backend="cudagraphs"), "backend='cudagraphs'")],
    ids=["reduce-overhead", "cudagraphs-backend"],
)
def test_whole_model_cuda_graphs_are_refused(tiny_pair, options, named):
    _, streamed, entry = tiny_pair("wan")
    compiled = torch.compile(streamed, **options)
    with dlo.enable(streamed, "cpu"):
        with pytest.raises(dlo.StreamingError, match=named):
            outputs(compiled, entry, seeds=[1])


class _TaggedBlock(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.tag = f"block{index}"  # a string per block: dynamo specializes each block's graph on it

    def forward(self, x):
        return self.linear(x) + (1 if self.tag.endswith("0") else 0)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_TaggedBlock(i) for i in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_recompile_per_block_logs_one_warning_naming_the_reason(caplog):
    model = _Stack().eval()
    counter = CompileCounter()
    with dlo.enable(model, "cpu") as handle:
        for block in model.blocks:
            block.compile(backend=counter, fullgraph=True)
        with caplog.at_level(logging.WARNING, logger="dlo"), torch.inference_mode():
            model(torch.ones(2, 8))
            model(torch.ones(2, 8))
        stats = handle.stats()
    assert counter.frame_count == 4 and stats.compile.recompiles == 3
    warnings = [r.getMessage() for r in caplog.records if "recompiled" in r.getMessage()]
    assert len(warnings) == 1
    assert "3 times in one call for 1 streamed block class" in warnings[0] and "tag" in warnings[0]
