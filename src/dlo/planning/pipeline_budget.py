"""One device budget for a whole pipeline call: where each component's weights live, how the
VAE decodes, and what is left for the transformers' residency. Plain numbers in, a plan out.

[Note: pipeline budget]
A pipeline call has three phases that share the device: the text encoders run once per prompt,
the transformers every step, the VAE decodes once. A component on the device keeps its weights
there through all three; a streamed transformer keeps its non-block parts and slots. A text
encoder (any component but the transformers) that dlo streams holds device memory in its own
phase only: its large non-block parts stream as blocks of their own (`with_single_blocks`), a
plain token embedding among them looks its rows up on the host and takes no slot (See [Note:
token embeddings looked up on the host]), and its slots go back to the caching allocator when a
transformer call starts (`OffloadHandle.release_slots`), to be taken again at its next call. Its
phase costs one pass over its blocks' bytes per prompt. The plan, for a budget B:
1. Everything on the device (no streaming) when all the weights plus the larger of a decode's
   activations (the most faithful that fits, see 3.) and `activation_reserve` (the
   transformer's and encoders' activations, not known before a call) fit in B less `HEADROOM`.
   A component that must be streamed (asked for, or a transformer loaded as a mapping, which
   has no private weights to move) is streamed with the residency budget of step 2, and becomes
   resident through its measured residency.
2. Otherwise the transformers are streamed, and each other component is streamed when it has
   repeated blocks and streaming it holds less than its weights (its non-block parts plus
   slots), else kept on the device. The VAE stays on the device unless it is asked for: its
   decoder runs its blocks once per latent frame and tile, and streaming would copy them that
   often. The held weights H are those of the components on the device, the streamed
   transformers and a streamed VAE; the encoders' phase holds H plus the parts of all streamed
   encoders (each keeps its slots until a transformer starts, so one's are still held while
   the next runs), each part its non-block parts plus its `num_slots` largest blocks (its slots
   are given back right after enable(), then taken per block size: See [Note: slots per size
   class]). The transformers run every step, so they get what is left: `resident_layers='auto'`
   within B less `HEADROOM`. Their residency is measured on the process's own peak in the
   steps, which holds the encoders' phase of the first call too (See [Note: residency
   budget]); the decode comes after it, so the plan hands over the larger of the decode's and
   the encoders' phase, H included (`other_phase_bytes`, less the transformer's own slots), and
   the resident blocks fit beside the larger of the two: every phase stays inside B with them.
3. The decode: whole when its predicted activations fit in what H leaves; else one sample at a
   time (diffusers' slicing, for a batch), else in tiles (tiling). Below H plus the larger of
   the cheapest decode and the encoders' phase, the budget is refused, naming that minimum.
The transformers' own activations are not predicted: `resident_layers='auto'` measures them
and keeps only the slots when nothing more fits. Nor are the encoders' (512 tokens of a T5-XXL
take tens of MiB).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dlo.errors import ConfigError

GIB = 2**30
HEADROOM = 0.02  # of the budget: allocator rounding, library workspaces


class Placement(enum.Enum):
    """Where a pipeline component runs."""

    DEVICE = "device"  # its weights on the device
    STREAMED = "streamed"  # dlo streams its blocks; non-block parts and slots on the device


@dataclass(frozen=True)
class ComponentCost:
    """`weight_bytes`: the component's weights on the device. `streamed_bytes`: what streaming it
    keeps there (non-block parts + slots); None when it has no repeated blocks. `every_step`: a
    transformer. `before_steps`: it runs before the steps (a text encoder): streamed, it holds
    the device in its own phase only."""

    name: str
    weight_bytes: int
    streamed_bytes: int | None
    every_step: bool = False
    before_steps: bool = False


class DecodeMode(enum.Enum):
    WHOLE = "whole"
    SLICED = "sliced"  # one sample of the batch at a time
    TILED = "tiled"  # spatial tiles (and one sample at a time)


@dataclass(frozen=True)
class DecodeCost:
    """A way to decode and its predicted activation peak (the VAE's weights excluded)."""

    mode: DecodeMode
    peak_bytes: int


@dataclass(frozen=True)
class PipelinePlan:
    budget_bytes: int
    placement: dict[str, Placement]
    decode: DecodeCost
    weight_bytes: int  # the weights held through the steps and the decode (H)
    transformer_budget_bytes: int | None  # resident_layers='auto' budget; None: the transformers are on the device
    released: dict[str, int]  # streamed encoders -> what their own phase adds to H (their slots go back)

    @property
    def other_phase_bytes(self) -> int:
        """What the decode or the encoders' phase, the larger, holds with H: the transformers'
        residency fits beside it (less their own slots, which H counts)."""
        return self.weight_bytes + max(self.decode.peak_bytes, sum(self.released.values()))

    def describe(self) -> list[str]:
        """The plan in lines a person reads (dlo inspect, logs)."""
        lines = [f"{name}: {where.value}" for name, where in self.placement.items()]
        lines.append(f"VAE decode: {self.decode.mode.value}, predicted activations {_gib(self.decode.peak_bytes)}")
        lines.append(f"weights on the device: {_gib(self.weight_bytes)} of the {_gib(self.budget_bytes)} budget")
        for name, nbytes in self.released.items():
            lines.append(f"{name}: {_gib(nbytes)} more while it runs, given back when the transformer starts")
        if self.transformer_budget_bytes is not None:
            lines.append(
                f"transformer residency: resident_layers='auto' within {_gib(self.transformer_budget_bytes)}, beside "
                f"the larger of the steps' measured peak and the {_gib(self.other_phase_bytes)} of the decode or "
                "encoders' phase"
            )
        return lines


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / 2**20:.1f} MiB"


def plan_pipeline(
    budget_bytes: int,
    components: Sequence[ComponentCost],
    decodes: Sequence[DecodeCost],
    activation_reserve: int,
    streamed: frozenset[str] = frozenset(),
) -> PipelinePlan:
    """See [Note: pipeline budget]. `decodes`: the ways the VAE can decode, cheapest last;
    `streamed`: components the caller asked dlo to stream. Refuses a budget below the minimum
    in one line naming it."""
    usable = int(budget_bytes * (1 - HEADROOM))
    everything = sum(c.weight_bytes for c in components)
    for decode in decodes:
        if everything + max(decode.peak_bytes, activation_reserve) <= usable:
            # Those asked to stream (or loaded as a mapping) become resident through their residency.
            placement = {c.name: Placement.STREAMED if c.name in streamed else Placement.DEVICE for c in components}
            return _plan(budget_bytes, usable, placement, components, decode)
    placement = {c.name: _least(c, c.name in streamed) for c in components}
    held, released = _phases(placement, components)
    encoders = sum(released.values())
    for decode in decodes:
        if held + max(decode.peak_bytes, encoders) <= usable:
            return _plan(budget_bytes, usable, placement, components, decode)
    cheapest = min(decodes, key=lambda d: d.peak_bytes)
    least = (held + max(cheapest.peak_bytes, encoders)) / (1 - HEADROOM)
    streamed_names = [name for name, where in placement.items() if where is Placement.STREAMED]
    encoder_phase = f", or {_gib(encoders)} while {' and '.join(released)} run" if released else ""
    raise ConfigError(
        f"OffloadConfig.hbm_budget_gib={budget_bytes / GIB:.3f} is below the {least / GIB:.3f} GiB this pipeline needs "
        f"at the least ({_gib(held)} of weights with {', '.join(streamed_names)} streamed, plus the larger of "
        f"{_gib(cheapest.peak_bytes)} for a {cheapest.mode.value} VAE decode{encoder_phase}, plus {HEADROOM:.0%} "
        "headroom) before the transformer's activations; raise hbm_budget_gib, lower num_slots, or decode a smaller "
        "output"
    )


def _plan(
    budget_bytes: int,
    usable: int,
    placement: dict[str, Placement],
    components: Sequence[ComponentCost],
    decode: DecodeCost,
) -> PipelinePlan:
    held, released = _phases(placement, components)
    # The transformers' residency: the budget less the headroom (what the meta device does not
    # see); the other phases are handed over beside it (PipelinePlan.other_phase_bytes).
    streamed = any(placement[c.name] is Placement.STREAMED for c in components if c.every_step)
    return PipelinePlan(budget_bytes, placement, decode, held, usable if streamed else None, released)


def _phases(placement: Mapping[str, Placement], components: Sequence[ComponentCost]) -> tuple[int, dict[str, int]]:
    """The bytes held through every phase, and each streamed encoder's own part (held until a
    transformer starts: the encoders' parts add up, the first one's being kept while the next runs)."""
    held, released = 0, {}
    for c in components:
        if placement[c.name] is Placement.STREAMED and c.before_steps:
            assert c.streamed_bytes is not None
            released[c.name] = c.streamed_bytes
        else:
            held += _held(c, placement[c.name])
    return held, released


def _least(cost: ComponentCost, asked: bool) -> Placement:
    """Step 2: the transformers and the components asked for are streamed; the others are
    streamed when that holds less on the device than their weights."""
    if cost.streamed_bytes is None:
        return Placement.DEVICE
    if cost.every_step or asked or cost.streamed_bytes < cost.weight_bytes:
        return Placement.STREAMED
    return Placement.DEVICE


def _held(cost: ComponentCost, where: Placement) -> int:
    if where is Placement.STREAMED:
        assert cost.streamed_bytes is not None
        return cost.streamed_bytes
    return cost.weight_bytes
