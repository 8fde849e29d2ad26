"""The multi-process harness reports failures and hangs instead of stalling."""

import time

import pytest
import torch
import torch.distributed as dist


def _all_reduce(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == sum(range(world))


def _rank1_raises(rank, world):
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def _rank0_stalls(rank, world):
    if rank == 0:
        time.sleep(120)  # never reaches the collective in time
    dist.barrier()


def test_collective_runs(dist_run):
    dist_run(_all_reduce, 4)


def test_failing_rank_traceback_is_reported(dist_run):
    with pytest.raises(AssertionError) as e:
        dist_run(_rank1_raises, 2, timeout=60)
    assert "rank 1" in str(e.value) and "boom on rank one" in str(e.value)


def test_hang_times_out(dist_run):
    with pytest.raises(AssertionError) as e:
        dist_run(_rank0_stalls, 2, timeout=8)
    assert "did not finish" in str(e.value)
