"""The CUDA implementation of `RegistrationDriver`, through NVIDIA's cuda-bindings.

torch.cuda.cudart() exposes cudaHostRegister but neither device attributes, pointer
attributes nor the pending-error calls this needs, and torch 2.11's Tensor.is_pinned() answers
False for memory registered outside torch's own pinned allocator; cuda-bindings has all of it
(an optional dependency: `pip install cuda-bindings`). Registration without the PORTABLE flag
pins memory for the current device's context only, so every call runs with the target device
current and restores the caller's device afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class CudaRegistrationDriver:
    def __init__(self, runtime: Any, device_index: int) -> None:
        self._rt = runtime
        self._index = device_index
        self._success = runtime.cudaError_t.cudaSuccess

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        err, previous = self._rt.cudaGetDevice()
        if err == self._success and previous != self._index:
            self._rt.cudaSetDevice(self._index)
            try:
                yield
            finally:
                self._rt.cudaSetDevice(previous)
        else:
            yield

    def read_only_supported(self) -> bool:
        attribute = self._rt.cudaDeviceAttr.cudaDevAttrHostRegisterReadOnlySupported  # 113
        err, value = self._rt.cudaDeviceGetAttribute(attribute, self._index)
        return err == self._success and value == 1

    def register(self, address: int, nbytes: int, flags: int) -> int:
        with self._on_device():
            (err,) = self._rt.cudaHostRegister(address, nbytes, flags)
        return int(err)

    def unregister(self, address: int) -> int:
        with self._on_device():
            (err,) = self._rt.cudaHostUnregister(address)
        return int(err)

    def is_registered(self, address: int) -> bool:
        err, attributes = self._rt.cudaPointerGetAttributes(address)
        return err == self._success and attributes.type == self._rt.cudaMemoryType.cudaMemoryTypeHost

    def clear_error(self, code: int) -> None:
        # Peek first: an error left by someone else's earlier call is not ours to swallow.
        (pending,) = self._rt.cudaPeekAtLastError()
        if int(pending) == code:
            self._rt.cudaGetLastError()

    def error_name(self, code: int) -> str:
        err, name = self._rt.cudaGetErrorName(self._rt.cudaError_t(code))
        return name.decode() if err == self._success else f"error {code}"


def registration_driver(device: torch.device) -> CudaRegistrationDriver | str | None:
    """The driver that registers host memory for `device`; None where registration does not
    apply (the CPU: slots are host memory); a reason where it cannot be done."""
    if device.type != "cuda":
        return None
    try:
        from cuda.bindings import runtime
    except ImportError:
        return "cuda-bindings is not installed (pip install cuda-bindings)"
    return CudaRegistrationDriver(runtime, device.index if device.index is not None else torch.cuda.current_device())
