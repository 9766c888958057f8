"""The disk tier: a transformer streamed under host_budget_gib, its blocks beyond the budget read
from the checkpoint on every use, caches dropped before each measured forward.

One run, side by side, on one checkpoint written under --dir (bench_streaming.py's shapes,
random bf16 weights from one seed, saved with save_pretrained; files fsynced):

  disk rate    the whole checkpoint read with O_DIRECT (4 MiB requests, 8 always in flight,
               as dlo's reader keeps them), pages dropped first, twice: the second read's
               rate is the floor's (every forward reads the file again; a virtual disk's host
               cache, which drop_caches inside the guest does not empty, serves that faster).
  resident     the model on the device (the compute time and the reference output).
  dlo budget   dlo.load_transformer + dlo.enable(OffloadConfig(host_budget_gib=B)) for each
               --budgets B ("1" GiB; "2/3": two thirds of the streamed blocks' bytes) and
               each of --modes (local: rank-local; allgather: use_allgather=True, this
               process its group of one, its shards read on the caller's thread), one
               warm-up forward and the forward dlo measures to choose which blocks stay in
               host memory (its "spread s" column: that call's time with enable()'s even
               spread, before the moves, and dlo's prediction for it), then --iters forwards
               on the chosen split ("predicted s": dlo's prediction for it), each
               after dropping the page cache (/proc/sys/vm/drop_caches as root, else
               POSIX_FADV_DONTNEED on the files).

  --float8     the checkpoint's block Linear weights stored float8 e4m3 with one fp32 scale per
               output row (as float8 checkpoints store them): dlo reads them as stored and
               dequantizes on the device; the resident model runs the dequantized weights.

  diffusers    enable_group_offload(block_level, one block a group, use_stream, record_stream,
               offload_to_disk_path under --dir): the same forwards, caches dropped alike (CUDA only).

Per dlo row: seconds per forward; the floor max(resident, disk bytes read per forward / disk
rate) and the ratio; RSS + the checkpoint's cached pages (mincore) after the forwards, against
the budget + read buffers; the output vs resident (torch.equal).

On the GPU machine, from the repository root:

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
  python3 benchmarks/bench_disk.py --dir /tmp/bench_disk

CPU smoke test: python benchmarks/bench_disk.py --device cpu --shape tiny --budgets 0.00012 --iters 1 --modes local,allgather [--float8]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import torch
from bench_streaming import GB, SHAPES, build_model, synchronize, timed_forwards, to_device
from safetensors.torch import load_file, save_file
from results_json import add_json_flag, write_json

import dlo
from dlo.host.pinned_buffer import aligned_empty

GIB = 2**30
CHUNK = 4 << 20


def drop_page_cache(files: list[Path]) -> str:
    """How: drop_caches (root) or fadvise of each file."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "fadvise"


def direct_read_gbps(files: list[Path], limit_bytes: int) -> float:
    """Up to `limit_bytes` of the files read with O_DIRECT in CHUNK requests on 8 threads,
    each with a buffer of its own and always one request in flight (as dlo's reader keeps
    them), pages dropped first."""
    drop_page_cache(files)
    jobs = []
    for path in files:
        size = path.stat().st_size
        jobs += [(path, offset) for offset in range(0, size - size % 4096, CHUNK)]
    jobs = jobs[: max(1, limit_bytes // CHUNK)]
    fds = {path: os.open(path, os.O_RDONLY | os.O_DIRECT) for path in files}
    local = threading.local()

    def read(job: tuple[Path, int]) -> int:
        if not hasattr(local, "buffer"):
            local.buffer = aligned_empty(CHUNK, torch.device("cpu"), 4096).numpy()
        return os.preadv(fds[job[0]], [local.buffer], job[1])

    started = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        total = sum(pool.map(read, jobs))
    seconds = time.perf_counter() - started
    for fd in fds.values():
        os.close(fd)
    return total / seconds / GB


def cached_bytes(files: list[Path]) -> int:
    libc = ctypes.CDLL(None)
    total = 0
    for path in files:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            mapping = mmap.mmap(handle.fileno(), size, prot=mmap.PROT_READ)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        residency = (ctypes.c_ubyte * pages)()
        view = np.frombuffer(mapping, dtype=np.uint8)
        libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), residency)
        del view
        mapping.close()
        total += sum(page & 1 for page in residency) * mmap.PAGESIZE
    return total


def write_float8(directory: Path, target: Path, block_lists: list[str]) -> tuple[dict[str, torch.Tensor], int]:
    """`directory`'s checkpoint with every block Linear weight stored as float8 e4m3 and one fp32
    scale per output row (`weight_scale`), as float8 checkpoints store them, in `target`.
    Returns the dequantized weights (the resident reference runs them) and the blocks' bytes
    in the new files."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    shutil.copy(directory / "config.json", target / "config.json")
    dequantized: dict[str, torch.Tensor] = {}
    block_bytes = 0
    weight_map = {}
    for path in sorted(directory.glob("*.safetensors")):
        stored = {}
        for name, tensor in load_file(path).items():
            in_block = name.startswith(tuple(f"{b}." for b in block_lists))
            if in_block and name.endswith(".weight") and tensor.dim() == 2:
                value = tensor.float()
                scale = (value.abs().amax(dim=1, keepdim=True) / 448).clamp_min(1e-12)
                data = (value / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                stored[name], stored[name[: -len("weight")] + "weight_scale"] = data, scale
                dequantized[name] = (data.float() * scale).to(tensor.dtype)
            else:
                stored[name] = tensor
            if in_block:
                scale_name = name[: -len("weight")] + "weight_scale"
                block_bytes += stored[name].nbytes + (stored[scale_name].nbytes if scale_name in stored else 0)
        save_file(stored, target / path.name)
        weight_map.update(dict.fromkeys(stored, path.name))
    index = directory / "diffusion_pytorch_model.safetensors.index.json"
    if index.exists():
        (target / index.name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dequantized, block_bytes


def budget_of(text: str, blocks_bytes: int) -> float:
    if "/" in text:
        numerator, denominator = text.split("/")
        return blocks_bytes * int(numerator) / int(denominator) / GIB
    return float(text)


def run_budget(
    directory: Path, files: list[Path], budget_gib: float, mode: str, inputs, device, args, reference
) -> dict | None:
    model, plan = dlo.load_transformer(directory)
    config = dlo.OffloadConfig(host_budget_gib=budget_gib, use_allgather=mode == "allgather")
    handle = dlo.enable(model, device, config, plan=plan)
    if handle._runtime.read_ahead is None:  # the budget holds every block: nothing to measure here
        handle.disable()
        return None
    seconds = []
    try:
        with torch.inference_mode():
            model(**inputs)  # warm-up
            model(**inputs)  # measured by dlo, which then chooses the blocks on disk
            handle._runtime.read_ahead.wait_idle()
            start = handle.stats().disk
            for _ in range(args.iters):
                drop_page_cache(files)
                forward_s, output = timed_forwards(model, inputs, device, 1)
                seconds += forward_s
            end = handle.stats()
        memory = psutil.Process().memory_info().rss + cached_bytes(files)
    finally:
        handle.disable()
    disk = end.disk
    read_per_forward = (disk.read_bytes - start.read_bytes) / args.iters
    return {
        "budget_gib": budget_gib,
        "mode": mode,
        "median_s": statistics.median(seconds),
        "forward_s": seconds,
        "disk_blocks": len(disk.blocks),
        "choice": vars(disk.choice),
        "read_bytes_per_forward": read_per_forward,
        "reader_gbps": (disk.read_bytes - start.read_bytes) / (disk.read_s - start.read_s) / GB,
        "read_buffer_bytes": disk.read_buffer_bytes,
        "rss_plus_cached_bytes": memory,
        "equal_to_resident": torch.equal(output.cpu(), reference),
    }


def run_diffusers_disk(shape, inputs, device, args, reference) -> dict:
    """diffusers' group offloading to disk (block_level, one block a group, streams), which
    writes each group to a file under --dir at setup and reads it back on every onload."""
    path = args.dir / "diffusers-offload"
    shutil.rmtree(path, ignore_errors=True)
    model = build_model(shape, args.seed, device)
    started = time.perf_counter()
    model.enable_group_offload(
        onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
        num_blocks_per_group=1, use_stream=True, record_stream=True, offload_to_disk_path=str(path),
    )
    setup_s = time.perf_counter() - started
    files = sorted(path.glob("*.safetensors"))
    seconds = []
    with torch.inference_mode():
        model(**inputs)  # warm-up
        for _ in range(args.iters):
            drop_page_cache(files)
            forward_s, output = timed_forwards(model, inputs, device, 1)
            seconds += forward_s
    memory = psutil.Process().memory_info().rss + cached_bytes(files)
    result = {
        "variant": "diffusers disk offload",
        "setup_s": setup_s,
        "median_s": statistics.median(seconds),
        "forward_s": seconds,
        "files_bytes": sum(f.stat().st_size for f in files),
        "rss_plus_cached_bytes": memory,
        "max_abs_diff_vs_resident": (output.cpu().float() - reference.float()).abs().max().item(),
    }
    del model, output
    shutil.rmtree(path, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_disk"))
    parser.add_argument("--shape", default="wan", choices=sorted(SHAPES))
    parser.add_argument("--budgets", type=lambda t: t.split(","), default=["1", "2/3"])
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", type=lambda t: t.split(","), default=["local"],
                        help="local (rank-local), allgather (all-gather mode, this one process as its group of one)")
    parser.add_argument("--float8", action="store_true",
                        help="store the block Linear weights float8 with per-row scales (read from disk as stored); "
                        "the resident reference runs their dequantized values")
    parser.add_argument("--no-diffusers", dest="diffusers", action="store_false",
                        help="skip diffusers' disk offload (needs CUDA streams; run by default on cuda)")
    add_json_flag(parser, "bench_disk")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    directory = args.dir / shape.name
    shutil.rmtree(directory, ignore_errors=True)
    started = time.perf_counter()
    model = build_model(shape, args.seed, device)
    model.save_pretrained(directory)
    block_lists = list(dlo.discover(model).block_lists)
    blocks_bytes = sum(
        p.numel() * p.element_size() for path in block_lists for p in model.get_submodule(path).parameters()
    )
    if args.float8:
        dequantized, blocks_bytes = write_float8(directory, args.dir / f"{shape.name}-float8", block_lists)
        shutil.rmtree(directory)
        directory = args.dir / f"{shape.name}-float8"
        model.load_state_dict(dequantized, strict=False)
        del dequantized  # out of this process's RSS, which the rows report
    files = sorted(directory.glob("*.safetensors"))
    print(f"wrote {sum(f.stat().st_size for f in files) / GB:.2f} GB in {time.perf_counter() - started:.1f} s", flush=True)
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(args.seed + 1)), device)
    # The whole checkpoint (up to 16 GiB), twice: a first read of the fresh file, and a read
    # again as every forward reads it again (a virtual disk's host cache serves repeated reads
    # faster, and drop_caches inside the guest does not empty it). The floor takes the second.
    first_gbps = direct_read_gbps(files, 16 * GIB)
    gbps = direct_read_gbps(files, 16 * GIB)
    print(f"disk O_DIRECT: {first_gbps:.2f} GB/s first read, {gbps:.2f} GB/s read again", flush=True)
    model = model.to(device)
    with torch.inference_mode():
        model(**inputs)
        resident_s, output = timed_forwards(model, inputs, device, args.iters)
    reference = output.cpu()
    resident = statistics.median(resident_s)
    del model, output
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows = []
    refused = []  # budgets a mode refused, or that hold every block
    for text in args.budgets:
        for mode in args.modes:
            try:
                row = run_budget(directory, files, budget_of(text, blocks_bytes), mode, inputs, device, args, reference)
            except dlo.ConfigError as err:  # a budget too small for the mode: its one line, reported
                refused.append(f"{text} GiB, {mode}: {err}")
                print(refused[-1], flush=True)
                continue
            if row is None:
                refused.append(f"{text} GiB, {mode}: holds every streamed block, nothing is read from disk")
                continue
            row["floor_s"] = max(resident, row["read_bytes_per_forward"] / (gbps * GB))
            row["x_floor"] = row["median_s"] / row["floor_s"]
            rows.append(row)
            print(row, flush=True)
    lines = [
        f"resident {resident:.3f} s/forward; disk O_DIRECT {first_gbps:.2f} GB/s first read, {gbps:.2f} GB/s read "
        f"again (the floor's); blocks {blocks_bytes / GB:.2f} GB",
        "",
        "| host_budget_gib | mode | blocks on disk | moved to disk / RAM | spread s (predicted) | predicted s | read GB/fwd | s/forward "
        "| floor s | x floor | reader GB/s | RSS + cached GiB | budget + buffers GiB | output vs resident |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        choice = r["choice"]
        moved = f"{len(choice['moved_to_disk'])} / {len(choice['moved_to_ram'])}" if choice["state"] == "chosen" else choice["state"]
        lines.append(
            f"| {r['budget_gib']:.2f} | {r['mode']} | {r['disk_blocks']} | {moved} | {choice['measured_call_s'] or 0:.3f} "
            f"({choice['predicted_before_s'] or 0:.3f}) "
            f"| {choice['predicted_call_s'] or 0:.3f} | {r['read_bytes_per_forward'] / GB:.2f} | {r['median_s']:.3f} "
            f"| {r['floor_s']:.3f} | {r['x_floor']:.3f} | {r['reader_gbps']:.2f} | {r['rss_plus_cached_bytes'] / GIB:.2f} "
            f"| {r['budget_gib'] + r['read_buffer_bytes'] / GIB:.2f} | {'bit-identical' if r['equal_to_resident'] else 'DIFFERS'} |"
        )
    if refused:
        lines += ["", *(f"not run: {line}" for line in refused)]
    diffusers_row = None
    if args.diffusers and device.type == "cuda":
        diffusers_row = run_diffusers_disk(shape, inputs, device, args, reference)
        print(diffusers_row, flush=True)
        lines += [
            "",
            f"diffusers disk offload (block_level, streams, offload_to_disk_path): {diffusers_row['median_s']:.3f} "
            f"s/forward, {diffusers_row['files_bytes'] / GB:.2f} GB of group files, RSS + cached "
            f"{diffusers_row['rss_plus_cached_bytes'] / GIB:.2f} GiB, max abs diff vs resident "
            f"{diffusers_row['max_abs_diff_vs_resident']:.3g}",
        ]
    table = "\n".join(lines)
    write_json(args.json, "bench_disk", rows, table, resident_s=resident, disk_gbps=gbps, first_read_gbps=first_gbps,
               diffusers=diffusers_row)
    print(table)


if __name__ == "__main__":
    main()
