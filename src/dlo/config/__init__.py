from dlo.config.offload_config import OffloadConfig
from dlo.config.topology import Topology

__all__ = ["OffloadConfig", "Topology"]
