import copy

import pytest
import torch
from torch import nn

import dlo
from dlo.models.tiny import TINY_MODELS
from dlo.planning.offload_plan import DECLARED_BLOCK_LISTS, resolve_blocks

diffusers = pytest.importorskip("diffusers")

# Arguments some classes need beyond their defaults to be built at all.
_EXTRA_ARGS = {
    "HiDreamImageTransformer2DModel": dict(patch_size=2, caption_channels=[4096, 4096], llama_layers=list(range(48))),
}


def _repeated_block_lists(model: nn.Module, hint: set[str]) -> set[str]:
    """Outermost ModuleLists whose every item is (or wraps) a class diffusers itself treats
    as a repeated block: found by walking the model, not read from dlo's table."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0 or any(name.startswith(f + ".") for f in found):
            continue
        if all(({type(c).__name__} | {type(g).__name__ for g in c.children()}) & hint for c in module):
            found.append(name)
    return set(found)


@pytest.mark.parametrize("class_name", sorted(DECLARED_BLOCK_LISTS))
def test_declared_plan_streams_exactly_the_repeated_blocks_of_the_real_class(class_name):
    cls = getattr(diffusers, class_name, None)
    if cls is None:
        pytest.skip(f"{class_name} is not in diffusers {diffusers.__version__}")
    with torch.device("meta"):  # full-size default config, no memory
        model = cls(**_EXTRA_ARGS.get(class_name, {}))
    plan = dlo.discover(model)
    hint = set(getattr(cls, "_repeated_blocks", None) or ()) | set(getattr(cls, "_no_split_modules", None) or ())
    assert plan.source == "declared"
    assert set(plan.block_lists) == _repeated_block_lists(model, hint)


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_declared_block_lists_are_in_execution_order(name):
    """The plan's order is the order a forward call runs the blocks in (hooks record it)."""
    entry = TINY_MODELS[name]
    model = entry.build(seed=0)
    ran: list[str] = []
    blocks = resolve_blocks(model, dlo.discover(model))
    for block in blocks:
        block.module.register_forward_pre_hook(lambda module, args, name=block.name: ran.append(name))
    with torch.inference_mode():
        model(**entry.inputs(seed=0))
    assert ran == [block.name for block in blocks]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.stages = nn.ModuleList([_Block(), _Block(), _Block()])
        self.heads = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])  # mixed classes: not blocks
        self.norms = nn.ModuleList([nn.ReLU(), nn.ReLU()])  # no parameters: not blocks
        self.single = nn.ModuleList([_Block()])  # one module: not a repeated block

    def forward(self, x):
        for block in self.stages:
            x = block(x)
        return x


def test_auto_discovery_finds_repeated_same_class_blocks_only():
    plan = dlo.discover(_Custom())
    assert plan == dlo.OffloadPlan(block_lists=("stages",), source="auto")


def test_auto_discovery_does_not_descend_into_found_lists():
    outer = nn.Module()
    inner = nn.ModuleList([_Block(), _Block()])
    outer.layers = nn.ModuleList([nn.Sequential(inner), nn.Sequential(nn.Linear(2, 2))])
    outer.layers = nn.ModuleList([_Custom(), _Custom()])
    assert dlo.discover(outer).block_lists == ("layers",)


def test_module_with_nothing_to_stream_says_what_was_looked_for():
    with pytest.raises(dlo.DiscoveryError, match="no declared plan and no nn.ModuleList of two or more"):
        dlo.discover(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_declared_class_whose_lists_moved_falls_back_to_auto(caplog):
    class WanTransformer3DModel(nn.Module):  # same name, different structure
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([_Block(), _Block()])

    plan = dlo.discover(WanTransformer3DModel())
    assert plan.block_lists == ("layers",) and plan.source == "auto"
    assert "no longer has the declared block lists" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(block_lists=()), "non-empty tuple"),
        (dict(block_lists="stages"), "non-empty tuple"),
        (dict(block_lists=("a", "a")), "names a list twice"),
        (dict(block_lists=("a", "a.b")), "lies inside"),
        (dict(block_lists=("a",), resident_eligible=("b",)), "not in block_lists"),
    ],
)
def test_invalid_plans_are_rejected(kwargs, message):
    with pytest.raises(dlo.DiscoveryError, match=message):
        dlo.OffloadPlan(**kwargs)


def test_plan_naming_a_missing_list_is_an_error():
    with pytest.raises(dlo.DiscoveryError, match="has nothing there"):
        dlo.enable(_Custom(), "cpu", plan=dlo.OffloadPlan(block_lists=("missing",)))


def test_plan_naming_a_stack_of_layers_instead_of_its_list_is_an_error():
    model = nn.Module()
    model.stack = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # one slot of its whole size, were it a block
    with pytest.raises(dlo.DiscoveryError, match="has Sequential there; block_lists must name nn.ModuleList"):
        dlo.enable(model, "cpu", plan=dlo.OffloadPlan(block_lists=("stack",)))


def test_plan_naming_a_module_without_parameters_is_an_error():
    with pytest.raises(dlo.DiscoveryError, match="has ReLU there; block_lists must name nn.ModuleList attributes, or single"):
        dlo.enable(_Custom(), "cpu", plan=dlo.OffloadPlan(block_lists=("norms.0", "stages")))


def test_a_plan_naming_a_single_module_streams_it_as_one_block():
    reference = _Custom()
    streamed = copy.deepcopy(reference)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    plan = dlo.OffloadPlan(block_lists=("embed", "stages"))
    with dlo.enable(streamed, "cpu", plan=plan) as handle, torch.inference_mode():
        assert handle.stats().streamed_blocks == 4  # embed + 3 stages
        assert streamed.embed.weight.stride() == (0, 0)  # a stand-in between calls
        assert torch.equal(streamed.stages[0](streamed.embed(x)), reference.stages[0](reference.embed(x)))
