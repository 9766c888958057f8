"""dlo: distributed layerwise offload for diffusion transformers.

Keep a transformer's blocks in host memory and stream them into rotating device slots just
before they run, overlapping copies with compute.
"""

from dlo.backend.enable import enable
from dlo.backend.handle import HandleState, OffloadHandle
from dlo.config import OffloadConfig
from dlo.errors import ConfigError, DiscoveryError, DloError, EnableError, StreamingError
from dlo.observe.stats import OffloadStats
from dlo.planning.offload_plan import OffloadPlan, discover

__all__ = [
    "ConfigError",
    "DiscoveryError",
    "DloError",
    "EnableError",
    "HandleState",
    "OffloadConfig",
    "OffloadHandle",
    "OffloadPlan",
    "OffloadStats",
    "StreamingError",
    "discover",
    "enable",
]
__version__ = "0.1.0"
