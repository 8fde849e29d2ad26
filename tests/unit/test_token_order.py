"""Properties of the load-balanced token order (megatron/usp/token_order.py), no process group.

For every (U, R, S) tried: the ranks' positions partition the sequence; sharding then
unsharding is the identity; the post-all-to-all permutation gives each ring rank its
zigzag super-chunks; the causal attention work of each ring rank is equal, in total and at
every ring step (and the contiguous order, as a control, is not balanced).
"""

import itertools

import pytest
import torch

from megatron.usp import token_order

GRIDS = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (3, 2), (8, 1), (1, 8)]


def _seq(u, r, mult=3):
    return 2 * u * r * mult


@pytest.mark.parametrize("u,r", GRIDS)
def test_positions_partition_the_sequence(u, r):
    cp, s = u * r, _seq(u, r)
    allpos = [p for c in range(cp) for p in token_order.positions_for_cp_rank(s, c, cp)]
    assert sorted(allpos) == list(range(s)), "a token is lost or duplicated"
    for c in range(cp):
        pos = token_order.positions_for_cp_rank(s, c, cp)
        assert len(pos) == s // cp
        # chunk c then chunk 2CP-1-c, each increasing
        chunk = s // (2 * cp)
        assert pos[:chunk] == list(range(c * chunk, (c + 1) * chunk))
        back = 2 * cp - 1 - c
        assert pos[chunk:] == list(range(back * chunk, (back + 1) * chunk))


@pytest.mark.parametrize("u,r", GRIDS)
def test_shard_matches_positions_and_unshard_inverts(u, r):
    cp, s = u * r, _seq(u, r, mult=2)
    x = torch.arange(s).repeat(3, 1) * 10 + torch.arange(3)[:, None]  # [b=3, s], distinct rows
    shards = [token_order.shard_for_cp_rank(x, 1, c, cp) for c in range(cp)]
    for c, sh in enumerate(shards):
        want = torch.tensor(token_order.positions_for_cp_rank(s, c, cp))
        assert torch.equal(sh, x[:, want])
    assert torch.equal(token_order.unshard_from_cp_ranks(shards, 1), x)
    # another sequence dim, e.g. [s, b, h]
    y = torch.randn(s, 2, 5)
    ys = [token_order.shard_for_cp_rank(y, 0, c, cp) for c in range(cp)]
    assert torch.equal(token_order.unshard_from_cp_ranks(ys, 0), y)


@pytest.mark.parametrize("u,r", GRIDS)
def test_ulysses_gather_then_permutation_gives_zigzag_super_chunks(u, r):
    cp, s = u * r, _seq(u, r)
    pos = torch.arange(s)
    order = token_order.ulysses_to_zigzag_order(u)
    assert sorted(order) == list(range(2 * u))
    for ring_rank in range(r):
        # The all-to-all gathers the sequence shards of the U ranks of this ring rank,
        # in Ulysses-rank order.
        gathered = torch.cat([
            token_order.shard_for_cp_rank(pos, 0, token_order.cp_rank_of(uu, ring_rank, u), cp)
            for uu in range(u)
        ])
        zz = token_order.permute_blocks(gathered, order, 0)
        want = token_order.positions_for_ring_rank(s, ring_rank, r)
        assert zz.tolist() == want
        half = len(want) // 2
        assert want[:half] == sorted(want[:half]) and want[half:] == sorted(want[half:])
        back = token_order.permute_blocks(zz, token_order.invert_order(order), 0)
        assert torch.equal(back, gathered)


def _causal_pairs(q_pos, k_pos):
    q = torch.tensor(q_pos)[:, None]
    k = torch.tensor(k_pos)[None, :]
    return int((k <= q).sum())


@pytest.mark.parametrize("r", [1, 2, 3, 4, 8])
def test_causal_work_is_equal_per_ring_rank_and_step(r):
    s = 2 * r * 5
    pos = [token_order.positions_for_ring_rank(s, i, r) for i in range(r)]
    totals = [_causal_pairs(pos[i], list(range(s))) for i in range(r)]
    assert len(set(totals)) == 1, totals
    assert sum(totals) == s * (s + 1) // 2
    # Ring step t: rank i attends its queries to the keys of rank (i - t) mod R.
    for t in range(r):
        work = [_causal_pairs(pos[i], pos[(i - t) % r]) for i in range(r)]
        assert len(set(work)) == 1, (t, work)
    if r > 1:  # control: contiguous blocks are not balanced, so the metric can fail
        block = s // r
        contiguous = [list(range(i * block, (i + 1) * block)) for i in range(r)]
        naive = [_causal_pairs(contiguous[i], list(range(s))) for i in range(r)]
        assert len(set(naive)) == r


def test_token_order_rejects_bad_lengths_and_ranks():
    with pytest.raises(ValueError, match=r"--seq-length=100 .* 2\*ulysses_degree\*ring_degree = 8"):
        token_order.check_seq_divisible(100, 4, "--seq-length")
    with pytest.raises(ValueError, match="try --seq-length 96 or 104"):
        token_order.check_seq_divisible(100, 4, "--seq-length")
    with pytest.raises(ValueError, match="try --seq-length 8"):
        token_order.check_seq_divisible(6, 4, "--seq-length")
    token_order.check_seq_divisible(7, 1)  # CP 1: anything goes
    with pytest.raises(ValueError):
        token_order.shard_for_cp_rank(torch.zeros(2, 12), 1, 0, 4)
    with pytest.raises(ValueError):
        token_order.cp_chunk_ids(4, 4)


def test_cp_rank_order_matches_the_grid():
    """cp rank c = u + U*r: Ulysses ranks are adjacent (TP -> Ulysses -> Ring order)."""
    for u, r in itertools.product([1, 2, 4], [1, 2, 3]):
        ranks = [token_order.cp_rank_of(uu, rr, u) for rr in range(r) for uu in range(u)]
        assert ranks == list(range(u * r))
