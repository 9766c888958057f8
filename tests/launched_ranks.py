"""Rank targets for tests/test_generate_ranks.py's launcher tests (imported by name in the ranks)."""

import os
import time


def one_rank_fails(place, payload):
    if place.rank == 1:
        raise RuntimeError("rank 1 broke")
    time.sleep(600)  # a peer left waiting: the launcher must end it


def one_rank_dies(place, payload):
    if place.rank == 1:
        os._exit(3)
    return dict(ok=True)
