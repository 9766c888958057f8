"""How fast can this machine read a file whose pages are not in the page cache? The ceiling of
every "page cache cold" row of bench_first_step.py (issue 19).

A --gib file of random bytes is written under --dir and flushed. Before each method its pages are
dropped with posix_fadvise(DONTNEED) (what bench_first_step does) and then read once:

  read        one thread, read() of 16 MiB chunks (the kernel's sequential read-ahead)
  read xN     N threads, each pread()s its contiguous 1/N of the file in 16 MiB chunks
  fault       mmap, one byte touched per page (how cudaHostRegister meets a cold mapping)
  advise+fault  mmap, dlo.host.registration.read_ahead over the whole file, then the same touches

Reported: GB/s (file bytes over wall time). On the GPU machine, from the repository root:

  PYTHONPATH=$PWD/src python3 benchmarks/investigations/cold_read_rate.py --dir /tmp/cold-read
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dlo.host.registration import HostRange, read_ahead

CHUNK = 16 << 20


def write_file(path: Path, nbytes: int) -> None:
    block = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()
    with open(path, "wb") as out:
        for _ in range(nbytes // CHUNK):
            out.write(block)
        out.flush()
        os.fsync(out.fileno())


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_span(path: Path, start: int, end: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = bytearray(CHUNK)
        for offset in range(start, end, CHUNK):
            os.preadv(fd, [memoryview(buffer)[: min(CHUNK, end - offset)]], offset)
    finally:
        os.close(fd)


def read_threads(path: Path, nbytes: int, threads: int) -> None:
    share = -(-nbytes // threads // CHUNK) * CHUNK
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: read_span(path, i * share, min(nbytes, (i + 1) * share)), range(threads)))


def touch_pages(path: Path, nbytes: int, advise: bool) -> None:
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), nbytes, prot=mmap.PROT_READ)
    try:
        view = np.frombuffer(mapping, dtype=np.uint8)
        if advise:
            address = view.ctypes.data
            read_ahead([HostRange(str(path), address, address + nbytes)])
        int(view[:: mmap.PAGESIZE].sum())  # one load per page faults every page in
        del view
    finally:
        mapping.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/dlo-cold-read"))
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--threads", type=lambda text: [int(t) for t in text.split(",")], default=[4, 16])
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "cold.bin"
    nbytes = int(args.gib * 2**30) // CHUNK * CHUNK
    if not path.exists() or path.stat().st_size != nbytes:
        write_file(path, nbytes)
    methods = {"read": lambda: read_threads(path, nbytes, 1)}
    methods |= {f"read x{n}": (lambda n=n: read_threads(path, nbytes, n)) for n in args.threads}
    methods["fault"] = lambda: touch_pages(path, nbytes, advise=False)
    methods["advise+fault"] = lambda: touch_pages(path, nbytes, advise=True)
    print(f"{path} ({nbytes / 1e9:.2f} GB), page cache dropped before each method")
    print("| method | s | GB/s |\n|---|---|---|")
    for name, method in methods.items():
        drop(path)
        started = time.perf_counter()
        method()
        seconds = time.perf_counter() - started
        print(f"| {name} | {seconds:.2f} | {nbytes / seconds / 1e9:.2f} |", flush=True)


if __name__ == "__main__":
    main()
