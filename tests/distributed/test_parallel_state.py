"""Live groups built through megatron-core equal the pure rank lists of ParallelDims."""

import pytest
import torch.distributed as dist

from megatron.usp.parallel_dims import ParallelDims, USPConfigError, group_containing

LAYOUTS = {
    "U2": (2, dict(ulysses_degree=2)),
    "R2": (2, dict(ring_degree=2)),
    "U2xR2": (4, dict(ulysses_degree=2, ring_degree=2)),
    "TP2xU2": (4, dict(tensor_model_parallel_size=2, ulysses_degree=2)),
    "U2xR2xDP2": (8, dict(ulysses_degree=2, ring_degree=2)),
    "U4xR2": (8, dict(ulysses_degree=4, ring_degree=2)),
    "TP2xU2xR2": (8, dict(tensor_model_parallel_size=2, ulysses_degree=2, ring_degree=2)),
    "TP2xR2xPP2": (8, dict(tensor_model_parallel_size=2, ring_degree=2,
                           pipeline_model_parallel_size=2)),
}


def _check_live_groups(rank, world, kwargs):
    from megatron.core import parallel_state as mpu  # megatron-core on first use

    from megatron.usp import parallel_state as usp_ps  # megatron-core on first use

    groups = usp_ps.initialize_usp_parallel(
        ParallelDims.from_flags(dist.get_world_size(), **kwargs), create_gloo_process_groups=False)
    expected = groups.dims.all_groups()

    def ranks(g):
        return dist.get_process_group_ranks(g)

    for name, live in [("tp", groups.tp), ("ulysses", groups.ulysses), ("ring", groups.ring),
                       ("cp", groups.cp), ("dp", groups.dp), ("dp_cp", groups.dp_cp),
                       ("pp", groups.pp)]:
        assert ranks(live) == group_containing(expected[name], rank), name
    assert ranks(mpu.get_model_parallel_group()) == group_containing(
        expected["model_parallel"], rank)
    assert ranks(mpu.get_tensor_and_context_parallel_group()) == group_containing(
        expected["tp_cp"], rank)
    emb = [g for g in expected["embedding"] if rank in g]
    if emb:
        assert ranks(mpu.get_embedding_group()) == emb[0]
    # Getters and the ProcessGroupCollection handed to the model agree.
    assert usp_ps.get_ulysses_world_size() == kwargs.get("ulysses_degree", 1)
    assert usp_ps.get_ring_world_size() == kwargs.get("ring_degree", 1)
    assert usp_ps.get_ulysses_group() is groups.ulysses
    assert list(groups.pg_collection.hcp) == [groups.ulysses, groups.ring]
    assert groups.cp_rank == groups.ulysses_rank + groups.ulysses_size * groups.ring_rank
    # megatron-core's own view agrees with ours.
    assert mpu.get_context_parallel_world_size() == groups.dims.cp
    assert mpu.get_data_parallel_world_size() == groups.dims.dp


def _check_layouts(rank, world, names):
    from megatron.usp.parallel_state import destroy_usp_parallel  # megatron-core on first use

    for name in names:
        _check_live_groups(rank, world, LAYOUTS[name][1])
        destroy_usp_parallel()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_live_groups_equal_pure_lists(dist_run, world):
    # One launch per world size; each layout is built, checked and torn down in turn.
    names = [n for n, (w, _) in LAYOUTS.items() if w == world]
    assert names
    dist_run(_check_layouts, world, names)


def _bad_layout(rank, world):
    from megatron.usp.parallel_state import initialize_usp_parallel  # megatron-core on first use

    try:
        initialize_usp_parallel(ParallelDims(world, ulysses=3))
    except USPConfigError as exc:
        assert "--ulysses-degree 3" in str(exc)
    else:
        raise AssertionError("a world of 4 with U=3 must be rejected before any group exists")


def test_bad_layout_fails_on_every_rank_without_hanging(dist_run):
    dist_run(_bad_layout, 4, timeout=60)
