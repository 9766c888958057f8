"""`load_state_dict` on a streamed module, or on any module holding streamed tensors.

[Note: loading a state dict while streaming]
torch loads module by module, copying each value into the tensor it names (`param.copy_`);
a size mismatch is recorded and raised only at the end, after every other tensor was copied.
Into a streamed block's stand-ins no copy can land (See [Note: stand-ins]). So every module
with streamed tensors below it carries a load pre-hook and post-hook (torch's own, removed
at disable()). The first of them a load reaches, the outermost, checks the whole load before
anything is copied: a value that is not a tensor, or whose shape differs from the tensor it
names, and `assign=True` naming a streamed tensor, are refused with a StreamingError, nothing
loaded. (A load naming no streamed tensor, such as PEFT loading an adapter, is left to torch
as it is.) Then each streamed block the load names is opened as torch reaches it (its own
pre-hook, or the outermost hook for a load called on a module inside a block), torch copies
into its real values with its own conversions, and the block's post-hook (torch runs it once
the block's subtree is loaded) writes it into the host copy and streams it again (See [Note:
editing a streamed block]): one block at a time on the device. Missing and unexpected keys
are torch's: `strict=True` raises after the load, as on the resident model (the hooks are
not told `strict`). A block a load left open when it raised is written back before the next
call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dlo.backend.weight_changes import WeightChanges
from dlo.errors import StreamingError


@dataclass
class _Load:
    token: list  # the load's own missing-keys list: one object per load_state_dict call
    outer: nn.Module
    opened_at: dict[int, list[int]] = field(default_factory=dict)  # id(module) -> blocks it opened


class StateDictLoads:
    def __init__(self, module: nn.Module, changes: WeightChanges) -> None:
        self._module = module
        self._changes = changes
        self._hooks: list[RemovableHandle] = []
        self._load: _Load | None = None
        self._block_of_tensor = {
            id(tensor): index for index, block in enumerate(changes.runtime.blocks) for tensor in block.tensors
        }
        self._block_modules = {id(ref.module): index for index, ref in enumerate(changes.refs)}

    def install(self) -> None:
        """Hook every module with streamed tensors below it; `remove()` undoes it, also after a
        partial install."""
        streamed = self._block_of_tensor
        for sub in self._module.modules():
            if any(id(t) in streamed for t in (*sub.parameters(), *sub.buffers())):
                self._hooks.append(sub.register_load_state_dict_pre_hook(self._before))
                self._hooks.append(sub.register_load_state_dict_post_hook(self._after))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _before(
        self,
        module: nn.Module,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
    ) -> None:
        load = self._load
        if load is None or load.token is not missing_keys:  # the outermost hooked module of a new load
            named = self._check(module, state_dict, prefix, local_metadata)
            if not named:
                return
            self._changes.close_all()  # a load cut short before left blocks open
            load = self._load = _Load(missing_keys, module)
            index = self._block_modules.get(id(module), self._changes.block_of(module))
            if index is not None:  # called on a block, or on a module inside one
                self._open(load, module, [index])
            return
        index = self._block_modules.get(id(module))
        if index is not None and any(self._block_of_tensor.get(id(t)) == index for t in self._named(module, state_dict, prefix)):
            self._open(load, module, [index])

    def _open(self, load: _Load, module: nn.Module, indices: list[int]) -> None:
        for index in indices:
            self._changes.open(index)
            load.opened_at.setdefault(id(module), []).append(index)

    def _after(self, module: nn.Module, incompatible_keys: object) -> None:
        load = self._load
        if load is None:
            return
        for index in load.opened_at.pop(id(module), []):
            self._changes.close(index)
        if module is load.outer:
            self._load = None

    @staticmethod
    def _named(module: nn.Module, state_dict: dict, prefix: str) -> list[torch.Tensor]:
        """The module's tensors (its own and its submodules') that the load names."""
        return [t for name, t in module.state_dict(keep_vars=True).items() if prefix + name in state_dict]

    def _check(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> bool:
        """Refuse a load torch would leave half done, before anything is copied; returns
        whether the load names a streamed tensor. See [Note: loading a state dict while streaming]"""
        own = module.state_dict(keep_vars=True)
        named = [(name, own[name[len(prefix) :]]) for name in state_dict if name[len(prefix) :] in own]
        if not any(id(tensor) in self._block_of_tensor for _, tensor in named):
            return False
        for name, tensor in named:
            value = state_dict[name]
            if not isinstance(value, torch.Tensor):
                raise StreamingError(
                    f"load_state_dict: {name!r} is a {type(value).__name__}, not a tensor; nothing was loaded "
                    "(a module streamed by dlo refuses a load it could not finish before it changes a weight)"
                )
            if value.shape != tensor.shape and not (tensor.dim() == 0 and value.shape == (1,)):
                raise StreamingError(
                    f"load_state_dict: {name!r} has shape {tuple(value.shape)}, the model's {tuple(tensor.shape)}; "
                    "nothing was loaded (a module streamed by dlo refuses a load it could not finish before it "
                    "changes a weight). Load a state dict saved from this model"
                )
        if local_metadata.get("assign_to_params_buffers", False):
            first = next(name for name, tensor in named if id(tensor) in self._block_of_tensor)
            raise StreamingError(
                f"load_state_dict(assign=True) would replace streamed tensors such as {first!r} by the state dict's "
                "own, which dlo does not stream; nothing was loaded. Load with assign=False (the values are copied "
                "into the weights dlo streams), or disable() first"
            )
        return True
