"""How the CUDA executor picks its streams, with stand-ins for the streams and the probe (the
probe itself runs in tests/gpu/test_cuda_stream_queues.py). See [Note: streams on separate
queues]"""

import itertools
import logging

import torch

from dlo.hotpath.executors import SHARED_QUEUE, STREAM_DRAWS, first_apart

DEVICE = torch.device("cuda", 0)


def test_the_first_drawn_stream_that_runs_apart_is_taken(caplog):
    draws = itertools.count()
    probed = []

    def apart(stream):
        probed.append(stream)
        return stream == 3

    with caplog.at_level(logging.WARNING, logger="dlo"):
        assert first_apart(lambda: next(draws), apart, "copy", DEVICE) == 3
    assert probed == [0, 1, 2, 3] and next(draws) == 4  # no draw past the one taken
    assert SHARED_QUEUE not in caplog.text


def test_when_no_draw_runs_apart_the_first_is_kept_and_the_code_logged(caplog):
    draws = itertools.count()
    with caplog.at_level(logging.WARNING, logger="dlo"):
        assert first_apart(lambda: next(draws), lambda stream: False, "dequantization", DEVICE) == 0
    assert next(draws) == STREAM_DRAWS
    (record,) = caplog.records
    assert f"({SHARED_QUEUE})" in record.getMessage() and "dequantization" in record.getMessage()
