"""Registering a checkpoint or host weight cache mapping at enable(), and closing it in the
right order.

[Note: mapping lifetime]
Registered pages belong to the driver until they are unregistered: unmapping them first
leaves the driver pinning pages of a mapping that no longer exists. So a mapping is closed
only after a clean unregister (`release_mapping`); when unregistering fails, the mapping is
kept open for the life of the process (`_STILL_REGISTERED` holds it, so not even garbage
collection unmaps it) and the error is reported. The same holds when a failed registration's
own rollback fails: enable() aborts and the mapping stays.
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass

import torch

from dlo.backend import cuda_registration
from dlo.config import OffloadConfig
from dlo.host.checkpoint import Checkpoint
from dlo.host.registration import HostRegistration, RegistrationError, coalesce

logger = logging.getLogger(__name__)

GIB = 2**30

# Memory the driver may still own (mappings whose unregister failed, with their
# registrations), kept for the life of the process. See [Note: mapping lifetime]
_STILL_REGISTERED: list[tuple[object, ...]] = []


@dataclass(frozen=True)
class RegistrationOutcome:
    """enable()'s registration decision. `registration` is None when the staging path is
    used; `fallback` then says why ("" when registration was not applicable at all)."""

    registration: HostRegistration | None
    fallback: str
    seconds: float


NOT_APPLICABLE = RegistrationOutcome(None, "", 0.0)  # no cache mapping, or a device without registration


def register_mapping(checkpoint: Checkpoint, config: OffloadConfig, device: torch.device) -> RegistrationOutcome:
    """Register every tensor of a checkpoint or cache mapping read-only, all or nothing
    (docs/guides/host-weight-cache.md). A refusal
    is logged and returned as a fallback; RegistrationCleanupError (a failed rollback)
    propagates: startup must abort. See [Note: mapping lifetime]"""
    if not config.pin_memory:
        return RegistrationOutcome(None, "OffloadConfig.pin_memory=False", 0.0)
    try:
        driver = cuda_registration.registration_driver(device)
    except Exception as err:  # e.g. cuda-bindings built for another driver
        return registration_refused(f"the CUDA runtime bindings failed: {err!r}", 0.0)
    if driver is None:  # nothing to register on this device: its slots are host memory
        return NOT_APPLICABLE
    if isinstance(driver, str):
        return registration_refused(driver, 0.0)
    mapped = [(source, checkpoint.view(key)) for key, source in checkpoint.tensors.items() if source.entry.nbytes]
    pieces = [(str(source.file.path), view.data_ptr(), source.entry.nbytes) for source, view in mapped]
    started = time.perf_counter()
    try:
        registration = HostRegistration(
            driver,
            coalesce(pieces, mmap.PAGESIZE),
            limit_bytes=math.ceil(config.pin_limit_gib * GIB),  # a tiny positive limit stays positive
            probes=[view.data_ptr() for _, view in mapped],
        )
    except RegistrationError as err:
        return registration_refused(str(err), time.perf_counter() - started)
    seconds = time.perf_counter() - started
    logger.info(
        "dlo: registered %.2f GiB of the mapping read-only (%d ranges, %.3f s): "
        "blocks copy straight from the shared pages",
        registration.total_bytes / GIB,
        registration.region_count,
        seconds,
    )
    return RegistrationOutcome(registration, "", seconds)


def registration_refused(reason: str, seconds: float = 0.0, quiet: bool = False) -> RegistrationOutcome:
    """The staging path, and why. `quiet`: an expected refusal (logged at INFO, not WARNING)."""
    logger.log(
        logging.INFO if quiet else logging.WARNING,
        "dlo: host registration not used (%s); blocks stream through pinned staging buffers",
        reason,
    )
    return RegistrationOutcome(None, reason, seconds)


def release_mapping(checkpoint: Checkpoint, registration: HostRegistration | None) -> list[str]:
    """Unregister (again, if an earlier attempt failed), then unmap; returns the unregister
    failures, in which case the mapping stays open. See [Note: mapping lifetime]"""
    failures = registration.close() if registration is not None else []
    if failures:
        assert registration is not None
        keep_registered(registration, checkpoint)
        logger.error("dlo: could not unregister host memory, keeping its mapping open: %s", "; ".join(failures))
    else:
        checkpoint.close()
    return failures


def keep_registered(*owners: object) -> None:
    """Keep these owners of host memory (a mapping, pinned buffers) alive for the life of the
    process: never unmapped nor freed. See [Note: mapping lifetime]"""
    _STILL_REGISTERED.append(owners)
