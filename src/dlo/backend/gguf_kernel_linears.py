"""`dlo.use_gguf_kernels(model)`: diffusers' GGUF Linears dequantize with dlo's Triton kernels.

[Note: GGUF kernel Linears]
diffusers' `GGUFLinear` dequantizes its packed weight in torch on every call (See [Note: GGUF
streaming] in dlo.planning.gguf_weights). `use_gguf_kernels` swaps the class of each GGUFLinear
whose quant type and compute dtype the kernels take (See [Note: GGUF kernels]) to
`GGUFKernelLinear`, a subclass whose forward dequantizes with one kernel launch and then runs
diffusers' own `F.linear(inputs, weight, bias)`; `restore()` swaps the classes back.

Why a class swap in place (as fp8 compute does, See [Note: fp8 compute]) and not a new module
in the parent or a hook: the module keeps its identity and its very Parameter objects, so
whatever holds it sees the change (a PEFT adapter wrapping it as its base layer, the user's
references) and dlo finds the same GGUFParameters whether `dlo.enable` runs before or after:
enable() records (module, key, tensor) and repoints the tensor's `.data` into a slot, which
the swap does not touch. A forward pre-hook cannot replace the computation, and a forward
hook would run after diffusers' dequantization; an instance `forward` would be the monkey
patch the style rules out. Nothing is attached to the modules; the handle holds the list.

The output equals diffusers' resident GGUF model's on the same device wherever the kernels'
values equal diffusers' dequantization (all the types, See [Note: GGUF kernels]), and a model
streamed by dlo with the kernels equals the same model resident with them, bit for bit: both
run the same kernel on the same packed bytes and the same F.linear on a fresh weight.
Other Linears (another quant type, BF16, a compute dtype the kernels do not write) keep
diffusers' dequantization, logged once; so does a swapped one whose weight is later replaced
by one of another type (logged once per type). The weights may be on the CPU when this is
called (dlo.enable moves them later); a call that reaches a swapped Linear whose weight is on
the CPU is refused, since the kernels run on CUDA (Triton's CPU interpreter, under
TRITON_INTERPRET=1, runs them on the CPU for tests).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dlo.errors import ConfigError, StreamingError
from dlo.planning.gguf_weights import is_gguf_parameter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    """What the swapped Linears call: `dequantize(packed uint8, quant name, dtype)`, the quant
    type names and dtypes it takes, and whether it runs CPU tensors (Triton's interpreter)."""

    dequantize: Callable[[torch.Tensor, str, torch.dtype], torch.Tensor]
    quants: frozenset[str]
    dtypes: tuple[torch.dtype, ...]
    on_cpu: bool


def load_kernels() -> Kernels:
    """dlo's Triton kernels, or one ConfigError line saying what is missing."""
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ConfigError(
            "dlo.use_gguf_kernels needs Triton, which is not installed: pip install triton (CUDA builds of torch "
            "bring it), or leave it out to dequantize with diffusers' torch code"
        ) from None
    from dlo.backend import gguf_kernels

    if not gguf_kernels.INTERPRETED and not torch.cuda.is_available():
        raise ConfigError(
            "dlo.use_gguf_kernels runs Triton kernels on a CUDA GPU, and torch sees none "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}); leave it out to dequantize with diffusers' "
            "torch code"
        )
    return Kernels(gguf_kernels.dequantize, frozenset(gguf_kernels.KERNELS), gguf_kernels.DTYPES,
                   gguf_kernels.INTERPRETED)


def _gguf_linear_class() -> type[nn.Linear]:
    from diffusers.quantizers.gguf.utils import GGUFLinear

    return GGUFLinear


def _quant_name(weight: torch.Tensor) -> str | None:
    """The GGUF quant type's name of a GGUFParameter, None for any other tensor."""
    return weight.quant_type.name if is_gguf_parameter(weight) else None


_fallbacks_logged: set[str] = set()


def _log_fallback(what: str) -> None:
    if what not in _fallbacks_logged:
        _fallbacks_logged.add(what)
        logger.info("dlo.use_gguf_kernels: a GGUF Linear with %s dequantizes with diffusers' torch code", what)


@functools.cache
def kernel_linear_class(kernels: Kernels) -> type[nn.Linear]:
    """GGUFKernelLinear, diffusers' GGUFLinear dequantizing through `kernels`."""

    class GGUFKernelLinear(_gguf_linear_class()):
        """A diffusers GGUFLinear whose weight dequantizes with one Triton kernel launch. Never
        constructed: dlo.use_gguf_kernels swaps a GGUFLinear's class in place and back (See
        [Note: GGUF kernel Linears])."""

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            weight = self.weight
            quant = _quant_name(weight)
            dtype = self.compute_dtype or torch.float16  # None: diffusers' float16 result as it is
            if quant not in kernels.quants or dtype not in kernels.dtypes:
                _log_fallback(f"a {quant or type(weight).__name__} weight, compute dtype {dtype},")
                return self.forward_native(inputs)
            if weight.device.type != "cuda" and not kernels.on_cpu:
                raise StreamingError(
                    f"dlo.use_gguf_kernels: a GGUF Linear's weight ({quant}) is on {weight.device} and the kernels run "
                    "on CUDA; move the model to the GPU or stream it with dlo.enable(model, 'cuda'), or call the "
                    "handle's restore() to dequantize with diffusers' torch code"
                )
            dense = kernels.dequantize(weight.as_tensor(), quant, dtype)
            bias = self.bias.to(dtype) if self.bias is not None else None
            return F.linear(inputs, dense, bias)

    return GGUFKernelLinear


class GGUFKernelHandle:
    """What `dlo.use_gguf_kernels` returns: the Linears it swapped, and `restore()`.

    converted: how many GGUF Linears run through the kernels.
    left: quant type (or compute dtype) -> how many GGUF Linears keep diffusers' dequantization.
    """

    def __init__(self, linears: list[nn.Linear], swapped_class: type[nn.Linear], left: dict[str, int]) -> None:
        self._linears = linears
        self._swapped_class = swapped_class
        self.converted = len(linears)
        self.left = left

    def restore(self) -> None:
        """Every swapped Linear a diffusers GGUFLinear again (the same module and parameters).
        Idempotent; works with dlo.enable on or off."""
        original = _gguf_linear_class()
        for linear in self._linears:
            if type(linear) is self._swapped_class:
                linear.__class__ = original
        self._linears = []

    def __enter__(self) -> GGUFKernelHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def use_gguf_kernels(model: nn.Module) -> GGUFKernelHandle:
    """Make every diffusers `GGUFLinear` in `model` dequantize its GGUF weight with one dlo
    Triton kernel launch (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K) into its compute dtype
    (bf16, f16 or f32), then run the same `F.linear` diffusers does. The modules and their
    parameters stay the same objects: call it before or after `dlo.enable(model, ...)`, or on a
    resident model. Outputs equal diffusers' (the kernels' values are diffusers'
    dequantization's, bit for bit), and a streamed model with the kernels equals the same model
    resident with them. Other GGUF types keep diffusers' torch dequantization (logged once).
    `restore()` on the returned handle (or leaving `with`) gives the GGUFLinears back.

    Refused with one ConfigError line, before anything changes: no GGUF Linear in `model`, its
    Linears already swapped, Triton not installed, no CUDA GPU. A call that reaches a swapped
    Linear whose weight is on the CPU is refused (StreamingError): the kernels run on CUDA.
    """
    linears = _gguf_linears(model)
    kernels = load_kernels()
    swapped = kernel_linear_class(kernels)
    chosen: list[nn.Linear] = []
    left: Counter[str] = Counter()
    for linear in linears:
        quant = _quant_name(linear.weight)
        dtype = linear.compute_dtype or torch.float16
        if quant in kernels.quants and dtype in kernels.dtypes:
            chosen.append(linear)
        else:
            left[quant if quant not in kernels.quants else str(dtype)] += 1
    for linear in chosen:
        linear.__class__ = swapped
    if left:
        logger.info(
            "dlo.use_gguf_kernels: %d GGUF Linears run through the kernels; %s keep diffusers' torch dequantization",
            len(chosen), ", ".join(f"{n} of {what}" for what, n in sorted(left.items())),
        )
    return GGUFKernelHandle(chosen, swapped, dict(left))


def _gguf_linears(model: nn.Module) -> list[nn.Linear]:
    """The model's diffusers GGUFLinears (as diffusers made them: subclasses are someone
    else's), refusing a model without any or one already swapped."""
    found = [m for m in model.modules() if _is_class(type(m), "GGUFLinear")]
    swapped = [m for m in model.modules() if type(m).__module__ == __name__]  # a GGUFKernelLinear
    if swapped:
        raise ConfigError(
            f"dlo.use_gguf_kernels: {type(model).__name__} already runs {len(swapped)} GGUF Linears through the "
            "kernels; call restore() on the first handle before asking again"
        )
    if not found:
        raise ConfigError(
            f"dlo.use_gguf_kernels: {type(model).__name__} has no diffusers GGUFLinear; load it from a GGUF file "
            "with quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=...)"
        )
    return found


def _is_class(cls: type, name: str) -> bool:
    """`cls` is diffusers' class `name`, known without importing diffusers."""
    return cls.__name__ == name and cls.__module__.startswith("diffusers.")
