"""A child process for tests/test_enable_host_peak.py: `python host_peak_child.py DIR KIND` loads
the bf16 checkpoint in DIR (KIND "mapped": dlo.load_transformer; "private": diffusers'
from_pretrained, its tensors copied into private memory), enables it on the CPU with stream_dtype="fp8" while a thread samples this
process's anonymous resident memory (RssAnon), runs one forward, and prints a JSON line:
baseline, peak during enable(), and after it (freed heap returned first), in bytes."""

from __future__ import annotations

import ctypes
import gc
import json
import sys
import threading
import time

import diffusers
import torch

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


def main() -> None:
    directory, kind = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if kind == "mapped":
        model, plan = dlo.load_transformer(directory)
    else:  # private: every tensor copied out of the file diffusers' loader maps
        model, plan = diffusers.WanTransformer3DModel.from_pretrained(directory, torch_dtype=torch.bfloat16).eval(), None
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.data = tensor.data.clone()
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
