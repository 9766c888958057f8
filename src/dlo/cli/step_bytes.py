"""What the CLI reports as bytes streamed per step, and the H2D rate beside it.

A run's counters include work that no steady step repeats: the first call's demand loads,
what the ring prefetched after the last step for a next call (the first blocks again), and
with resident_layers='auto' the measuring first call (every block streamed) and the copies
that then make blocks resident. So the bytes per step are the last step's: the counters at
the end less those when the step before it ended, as `inspect`'s "streamed per call" (times
the transformer calls a step makes) predicts them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlo.cli.format import human_bytes


@dataclass(frozen=True)
class StepBytes:
    before_last: int | None  # streamed when the step before the last ended (None: one step, or not sampled)
    total: int  # streamed by the end of the run
    steps: int

    @staticmethod
    def sampled_after(steps: int) -> int:
        """The step (counted from 0) after which `before_last` is sampled."""
        return steps - 2

    def text(self) -> str:
        if self.before_last is None:
            return f"{human_bytes(self.total)} in all (with the next call's prefetch)"
        last = self.total - self.before_last
        if last * self.steps == self.total:
            return human_bytes(last)
        return f"{human_bytes(last)} ({human_bytes(self.total)} over the {self.steps} steps)"


def h2d_text(gbps: float, device_type: str, digits: int = 1) -> str:
    """The achieved host-to-device rate; on the CPU there is no link (the "copies" are memcpy)."""
    return f"{gbps:.{digits}f} GB/s" if device_type == "cuda" else "n/a (cpu)"
