"""`save_pretrained` of a streamed model writes its weights, not the stand-ins.

[Note: saving a streamed model]
Between calls a streamed block's tensors are stand-ins (See [Note: stand-ins]) and
`state_dict()` returns them: diffusers' and transformers' `save_pretrained` would write NaN
without a word. `state_dict()` itself is left as it is: diffusers calls it on every LoRA load
(for shapes and devices), where real values would copy every cast or concatenated tensor of a
mapped checkpoint, and dequantize every float8 weight, on each load. While enabled, a module's
`save_pretrained` is dlo's: it settles what changed since the last call (as a call's start
does: a change that missed the streamed weights is refused there), then runs the class's own
with a state-dict hook that puts each streamed block's values in place of its stand-ins: views
of its host copy, or of the checkpoint mapping where a tensor is one range of it as saved, and
private copies of the rest (float8 weights dequantized: what the model computes with, as
`dlo.quantize_resident` gives it). So the files equal those the resident model doing the same
writes, and a mapped model is not copied into private memory to be saved. Blocks kept
resident or open for an edit hold their values already. Refused before anything is written:
in all-gather mode across ranks (each rank holds 1/N of a block; disable() on every rank
gives the weights back), and with `fp8_compute` (its Linears are not the class's until
disable() converts them back). After disable(restore=False) the module has no weights, and
its save is refused too (dlo.backend.handle).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import chain

from torch import nn

from dlo.errors import StreamingError
from dlo.host.block_sources import DiskShardSource, ShardSource, restored_image
from dlo.hotpath.runtime import StreamingRuntime


class StreamedSaves:
    def __init__(self, module: nn.Module, runtime: StreamingRuntime, settle: Callable[[], None], fp8_compute: bool) -> None:
        self._module = module
        self._runtime = runtime
        self._settle = settle  # a call's first steps: blocks left open written back, missed changes refused
        self._fp8_compute = fp8_compute

    def install(self) -> None:
        """The module's `save_pretrained`, if its class has one, is `save_pretrained` below
        until `remove()`."""
        if callable(getattr(type(self._module), "save_pretrained", None)):
            self._module.__dict__["save_pretrained"] = self.save_pretrained

    def remove(self) -> None:
        self._module.__dict__.pop("save_pretrained", None)

    def save_pretrained(self, *args: object, **kwargs: object) -> object:
        """The class's `save_pretrained`, with the streamed blocks' values in its state dict."""
        name = type(self._module).__name__
        gather = self._runtime.gather
        if gather is not None and gather.size > 1:
            raise StreamingError(
                f"{name}.save_pretrained: in all-gather mode each rank holds 1/{gather.size} of every streamed "
                "block; call handle.disable() on every rank (it gathers the weights back), then save on one"
            )
        if self._fp8_compute:
            raise StreamingError(
                f"{name}.save_pretrained: with fp8_compute the streamed blocks' Linears run as FP8 GEMMs, not "
                f"{name}'s own; call handle.disable() first (it converts them back), then save"
            )
        self._settle()
        # torch marks the hook with an attribute: a partial takes one, a bound method does not
        hook = self._module.register_state_dict_post_hook(functools.partial(self._real_values))
        try:
            return type(self._module).save_pretrained(self._module, *args, **kwargs)
        finally:
            hook.remove()

    def _real_values(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        names: dict[int, list[str]] = {}
        tensors = chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))
        for name, tensor in tensors:
            names.setdefault(id(tensor), []).append(prefix + name)
        runtime = self._runtime
        for index, block in enumerate(runtime.blocks):
            stand_ins = [
                k for k, (tensor, stand_in) in enumerate(zip(block.tensors, block.placeholders))
                if tensor.data_ptr() == stand_in.data_ptr()
            ]
            if index in runtime.promoted or not stand_ins:
                continue
            if isinstance(block.source, (ShardSource, DiskShardSource)):  # a group of one: no peer to wait for
                values = restored_image(runtime.gathered(index), block.layout, block.wire)
            else:
                values = block.source.values(block.layout, block.wire)
            for k in stand_ins:
                for key in names.get(id(block.tensors[k]), ()):
                    if key in state_dict:  # not a non-persistent buffer
                        state_dict[key] = values[k]


def refuse_saves(module: nn.Module, why: str) -> None:
    """After disable(restore=False): the module's `save_pretrained` raises `why`, as a call does."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise StreamingError(why)

    if callable(getattr(type(module), "save_pretrained", None)):
        module.__dict__["save_pretrained"] = refuse
