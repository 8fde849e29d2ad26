"""Ranks that must hold the same micro-batch check that they do; ring waits end.

* :func:`~megatron.training.data.batch.batch_fingerprint` changes with the token ids, the
  segment ids and the chunk assignment.
* On 4 gloo ranks (U2 x R2: one TP x CP group of four), one CP rank reads another
  micro-batch at the third micro-batch: every rank stops with the same one-line
  :class:`BatchMismatchError` naming the odd rank; ``--batch-agreement-interval 0`` lets the
  same run train.
* A ring exchange whose peer runs another schedule raises :class:`RingTimeoutError` in one
  line naming the ranks, after the Ring group's timeout, instead of waiting forever.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from megatron.training.data.batch import batch_fingerprint, mismatch_message
from megatron.usp.token_order import ChunkAssignment

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--mock-data", "--vocab-size", "512", "--lr", "1e-3",
        "--num-workers", "0", "--device", "cpu", "--eval-iters", "0", "--train-iters", "3",
        "--ulysses-degree", "2", "--ring-degree", "2", "--micro-batch-size", "1",
        "--global-batch-size", "2"]


def test_fingerprint_covers_tokens_segments_and_assignment():
    tokens = torch.arange(16).reshape(1, 16)
    seg = torch.zeros(1, 16, dtype=torch.int32)
    zigzag = ChunkAssignment(1, ((0, 3), (1, 2)))
    base = batch_fingerprint({"tokens": tokens, "segment_ids": seg, "chunk_assignment": zigzag})
    assert 0 <= base < 2**63
    other_tokens = tokens.clone()
    other_tokens[0, 5] += 1
    seg_split = seg.clone()
    seg_split[0, 8:] = 1
    for changed in ({"tokens": other_tokens, "segment_ids": seg, "chunk_assignment": zigzag},
                    {"tokens": tokens, "segment_ids": seg_split, "chunk_assignment": zigzag},
                    {"tokens": tokens, "segment_ids": seg,
                     "chunk_assignment": ChunkAssignment(1, ((0, 1), (2, 3)))}):
        assert batch_fingerprint(changed) != base
    assert batch_fingerprint({"tokens": tokens.clone(), "segment_ids": seg.clone(),
                              "chunk_assignment": zigzag}) == base


def test_mismatch_message_names_the_odd_ranks():
    msg = mismatch_message(3, [7, 7, 9, 7], [4, 5, 6, 7])
    assert msg.startswith("micro-batch 3: the TP and context-parallel ranks [4, 5, 6, 7] must "
                          "read the same micro-batch, but rank(s) 4, 5, 7 hold one, rank(s) 6 "
                          "hold another")
    assert "\n" not in msg


def _odd_batch_on_rank_2(ctx, data_iterator, model):
    """batch.forward_step, except that CP rank 2 reads the next sample instead at the third
    micro-batch."""
    import torch.distributed as dist

    from megatron.training.data import batch

    calls = _odd_batch_on_rank_2.calls = getattr(_odd_batch_on_rank_2, "calls", 0) + 1
    if dist.get_rank() == 2 and calls == 3:
        next(data_iterator)                 # skip one: this rank now reads another sample
    return batch.forward_step(ctx, data_iterator, model)


def _train_with_an_odd_batch(rank, world_size):
    from megatron.training.cli.arguments import parse_args
    from megatron.training.data.errors import BatchMismatchError
    from megatron.training.loop import RUN_ERRORS, exit_status, pretrain, reported_here

    with pytest.raises(BatchMismatchError) as info:
        pretrain(parse_args(TINY), forward_step_func=_odd_batch_on_rank_2)
    message = str(info.value)
    assert message.startswith("micro-batch 3: the TP and context-parallel ranks [0, 1, 2, 3] "
                              "must read the same micro-batch, but rank(s) 0, 1, 3 hold one, "
                              "rank(s) 2 hold another"), message
    assert "\n" not in message and isinstance(info.value, RUN_ERRORS)
    assert exit_status(info.value) == 1 and reported_here(info.value, rank) == (rank == 0)
    # The check off: the same run trains (on a rank-dependent batch, which nothing sees).
    _odd_batch_on_rank_2.calls = 0
    pretrain(parse_args(TINY + ["--batch-agreement-interval", "0"]),
             forward_step_func=_odd_batch_on_rank_2)


def test_a_cp_rank_with_another_batch_stops_the_run_naming_it(dist_run):
    dist_run(_train_with_an_odd_batch, 4, timeout=300)


def _mismatched_ring_schedule(rank, world_size):
    import torch.distributed as dist

    from megatron.usp.ring_comm import RingComm, RingTimeoutError

    ring = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    comm = RingComm(ring)
    assert comm.timeout == datetime.timedelta(seconds=3)
    if rank == 1:
        # Rank 1's plan expects rank 0's K/V at step 1; rank 0's plan sends nothing.
        start = time.monotonic()
        pending = comm.shift(1, None, torch.empty(8))
        with pytest.raises(RingTimeoutError) as info:
            pending.wait()
        assert 2.5 < time.monotonic() - start < 30
        assert str(info.value).startswith(
            "ring exchange timed out after 3 s: ring rank 1 (global rank 1) was receiving from "
            "global rank 0; the ring ranks ran different schedules"), str(info.value)
        assert "\n" not in str(info.value)
    dist.barrier()


def test_a_ring_wait_ends_with_the_group_timeout(dist_run):
    dist_run(_mismatched_ring_schedule, 2, timeout=120)
