"""The zigzag ring schedule, checked by counting (query, key) pairs; no process group.

For every ring size R and ring rank r, the blocks of :func:`zigzag_block_plan` over the R steps
must cover exactly the (query, key) pairs single-device attention computes for r's queries
(causal: key position <= query position; else all), each pair once, and every step must cost
every rank the same work.
"""

from __future__ import annotations

import itertools

import pytest

from megatron.usp.ring_attention import BlockPlan, zigzag_block_plan
from megatron.usp.token_order import positions_for_ring_rank

CHUNK = 3  # tokens per super-chunk; odd so that off-by-one slicing would show


def _work_units(plan: BlockPlan) -> float:
    """Work in c x c blocks; a causal (diagonal) block pair counts half of its area."""
    rows = 2 if plan.q_rows == "all" else 1
    cols = 2 if plan.kv_cols == "all" else 1
    area = rows * cols
    return area / 2 if plan.causal else float(area)


def _block_pairs(plan: BlockPlan, ring_size: int):
    """The (query position, key position) pairs a block computes, via the token order module."""
    seq = 2 * ring_size * CHUNK
    q_pos = positions_for_ring_rank(seq, plan.rank, ring_size)
    k_pos = positions_for_ring_rank(seq, plan.source, ring_size)
    rows = range(CHUNK, 2 * CHUNK) if plan.q_rows == "back" else range(2 * CHUNK)
    cols = range(CHUNK) if plan.kv_cols == "front" else range(2 * CHUNK)
    pairs = []
    for i, j in itertools.product(rows, cols):
        if plan.causal and j > i:      # square local causal mask (top-left == bottom-right)
            continue
        pairs.append((q_pos[i], k_pos[j]))
    return pairs


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_schedule_covers_each_pair_exactly_once(ring_size, causal):
    seq = 2 * ring_size * CHUNK
    for rank in range(ring_size):
        seen = []
        for step in range(ring_size):
            plan = zigzag_block_plan(step, rank, ring_size, causal)
            assert plan.source == (rank - step) % ring_size
            seen.extend(_block_pairs(plan, ring_size))
        assert len(seen) == len(set(seen)), "a (query, key) pair is computed twice"
        q_pos = positions_for_ring_rank(seq, rank, ring_size)
        expected = {(qp, kp) for qp in q_pos for kp in range(seq) if not causal or kp <= qp}
        assert set(seen) == expected


@pytest.mark.parametrize("ring_size", [2, 3, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_every_step_costs_every_rank_the_same(ring_size, causal):
    for step in range(ring_size):
        plans = [zigzag_block_plan(step, r, ring_size, causal) for r in range(ring_size)]
        units = {_work_units(p) for p in plans}
        assert units == {2.0 if causal else 4.0}, (step, [_work_units(p) for p in plans])
        # The pair counts agree too, up to the diagonal (a causal square block keeps its
        # diagonal: 2c(2c+1)/2 pairs against 2c*c for the off-diagonal steps).
        counts = {len(_block_pairs(p, ring_size)) for p in plans}
        assert len(counts) == 1, (step, counts)


def test_causal_step_cases():
    # ring size 4, rank 2: step 0 diagonal, sources 1 and 0 (< 2) front keys, source 3 back rows
    plans = [zigzag_block_plan(i, 2, 4, True) for i in range(4)]
    assert [(p.source, p.q_rows, p.kv_cols, p.causal) for p in plans] == [
        (2, "all", "all", True),
        (1, "all", "front", False),
        (0, "all", "front", False),
        (3, "back", "all", False),
    ]


def test_total_causal_work_is_half_the_full_matrix():
    for ring_size in (2, 4, 8):
        total = sum(
            _work_units(zigzag_block_plan(i, r, ring_size, True))
            for i in range(ring_size)
            for r in range(ring_size)
        )
        # (2R x 2R blocks of c x c) / 2 = 2R^2
        assert total == 2 * ring_size**2


def test_plan_rejects_out_of_range():
    with pytest.raises(ValueError):
        zigzag_block_plan(2, 0, 2, True)
    with pytest.raises(ValueError):
        zigzag_block_plan(0, 3, 2, True)
