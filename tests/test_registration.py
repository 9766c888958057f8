"""All-or-nothing host registration with a fake driver (docs/guides/host-weight-cache.md): the policy, on CPU."""

import ctypes
import mmap
import os
import time

import numpy as np
import pytest

from fake_driver import FakeDriver

from dlo.host.registration import (
    READ_ONLY,
    HostRange,
    HostRegistration,
    RegistrationCleanupError,
    RegistrationError,
    coalesce,
)

PAGE = 4096
_libc = ctypes.CDLL(None, use_errno=True)
RANGES = [HostRange("a", 0x1000, 0x3000), HostRange("a", 0x9000, 0xA000), HostRange("b", 0x20000, 0x21000)]


def test_coalescing_pages_within_one_file():
    pieces = [("f", 0x1003, 4096), ("f", 0x2800, 1024), ("f", 0x9001, 1)]
    assert coalesce(pieces, PAGE) == [HostRange("f", 0x1000, 0x3000), HostRange("f", 0x9000, 0xA000)]


def test_adjacent_ranges_of_two_files_stay_separate():
    pieces = [("a", 0x1000, 0x1000), ("b", 0x2000, 0x1000), ("a", 0x2000, 0x10)]
    assert coalesce(pieces, PAGE) == [HostRange("a", 0x1000, 0x3000), HostRange("b", 0x2000, 0x3000)]


def test_all_ranges_registered_read_only():
    driver = FakeDriver()
    registration = HostRegistration(driver, RANGES, limit_bytes=0, probes=[0x1008, 0x20010])
    assert registration.total_bytes == 0x2000 + 0x1000 + 0x1000 and registration.region_count == 3
    assert [c[3] for c in driver.calls if c[0] == "register"] == [READ_ONLY] * 3


def test_the_ceiling_is_checked_before_any_driver_call():
    driver = FakeDriver()
    with pytest.raises(RegistrationError, match="exceeds the registration ceiling"):
        HostRegistration(driver, RANGES, limit_bytes=0x1000)
    assert driver.calls == []


def test_no_read_only_support_registers_nothing():
    driver = FakeDriver(read_only=False)
    with pytest.raises(RegistrationError, match="attribute 113"):
        HostRegistration(driver, RANGES, limit_bytes=0)
    assert [c for c in driver.calls if c[0] == "register"] == []


def test_a_failure_midway_rolls_back_in_reverse_and_clears_its_error():
    driver = FakeDriver(fail_register_at=2)
    with pytest.raises(RegistrationError, match="4096 bytes of b failed: fake error 2"):
        HostRegistration(driver, RANGES, limit_bytes=0)
    assert [c[1] for c in driver.calls if c[0] == "unregister"] == [0x9000, 0x1000]
    assert driver.registered == {} and driver.cleared == [2]


def test_a_driver_exception_is_wrapped_after_the_rollback():
    driver = FakeDriver(raise_at=1)
    with pytest.raises(RegistrationError, match="driver exploded"):
        HostRegistration(driver, RANGES, limit_bytes=0)
    assert driver.registered == {}


@pytest.mark.parametrize("registered", [False, True], ids=["before-the-call", "as-the-call-returns"])
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_during_registration_rolls_back_and_propagates_unchanged(interrupt, registered):
    """Ctrl-C must stop the run (`dlo: interrupted`), not become a staging fallback. Python
    raises it once the driver call returns, so the range in flight may be registered by then:
    it is unregistered too (else its pages stay pinned and the caller unmaps them)."""
    driver = FakeDriver(raise_at=1, raises=interrupt, raises_registered=registered)
    with pytest.raises(interrupt):
        HostRegistration(driver, RANGES, limit_bytes=0)
    unregistered = [c[1] for c in driver.calls if c[0] == "unregister"]
    assert unregistered == ([RANGES[1].start, 0x1000] if registered else [0x1000]) and driver.registered == {}


def test_a_tensor_that_does_not_read_as_pinned_rolls_back():
    driver = FakeDriver()
    with pytest.raises(RegistrationError, match="do not read as pinned"):
        HostRegistration(driver, RANGES, limit_bytes=0, probes=[0x500000])
    assert driver.registered == {}


def test_a_failed_rollback_is_a_cleanup_error():
    driver = FakeDriver(fail_register_at=2, fail_unregister=[0x1000])
    with pytest.raises(RegistrationCleanupError, match="could not unregister"):
        HostRegistration(driver, RANGES, limit_bytes=0)


def test_close_is_reverse_idempotent_and_retries_failures():
    driver = FakeDriver(fail_unregister=[0x9000])
    registration = HostRegistration(driver, RANGES, limit_bytes=0)
    failures = registration.close()
    assert failures == ["HostRange(file='a', start=36864, end=40960): fake error 1"]  # 0x9000..0xA000
    assert [c[1] for c in driver.calls if c[0] == "unregister"] == [0x20000, 0x9000, 0x1000]
    assert registration.region_count == 1  # kept for a retry
    assert registration.close() == [] and registration.region_count == 0
    assert registration.close() == []  # idempotent
    assert [c[1] for c in driver.calls if c[0] == "unregister"][-1] == 0x9000


def test_a_driver_whose_attribute_query_raises_is_a_registration_error():
    driver = FakeDriver()

    def raising():
        raise RuntimeError("cudaErrorNoDevice")

    driver.read_only_supported = raising
    with pytest.raises(RegistrationError, match="cudaErrorNoDevice"):
        HostRegistration(driver, RANGES, limit_bytes=0)
    assert driver.registered == {}


def _resident_pages(address: int, nbytes: int) -> int:
    vector = np.zeros(-(-nbytes // mmap.PAGESIZE), dtype=np.uint8)
    assert _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), ctypes.c_void_p(vector.ctypes.data)) == 0
    return int((vector & 1).sum())


def test_registration_has_the_pages_of_a_cold_mapping_read_ahead(tmp_path):
    """The fake driver touches no page: only the read-ahead can bring the file in (20 MiB: two
    whole probe regions and a partial one)."""
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(20 << 20))
    with open(path, "rb") as file:
        os.fsync(file.fileno())  # dirty pages cannot be dropped
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        mapping = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ)
    address, nbytes = np.frombuffer(mapping, dtype=np.uint8).ctypes.data, len(mapping)
    pages = nbytes // mmap.PAGESIZE
    if _resident_pages(address, nbytes) == pages:
        pytest.skip(f"the filesystem of {tmp_path} keeps dropped pages in memory (tmpfs?): nothing to read ahead")
    registration = HostRegistration(FakeDriver(), [HostRange(str(path), address, address + nbytes)], limit_bytes=0)
    deadline = time.monotonic() + 60  # the reads complete asynchronously: wait for them, boundedly
    while _resident_pages(address, nbytes) < pages and time.monotonic() < deadline:
        time.sleep(0.05)
    # Without the read-ahead none would be resident; under the suite's memory pressure the kernel
    # may already have dropped a few of those read (5085 of 5120 seen once).
    assert _resident_pages(address, nbytes) >= 0.95 * pages
    assert registration.close() == []


def test_read_ahead_pieces_follow_the_disk_queue_or_the_usual_floor(tmp_path):
    from dlo.host.registration import ADVICE_FLOOR_BYTES, PROBE_BYTES, advice_bytes

    assert advice_bytes(os.makedev(0, 65000)) == ADVICE_FLOOR_BYTES  # no block device: no queue to read
    assert ADVICE_FLOOR_BYTES <= advice_bytes(os.stat(tmp_path).st_dev) <= PROBE_BYTES


def test_an_interrupted_range_the_driver_cannot_account_for_keeps_the_mapping_open():
    """Ctrl-C as the call returns and the driver cannot say whether the range is registered:
    it counts as registered, its unregister fails, and the caller is told not to unmap."""

    class Unsure(FakeDriver):
        def is_registered(self, address):
            raise RuntimeError("no answer")

    driver = Unsure(raise_at=1, raises=KeyboardInterrupt)
    with pytest.raises(RegistrationCleanupError, match="could not unregister") as raised:
        HostRegistration(driver, RANGES, limit_bytes=0)
    assert [c[1] for c in driver.calls if c[0] == "unregister"] == [RANGES[1].start, 0x1000]
    assert raised.value.registration.region_count == 1  # the unsure range, kept for a later close()
