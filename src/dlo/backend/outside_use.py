"""Serving streamed blocks whose parts run outside the block's own call.

[Note: blocks used outside their call]
A streamed block holds its weights only between its own entry and exit. Some models use a
block's submodule elsewhere: DiT computes `self.transformer_blocks[0].norm1.emb(...)` after
its loop, and a parent may unpack a list of pairs (`for attn, ff in self.layers`) so that the
listed items never run as modules at all. Discovery refuses the second shape by construction
(`dlo.planning.offload_plan`: items without a forward of their own are not blocks); for the
first, every submodule of a streamed block carries one pre-hook, and so does every module
outside the blocks whose tensors are all one block's (a tied weight: T5's `shared` beside its
streamed `encoder.embed_tokens`). When such a module runs while its block is not running, the
block is promoted on the spot (its own device memory, filled from its host copy) and stays
resident: that call and every later one compute exactly what the resident model computes. The
hook is one bound method for every submodule, checking two planner lookups (about a microsecond
a call); under torch.compile it returns at once while dynamo traces, so a compiled block's
graph is the resident one's, and the hooks stay for the handle's life: removing them would make
dynamo recompile. Not served: under whole-model compilation (`torch.compile(model)`) an outside
use is traced, not run, so the probe cannot promote the block there and the graph reads its NaN
stand-ins (See [Note: stand-ins]); one eager call first promotes it (then the compiled calls
are exact). In all-gather mode a block cannot be promoted (every load is a collective), so the
probe raises StreamingError naming the module.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dlo.errors import StreamingError
from dlo.hotpath.runtime import StreamingRuntime
from dlo.planning.offload_plan import BlockRef

logger = logging.getLogger(__name__)


class OutsideUseProbe:
    def __init__(
        self, runtime: StreamingRuntime, refs: list[BlockRef], aliases: dict[str, tuple[nn.Module, int]] | None = None
    ) -> None:
        """`refs`: the streamed blocks, in the runtime's block order; `aliases`: modules outside
        them whose tensors are one block's (a tied weight), name -> (module, block index)."""
        self._runtime = runtime
        self._hooks: list[RemovableHandle] = []
        # One hook function for every submodule, its block looked up by the module's id: under
        # torch.compile the hook is inlined into the block's graph, where it returns at once,
        # and a per-module closure would give dynamo a different constant to guard on per block.
        # Submodules shared by several blocks, or holding no tensors, need no block's weights.
        self._owner: dict[int, tuple[int, str]] = {}
        shared: set[int] = set()
        for index, ref in enumerate(refs):
            for name, sub in ref.module.named_modules():
                holds_tensors = any(True for _ in sub.parameters()) or any(True for _ in sub.buffers())
                if sub is ref.module or not holds_tensors:
                    continue
                if id(sub) in self._owner and self._owner[id(sub)][0] != index:
                    shared.add(id(sub))
                self._owner.setdefault(id(sub), (index, f"{ref.name}.{name}"))
        for key in shared:
            del self._owner[key]
        self._aliases = [module for module, _ in (aliases or {}).values()]
        for name, (module, index) in (aliases or {}).items():
            self._owner[id(module)] = (index, name)
        self._refs = refs

    def install(self) -> None:
        """Hook the blocks' submodules; `remove()` undoes it, also after a partial install."""
        hooked: set[int] = set()  # one hook per module, however many names reach it
        for sub in [*(s for ref in self._refs for s in ref.module.modules()), *self._aliases]:
            if id(sub) in self._owner and id(sub) not in hooked:
                hooked.add(id(sub))
                self._hooks.append(sub.register_forward_pre_hook(self._check))

    def _check(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            return
        index, name = self._owner[id(module)]
        if self._runtime.is_running(index) or self._runtime.planner.is_resident(index):
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
