"""NVLink all-gather rate on its own and while the same rank copies host -> device: is the
gather or the link the bottleneck of all-gather streaming? Run under torchrun, one GPU per rank:

  NCCL_DEBUG=INFO python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/investigations/allgather_rate.py

Prints, on rank 0: the gather rate of a 679 MB block (Flux double-block size) alone, the H2D
rate of a 340 MB pinned shard alone, and both at once on separate streams.
"""

import os
import time

import torch
import torch.distributed as dist


def timed(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    block = 679 * 2**20
    shard = block // world
    whole = torch.empty(block, dtype=torch.uint8, device="cuda")
    own = torch.empty(shard, dtype=torch.uint8, device="cuda")
    host = torch.empty(shard, dtype=torch.uint8).pin_memory()
    copy_stream, comm_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def gather():
        with torch.cuda.stream(comm_stream):
            dist.all_gather_into_tensor(whole, own)
        torch.cuda.current_stream().wait_stream(comm_stream)

    def h2d():
        with torch.cuda.stream(copy_stream):
            own.copy_(host, non_blocking=True)
        torch.cuda.current_stream().wait_stream(copy_stream)

    def both():
        with torch.cuda.stream(copy_stream):
            own.copy_(host, non_blocking=True)
        with torch.cuda.stream(comm_stream):
            dist.all_gather_into_tensor(whole, own)
        torch.cuda.current_stream().wait_stream(copy_stream)
        torch.cuda.current_stream().wait_stream(comm_stream)

    dist.barrier()
    gather_s, h2d_s, both_s = timed(gather), timed(h2d), timed(both)
    if rank == 0:
        print(f"all-gather {block / 1e6:.0f} MB: {gather_s * 1e3:.2f} ms ({block / gather_s / 1e9:.1f} GB/s of output)")
        print(f"H2D {shard / 1e6:.0f} MB pinned: {h2d_s * 1e3:.2f} ms ({shard / h2d_s / 1e9:.1f} GB/s)")
        print(f"both on separate streams: {both_s * 1e3:.2f} ms (sum of the two: {(gather_s + h2d_s) * 1e3:.2f} ms)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
