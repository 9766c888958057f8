"""The resident model that fp8 streaming equals: for tests and for measuring the error."""

from __future__ import annotations

import torch
from torch import nn

from dlo.backend.fp8_compute import quantize_resident_gemms
from dlo.config import OffloadConfig
from dlo.config.offload_config import AUTO
from dlo.host.fp8_codec import dequantized, quantize_into
from dlo.planning.adapters import adapter_modules
from dlo.planning.fp8_selection import fp8_format, quantized_tensors
from dlo.planning.offload_plan import OffloadPlan, discover, resolve_blocks
from dlo.planning.tensor_walk import unique_tensors


def quantize_resident(module: nn.Module, config: OffloadConfig, plan: OffloadPlan | None = None) -> int:
    """Give `module`, in place, the weights that `dlo.enable(module, device, config, plan)`
    streams as float8: each is quantized as enable() quantizes it, then dequantized on the
    device the weight is on (with `fp8_compute`, the Linears enable() runs as FP8 GEMMs
    become those: See [Note: fp8 compute]). Run resident on that device, the module computes
    exactly what the streamed one does (See [Note: fp8 streaming]); compare it with the
    unquantized model for the quantization error. Returns the number of weights changed."""
    fp8 = fp8_format(config)
    if fp8 is None:
        return 0
    refs = resolve_blocks(module, discover(module) if plan is None else plan)
    resident = 0 if config.resident_layers == AUTO else config.resident_layers
    # FP8 GEMM Linears first: their weights are float8 then, and the loop below leaves them.
    changed = quantize_resident_gemms(module, refs[resident:], config) if config.fp8_compute else 0
    with torch.no_grad():
        for ref in refs[resident:]:
            chosen = quantized_tensors(module, ref, config)
            for owned in unique_tensors(ref.module, adapter_modules(ref.module)).values():
                weight = owned.tensor
                if id(weight) not in chosen:
                    continue
                data = torch.empty(weight.shape, dtype=fp8.dtype)
                scale = torch.empty(fp8.scale_shape(weight.shape[0]), dtype=torch.float32)
                quantize_into(weight, data, scale, f"{ref.name}.{owned.name}")
                weight.data = dequantized(data.to(weight.device), scale.to(weight.device), weight.dtype)
                changed += 1
    return changed
