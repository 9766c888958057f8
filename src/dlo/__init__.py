"""dlo: distributed layerwise offload for diffusion transformers.

Keep a transformer's blocks in host memory and stream them into rotating device slots just
before they run, overlapping copies with compute.
"""

import importlib
from typing import Any

# name -> the module defining it. Imported on first use (PEP 562): `import dlo` costs nothing,
# so the CLI can answer Ctrl-C while torch is still being imported.
_EXPORTS = {
    "CheckpointError": "dlo.host.safetensors_file",
    "CheckpointErrorKind": "dlo.host.safetensors_file",
    "ConfigError": "dlo.errors",
    "DiscoveryError": "dlo.errors",
    "DloError": "dlo.errors",
    "EnableError": "dlo.errors",
    "GGUFKernelHandle": "dlo.backend.gguf_kernel_linears",
    "HandleState": "dlo.backend.handle",
    "HostMemory": "dlo.host.memory_accounting",
    "HostWeightPlan": "dlo.host.host_weight_plan",
    "OffloadConfig": "dlo.config",
    "OffloadHandle": "dlo.backend.handle",
    "OffloadPlan": "dlo.planning.offload_plan",
    "OffloadStats": "dlo.observe.stats",
    "OutputSize": "dlo.backend.decode_peak",
    "ParallelGroups": "dlo.backend.gather_group",
    "PipelineHandle": "dlo.backend.pipeline",
    "PipelinePlan": "dlo.planning.pipeline_budget",
    "RegistrationCleanupError": "dlo.host.registration",
    "StreamingError": "dlo.errors",
    "Topology": "dlo.config",
    "discover": "dlo.planning.offload_plan",
    "enable": "dlo.backend.enable",
    "enable_pipeline": "dlo.backend.pipeline",
    "load_transformer": "dlo.host.loader",
    "process_tree_memory": "dlo.host.memory_accounting",
    "quantize_resident": "dlo.backend.fp8_reference",
    "read_smaps_rollup": "dlo.host.memory_accounting",
    "use_gguf_kernels": "dlo.backend.gguf_kernel_linears",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:  # a subpackage used as an attribute (dlo.host.checkpoint...)
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":  # a dependency of that module is missing: say so
                raise
            raise AttributeError(f"module 'dlo' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__version__ = "0.1.0"
