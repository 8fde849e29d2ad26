"""The loop's per-iteration maxima over ranks (megatron/training/loop.py: RankMaxima).

Three gloo ranks exchange different numbers each iteration: every rank must get the maximum
over all of them, of the previous iteration (one late, so the host never waits for the step it
queued), or of the current one with ``now``; one process gets its own values at once.
"""

import torch

from megatron.training.loop import RankMaxima


def _exchange_on_ranks(rank, world_size):
    maxima = RankMaxima(torch.device("cpu"))
    seen = []
    for it in range(4):
        values = [float(rank * 10 + it), float(-rank - it)]
        seen.append(maxima.exchange(values, now=(it == 3)))
    top = world_size - 1
    assert seen[0] is None, seen
    assert seen[1] == [top * 10 + 0.0, 0.0], seen        # iteration 0's maxima
    assert seen[2] == [top * 10 + 1.0, -1.0], seen
    assert seen[3] == [top * 10 + 3.0, -3.0], seen        # now: iteration 3's, not 2's
    assert maxima.exchange([1.0, 2.0]) is None            # after a now, nothing is pending


def test_maxima_over_ranks_are_one_iteration_late_and_agree(dist_run):
    dist_run(_exchange_on_ranks, 3, timeout=60)


def _one_rank(rank, world_size):
    maxima = RankMaxima(torch.device("cpu"))
    assert maxima.exchange([15.0, 2.5]) == [15.0, 2.5]


def test_one_process_gets_its_own_values_at_once(dist_run):
    dist_run(_one_rank, 1, timeout=60)
