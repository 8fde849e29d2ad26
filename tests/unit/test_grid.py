"""Pure tests of the rank arithmetic, checked against megatron-core's RankGenerator."""

import itertools

import pytest
from megatron.core.parallel_state import RankGenerator

from megatron.usp.grid import (
    GridShape,
    all_groups,
    coords_of_rank,
    group_containing,
    rank_groups,
    rank_of_coords,
    ring_neighbours,
)

LAYOUTS = [
    # (world, tp, u, r, pp)
    (2, 1, 2, 1, 1),
    (2, 1, 1, 2, 1),
    (4, 1, 2, 2, 1),
    (4, 2, 2, 1, 1),
    (8, 1, 2, 2, 1),
    (8, 1, 4, 2, 1),
    (8, 2, 2, 2, 1),
    (8, 2, 1, 2, 2),
    (16, 2, 2, 2, 2),
    (24, 2, 3, 2, 1),
    (1, 1, 1, 1, 1),
]


def _megatron_hierarchical(cp_ranks, sizes):
    """Megatron's hierarchical CP split, re-derived by hand: level 0 adjacent, level 1 strided."""
    u, r = sizes
    ulysses = [cp_ranks[i * u:(i + 1) * u] for i in range(r)]
    ring = [cp_ranks[j::u] for j in range(u)]
    return ulysses, ring


@pytest.mark.parametrize("world,tp,u,r,pp", LAYOUTS)
def test_groups_match_megatron_rank_generator(world, tp, u, r, pp):
    shape = GridShape(world_size=world, tp=tp, ulysses=u, ring=r, pp=pp)
    gen = RankGenerator(tp=tp, ep=1, dp=shape.dp, pp=pp, cp=u * r, order="tp-cp-ep-dp-pp")
    ours = all_groups(shape)
    for name, token in [
        ("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"), ("dp_cp", "dp-cp"),
        ("model_parallel", "tp-pp"), ("tp_cp", "tp-cp"), ("tp_dp", "tp-dp"),
        ("tp_dp_cp", "tp-dp-cp"),
    ]:
        assert ours[name] == gen.get_ranks(token), name
    ul, rg = [], []
    for cp_ranks in gen.get_ranks("cp"):
        a, b = _megatron_hierarchical(cp_ranks, (u, r))
        ul += a
        rg += b
    assert sorted(map(sorted, ours["ulysses"])) == sorted(map(sorted, ul))
    assert sorted(map(sorted, ours["ring"])) == sorted(map(sorted, rg))


@pytest.mark.parametrize("world,tp,u,r,pp", LAYOUTS)
def test_groups_partition_the_world(world, tp, u, r, pp):
    shape = GridShape(world_size=world, tp=tp, ulysses=u, ring=r, pp=pp)
    for name, groups in all_groups(shape).items():
        if name in ("embedding", "position_embedding"):
            continue
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(world)), name
        sizes = {len(g) for g in groups}
        assert len(sizes) == 1, name


def test_order_tp_fastest_ulysses_adjacent_ring_strided():
    shape = GridShape(world_size=16, tp=2, ulysses=2, ring=2, pp=2)  # dp = 2
    groups = all_groups(shape)
    assert groups["tp"][0] == [0, 1]
    assert groups["ulysses"][0] == [0, 2]  # adjacent once TP is factored out
    assert groups["ring"][0] == [0, 4]  # strided by TP*U
    assert groups["cp"][0] == [0, 2, 4, 6]
    assert shape.dp == 1
    assert groups["dp"][0] == [0]
    assert groups["pp"][0] == [0, 8]  # PP is slowest: stride TP*U*R*DP = 8
    shape8 = GridShape(world_size=8, tp=1, ulysses=2, ring=2, pp=1)  # dp = 2
    g8 = all_groups(shape8)
    assert g8["ulysses"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g8["ring"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g8["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g8["dp_cp"] == [[0, 1, 2, 3, 4, 5, 6, 7]]


def test_cp_group_local_rank_is_u_plus_U_times_r():
    shape = GridShape(world_size=8, tp=1, ulysses=4, ring=2)
    for cp in rank_groups(shape, ("ulysses", "ring")):
        for local, rank in enumerate(cp):
            c = coords_of_rank(shape, rank)
            assert local == c["ulysses"] + 4 * c["ring"]


def test_embedding_groups_first_and_last_stage():
    shape = GridShape(world_size=8, tp=2, ring=2, pp=2)
    assert all_groups(shape)["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all_groups(shape)["position_embedding"] == [[0], [1], [2], [3]]
    single = GridShape(world_size=2, tp=2)
    assert all_groups(single)["embedding"] == [[0], [1]]


def test_coords_roundtrip():
    shape = GridShape(world_size=24, tp=2, ulysses=3, ring=2)
    for rank in range(24):
        assert rank_of_coords(shape, coords_of_rank(shape, rank)) == rank


def test_ring_neighbours():
    assert ring_neighbours(0, 4) == (1, 3)
    assert ring_neighbours(3, 4) == (0, 2)
    assert ring_neighbours(0, 1) == (0, 0)


def test_group_containing():
    groups = [[0, 1], [2, 3]]
    assert group_containing(groups, 3) == [2, 3]
    with pytest.raises(ValueError):
        group_containing(groups, 7)


@pytest.mark.parametrize("kwargs", [dict(world_size=6, tp=4), dict(world_size=8, ulysses=3),
                                    dict(world_size=8, ring=0), dict(world_size=0)])
def test_bad_shapes_rejected(kwargs):
    with pytest.raises(ValueError):
        GridShape(**kwargs)
