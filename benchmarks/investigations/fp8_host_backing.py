"""Does the backing of the pinned host buffers set an fp8 enable's speed? (issue 31: enables of
one Flux-shaped fp8 configuration stream at different speeds, back to back too, while their
copies run at the full link rate with the device idle and beside GEMMs; one hypothesis was the
buffers' backing: transparent huge pages or 4 KiB pages.)

dlo allocates each block's host copy with torch.empty and page-locks it with cudaHostRegister
(dlo.host.pinned_buffer). Here that allocation is replaced, per enable, by an anonymous mapping
aligned to 2 MiB and advised before its first touch:
  thp      madvise(MADV_HUGEPAGE): huge pages wherever the kernel has them;
  4k       madvise(MADV_NOHUGEPAGE): 4 KiB pages only;
  default  torch.empty, as dlo does (the system's transparent_hugepage setting decides).
Rounds enable every variant once each, the order rotated by one each round, so drift over the
run and a place in the round fall on all alike. Per enable: the share of its host buffers backed
by huge pages (AnonHugePages over Rss of the mappings holding them, /proc/self/smaps), then the
median of --iters forwards each from a synchronized device, and --iters forwards back to back;
outputs compared (torch.equal) with the first enable's; the link's rate just before and just
after the timed forwards (a 256 MiB pinned buffer copied alone, median of 5: does an enable's
speed follow the link's rate of the moment?); as root, where the buffers lie in the guest's
physical memory (10th, 50th and 90th percentile of their sampled pages' addresses, GiB). Before
the enables, a 64 MiB region advised MADV_HUGEPAGE is touched and its share printed: 0 there
means the system grants no huge pages, whatever the advice.

Each enable's copy and dequantization streams are the next ones of torch's stream pools, as in
dlo; their ids are printed per enable. With --streams first, every enable after the first is
handed the first enable's two streams instead (does an fp8 enable's speed follow its streams?).
--pool-skip C,D draws C normal- and D high-priority streams from the pools before the first
enable, so the enables' streams sit at other places in them. --resident-first runs the model
resident before the first enable, its weights quantized and dequantized once as fp8 streaming
would (dlo.quantize_resident, on the device here), so its forwards are plain bf16 ones (the two
earlier runs whose first fp8 enable was fast had run such a model first, quantized on the CPU).
--plain-copy kernel writes each block's plain region (biases, norms) from the landing buffer
into its slot with an elementwise kernel (uint8 into an int8 view: the same bytes) instead of
dlo's device-to-device copy, which the driver may run on a copy engine that the host-to-device
copies also use (does the dequantization stream's copy engine set the speed?).

  PYTHONPATH=$PWD/src python3 benchmarks/investigations/fp8_host_backing.py --rounds 3
  CPU smoke test: ... --shape tiny --device cpu --iters 1 --rounds 1
"""

from __future__ import annotations

import argparse
import copy
import mmap
import os
import statistics
import struct
import sys
from itertools import chain
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_streaming import SHAPES, build_model, to_device  # noqa: E402
from slots_back_to_back import timed  # noqa: E402

import dlo  # noqa: E402
from dlo.backend import enable as enable_module  # noqa: E402
from dlo.host import pinned_buffer  # noqa: E402
from dlo.host.fp8_codec import dequantize_into  # noqa: E402
from dlo.hotpath import block_loads  # noqa: E402

HUGE = 2 << 20
SAMPLE_EVERY = 64  # pages between pagemap reads
PFN_MASK = (1 << 55) - 1
PRESENT = 1 << 63
PROBE = 256 << 20  # bytes a link probe copies
ADVICE = {"thp": getattr(mmap, "MADV_HUGEPAGE", None), "4k": getattr(mmap, "MADV_NOHUGEPAGE", None), "default": None}


class Allocations:
    """Stands in for pinned_buffer.aligned_empty on the CPU: allocates as the variant says and
    records every host range, so the enable's buffers can be found in /proc/self/smaps."""

    def __init__(self, original) -> None:
        self.original = original
        self.variant = "default"
        self.ranges: list[tuple[int, int]] = []

    def __call__(self, nbytes: int, device: torch.device, alignment: int = pinned_buffer.ALIGNMENT) -> torch.Tensor:
        if device.type != "cpu":
            return self.original(nbytes, device, alignment)
        if self.variant == "default":
            tensor = self.original(nbytes, device, alignment)
        else:
            # Private: a shared anonymous mapping is shmem, whose huge pages follow another setting.
            region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE)
            region.madvise(ADVICE[self.variant])  # before the first touch: the pages follow it
            raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
            skip = (-raw.data_ptr()) % HUGE
            tensor = raw[skip : skip + nbytes]
        self.ranges.append((tensor.data_ptr(), tensor.data_ptr() + nbytes))
        return tensor


class Executors:
    """Stands in for enable's make_executor: records each enable's executor and, with `reuse`,
    gives it the first CUDA executor's copy and dequantization streams."""

    def __init__(self, original, reuse: bool) -> None:
        self.original, self.reuse = original, reuse
        self.latest = None
        self.first_streams: tuple | None = None

    def __call__(self, device: torch.device, gathers: bool = False):
        executor = self.latest = self.original(device, gathers)
        if device.type != "cuda":
            return executor
        allocate = executor.allocate_landings

        def allocate_landings(nbytes: int) -> None:
            allocate(nbytes)
            if self.first_streams is None:
                self.first_streams = (executor.copy_stream, executor._dequant_stream)
            elif self.reuse:
                executor.copy_stream, executor._dequant_stream = self.first_streams

        executor.allocate_landings = allocate_landings
        return executor

    def stream_ids(self) -> str:
        executor = self.latest
        if executor is None or not hasattr(executor, "copy_stream"):
            return "-"
        dequant = executor._dequant_stream
        return f"{executor.copy_stream.stream_id}/{dequant.stream_id if dequant is not None else '-'}"


def finish_with_a_kernel(self, index: int, state, k: int) -> None:
    """BlockLoads._finish with the plain region written by an elementwise kernel."""
    wire = self.blocks[index].wire
    views = state.views[index]
    if wire.plain_bytes:
        target = state.slot.buffer[: wire.plain_bytes].view(torch.int8)
        target.copy_(self._executor.landings[k][: wire.plain_bytes])  # uint8 -> int8: a kernel, not a memcpy
    for q, (data, scale) in zip(wire.quantized, self._landed[k][index]):
        dequantize_into(views[q.index], data, scale)


def physical_gib(address: int, nbytes: int) -> list[float]:
    """Guest physical addresses (GiB) of every SAMPLE_EVERY-th page of the range."""
    found = []
    with open("/proc/self/pagemap", "rb") as pagemap:
        for page in range(address // pinned_buffer.PAGE, (address + nbytes) // pinned_buffer.PAGE, SAMPLE_EVERY):
            pagemap.seek(page * 8)
            (entry,) = struct.unpack("<Q", pagemap.read(8))
            if entry & PRESENT and entry & PFN_MASK:
                found.append((entry & PFN_MASK) * pinned_buffer.PAGE / 2**30)
    return found


def huge_share(ranges: list[tuple[int, int]]) -> float:
    """AnonHugePages / Rss over the mappings that overlap `ranges`."""
    rss = huge = 0
    hit = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: its address range
                low, high = (int(part, 16) for part in head[0].split("-"))
                hit = any(a < high and b > low for a, b in ranges)
            elif hit and head[0] == "Rss:":
                rss += int(head[1])
            elif hit and head[0] == "AnonHugePages:":
                huge += int(head[1])
    return huge / rss if rss else 0.0


def physical_spread(ranges: list[tuple[int, int]]) -> str:
    """p10/p50/p90 of the ranges' sampled guest physical addresses in GiB ('-' without root)."""
    if os.geteuid() != 0:
        return "-"
    found = sorted(chain.from_iterable(physical_gib(low, high - low) for low, high in ranges))
    if not found:
        return "-"
    return "/".join(f"{found[int(q * (len(found) - 1))]:.0f}" for q in (0.1, 0.5, 0.9))


def link_gbps(host: torch.Tensor, device_buffer: torch.Tensor, copies: int = 5) -> float:
    """The link's rate now, the device otherwise idle: median of `copies` copies of `host`."""
    rates = []
    for _ in range(copies):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device_buffer.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(host.numel() / (start.elapsed_time(end) / 1e3) / 1e9)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="thp,4k,default")
    parser.add_argument("--shape", default="flux", help="a bench_streaming.py shape (CPU smoke test: tiny)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--streams", choices=("new", "first"), default="new")
    parser.add_argument("--pool-skip", default="0,0", help="C,D: pool streams drawn before the first enable")
    parser.add_argument("--resident-first", action="store_true")
    parser.add_argument("--plain-copy", choices=("memcpy", "kernel"), default="memcpy")
    args = parser.parse_args()
    device = torch.device(args.device)
    for name in ("enabled", "defrag"):
        path = Path(f"/sys/kernel/mm/transparent_hugepage/{name}")
        print(f"transparent_hugepage/{name}: {path.read_text().strip() if path.exists() else 'absent'}")
    mthp = Path("/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/enabled")
    print(f"hugepages-2048kB/enabled: {mthp.read_text().strip() if mthp.exists() else 'absent'}")
    probe = Allocations(pinned_buffer.aligned_empty)
    probe.variant = "thp"
    region = probe(64 << 20, torch.device("cpu")).fill_(1)  # does this system grant huge pages at all?
    print(f"huge-page share of a touched 64 MiB region advised MADV_HUGEPAGE: {huge_share(probe.ranges):.2f}")
    del region
    iommu = Path("/sys/class/iommu")
    print(f"/sys/class/iommu: {sorted(p.name for p in iommu.iterdir()) if iommu.exists() else 'absent'}")
    shape = SHAPES[args.shape]
    weights = build_model(shape, 0, device)
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(1)), device)
    cuda = device.type == "cuda"
    if cuda:  # one probe buffer for the whole run, allocated before the enables
        probe_host = torch.empty(PROBE, dtype=torch.uint8, pin_memory=True).fill_(1)
        probe_device = torch.empty(PROBE, dtype=torch.uint8, device=device)
    copy_skip, dequant_skip = (int(count) for count in args.pool_skip.split(","))
    if cuda:  # each draw moves the pool's round-robin on by one; pool streams live as long as the process
        for priority, count in ((0, copy_skip), (-1, dequant_skip)):
            for _ in range(count):
                torch.cuda.Stream(device, priority=priority)
    if args.resident_first:
        resident = copy.deepcopy(weights)
        dlo.quantize_resident(resident, dlo.OffloadConfig(stream_dtype="fp8"))
        wall, loop, _ = timed(resident.to(device), inputs, args.iters, device)
        print(f"resident fp8 first: {wall * 1e3:.1f} ms synchronized, {loop * 1e3:.1f} back to back", flush=True)
        del resident
        if cuda:
            torch.cuda.empty_cache()
    if args.plain_copy == "kernel":
        block_loads.BlockLoads._finish = finish_with_a_kernel
    allocations = Allocations(pinned_buffer.aligned_empty)
    pinned_buffer.aligned_empty = allocations
    executors = Executors(enable_module.make_executor, reuse=args.streams == "first")
    enable_module.make_executor = executors
    rows, reference = [], None
    for round_ in range(args.rounds):
        variants = args.variants.split(",")
        for variant in variants[round_ % len(variants) :] + variants[: round_ % len(variants)]:
            allocations.variant, allocations.ranges = variant, []
            model = copy.deepcopy(weights)
            with dlo.enable(model, device, dlo.OffloadConfig(stream_dtype="fp8")):
                share = huge_share(allocations.ranges)
                streams = executors.stream_ids()
                physical = physical_spread(allocations.ranges)
                before = f"{link_gbps(probe_host, probe_device):.1f}" if cuda else "-"
                wall, loop, out = timed(model, inputs, args.iters, device)
                after = f"{link_gbps(probe_host, probe_device):.1f}" if cuda else "-"
            reference = out if reference is None else reference
            same = "bit-identical" if torch.equal(out, reference) else "DIFFERENT"
            rows.append((round_, variant, streams, share, physical, before, after, wall, loop, same))
            print(rows[-1], flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(
        f"\n{args.shape}-shaped fp8, 2 slots, streams {args.streams}, pool skip {args.pool_skip}, plain copy "
        f"{args.plain_copy}, ms a forward "
        f"(median of {args.iters} synchronized; {args.iters} back to back)"
    )
    print(
        "| round | host buffers | copy/dequant stream ids | huge-page share | physical GiB p10/p50/p90 | link GB/s before / after "
        "| synchronized | back to back | output vs first |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for round_, variant, streams, share, physical, before, after, wall, loop, same in rows:
        print(
            f"| {round_} | {variant} | {streams} | {share:.2f} | {physical} | {before} / {after} "
            f"| {wall * 1e3:.1f} | {loop * 1e3:.1f} | {same} |"
        )


if __name__ == "__main__":
    main()
