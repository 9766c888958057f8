"""How a streamed block is called: dlo's bookkeeping around the block, outside torch.compile.

[Note: compiled blocks]
`nn.Module.__call__` runs `module._compiled_call_impl` when it is set (what `block.compile()`
and diffusers' `compile_repeated_blocks` set, to `torch.compile(block._call_impl)`), else
`_call_impl`, which runs the forward hooks. Forward hooks therefore run *inside* a compiled
block, where dynamo would trace dlo's slot planner and copies. So dlo does not hook streamed
blocks: it sets `block._compiled_call_impl` to a `StreamedCall` that loads the block
(`before_block`), calls the user's compiled callable (or `_call_impl`), and releases the slot
(`after_block`, in a `finally`). Both orders work: a compiled callable found at enable() is
wrapped; one set after enable() (`block.compile()` replaces the attribute) is wrapped again by
the root module's pre-hook before the next call (`keep_installed`); disable() puts the user's
callable back, so a compiled model stays compiled and runs resident.

Whole-model `torch.compile(model)` (or `model.compile()`) traces the root's forward.
`StreamedCall.__call__` is `torch.compiler.disable(recursive=False)`: dynamo cannot inline it
and breaks the graph at the first streamed block call. That call sits in the root's loop over
its blocks, and dynamo does not resume inside a loop: it runs the root's forward eagerly and
compiles what it calls as frames of their own (embeddings, head, and each block's forward:
one graph per block class, as regional compilation has). Dynamo reports these breaks once per
model, not per block or call (tiny Wan and Flux: 3, in `handle.stats().compile`). The
bookkeeping (`_enter_untraced`, `_leave_untraced`, the root's hooks) is disabled recursively:
never traced.
Whole-model output therefore equals the resident model compiled whole with the same breaks
(`isolate()` gives resident blocks dlo's boundary), not a resident model compiled as one
graph, whose inductor fusions across block boundaries round differently in the last bits.

Dynamo calls a module's `__call__`, and so sees `_compiled_call_impl`, only when the module
has hooks; without any it inlines `forward`, whose tensors are still placeholders. Hence one
no-op forward pre-hook per streamed block (`_seen_by_dynamo`). It is disabled too: dynamo
skips torch.nn's own frames, so compiling `block._call_impl` compiles its hooks and forward
as separate frames, and a traced hook would be a frame guarded on each block class (Flux's
two classes: a recompile).

Why no recompilation: dynamo inlines nn.Modules (`inline_inbuilt_nn_modules`, always on in
torch 2.13), so a block's parameters are graph inputs, and its guards check each input's
size, stride, dtype, device and requires_grad: not its address, storage offset or the storage
it views (the overlap guard concerns inputs a graph mutates; blocks mutate none). A parameter
repointed into a slot keeps its size, stride and dtype, and the guards are on the module's
type and attributes, not its identity (TORCH_LOGS=guards: TYPE_MATCH on the block,
TENSOR_MATCH per parameter, NO_TENSOR_ALIASING between the frame's own arguments only): every block of a class runs the one graph compiled for
its `forward`, whichever slot it sits in (tests/test_compile.py streams 4 Wan blocks through 2
slots with error_on_recompile). Offsets inside a slot are 512-byte aligned, more than the 16
bytes inductor's kernels assume of their inputs.

What cannot be served: CUDA graphs (`mode="reduce-overhead"`, or inductor's
`triton.cudagraphs`) treat parameters as inputs at fixed addresses, recorded at capture and
replayed; here one graph serves every block of a class, each from whichever slot it was
copied into (N blocks over 2 slots), so replay would need a capture per block and slot.
Inductor's `freezing` folds the weights into the graph as constants: every block would run with
the weights of the block it was compiled with. Both are refused with an error that names them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.hooks import RemovableHandle
from torch._dynamo.utils import counters, get_compilation_metrics

from dlo.errors import StreamingError


class BlockRuntime(Protocol):
    device: torch.device

    def before_block(self, index: int) -> bool: ...

    def after_block(self, index: int) -> None: ...


def _enter(runtime: BlockRuntime, index: int) -> bool:
    return runtime.before_block(index)


def _leave(runtime: BlockRuntime, index: int) -> None:
    runtime.after_block(index)


# Under a whole-model compile, dynamo traces the frames the record calls: dlo's bookkeeping is
# disabled recursively there. Only there: a disabled call costs microseconds per block.
_enter_untraced = torch.compiler.disable(_enter)
_leave_untraced = torch.compiler.disable(_leave)


@torch.compiler.disable(recursive=False)  # never a frame of its own: dynamo would guard on each block class
def _seen_by_dynamo(module: nn.Module, args: tuple) -> None:
    """A no-op forward pre-hook: its presence makes dynamo call the block's `__call__`. See
    [Note: compiled blocks]"""


@dataclass(frozen=True)
class StreamedCall:
    """A streamed block's `_compiled_call_impl`. `compiled`: the user's compiled callable it
    replaced (None: the block runs eagerly through `call_impl`)."""

    runtime: BlockRuntime
    index: int
    call_impl: Callable[..., Any]
    compiled: Callable[..., Any] | None

    @torch.compiler.disable(recursive=False)  # a graph break here, not a trace of what follows
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is not None and self.compiled not in _VETTED:
            _vet(self.compiled, "this block was compiled")
        # Set under a whole-model compile: the compile whose graph broke here (False: dynamo's
        # run-only mode, which compiles nothing).
        callback = torch._C._dynamo.eval_frame.get_eval_frame_callback()
        compiling = callback is not None and callback is not False
        if compiling and callback not in _VETTED:
            _vet(_backend(callback), "the model was compiled")
            _VETTED.add(callback)
        enter, leave = (_enter_untraced, _leave_untraced) if compiling else (_enter, _leave)
        try:
            # Inside: a Ctrl-C held by the start's step fires as the step ends, after the block
            # was pointed at its slot or host copy; `leave` points it back (a block that never
            # started is left alone).
            on_host = enter(self.runtime, self.index)
            if not on_host:
                return (self.compiled or self.call_impl)(*args, **kwargs)
            # See [Note: token embeddings looked up on the host]
            args, kwargs = tree_map_only(torch.Tensor, torch.Tensor.cpu, (args, kwargs))
            outputs = (self.compiled or self.call_impl)(*args, **kwargs)
            return tree_map_only(torch.Tensor, partial(torch.Tensor.to, device=self.runtime.device), outputs)
        finally:
            leave(self.runtime, self.index)


class StreamedCallHandle:
    """Installs a block's `StreamedCall` (`install()`); `remove()` puts back what was there,
    also after a partial install (a removable handle, like a hook's). See [Note: compiled
    blocks]"""

    def __init__(self, block: nn.Module, runtime: BlockRuntime, index: int) -> None:
        self.block = block
        self._runtime = runtime
        self._index = index
        self._hook: RemovableHandle | None = None

    def install(self) -> StreamedCallHandle:
        self._hook = self.block.register_forward_pre_hook(_seen_by_dynamo)
        self.keep_installed()
        return self

    def keep_installed(self) -> None:
        """Wrap the block again if its `_compiled_call_impl` was replaced (`block.compile()`
        after enable()). One attribute check when it was not."""
        current = self.block._compiled_call_impl
        if type(current) is not StreamedCall:
            self.block._compiled_call_impl = StreamedCall(self._runtime, self._index, self.block._call_impl, current)

    def remove(self) -> None:
        current = self.block._compiled_call_impl
        if type(current) is StreamedCall:
            self.block._compiled_call_impl = current.compiled
        if self._hook is not None:
            self._hook.remove()


def isolate(blocks: Sequence[nn.Module]) -> list[StreamedCallHandle]:
    """Give resident `blocks` the call boundary streamed blocks have, without streaming: a
    resident reference that `torch.compile(model)` partitions as it partitions the model under
    dlo (the fair comparison for whole-model compilation). `remove()` each handle to undo."""
    return [StreamedCallHandle(block, _NO_STREAMING, index).install() for index, block in enumerate(blocks)]


class _NoStreaming:
    def before_block(self, index: int) -> None:
        pass

    def after_block(self, index: int) -> None:
        pass


_NO_STREAMING = _NoStreaming()


# Compiled callables and eval-frame callbacks (one per torch.compile) already checked: reading
# the inductor config is too slow for every block call. Weak: a dropped compile is forgotten.
_VETTED: weakref.WeakSet[object] = weakref.WeakSet()


def _backend(callback: object) -> object:
    """The backend of an eval-frame callback: CatchErrorsWrapper -> ConvertFrame ->
    WrapBackendDebug, which has the backend's `get_compiler_config`."""
    for _ in range(4):
        if hasattr(callback, "get_compiler_config") or not hasattr(callback, "_torchdynamo_orig_backend"):
            break
        callback = callback._torchdynamo_orig_backend
    return callback


def _compiler_config(compiled: object) -> object:
    """Inductor's config for a compiled callable or backend: its mode's and options' patches
    over the global config (None: not inductor). torch 2.13 answers from the callable's
    `get_compiler_config`; torch 2.11's answers None there, and only the backend of the
    compile context in the callable's closure knows."""
    get = getattr(compiled, "get_compiler_config", None)
    config = get() if callable(get) else None
    if config is None:
        get = getattr(_closure_backend(compiled), "get_compiler_config", None)
        config = get() if callable(get) else None
    return config


def _closure_backend(compiled: object) -> object | None:
    """The backend of the compile context in a compiled callable's closure (None: none)."""
    # A private torch class, looked up here: renamed in a later torch, only this lookup goes.
    context_type = getattr(torch._dynamo.eval_frame, "_TorchDynamoContext", ())
    contexts = (cell.cell_contents for cell in getattr(compiled, "__closure__", None) or () if _filled(cell))
    context = next((c for c in contexts if isinstance(c, context_type)), None)
    return _backend(context.callback) if context is not None else None


def _compiler_name(backend: object | None) -> str | None:
    """torch.compile's name of a backend: `compiler_name` on its wrapper of a named backend,
    `_compiler_name` on dynamo's debug wrapper."""
    return getattr(backend, "compiler_name", None) or getattr(backend, "_compiler_name", None)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not assigned yet
        return False
    return True


def _vet(compiled: object, what: str) -> None:
    """Refuse what a streamed block cannot be compiled with. See [Note: compiled blocks]"""
    if "cudagraphs" in (_compiler_name(compiled), _compiler_name(_closure_backend(compiled))):
        raise StreamingError(
            f"{what} with backend='cudagraphs': graph replay reuses the weight addresses of the capture, and dlo "
            "moves a streamed block's weights from slot to slot. Compile with the default backend (inductor)"
        )
    config = _compiler_config(compiled)
    if isinstance(config, dict):
        if config.get("triton.cudagraphs"):
            raise StreamingError(
                f"{what} with CUDA graphs (torch.compile mode='reduce-overhead', or inductor's triton.cudagraphs): "
                "graph replay reuses the weight addresses of the capture, and dlo moves a streamed block's "
                "weights from slot to slot. Compile with mode='default' or mode='max-autotune-no-cudagraphs'"
            )
        if config.get("freezing"):
            raise StreamingError(
                f"{what} with inductor's freezing=True, which folds weights into the graph as constants: every "
                "streamed block would run with the weights it was compiled with. Compile without freezing"
            )
    with contextlib.suppress(TypeError):  # not weakly referenceable: checked again next time
        _VETTED.add(compiled)


class CompileWatch:
    """torch.compile activity since it was made, read from dynamo's process-wide records (so
    they include other models compiled meanwhile): graphs compiled, graph breaks (dynamo's
    `graph_break` and `unimplemented` counters: torch 2.11 files a break at a
    `torch.compiler.disable`d call, dlo's boundary under whole-model compilation, under the
    first, 2.13 under the second), and recompilations (a frame compiled again because its
    guards failed). `poll()` before dynamo's record of recent compilations (the last 64)
    overflows: once per call."""

    def __init__(self) -> None:
        self._graphs = counters["stats"]["unique_graphs"]
        self._breaks = _graph_breaks()
        self._seen = _latest_compilation()
        self.recompiles = 0
        self.recompile_reasons: list[str] = []

    def poll(self) -> None:
        metrics = get_compilation_metrics()
        start = next((i + 1 for i in range(len(metrics) - 1, -1, -1) if metrics[i] is self._seen), 0)
        for metric in metrics[start:]:
            if metric.recompile_reason:
                self.recompiles += 1
                self.recompile_reasons.append(f"{metric.co_name}: {metric.recompile_reason}")
        if metrics:
            self._seen = metrics[-1]

    @property
    def graphs(self) -> int:
        return counters["stats"]["unique_graphs"] - self._graphs

    @property
    def graph_breaks(self) -> int:
        return _graph_breaks() - self._breaks


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values())


def _latest_compilation() -> object | None:
    metrics = get_compilation_metrics()
    return metrics[-1] if metrics else None
