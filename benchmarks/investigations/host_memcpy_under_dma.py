"""Packing rate into a pinned (or write-combined) staging buffer while a concurrent H2D copy
runs at link rate, by chunk size and thread count: the memory-bandwidth ceiling of the staged
path. Needs CUDA and cuda-bindings. Run: python3 benchmarks/investigations/host_memcpy_under_dma.py.
Results in RESULTS.md (issue 3)."""
import time, threading
import numpy as np, torch
from concurrent.futures import ThreadPoolExecutor
from dlo.host.pinned_buffer import HostBuffer
from cuda.bindings import runtime as rt
BLOCK = 700 << 20
src = np.empty(5 * BLOCK, dtype=np.uint8); src[:] = 3
staging_a = HostBuffer(BLOCK, pin=True).tensor
err, wc_ptr = rt.cudaHostAlloc(BLOCK, rt.cudaHostAllocWriteCombined)
assert err == rt.cudaError_t.cudaSuccess, err
import ctypes
wc = np.ctypeslib.as_array((ctypes.c_uint8 * BLOCK).from_address(int(wc_ptr)))
dma_src = HostBuffer(BLOCK, pin=True).tensor
dev = torch.empty(BLOCK, dtype=torch.uint8, device="cuda")
stop = threading.Event()
def dma_loop():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        while not stop.is_set():
            dev.copy_(dma_src, non_blocking=True); s.synchronize()
def pack(dst, threads, chunk):
    tasks = [(i, min(i + chunk, BLOCK)) for i in range(0, BLOCK, chunk)]
    def run(t): np.copyto(dst[t[0]:t[1]], src[t[0]:t[1]])
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, tasks))  # warm
        rates = []
        for _ in range(4):
            t0 = time.perf_counter(); list(pool.map(run, tasks)); rates.append(BLOCK / (time.perf_counter() - t0) / 1e9)
    return np.median(rates)
normal = staging_a.numpy()
for with_dma in (False, True):
    if with_dma:
        th = threading.Thread(target=dma_loop); th.start(); time.sleep(0.2)
    for name, dst in (("registered", normal), ("write-combined", wc)):
        for chunk_mb in (1, 8, 64):
            for threads in (8, 16):
                print(f"dma={with_dma!s:5s} {name:14s} chunk {chunk_mb:3d} MB threads {threads:2d}: {pack(dst, threads, chunk_mb << 20):5.1f} GB/s", flush=True)
    if with_dma:
        stop.set(); th.join()
# DMA rate from WC memory
wct = torch.from_numpy(wc)
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(5): dev.copy_(wct, non_blocking=True)
torch.cuda.synchronize(); print("H2D from WC GB/s", 5 * BLOCK / (time.perf_counter() - t0) / 1e9)
