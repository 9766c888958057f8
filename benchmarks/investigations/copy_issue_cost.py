"""What issuing one host-to-device copy costs the host thread, by source memory and by how the
copies are issued (issue 31: a GGUF file mapped and registered is copied tensor by tensor, about
20 copies a block, and its forward is bound by the host thread).

Sources, each 400 tensors of --small-kib and 400 of --large-mib, views of one buffer:
  pinned       torch's pinned host memory (cudaHostAlloc)
  registered   a read-only shared file mapping registered with cudaHostRegister (read-only
               flag), as dlo registers a checkpoint mapping
Issue modes:
  loop+ctx     `with torch.cuda.stream(s): dst.copy_(src, non_blocking=True)` per copy (dlo's
               executor today)
  loop         one stream context around a Python loop of copy_
  foreach      torch._foreach_copy_(dsts, srcs, non_blocking=True) in one call
Printed: host microseconds per copy issued (the loop's wall time / copies, the device left to
drain after), median of --iters.

  python3 benchmarks/investigations/copy_issue_cost.py
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time

import torch

READ_ONLY = 0x08  # cudaHostRegisterReadOnly


def sources(kind: str, count: int, nbytes: int):
    total = count * nbytes
    if kind == "pinned":
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        return buffer, [buffer[i * nbytes : (i + 1) * nbytes] for i in range(count)], lambda: None
    handle = tempfile.TemporaryFile()
    handle.truncate(total)
    os.pwrite(handle.fileno(), b"\1" * min(total, 1 << 20), 0)
    mapping = mmap.mmap(handle.fileno(), total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(buffer.data_ptr(), total, READ_ONLY)) == 0
    views = [buffer[i * nbytes : (i + 1) * nbytes] for i in range(count)]

    def release():
        assert int(cudart.cudaHostUnregister(buffer.data_ptr())) == 0

    return buffer, views, release


def issue(mode: str, stream, targets, sources_) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    if mode == "loop+ctx":
        for target, source in zip(targets, sources_):
            with torch.cuda.stream(stream):
                target.copy_(source, non_blocking=True)
    elif mode == "loop":
        with torch.cuda.stream(stream):
            for target, source in zip(targets, sources_):
                target.copy_(source, non_blocking=True)
    else:
        with torch.cuda.stream(stream):
            torch._foreach_copy_(targets, sources_, non_blocking=True)
    seconds = time.perf_counter() - started
    torch.cuda.synchronize()
    return seconds / len(targets) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--small-kib", type=int, default=12)
    parser.add_argument("--large-mib", type=int, default=4)
    parser.add_argument("--iters", type=int, default=7)
    args = parser.parse_args()
    stream = torch.cuda.Stream()
    rows = []
    for size_name, nbytes in (("small", args.small_kib << 10), ("large", args.large_mib << 20)):
        targets = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(args.count)]
        for kind in ("pinned", "registered"):
            buffer, views, release = sources(kind, args.count, nbytes)
            for mode in ("loop+ctx", "loop", "foreach"):
                issue(mode, stream, targets, views)  # warm-up
                per_copy = statistics.median(issue(mode, stream, targets, views) for _ in range(args.iters))
                rows.append((size_name, nbytes, kind, mode, per_copy))
            release()
            del buffer, views
    print("| tensors | bytes each | source | issue | host us per copy |")
    print("|---|---|---|---|---|")
    for size_name, nbytes, kind, mode, per_copy in rows:
        print(f"| {size_name} | {nbytes} | {kind} | {mode} | {per_copy:.1f} |")


if __name__ == "__main__":
    main()
