"""Is a Flux-shaped Q8_0 GGUF forward bound by the host's kernel launches? (issue 31: streamed
with diffusers' dequantization it takes 1.17-1.26x the resident forward, with only ~6 ms of
exposed copy wait a forward.)

Per variant (bench_gguf.py's sessions on diffusers' GGUF model, a private copy), after two
warm-up forwards, --iters times each:
  wall     the forward from a synchronized device to its end on the device;
  enqueue  from the same start until the Python call returns (what the host spends issuing it);
  device   the forward issued while the device sleeps (torch.cuda._sleep): CUDA events around
           it then time the device's own work with every launch queued ahead, as long as the
           host finished issuing before the sleep ended ("ahead" column; if not, the host
           waited for the device inside the call and the number is not the device's alone).
enqueue close to wall and device well below it: the forward waits for the host's launches.
With --cprofile, the dlo variants' forwards also run under cProfile (wall time per Python
function, blocking C calls included) and the functions that took the most are printed.
Variants beyond bench_gguf's, each removing one piece of dlo's per-block host work: "dlo fixed
slots" (slots never shrink between size classes, so no refit after the first call), "dlo
without probe" (no pre-hooks on the blocks' submodules); and "dlo 4 slots" (loads further
ahead), "dlo 4 fixed slots" (both). Each variant prints the caching allocator's cudaMalloc and
cudaFree calls, retries and all-stream synchronizations over its timed forwards (each stalls
the host until the device catches up).
"dlo timeline" records the device intervals and prints the last forward's blocks: copy,
compute, the compute stream's idle time before each block, and whether its copy came late
("dlo 4 slots timeline": the same with four slots).
"resident timeline" times each block of the resident model on the device (CUDA events around
it), so a block's compute beside dlo's copies can be set against the same block alone. Both
timelines also print the gap from the previous forward's last block to the last forward's
first (the forwards before it ran back to back): the work outside the blocks, and any wait for
the host's launches at a call's start.

  python3 benchmarks/investigations/gguf_host_bound.py --tmp /tmp [--cprofile]
  (per-block device times: --variants "resident timeline,dlo timeline")
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import dlo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gguf import VARIANTS, Dlo, DloKernels, load_gguf, write_gguf  # noqa: E402
from bench_streaming import Resident  # noqa: E402
from bench_streaming import SHAPES, build_model, to_device  # noqa: E402

from dlo.hotpath import slot_queue  # noqa: E402
from dlo.planning.offload_plan import discover  # noqa: E402

SHRINK_BELOW = slot_queue._SHRINK_BELOW
# cudaMalloc / cudaFree calls, retries after a failed cudaMalloc, and synchronizations of every
# stream by the caching allocator: each stalls the host until the device catches up.
ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
SLEEP_CYCLES = 2_000_000_000  # about a second at the H200's clock: longer than any issue here


def timed(model, inputs, iters: int) -> tuple[float, float, float, int, float]:
    """Median wall, enqueue and device seconds, how many device timings were issued ahead, and
    the seconds a forward of `iters` forwards run back to back (synchronized before the first
    and after the last only, as a sampler's steps run: loads for the next forward overlap this
    one's end instead of being counted in it)."""
    walls, enqueues, devices, ahead = [], [], [], 0
    for _ in range(iters):
        torch.cuda.synchronize()
        started = time.perf_counter()
        model(**inputs)
        enqueues.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - started)
    for _ in range(iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        begin.record()
        model(**inputs)
        end.record()
        ahead += not begin.query()  # the sleep still runs: every launch was queued before it ended
        torch.cuda.synchronize()
        devices.append(begin.elapsed_time(end) / 1e3)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        model(**inputs)
    torch.cuda.synchronize()
    loop = (time.perf_counter() - started) / iters
    return statistics.median(walls), statistics.median(enqueues), statistics.median(devices), ahead, loop


def profile_forwards(variant: str, model, inputs, iters: int) -> None:
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(iters):
        model(**inputs)
    torch.cuda.synchronize()
    profiler.disable()
    print(f"\n== {variant}: cProfile of {iters} forwards (seconds over all of them)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


class DloFixedSlots(Dlo):
    """dlo whose slots never shrink back between Flux's two size classes: no refit after the
    first call, so each block's views in a slot are made once (the hot path's policy frees the
    larger buffers during the smaller blocks' phase: See [Note: slots per size class])."""

    def __init__(self, model, device, plan=None) -> None:
        slot_queue._SHRINK_BELOW = 0.0  # this variant only: restored by close()
        super().__init__(model, device, plan)

    def close(self) -> None:
        slot_queue._SHRINK_BELOW = SHRINK_BELOW
        super().close()


class DloFourFixedSlots(DloFixedSlots):
    """"dlo fixed slots" with four slots: no refit and loads further ahead."""

    config = dlo.OffloadConfig(num_slots=4)


class DloWithoutProbe(Dlo):
    """dlo without the pre-hooks on every submodule of the streamed blocks (See [Note: blocks
    used outside their call]): what their dispatch costs the host a forward."""

    def __init__(self, model, device, plan=None) -> None:
        super().__init__(model, device, plan)
        self.handle._probe.remove()


class DloFourSlots(Dlo):
    """dlo with four slots (the default is two): loads may run further ahead of the compute."""

    config = dlo.OffloadConfig(num_slots=4)


class DloThreeSlots(Dlo):
    """dlo with three slots."""

    config = dlo.OffloadConfig(num_slots=3)


class DloFiveSlots(Dlo):
    """dlo with five slots: in a model of 6 double blocks (copy slower than compute) and 12
    single ones (the reverse), four slots leave the double phase waiting for copies, five do not
    (by a simulation from run 5's per-block times; see RESULTS.md)."""

    config = dlo.OffloadConfig(num_slots=5)


class DloSixSlots(Dlo):
    config = dlo.OffloadConfig(num_slots=6)


class DloKernelsSlots(DloKernels):
    """"dlo + kernels" with --slots slots (set by main)."""


class DloTimeline(Dlo):
    """dlo recording every copy's and block's device interval (`record_timeline`): after its
    forwards, the last one's blocks are printed (see `print_block_timeline`)."""

    config = dlo.OffloadConfig(record_timeline=True)


class DloFourSlotsTimeline(DloTimeline):
    """"dlo timeline" with four slots."""

    config = dlo.OffloadConfig(num_slots=4, record_timeline=True)


class ResidentTimeline(Resident):
    """The resident model with CUDA events around each block call: `print_blocks` gives the last
    forward's per-block device time, named as dlo's timeline names them, and the gap before it
    (from the previous forward's last block). The hooks stay on for the timed forwards: this
    row's wall and enqueue times include their cost."""

    def __init__(self, model, device) -> None:
        super().__init__(model, device)
        self.calls: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # every block call, in order
        self.blocks = 0
        self.hooks = []
        started: dict[str, torch.cuda.Event] = {}

        def begin(name: str) -> None:
            started[name] = torch.cuda.Event(enable_timing=True)
            started[name].record()

        def end(name: str) -> None:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            self.calls.append((name, started.pop(name), ended))

        for path in discover(self.model).block_lists:
            for i, block in enumerate(self.model.get_submodule(path)):
                self.blocks += 1
                self.hooks.append(block.register_forward_pre_hook(lambda *_, name=f"{path}.{i}": begin(name)))
                self.hooks.append(block.register_forward_hook(lambda *_, name=f"{path}.{i}": end(name)))

    def print_blocks(self) -> None:
        torch.cuda.synchronize()
        last = self.calls[-self.blocks:]
        print("\n| block | resident compute |")
        print("|---|---|")
        for name, begin, end in last:
            print(f"| {name} | {begin.elapsed_time(end):.2f} |")
        gap = self.calls[-self.blocks - 1][2].elapsed_time(last[0][1]) if len(self.calls) > self.blocks else float("nan")
        print(f"blocks: compute {sum(b.elapsed_time(e) for _, b, e in last):.1f} ms; from the previous forward's last "
              f"block to this one's first {gap:.2f} ms")

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        super().close()


VARIANTS = {
    **VARIANTS, "dlo fixed slots": DloFixedSlots, "dlo without probe": DloWithoutProbe, "dlo 4 slots": DloFourSlots, "dlo 3 slots": DloThreeSlots,
    "dlo 5 slots": DloFiveSlots, "dlo 6 slots": DloSixSlots,
    "dlo 4 fixed slots": DloFourFixedSlots,
    "dlo + kernels --slots": DloKernelsSlots,
    "dlo timeline": DloTimeline, "dlo 4 slots timeline": DloFourSlotsTimeline, "resident timeline": ResidentTimeline,
}


def print_block_timeline(handle: dlo.OffloadHandle) -> None:
    """The last forward's streamed blocks on the device, in ms: each block's copy (the last one
    that started before the block did) and compute, the compute stream's idle time before the
    block, and how long after the previous block's end its copy landed (> 0: the block waited
    for its copy)."""
    handle.stats()  # settles the ledger
    runtime = handle._runtime
    timeline = runtime.ledger.timeline
    every_compute = [i for i in timeline if i.track == "compute"]
    computes = every_compute[-len(runtime.blocks):]
    before = every_compute[-len(runtime.blocks) - 1] if len(every_compute) > len(runtime.blocks) else None
    rows, previous_end = [], None
    for block in computes:
        copies = [i for i in timeline if i.track == "copy" and i.name == block.name and i.start_s <= block.start_s]
        copy = copies[-1] if copies else None
        idle = block.start_s - previous_end if previous_end is not None else 0.0
        late = copy.start_s + copy.duration_s - previous_end if copy and previous_end is not None else float("nan")
        rows.append((block.name, copy.duration_s if copy else float("nan"), block.duration_s, idle, late))
        previous_end = block.start_s + block.duration_s
    print("\n| block | copy | compute | idle before | copy end - previous end |")
    print("|---|---|---|---|---|")
    for name, copy_s, compute_s, idle_s, late_s in rows:
        print(f"| {name} | {copy_s * 1e3:.2f} | {compute_s * 1e3:.2f} | {idle_s * 1e3:.2f} | {late_s * 1e3:.2f} |")
    span = previous_end - computes[0].start_s if computes else 0.0
    compute_ms, idle_ms = sum(r[2] for r in rows) * 1e3, sum(r[3] for r in rows) * 1e3
    gap = computes[0].start_s - before.start_s - before.duration_s if before and computes else float("nan")
    print(f"blocks: compute {compute_ms:.1f} ms, idle between them {idle_ms:.1f} ms, first start to last end {span * 1e3:.1f} ms; "
          f"from the previous forward's last block to this one's first {gap * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tmp", default=None)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--variants", default="resident,dlo,resident + kernels,dlo + kernels")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--slots", type=int, default=4, help="slots of the 'dlo + kernels, --slots' variant")
    args = parser.parse_args()
    DloKernelsSlots.config = dlo.OffloadConfig(num_slots=args.slots)
    device = torch.device("cuda")
    shape = SHAPES["flux"]
    directory = Path(tempfile.mkdtemp(prefix="gguf_host_bound_", dir=args.tmp))
    model = build_model(shape, 0, device)
    model.save_config(directory)
    path = directory / "Q8_0.gguf"
    write_gguf(model, path, "Q8_0", 2)
    del model
    inputs = to_device(shape.make_inputs(torch.Generator().manual_seed(1)), device)
    rows = []
    for variant in args.variants.split(","):
        session = VARIANTS[variant](load_gguf(path, directory, shape.class_name), device)
        try:
            with torch.inference_mode():
                for _ in range(2):
                    session.model(**inputs)
                session.start_window()
                before = torch.cuda.memory_stats()
                rows.append((variant, *timed(session.model, inputs, args.iters)))
                after = torch.cuda.memory_stats()
                counts = {key: after.get(key, 0) - before.get(key, 0) for key in ALLOCATOR_COUNTS}
                print(f"  {variant}: caching allocator over the timed forwards {counts}; back to back "
                      f"{rows[-1][-1] * 1e3:.1f} ms a forward", flush=True)
                session.streaming(2 * args.iters)  # a dlo session's close prints its CPU seconds from it
                if args.cprofile:
                    profile_forwards(variant, session.model, inputs, args.iters)
                if isinstance(session, DloTimeline):
                    print_block_timeline(session.handle)
                if isinstance(session, ResidentTimeline):
                    session.print_blocks()
        finally:
            session.close()
        del session
        torch.cuda.empty_cache()
    print(f"\nFlux-shaped Q8_0, median of {args.iters}, ms a forward")
    print("| variant | wall | enqueue | device (issued ahead) | ahead | back to back |")
    print("|---|---|---|---|---|---|")
    for variant, wall, enqueue, device_s, ahead, loop in rows:
        print(f"| {variant} | {wall * 1e3:.1f} | {enqueue * 1e3:.1f} | {device_s * 1e3:.1f} | {ahead}/{args.iters} | {loop * 1e3:.1f} |")


if __name__ == "__main__":
    main()
