from dlo.config.offload_config import OffloadConfig

__all__ = ["OffloadConfig"]
