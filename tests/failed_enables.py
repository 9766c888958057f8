"""A child process that enables a cache-mapped model in a way dlo refuses, then runs it
(tests/test_host_weight_cache.py): reading a view of a closed mapping would kill it."""

import torch

import dlo
from dlo.models.tiny import TINY_MODELS


class Wrapped(torch.nn.Module):
    """A wrapper that renames a weight, as peft's do."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base

    def forward(self, x):
        return self.base_layer(x)


def failed_enable(directory: str, cache: str, out: str, failure: str) -> None:
    config = dlo.OffloadConfig(host_weight_cache=True, cache_dir=cache)
    model, plan = dlo.load_transformer(directory, config)
    if failure == "tie":  # a tie dlo refuses, after the plan was bound
        model.blocks[1].ffn.net[0].proj.bias = model.blocks[0].ffn.net[0].proj.bias
    else:  # a renamed planned weight: binding the plan fails halfway
        model.blocks[0].attn1.to_q = Wrapped(model.blocks[0].attn1.to_q)
    try:
        dlo.enable(model, "cpu", config, plan=plan)
    except dlo.EnableError:
        pass
    with torch.inference_mode():
        output = model(**TINY_MODELS["wan"].inputs(1))[0]  # reads every weight after the rollback
    torch.save(output, out)
