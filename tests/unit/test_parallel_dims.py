"""ParallelDims: its rank arithmetic against megatron-core's RankGenerator, and its one check
(every bad layout fails with a message naming the flag and a fix)."""

import itertools

import pytest
from megatron.core.parallel_state import RankGenerator

from megatron.shapes import ModelShape
from megatron.usp.parallel_dims import (
    ParallelDims,
    USPConfigError,
    group_containing,
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
    dims = ParallelDims(world, tp=tp, ulysses=u, ring=r, pp=pp)
    gen = RankGenerator(tp=tp, ep=1, dp=dims.dp, pp=pp, cp=u * r, order="tp-cp-ep-dp-pp")
    ours = dims.all_groups()
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
    dims = ParallelDims(world, tp=tp, ulysses=u, ring=r, pp=pp)
    for name, groups in dims.all_groups().items():
        if name in ("embedding", "position_embedding"):
            continue
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(world)), name
        sizes = {len(g) for g in groups}
        assert len(sizes) == 1, name


def test_order_tp_fastest_ulysses_adjacent_ring_strided():
    dims = ParallelDims(16, tp=2, ulysses=2, ring=2, pp=2)  # dp = 2
    groups = dims.all_groups()
    assert groups["tp"][0] == [0, 1]
    assert groups["ulysses"][0] == [0, 2]  # adjacent once TP is factored out
    assert groups["ring"][0] == [0, 4]  # strided by TP*U
    assert groups["cp"][0] == [0, 2, 4, 6]
    assert dims.dp == 1
    assert groups["dp"][0] == [0]
    assert groups["pp"][0] == [0, 8]  # PP is slowest: stride TP*U*R*DP = 8
    dims8 = ParallelDims(8, tp=1, ulysses=2, ring=2, pp=1)  # dp = 2
    g8 = dims8.all_groups()
    assert g8["ulysses"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g8["ring"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g8["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g8["dp_cp"] == [[0, 1, 2, 3, 4, 5, 6, 7]]


def test_cp_group_local_rank_is_u_plus_U_times_r():
    dims = ParallelDims(8, tp=1, ulysses=4, ring=2)
    for cp in dims.rank_groups(("ulysses", "ring")):
        for local, rank in enumerate(cp):
            c = dims.coords(rank)
            assert local == c["ulysses"] + 4 * c["ring"]


def test_embedding_groups_first_and_last_stage():
    dims = ParallelDims(8, tp=2, ring=2, pp=2)
    assert dims.all_groups()["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.all_groups()["position_embedding"] == [[0], [1], [2], [3]]
    single = ParallelDims(2, tp=2)
    assert single.all_groups()["embedding"] == [[0], [1]]


def test_coords_roundtrip():
    dims = ParallelDims(24, tp=2, ulysses=3, ring=2)
    for rank in range(24):
        assert dims.rank_of(dims.coords(rank)) == rank


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
def test_bad_dimss_rejected(kwargs):
    with pytest.raises(ValueError):
        ParallelDims(**kwargs)


# --------------------------------------------------------------------------- the check
def dims(world=1, **kw):
    return ParallelDims(world, **kw)


def heads(n, groups=None, num_layers=4):
    """A model of ``n`` query heads (of dim 64) and ``groups`` KV heads (None: MHA)."""
    return ModelShape(num_layers=num_layers, hidden_size=64 * n, num_attention_heads=n,
                      num_query_groups=groups)


def test_valid_layouts_pass_and_dp_is_derived():
    d = dims(16, tp=2, ulysses=2, ring=2)
    assert d.violations(heads(32, 8), seq_length=4096) == []
    assert (d.dp, d.cp) == (2, 4)


def test_world_not_divisible():
    with pytest.raises(USPConfigError) as e:
        dims(8, ulysses=2, ring=3)
    msg = str(e.value)
    assert "world size 8" in msg and "--ring-degree" in msg and "[1, 2, 4]" in msg


def test_world_not_divisible_by_ulysses_suggests_another_ulysses():
    with pytest.raises(USPConfigError) as e:
        dims(4, ulysses=3)
    msg = str(e.value)
    assert "[]" not in msg and "--ulysses-degree could be one of [1, 2, 4]" in msg


@pytest.mark.parametrize("flag,kw", [
    ("--ulysses-degree", dict(ulysses=0)),
    ("--ring-degree", dict(ring=-1)),
    ("--tensor-model-parallel-size", dict(tp=0)),
])
def test_degrees_must_be_positive(flag, kw):
    with pytest.raises(USPConfigError, match=flag):
        dims(4, **kw)


def _first(d, *a, **kw):
    found = d.violations(*a, **kw)
    assert found, "expected a violation"
    return found[0]


def test_heads_not_divisible_by_ulysses_lists_valid_values():
    v = _first(dims(8, ulysses=4, tp=2), heads(12))
    assert v.rule == "ulysses-heads"
    assert "--ulysses-degree 4" in v.message and "[1, 2, 3, 6]" in v.message
    with pytest.raises(USPConfigError, match="--ulysses-degree 4"):
        dims(8, ulysses=4, tp=2).check(heads(12))


def test_heads_not_divisible_by_tp():
    assert "--tensor-model-parallel-size" in _first(dims(4, tp=4), heads(6)).message


def test_kv_heads_fewer_than_ulysses_allowed_when_they_divide():
    # Llama-3-8B: 32 heads, 8 KV groups, TP 2 -> 4 KV heads per TP rank, U 8 replicates.
    assert dims(16, tp=2, ulysses=8).violations(heads(32, 8)) == []
    assert dims(16, tp=2, ulysses=8).kv_heads_into_all_to_all(8) == 8
    assert dims(4, ulysses=4).violations(heads(8, 1)) == []     # MQA


def test_kv_heads_and_ulysses_must_divide_each_other():
    v = _first(dims(4, ulysses=4), heads(24, 6))
    assert v.rule == "ulysses-kv-heads"
    assert "--ulysses-degree" in v.message and "KV heads" in v.message


def test_seq_length_divisible_by_2UR():
    v = _first(dims(4, ulysses=2, ring=2), seq_length=100)
    assert v.rule == "seq-divisible"
    assert "--seq-length=100" in v.message and "8" in v.message and "96 or 104" in v.message
    assert dims(4, ulysses=2, ring=2).violations(seq_length=104) == []


def test_sequence_parallel_split():
    d = dims(8, tp=4, ulysses=2)
    assert d.violations(seq_length=20) == []
    v = _first(d, seq_length=20, sequence_parallel=True)
    assert v.rule == "sequence-parallel" and "--sequence-parallel" in v.message


def test_layers_and_batch():
    d = dims(8, pp=2, ulysses=2)          # DP 2
    assert _first(d, heads(8, num_layers=3)).rule == "pp-layers"
    v = _first(d, micro_batch_size=1, global_batch_size=3)
    assert v.rule == "batch" and "--global-batch-size 2 or 4" in v.message
    assert d.violations(heads(8, num_layers=4), micro_batch_size=1,
                        global_batch_size=4) == []


def test_conflicting_context_parallel_size():
    with pytest.raises(USPConfigError) as e:
        ParallelDims.from_flags(4, ulysses_degree=2, ring_degree=2, context_parallel_size=2)
    msg = str(e.value)
    assert "--context-parallel-size=2" in msg and "--context-parallel-size 4" in msg
    ParallelDims.from_flags(4, ulysses_degree=2, ring_degree=2, context_parallel_size=4)


def test_num_query_groups_must_divide_heads():
    assert "--num-query-groups" in _first(dims(), heads(8, 3)).message


def test_megatron_kwargs_and_short():
    d = dims(16, tp=2, ulysses=2, ring=2, pp=2)
    assert d.megatron_kwargs() == {"tensor_model_parallel_size": 2,
                                   "pipeline_model_parallel_size": 2,
                                   "context_parallel_size": 4,
                                   "hierarchical_context_parallel_sizes": [2, 2]}
    assert d.short() == "TP2 U2 R2 DP1 PP2"


def test_world_no_single_degree_fits_suggests_pairs():
    # Neither R alone (with U 4) nor U alone (with R 4) tiles 6 ranks: name U x R pairs that do.
    with pytest.raises(USPConfigError) as e:
        dims(6, ulysses=4, ring=4)
    msg = str(e.value)
    assert "[]" not in msg and "no degree fits" not in msg
    assert "--ulysses-degree 2 --ring-degree 3" in msg and "(e.g. 16)" in msg
