"""Rank targets for tests/test_generate_ranks.py's launcher tests (imported by name in the ranks)."""

import os
import time

import torch.distributed as dist


def one_rank_fails(place, payload):
    if place.rank == 1:
        raise RuntimeError("rank 1 broke")
    time.sleep(600)  # a peer left waiting: the launcher must end it


def one_rank_dies(place, payload):
    # Both ranks past init_process_group first: a rank that exits while its peer still connects
    # the group fails the peer's init (Gloo: "Connection closed by peer"), and the launcher
    # rightly reports that first failure instead of the silent death this tests.
    dist.barrier()
    if place.rank == 1:
        os._exit(3)
    return dict(ok=True)
