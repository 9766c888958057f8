"""Where this process sits in a parallel deployment: what host-storage decisions depend on."""

from __future__ import annotations

from dataclasses import dataclass

from dlo.errors import ConfigError


@dataclass(frozen=True)
class Topology:
    """Sizes and ranks of the parallel dimensions around the transformer.

    tp: tensor parallel (weights are sliced per rank); dp: data parallel replicas; sp:
    sequence parallel; hsdp: hybrid-sharded data parallel (weights sharded across replicas).
    A plain single process is `Topology()`.
    """

    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    sp_size: int = 1
    sp_rank: int = 0
    hsdp: bool = False
    ep_size: int = 1  # expert parallel
    pp_size: int = 1  # pipeline parallel
    cfg_size: int = 1  # classifier-free-guidance parallel (cond / uncond on different ranks)

    def __post_init__(self) -> None:
        for dim in ("tp", "dp", "sp"):
            size, rank = getattr(self, f"{dim}_size"), getattr(self, f"{dim}_rank")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(f"Topology.{dim}_size must be an int >= 1, got {size!r}")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
                raise ConfigError(f"Topology.{dim}_rank must be an int in [0, {size}), got {rank!r}")
        for name in ("ep_size", "pp_size", "cfg_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Topology.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.hsdp, bool):
            raise ConfigError(f"Topology.hsdp must be True or False, got {self.hsdp!r}")
