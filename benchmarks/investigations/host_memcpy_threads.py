"""Host memcpy ceilings on the GPU machine: page-cache mmap vs anonymous memory into pinned
memory, by thread count, and page faults per pass. Run: python3 benchmarks/investigations/host_memcpy_threads.py
(writes a 4 GiB file to /tmp). Results in RESULTS.md (issue 3)."""
import mmap, os, time, resource
import numpy as np, torch
from concurrent.futures import ThreadPoolExecutor
from dlo.host.pinned_buffer import HostBuffer
N = 4 << 30
path = "/tmp/packdiag.bin"
if not os.path.exists(path) or os.path.getsize(path) != N:
    with open(path, "wb") as f:
        chunk = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
        for _ in range(N // len(chunk)): f.write(chunk)
fd = os.open(path, os.O_RDONLY)
def mapping(populate):
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    m = mmap.mmap(fd, N, flags=flags, prot=mmap.PROT_READ)
    return m, np.frombuffer(m, dtype=np.uint8)
dst = HostBuffer(700 << 20, pin=True).tensor.numpy()
anon = np.empty(N, dtype=np.uint8); anon[:] = 1
BLOCK = 700 << 20
def pack(src, threads, chunk=8 << 20, offset=0):
    tasks = [(i, min(i + chunk, BLOCK)) for i in range(0, BLOCK, chunk)]
    def run(t): np.copyto(dst[t[0]:t[1]], src[offset + t[0]: offset + t[1]])
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter(); list(pool.map(run, tasks)); return BLOCK / (time.perf_counter() - t0) / 1e9
def passes(src, threads, label, n=5):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rates = [pack(src, threads, offset=(i % 5) * BLOCK) for i in range(n)]
    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    print(f"{label:34s} threads={threads:2d}  GB/s first {rates[0]:6.1f}  rest {np.median(rates[1:]):6.1f}  minor faults {f1-f0}")
m, src = mapping(False)
for th in (1, 4, 8, 12, 16): passes(src, th, "mmap (MAP_SHARED)")
passes(src, 8, "mmap second round")
m2, src2 = mapping(True)
passes(src2, 8, "mmap MAP_POPULATE (fresh map)")
passes(src2, 16, "mmap MAP_POPULATE (fresh map)")
for th in (1, 8, 16): passes(anon, th, "anonymous memory")
t = torch.from_numpy(src[:BLOCK]); d = torch.from_numpy(dst)
t0 = time.perf_counter(); d.copy_(t); print("torch copy_ one call GB/s", BLOCK / (time.perf_counter() - t0) / 1e9, "threads", torch.get_num_threads())
t0 = time.perf_counter(); d.copy_(t); print("torch copy_ again GB/s", BLOCK / (time.perf_counter() - t0) / 1e9)
print("cpus", os.cpu_count(), "meminfo", open("/proc/meminfo").read().split("\n")[:3])
