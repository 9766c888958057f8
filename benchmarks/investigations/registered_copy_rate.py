"""Host-to-device copy rate from a registered file mapping vs pinned memory, by copy size and
source alignment: is a registered page-cache page slower to DMA from than a pinned one?

(Issue 18: Flux fp8 from the registered cache runs at 52.3 GB/s of float8 loads where the
pinned fp8 copy runs at 55.3, while bf16 entries copied the same way match pinned.)

A --file-gib file is written under --dir and read once (page cache hot), mapped read-only and
registered with cudaHostRegisterReadOnly like a cache entry; a pinned buffer of the same size
gets the same bytes. For each copy size, consecutive slices of the source are copied into one
device buffer, one cudaMemcpyAsync each on a side stream, --rounds times over the source; the
rate is bytes over the CUDA-event time. Source start offsets: 0 (page-aligned) and 512 (the
alignment of a block image inside a cache entry). --device-load runs D2D copies on another stream
while the timed copies run (device-memory traffic like a forward's dequantization and compute).

On the GPU machine, from the repository root: PYTHONPATH=$PWD/src python3 benchmarks/investigations/registered_copy_rate.py
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from pathlib import Path

import numpy as np
import torch

from dlo.backend.cuda_registration import registration_driver
from dlo.host.registration import READ_ONLY

MIB = 2**20


class DeviceLoad:
    """Device-memory traffic on its own stream while the timed copies run, as dequantization
    and compute kernels make it in a streamed forward: D2D copies of a 1 GiB buffer, enqueued
    (from a timed sample) to last longer than `seconds`."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.source = torch.empty(2**30, dtype=torch.uint8, device=device)
        self.target = torch.empty_like(self.source)
        started = time.perf_counter()
        for _ in range(20):
            self.target.copy_(self.source)
        torch.cuda.synchronize(device)
        self.copy_s = (time.perf_counter() - started) / 20

    def start(self, seconds: float) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(int(seconds * 1.5 / self.copy_s) + 1):
                self.target.copy_(self.source)


def copy_rate(
    source: torch.Tensor, target: torch.Tensor, size: int, offset: int, rounds: int, load: DeviceLoad | None
) -> float:
    """GB/s of copying `source` slice by slice (`size` bytes from `offset`) into `target`."""
    stream = torch.cuda.Stream()
    count = (source.numel() - offset) // size
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        target[:size].copy_(source[offset : offset + size], non_blocking=True)  # warm-up
        if load is not None:
            stream.synchronize()
            load.start(rounds * count * size / 50e9)
        start.record(stream)
        for _ in range(rounds):
            for k in range(count):
                begin = offset + k * size
                target[:size].copy_(source[begin : begin + size], non_blocking=True)
        end.record(stream)
    torch.cuda.synchronize()
    return rounds * count * size / (start.elapsed_time(end) / 1e3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dlo-copy-rate"))
    parser.add_argument("--file-gib", type=float, default=4.0)
    parser.add_argument("--sizes", default="32,85,170,340,680", help="copy sizes in MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--device-load", action="store_true", help="D2D copies on another stream during the timed copies"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    nbytes = int(args.file_gib * 2**30)
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "weights.bin"
    if not path.exists() or path.stat().st_size != nbytes:
        path.write_bytes(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes())
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ)
    mapped = torch.frombuffer(memoryview(mapping), dtype=torch.uint8)  # read-only: never written
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    pinned.copy_(mapped)  # also reads the whole file: page cache hot
    driver = registration_driver(device)
    if driver is None or isinstance(driver, str) or driver.register(mapped.data_ptr(), nbytes, READ_ONLY) != 0:
        raise SystemExit(f"registering the mapping failed: {driver}")
    target = torch.empty(max(int(s) for s in args.sizes.split(",")) * MIB, dtype=torch.uint8, device=device)
    load = DeviceLoad(device) if args.device_load else None
    rows = []
    try:
        for size_mib in (int(s) for s in args.sizes.split(",")):
            for offset in (0, 512):
                rates = {
                    name: copy_rate(source, target, size_mib * MIB, offset, args.rounds, load)
                    for name, source in (("pinned", pinned), ("registered mapping", mapped))
                }
                rows.append((size_mib, offset, rates["pinned"], rates["registered mapping"]))
                print(rows[-1], flush=True)
    finally:
        driver.unregister(mapped.data_ptr())
    load_flag = " --device-load" if args.device_load else ""
    print(f"\n{os.path.basename(__file__)} --file-gib {args.file_gib} --sizes {args.sizes} --rounds {args.rounds}{load_flag}")
    print("| copy MiB | source offset | pinned GB/s | registered mapping GB/s | mapping / pinned |")
    print("|---|---|---|---|---|")
    for size_mib, offset, pinned_rate, mapped_rate in rows:
        print(f"| {size_mib} | {offset} | {pinned_rate:.1f} | {mapped_rate:.1f} | {mapped_rate / pinned_rate:.3f} |")


if __name__ == "__main__":
    main()
