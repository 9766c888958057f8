"""Packing rate of one real Wan-14B-shaped block (its ~107 tensors, from the checkpoint
mapping into a pinned buffer) vs one contiguous region of the same file, by thread count.
Needs the checkpoint bench_host_backings.py writes (/tmp/wan-ckpt) and CUDA for pinning.
Run: python3 benchmarks/investigations/host_memcpy_block.py. Results in RESULTS.md (issue 3)."""
import time, numpy as np
from concurrent.futures import ThreadPoolExecutor
import dlo
from dlo.host.tensor_source import CopyTask
from dlo.host.pinned_buffer import HostBuffer
from dlo.planning.block_layout import TensorSpec, plan_block_layout
model, plan = dlo.load_transformer("/tmp/wan-ckpt")
w = plan.take(); ck = w.checkpoint
names = [n for n in w.bindings if n.startswith("blocks.0.")]
specs = [TensorSpec(n, w.bindings[n].shape, w.bindings[n].dtype) for n in names]
layout = plan_block_layout(specs)
staging = HostBuffer(layout.nbytes, pin=True).tensor
from dlo.planning.block_layout import view_placement
def tasks(block):
    out = []
    for n, p in zip([f"blocks.{block}." + s.name[len('blocks.0.'):] for s in specs], layout.placements):
        out += w.bindings[n].copy_tasks(ck, view_placement(staging, p))
    return out
print("tasks per block", len(tasks(0)), "sizes MB", sorted({round(t.source.numel()*t.source.element_size()/2**20,1) for t in tasks(0)})[-5:])
for threads in (8, 16):
    with ThreadPoolExecutor(threads) as pool:
        rates = []
        for b in range(12):
            ts = tasks(b)
            t0 = time.perf_counter(); list(pool.map(CopyTask.run, ts)); rates.append(layout.nbytes / (time.perf_counter() - t0) / 1e9)
        print(f"mapped block pack threads={threads}: first {rates[0]:.1f} median {np.median(rates[1:]):.1f} GB/s")
        # same bytes as one contiguous source region copied in 8 MB chunks
        src = ck.files[0]._bytes
        def run(i): np.copyto(staging.numpy()[i:i + (8 << 20)], src[i:i + (8 << 20)].numpy())
        idx = list(range(0, layout.nbytes - (8 << 20), 8 << 20))
        t0 = time.perf_counter(); list(pool.map(run, idx)); print(f"  contiguous file region, same threads: {len(idx)*(8<<20)/(time.perf_counter()-t0)/1e9:.1f} GB/s")
