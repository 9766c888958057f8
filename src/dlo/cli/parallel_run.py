"""`dlo generate --nproc N --parallel {dp,sp}`: the flags' rules, checked from the flags alone
(before torch is imported), and what each rank does differently.

dp: every rank runs the whole call, rank r with seed + r, and writes its own output.
sp: every rank runs the same call on its slice of the transformer's sequence (diffusers'
context parallelism: Ulysses and/or ring attention over all N ranks); rank 0 writes the output.
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass
from pathlib import Path

from dlo.errors import ConfigError


class Parallel(enum.Enum):
    DP = "dp"
    SP = "sp"


@dataclass(frozen=True)
class ParallelRun:
    """How many ranks and how they split the work; `mode` None: one process."""

    nproc: int = 1
    mode: Parallel | None = None
    ulysses_degree: int = 1
    ring_degree: int = 1

    def seed(self, seed: int, rank: int) -> int:
        """DP ranks make different outputs; SP ranks share one call, so one seed."""
        return seed + rank if self.mode is Parallel.DP else seed

    def output(self, output: Path, rank: int) -> Path | None:
        """Where `rank` writes: its own file in DP (`out.rank1.png`), only rank 0 in SP."""
        if self.mode is Parallel.DP:
            return output.with_name(f"{output.stem}.rank{rank}{output.suffix}")
        return output if rank == 0 else None

    def outputs(self, output: Path) -> list[Path]:
        return [path for rank in range(self.nproc) if (path := self.output(output, rank)) is not None]


def parallel_run_from_flags(args: argparse.Namespace) -> ParallelRun:
    """The run `--nproc`, `--parallel`, `--ulysses` and `--ring` ask for, or the first broken rule."""
    nproc, ulysses, ring = args.nproc, args.ulysses, args.ring
    mode = Parallel(args.parallel) if args.parallel else None
    given = " ".join(f"{flag} {value}" for flag, value in (("--ulysses", ulysses), ("--ring", ring)) if value)
    if given and mode is not Parallel.SP:
        raise ConfigError(f"{given}: the degrees of sequence parallelism need --parallel sp")
    if nproc > 1 and mode is None:
        raise ConfigError(
            f"--nproc {nproc}: say how the ranks split the work, --parallel dp (an output per rank, seed + rank) "
            "or --parallel sp (one output, the sequence split across the ranks)"
        )
    if mode is not None and nproc < 2:
        raise ConfigError(f"--parallel {mode.value} needs --nproc N with N >= 2 ranks")
    if mode is not Parallel.SP:
        return ParallelRun(nproc, mode)
    if not given:
        ulysses = nproc  # Ulysses over every rank: one all-to-all per attention, no ring passes
    ulysses, ring = ulysses or 1, ring or 1
    if ulysses * ring != nproc:
        raise ConfigError(f"{given}: the sequence-parallel degrees multiply to {ulysses * ring}, not --nproc {nproc}")
    return ParallelRun(nproc, mode, ulysses, ring)
