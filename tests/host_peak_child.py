"""A child process for tests/test_enable_host_peak.py: `python host_peak_child.py DIR KIND` loads
the bf16 checkpoint in DIR (KIND "mapped": dlo.load_transformer; "private": diffusers'
from_pretrained, its tensors copied into private memory), enables it on the CPU with stream_dtype="fp8" while a thread samples this
process's anonymous resident memory (RssAnon), runs one forward, and prints a JSON line:
baseline, peak during enable(), and after it (freed heap returned first), in bytes.

KIND "moves": the checkpoint mapped under host_budget_gib=BUDGET (a third argument, GiB), the
choice made from the measured call forced to swap two blocks on disk with two kept in host
memory; RssAnon sampled during that call (its moves included): before, peak, after, and the
blocks moved.

KIND "disable": the checkpoint mapped (under host_budget_gib=BUDGET GiB when a fourth argument
gives one), one forward, then `disable(restore=RESTORE)` (third argument, 0 or 1) while RssAnon
is sampled: before, peak, after."""

from __future__ import annotations

import ctypes
import gc
import json
import sys
import threading
import time

import diffusers
import torch
from ordinary_tensors import ordinary_tensors

import dlo
from dlo.models.tiny import TINY_MODELS


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


class Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = rss_anon()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.0005)


def swap_two(blocks, room, current, model, **options):
    """The measured choice, forced: the first two disk blocks kept, the first two kept ones on disk."""
    from dlo.planning.host_tier import TierChoice

    kept = [i for i, b in enumerate(blocks) if b.read_bytes is not None and i not in current]
    on_disk = tuple(sorted(set(current) - set(current[:2]) | set(kept[:2])))
    return TierChoice(on_disk, 0.0, 0)


def moves(directory: str, budget_gib: float) -> None:
    from dlo.backend import host_tier_choice

    host_tier_choice.choose_tier = swap_two
    model, plan = dlo.load_transformer(directory)
    inputs = TINY_MODELS["wan"].inputs(1, torch.bfloat16)
    with dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib), plan=plan) as handle:
        with torch.inference_mode():
            model(**inputs)  # the warm-up call
            gc.collect()
            ctypes.CDLL(None).malloc_trim(0)
            before = rss_anon()
            sampler = Sampler()
            sampler.start()
            finite = bool(torch.isfinite(model(**inputs)[0]).all())  # measured, then the moves
            sampler.stop.set()
            sampler.join()
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)
        choice = handle.stats().disk.choice
        print(json.dumps(dict(before=before, peak=sampler.peak, after=rss_anon(), finite=finite,
                              moved=len(choice.moved_to_disk) + len(choice.moved_to_ram))))


def disable(directory: str, restore: bool, budget_gib: float | None) -> None:
    model, plan = dlo.load_transformer(directory)
    inputs = TINY_MODELS["wan"].inputs(1, torch.bfloat16)
    handle = dlo.enable(model, "cpu", dlo.OffloadConfig(host_budget_gib=budget_gib), plan=plan)
    with torch.inference_mode():
        finite = bool(torch.isfinite(model(**inputs)[0]).all())
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    before = rss_anon()
    sampler = Sampler()
    sampler.start()
    handle.disable(restore=restore)
    sampler.stop.set()
    sampler.join()
    print(json.dumps(dict(before=before, peak=sampler.peak, after=rss_anon(), finite=finite)))


def main() -> None:
    directory, kind = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if kind == "moves":
        moves(directory, float(sys.argv[3]))
        return
    if kind == "disable":
        disable(directory, sys.argv[3] == "1", float(sys.argv[4]) if len(sys.argv) > 4 else None)
        return
    if kind == "mapped":
        model, plan = dlo.load_transformer(directory)
    else:  # private: every tensor copied out of the file diffusers' loader maps
        model, plan = diffusers.WanTransformer3DModel.from_pretrained(directory, torch_dtype=torch.bfloat16).eval(), None
        ordinary_tensors(model)
        gc.collect()
    inputs = TINY_MODELS["wan"].inputs(1, torch.bfloat16)
    baseline = rss_anon()
    sampler = Sampler()
    sampler.start()
    handle = dlo.enable(model, "cpu", dlo.OffloadConfig(stream_dtype="fp8"), plan=plan)
    sampler.stop.set()
    sampler.join()
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # freed heap back to the system: "after" is what is held
    after = rss_anon()
    with torch.inference_mode():
        finite = bool(torch.isfinite(model(**inputs)[0]).all())
    print(json.dumps(dict(baseline=baseline, peak=sampler.peak, after=after, host_bytes=handle.stats().host_bytes,
                          finite=finite)))
    handle.disable()


if __name__ == "__main__":
    main()
