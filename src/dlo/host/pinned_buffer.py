"""Host buffers for streamed blocks: aligned, optionally page-locked with exact sizes.

`torch.empty(..., pin_memory=True)` goes through the caching host allocator, which rounds
every request up to a power of two: a 700 MB Wan-14B block would take 1 GiB of locked RAM.
We allocate an ordinary buffer and page-lock exactly its pages with cudaHostRegister.
"""

from __future__ import annotations

import torch

from dlo.errors import EnableError
from dlo.planning.block_layout import ALIGNMENT, align_up

PAGE = 4096


def _driver():  # the CUDA runtime; tests substitute a fake driver here
    return torch.cuda.cudart()


@torch.inference_mode(False)
def aligned_empty(nbytes: int, device: torch.device, alignment: int = ALIGNMENT) -> torch.Tensor:
    """A flat uint8 tensor of `nbytes` whose first byte sits at a multiple of `alignment`.
    Never an inference tensor, even when allocated during a call under inference mode (e.g.
    automatic residency): later calls may run under no_grad and copy into it."""
    # See [Note: 512-byte alignment]
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, device=device)
    skip = (-raw.data_ptr()) % alignment
    return raw[skip : skip + nbytes]


class HostBuffer:
    """One block's host copy. Pinned buffers stay locked until `unpin()`; the bytes stay
    valid after it (views taken from `tensor` keep the allocation alive)."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        self._locked_bytes = align_up(nbytes, PAGE) if pin and nbytes else 0
        # Page-aligned start and a page-multiple span, so registration covers whole pages
        # that belong to this buffer alone.
        try:
            self.tensor = aligned_empty(max(nbytes, self._locked_bytes), torch.device("cpu"), PAGE)[:nbytes]
        except RuntimeError as err:  # the CPU allocator's out-of-memory
            self._locked_bytes = 0
            raise EnableError(f"cannot allocate {nbytes} bytes of host memory: {err}") from None
        if self._locked_bytes:
            cudart = _driver()
            err = cudart.cudaHostRegister(self.tensor.data_ptr(), self._locked_bytes, 0)
            if err != cudart.cudaError.success:
                self._locked_bytes = 0
                raise EnableError(
                    f"cudaHostRegister of {nbytes} bytes failed ({err}); the host may be out of "
                    "lockable memory (ulimit -l). Use OffloadConfig(pin_memory=False) to stream from "
                    "pageable memory at a lower rate."
                )

    @property
    def pinned(self) -> bool:
        return self._locked_bytes > 0

    def unpin(self) -> None:
        """Idempotent. A failed unregister keeps the buffer pinned, so a later call retries."""
        if self._locked_bytes:
            cudart = _driver()
            err = cudart.cudaHostUnregister(self.tensor.data_ptr())
            if err != cudart.cudaError.success:
                raise EnableError(f"cudaHostUnregister failed ({err})")
            self._locked_bytes = 0


def host_buffers(count: int, nbytes: int, pin: bool) -> list[HostBuffer]:
    """`count` buffers of `nbytes`, all or none: if one cannot be allocated or pinned, the
    ones made before it are unpinned before the error propagates."""
    made: list[HostBuffer] = []
    try:
        for _ in range(count):
            made.append(HostBuffer(nbytes, pin))
    except BaseException:
        for buffer in reversed(made):
            buffer.unpin()
        raise
    return made
