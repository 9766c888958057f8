"""`save_pretrained` of a streamed model writes its weights, not the stand-ins.

[Note: saving a streamed model]
Between calls a streamed block's tensors are stand-ins (See [Note: stand-ins]) and
`state_dict()` returns them: diffusers' and transformers' `save_pretrained` would write NaN
without a word. `state_dict()` itself is left as it is: diffusers calls it on every LoRA load
(for shapes and devices), where real values would copy every cast or concatenated tensor of a
mapped checkpoint, and dequantize every float8 weight, on each load. While enabled, the
`save_pretrained` of the module and of every submodule that holds streamed tensors and whose
class has one is dlo's, with the class's signature (diffusers' pipeline save passes `variant`,
`max_shard_size` and the rest only to a method whose signature names them). It settles what
changed since the last call, as a call's start does (a change that missed the streamed weights,
or adapters a direct unmerge lost, are refused there), then runs the class's own with a
state-dict hook that puts each streamed block's values in place of its stand-ins: views of its
host copy, or of the checkpoint mapping where a tensor is one range of it as saved, and private
copies of the rest (float8 weights dequantized: what the model computes with, as
`dlo.quantize_resident` gives it; all of them at once, as the state dict holds every value).
Blocks kept resident, open for an edit, or running (a save from a hook inside a call) hold
their values already. Every block tensor's value gets a storage of its own bytes: torch
pickles a view's whole storage (a block's host buffer with its uninitialized alignment gaps, a
slot, or the whole mapped file), and huggingface_hub keeps the tensors of one storage in one
shard. So the weight files equal those the resident model doing the same writes (safetensors
byte for byte, sharded too; a pickle records the device, and streamed values are on the CPU),
and a mapped model is not copied into private memory to be saved. Refused before anything is
written: in all-gather mode across ranks (each rank holds 1/N of a block; disable() on every
rank gives the weights back), with `fp8_compute` (its Linears are not the class's until
disable() converts them back), and with a `state_dict` argument holding stand-ins. After
disable(restore=False) the module has no weights, and its save is refused too
(dlo.backend.handle). A pipeline's save checks every streamed component's first, and
diffusers' loading of a Flux control LoRA's norm layers (which keeps copies of `state_dict()`
values to put back on unfuse or unload) reads the real values (dlo.backend.pipeline). Not
covered: the save of a module that contains the enabled one (its state dict holds the
stand-ins; save the enabled module), and any other writer of `state_dict()` (`torch.save`,
accelerate's `save_model`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from itertools import chain

import torch
from torch import nn

from dlo.errors import StreamingError
from dlo.host.block_sources import DiskShardSource, ShardSource, restored_image
from dlo.hotpath.runtime import StreamingRuntime


class StreamedSaves:
    def __init__(self, module: nn.Module, runtime: StreamingRuntime, settle: Callable[[], None], fp8_compute: bool) -> None:
        self._module = module
        self._runtime = runtime
        self._settle = settle  # a call's first checks: blocks left open written back, missed changes refused
        self._fp8_compute = fp8_compute
        self._installed: list[nn.Module] = []

    def install(self) -> None:
        """Every module under the root that holds streamed tensors and whose class has a
        `save_pretrained` gets dlo's, until `remove()` (also after a partial install)."""
        streamed = {id(t) for block in self._runtime.blocks for t in block.tensors}
        for sub in savers(self._module, streamed):
            self._installed.append(sub)
            sub.__dict__["save_pretrained"] = self._replacement(sub, type(sub).save_pretrained)

    def remove(self) -> None:
        for sub in self._installed:
            sub.__dict__.pop("save_pretrained", None)
        self._installed.clear()

    def refusal(self, name: str) -> str | None:
        """Why a save of the module (class `name`) is refused now, if it is."""
        gather = self._runtime.gather
        if gather is not None and gather.size > 1:
            return (
                f"{name}.save_pretrained: in all-gather mode each rank holds 1/{gather.size} of every streamed "
                "block; call handle.disable() on every rank (it gathers the weights back), then save on one"
            )
        if self._fp8_compute:
            return (
                f"{name}.save_pretrained: with fp8_compute the streamed blocks' Linears run as FP8 GEMMs, not "
                f"{name}'s own; call handle.disable() first (it converts them back), then save"
            )
        return None

    def _replacement(self, sub: nn.Module, method: Callable) -> Callable:
        def save_pretrained(*args: object, **kwargs: object) -> object:
            return self._save(sub, method, args, kwargs)

        save_pretrained.__signature__ = inspect.signature(method.__get__(sub))  # type: ignore[attr-defined]
        save_pretrained.__doc__ = method.__doc__
        return save_pretrained

    def check(self, name: str) -> None:
        """Raise the StreamingError a save of the module (class `name`) would raise before
        writing anything: the refusal, or what settling the changes refuses."""
        if (why := self.refusal(name)) is not None:
            raise StreamingError(why)
        self._settle()

    def _save(self, sub: nn.Module, method: Callable, args: tuple, kwargs: dict) -> object:
        name = type(sub).__name__
        given = inspect.signature(method).bind_partial(sub, *args, **kwargs).arguments.get("state_dict")
        if isinstance(given, dict) and self._holds_stand_ins(given):
            raise StreamingError(
                f"{name}.save_pretrained: state_dict= holds streamed blocks' stand-ins (state_dict() of a streamed "
                "model returns them); leave state_dict out and dlo saves the real weights"
            )
        self.check(name)
        with self.real_values(sub):
            return method(sub, *args, **kwargs)

    @contextlib.contextmanager
    def real_values(self, module: nn.Module) -> Iterator[None]:
        """Within it, `module.state_dict()` holds the streamed blocks' values, not their stand-ins."""
        # torch marks the hook with an attribute: a partial takes one, a bound method does not
        hook = module.register_state_dict_post_hook(functools.partial(self._real_values))
        try:
            yield
        finally:
            hook.remove()

    def _holds_stand_ins(self, state_dict: dict) -> bool:
        stand_ins = {stand_in.data_ptr() for block in self._runtime.blocks for stand_in in block.placeholders}
        return any(isinstance(v, torch.Tensor) and v.data_ptr() in stand_ins for v in state_dict.values())

    def _real_values(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        names: dict[int, list[str]] = {}
        tensors = chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))
        for name, tensor in tensors:
            names.setdefault(id(tensor), []).append(prefix + name)
        runtime = self._runtime
        for index, block in enumerate(runtime.blocks):
            held = [k for k, tensor in enumerate(block.tensors) if id(tensor) in names]
            stand_ins = {
                k for k in held
                if index not in runtime.promoted and block.tensors[k].data_ptr() == block.placeholders[k].data_ptr()
            }
            if not stand_ins:
                values = None
            elif isinstance(block.source, (ShardSource, DiskShardSource)):  # a group of one: no peer to wait for
                values = restored_image(runtime.gathered(index), block.layout, block.wire)
            else:
                values = block.source.values(block.layout, block.wire)
            for k in held:
                keys = [key for key in names[id(block.tensors[k])] if key in state_dict]  # not non-persistent buffers
                if keys:  # a block open for an edit, running or promoted: views of one buffer too
                    value = _own_storage(values[k] if k in stand_ins else state_dict[keys[0]])
                    state_dict.update(dict.fromkeys(keys, value))


def _own_storage(view: torch.Tensor) -> torch.Tensor:
    """`view` on a storage holding its bytes only, sharing them (no copy); the new storage
    keeps the old one alive."""
    if view.numel() == 0:  # as an ordinary empty tensor: no address another tensor may start at
        return torch.empty(view.shape, dtype=view.dtype, device=view.device)
    if not view.is_contiguous():  # not a view dlo makes: a copy is its own
        return view.contiguous()
    start, nbytes = view.storage_offset() * view.element_size(), view.numel() * view.element_size()
    if start == 0 and nbytes == view.untyped_storage().nbytes():
        return view
    storage = view.untyped_storage()[start : start + nbytes]
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(storage, 0, view.shape)


def savers(module: nn.Module, streamed: set[int]) -> list[nn.Module]:
    """The modules under `module` (itself included) whose class has a `save_pretrained` and
    that hold one of the tensors `streamed` (ids)."""
    return [
        sub for sub in module.modules()
        if callable(getattr(type(sub), "save_pretrained", None))
        and any(id(t) in streamed for t in chain(sub.parameters(), sub.buffers()))
    ]


def refuse_saves(module: nn.Module, streamed: set[int], why: str) -> None:
    """After disable(restore=False): the `save_pretrained` of each of `savers` raises `why`, as a
    call does."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise StreamingError(why)

    for sub in savers(module, streamed):
        sub.__dict__["save_pretrained"] = refuse
