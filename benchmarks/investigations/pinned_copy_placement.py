"""Is a pinned host buffer's copy rate a property of where its pages lie? (issue 31: fp8 enables
of one configuration stream back to back at about 68.2 or 72.3 ms; enables whose buffers were
all 4 KiB pages ran at both levels, the same variant changing level between rounds. One hypothesis:
this machine is a virtual one, and the host backs ranges of the guest's physical memory from
different sockets, so a buffer's rate follows the physical addresses it was given.)

Allocates --buffers host buffers of --mib each exactly as dlo does (dlo.host.pinned_buffer:
torch.empty page-locked by cudaHostRegister; every other one on huge pages instead, advised
MADV_HUGEPAGE as fp8_host_backing.py's "thp"), then per buffer: the median host-to-device copy
rate of --copies copies into one device buffer, measured twice (in allocation order, then in
reverse, so a drift over time cannot pass for a property of the buffer), and the guest physical
addresses of a sample of its pages (/proc/self/pagemap; needs root). The table is sorted by
physical address. Also prints what the guest knows of its topology (NUMA nodes, the GPU's).

  (as root) PYTHONPATH=$PWD/src python3 benchmarks/investigations/pinned_copy_placement.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_host_backing import Allocations, huge_share, link_gbps, physical_gib  # noqa: E402

from dlo.host import pinned_buffer  # noqa: E402


def topology() -> None:
    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    print(f"NUMA nodes seen by the guest: {nodes}")
    for line in subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout.splitlines():
        print(f"  {line}")
    bus = subprocess.run(
        ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip().lower()
    numa = Path(f"/sys/bus/pci/devices/{bus[-12:]}/numa_node")
    print(f"GPU {bus}: numa_node {numa.read_text().strip() if numa.exists() else 'unknown'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buffers", type=int, default=32)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--copies", type=int, default=5)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("pinned_copy_placement.py: reading physical addresses needs root; run it as root")
    topology()
    nbytes = args.mib << 20
    # Every other buffer on huge pages (MADV_HUGEPAGE before the first touch), the rest as dlo
    # allocates: is a huge-page buffer's copy slower?
    allocations = Allocations(pinned_buffer.aligned_empty)
    pinned_buffer.aligned_empty = allocations
    buffers, backing, ranges = [], [], {"default": [], "thp": []}
    for index in range(args.buffers):
        allocations.variant = "thp" if index % 2 else "default"
        buffers.append(pinned_buffer.HostBuffer(nbytes, pin=True))
        backing.append(allocations.variant)
        ranges[allocations.variant].append(allocations.ranges[-1])
    for buffer in buffers:
        buffer.tensor.fill_(1)
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    link_gbps(buffers[0].tensor, device_buffer, 2)  # warm-up
    first = [link_gbps(b.tensor, device_buffer, args.copies) for b in buffers]
    second = [link_gbps(b.tensor, device_buffer, args.copies) for b in reversed(buffers)][::-1]
    rows = []
    for index, buffer in enumerate(buffers):
        addresses = physical_gib(buffer.tensor.data_ptr(), nbytes)
        if not addresses:
            raise SystemExit("pagemap gave no physical addresses (needs root and a kernel that shows PFNs)")
        rows.append((statistics.median(addresses), min(addresses), max(addresses), index, backing[index], first[index], second[index]))
    print(f"\n{args.buffers} pinned host buffers of {args.mib} MiB, H2D GB/s (median of {args.copies} copies)")
    print("| buffer | backing | physical GiB median | min | max | GB/s pass 1 | GB/s pass 2 |")
    print("|---|---|---|---|---|---|---|")
    for median, low, high, index, kind, rate1, rate2 in sorted(rows):
        print(f"| {index} | {kind} | {median:.1f} | {low:.1f} | {high:.1f} | {rate1:.1f} | {rate2:.1f} |")
    for kind in ("default", "thp"):
        rates = [rate for row in rows if row[4] == kind for rate in row[5:]]
        print(
            f"{kind}: huge-page share {huge_share(ranges[kind]):.2f}, median {statistics.median(rates):.1f} GB/s, "
            f"min {min(rates):.1f}, max {max(rates):.1f}"
        )
    for buffer in buffers:
        buffer.unpin()


if __name__ == "__main__":
    main()
