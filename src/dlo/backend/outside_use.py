"""Finding streamed blocks whose parts run outside the block's own call, during the first call.

[Note: blocks used outside their call]
A streamed block holds its weights only between its own pre- and post-hooks. Some models use
a block's submodule elsewhere: DiT computes `self.transformer_blocks[0].norm1.emb(...)` after
its loop, and a parent may unpack a list of pairs (`for attn, ff in self.layers`) so that the
listed items never run as modules at all. Discovery refuses the second shape by construction
(`dlo.planning.offload_plan`: items without a forward of their own are not blocks); for the
first, every submodule of a streamed block gets a pre-hook during the module's first call.
When one runs while its block is not running, the block is promoted on the spot (its own
device memory, filled from its host copy) and stays resident: that call and every later one
compute exactly what the resident model computes. The hooks are removed after the first call,
so later calls pay nothing; a path that first uses a block from outside in a later call is not
seen (it fails on the block's empty placeholders, never with wrong numbers). In all-gather mode
a block cannot be promoted (every load is a collective), so the probe raises StreamingError
naming the module. Under torch.compile the hooks do nothing while dynamo traces (the block's
own regions); outside uses in eager code are still seen.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dlo.errors import StreamingError
from dlo.hotpath.runtime import StreamingRuntime
from dlo.planning.offload_plan import BlockRef

logger = logging.getLogger(__name__)


class OutsideUseProbe:
    def __init__(self, runtime: StreamingRuntime, refs: list[BlockRef]) -> None:
        """`refs`: the streamed blocks, in the runtime's block order."""
        self._runtime = runtime
        self._hooks: list[RemovableHandle] = []
        for index, ref in enumerate(refs):
            for name, sub in ref.module.named_modules():
                if sub is not ref.module:
                    hook = partial(self._check, index, f"{ref.name}.{name}")
                    self._hooks.append(sub.register_forward_pre_hook(hook))

    def _check(self, index: int, name: str, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            return
        planner = self._runtime.planner
        if planner.is_running(index) or planner.is_resident(index):
            return
        block = self._runtime.blocks[index].name
        if self._runtime.gather is not None:
            raise StreamingError(
                f"{name} ran outside the call of its streamed block {block!r}, which all-gather mode cannot serve "
                "(every load is a collective in plan order); keep the block resident (resident_layers) or use "
                "rank-local mode. See [Note: blocks used outside their call]"
            )
        nbytes = self._runtime.promote(index)
        logger.warning(
            "dlo: %s ran outside the call of its block %r; that block stays resident from now on (%.2f MiB)",
            name,
            block,
            nbytes / 2**20,
        )

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
