"""dlo: distributed layerwise offload for diffusion transformers.

Keep a transformer's blocks in host memory and stream them into rotating device slots just
before they run, overlapping copies with compute.
"""

from dlo.backend.enable import enable
from dlo.backend.fp8_reference import quantize_resident
from dlo.backend.gather_group import ParallelGroups
from dlo.backend.handle import HandleState, OffloadHandle
from dlo.backend.pipeline import PipelineHandle, enable_pipeline
from dlo.config import OffloadConfig, Topology
from dlo.host.host_weight_plan import HostWeightPlan
from dlo.host.loader import load_transformer
from dlo.host.memory_accounting import HostMemory, process_tree_memory, read_smaps_rollup
from dlo.host.registration import RegistrationCleanupError
from dlo.host.safetensors_file import CheckpointError, CheckpointErrorKind
from dlo.errors import ConfigError, DiscoveryError, DloError, EnableError, StreamingError
from dlo.observe.stats import OffloadStats
from dlo.planning.offload_plan import OffloadPlan, discover

__all__ = [
    "CheckpointError",
    "CheckpointErrorKind",
    "ConfigError",
    "DiscoveryError",
    "DloError",
    "EnableError",
    "HandleState",
    "HostMemory",
    "HostWeightPlan",
    "OffloadConfig",
    "OffloadHandle",
    "OffloadPlan",
    "OffloadStats",
    "PipelineHandle",
    "RegistrationCleanupError",
    "ParallelGroups",
    "StreamingError",
    "Topology",
    "discover",
    "enable",
    "enable_pipeline",
    "load_transformer",
    "process_tree_memory",
    "quantize_resident",
    "read_smaps_rollup",
]
__version__ = "0.1.0"
