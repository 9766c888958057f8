"""dlo's copy, dequantization and compute streams run on separate hardware queues: work on
one does not wait behind a wait on another, in every fp8 enable of a process (the pool hands
each enable new streams). See [Note: streams on separate queues]"""

import logging

import pytest
import torch

import dlo
from dlo.hotpath import executors
from dlo.models.tiny import TINY_MODELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FP8 = dlo.OffloadConfig(stream_dtype="fp8")
GATE_BYTES = 1 << 30  # about 20 ms over PCIe Gen5: the host sees an apart stream's event long before


def passes_a_held_stream(held, other, host, device_buffer) -> bool:
    """Held by a wait on a long host-to-device copy on a stream of its own (the executor's own
    probe holds with a sleep kernel instead): does an event on `other` complete meanwhile?"""
    gate, released, passed = torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.Event()
    with torch.cuda.stream(gate):
        device_buffer.copy_(host, non_blocking=True)
    released.record(gate)
    held.wait_event(released)
    passed.record(other)
    passed.synchronize()
    apart = not released.query()
    released.synchronize()
    return apart


def test_every_fp8_enable_in_a_process_gets_streams_that_pass_each_others_waits():
    entry = TINY_MODELS["flux"]
    host = torch.empty(GATE_BYTES, dtype=torch.uint8, pin_memory=True)
    device_buffer = torch.empty(GATE_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(6):  # runs of six enables found the fourth on slow, on the pool's streams
        model = entry.build(seed=0)
        with dlo.enable(model, "cuda", FP8) as handle:
            executor = handle._runtime.executor
            copy, dequant, compute = executor.copy_stream, executor._dequant_stream, executor.compute_stream()
            pairs = [(compute, copy), (copy, compute), (copy, dequant), (dequant, copy), (compute, dequant)]
            assert all(passes_a_held_stream(held, other, host, device_buffer) for held, other in pairs)


def test_a_stream_that_never_runs_apart_is_kept_with_the_shared_queue_code(monkeypatch, caplog):
    monkeypatch.setattr(executors, "runs_apart", lambda held, other, gate: False)
    drawn = []
    real_stream = torch.cuda.Stream

    def recorded(*args, **kwargs):
        drawn.append(real_stream(*args, **kwargs))
        return drawn[-1]

    with caplog.at_level(logging.WARNING, logger="dlo"):
        monkeypatch.setattr(torch.cuda, "Stream", recorded)
        stream = executors.stream_apart(torch.device("cuda"), -1, [torch.cuda.current_stream()], "dequantization")
        monkeypatch.setattr(torch.cuda, "Stream", real_stream)
    assert len(drawn) == 1 + executors.STREAM_DRAWS  # the gate, then every candidate
    assert stream is drawn[1]
    assert f"({executors.SHARED_QUEUE})" in caplog.text and "dequantization" in caplog.text
