"""Packed-document metadata is built once per micro-batch, and kernels are chosen alike.

U2xR2 on 4 gloo ranks and DP4 (U = R = 1, the in-place path), the tiny model of
``test_training_parity.py`` with the three document flags, 2 steps of 2 micro-batches per rank:

* every rank builds one document ring plan per micro-batch (not per layer, not again for the
  backward or the recompute), its blocks once each, and (U = R = 1) one in-place plan per
  block, reused by both layers; ``auto`` decides each block's kernel once;
* the cost table ``auto`` prices with comes to all 4 ranks of U2xR2 from one of them, once
  (the CPU's table with a dearer masked product, :data:`MASKED_CALL_S`, so that both
  ``tiles`` and ``math`` are chosen);
  every kernel a ring rank chose is the one a single process (the test's own, after the run)
  chooses for the same blocks, rebuilt from the same segment ids, with the same table; the
  two Ulysses ranks of a ring rank chose alike; the in-place plans are the ones a single
  process builds from the same document lengths;
* with noisy per-rank timings standing in for a GPU's, the ranks of a group still hold one
  table (the first rank's, measured there only) and so choose one kernel per block.
"""

from __future__ import annotations

import pickle

import pytest
import torch.distributed as dist

from tests.distributed.test_training_parity import MODEL
from tests.harness import run_on_ranks

STEPS, MICRO = 2, 2
DOCS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
TRAINING = ["--global-batch-size", "8", "--train-iters", str(STEPS), "--lr", "1e-3",
            "--seed", "1234", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
            "--device", "cpu"] + DOCS
LAYOUTS = {"u2r2": ["--ulysses-degree", "2", "--ring-degree", "2", "--micro-batch-size", "4"],
           "dp4": ["--micro-batch-size", "1"]}
# U2xR2 prices its blocks with the CPU's table but a dearer masked product, so that blocks of
# few tile groups are tiled and blocks of many masked: both kernels are chosen.
MASKED_CALL_S = 0.03


def ring_table(cpu_costs):
    costs = cpu_costs()
    costs.masked_call_s = MASKED_CALL_S
    return costs


def _count_builds(rank, world_size, layout, out_dir):
    # the training stack loads in the ranks only, so collecting this file stays light
    import megatron.training.data.batch as batch_mod
    import megatron.usp.document_choice as dc
    import megatron.usp.document_ring as dr
    import megatron.usp.packed_documents as pd
    from megatron.training.cli.arguments import parse_args
    from megatron.training.loop import pretrain

    counts = {"plans": 0, "blocks": 0, "packed": 0, "tables": 0}
    plans, decisions, packed, table_groups = [], [], [], []
    where = {}                                     # id(block) -> (plan index, source rank)
    real = (dr.build_document_ring_plan, dr.build_document_block, pd.build_packed_plan,
            dc.choose_block_kernel, pd.agreed_costs)

    def plan(segments, ring_rank, ring_size, assignment, causal=True, device=None):
        counts["plans"] += 1
        result = real[0](segments, ring_rank, ring_size, assignment, causal, device)
        plans.append((segments.copy(), ring_rank, ring_size, assignment, causal))
        for j, blk in enumerate(result.blocks):
            if blk is not None:
                where[id(blk)] = (len(plans) - 1, j)
        return result

    def block(*a, **k):
        counts["blocks"] += 1
        return real[1](*a, **k)

    def packed_plan(lengths, causal, costs, device=None, window=None):
        counts["packed"] += 1
        result = real[2](lengths, causal, costs, device, window)
        packed.append(([list(r) for r in lengths], causal, result.segments))
        return result

    def choose(blk, costs, candidates):
        state = pd.costs_state(costs)
        name = real[3](blk, costs, candidates)
        decisions.append((where[id(blk)], state, tuple(candidates), name))
        return name

    def agreed(measure, group):
        counts["tables"] += 1
        table_groups.append(None if group is None else dist.get_process_group_ranks(group))
        return real[4](measure, group)

    dr.build_document_ring_plan, dr.build_document_block = plan, block
    batch_mod.build_document_ring_plan = plan             # get_batch's own reference
    pd.build_packed_plan, dc.choose_block_kernel, pd.agreed_costs = packed_plan, choose, agreed
    real_cpu_costs = pd.cpu_costs
    if layout == "u2r2":
        pd.cpu_costs = lambda: ring_table(real_cpu_costs)
    pd._COSTS.clear()                                     # this run's tables, not a test's
    try:
        pretrain(parse_args(MODEL + TRAINING + LAYOUTS[layout]))
    finally:
        dr.build_document_ring_plan, dr.build_document_block = real[0], real[1]
        batch_mod.build_document_ring_plan = real[0]
        pd.build_packed_plan, dc.choose_block_kernel, pd.agreed_costs = real[2:]
        pd.cpu_costs = real_cpu_costs
    micro_batches = STEPS * MICRO
    assert counts["plans"] == micro_batches, (rank, counts)
    if layout == "u2r2":
        # at most one block per source ring rank and micro-batch, none rebuilt, each decided
        # once for both layers and the backward
        assert micro_batches <= counts["blocks"] <= 2 * micro_batches, (rank, counts)
        assert len(decisions) == counts["blocks"], (rank, counts, len(decisions))
        assert counts["tables"] == 1 and table_groups == [[0, 1, 2, 3]], table_groups
        with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
            pickle.dump({"plans": plans, "decisions": decisions}, f)
    else:
        assert counts["blocks"] == micro_batches, (rank, counts)
        assert counts["packed"] == micro_batches, (rank, counts)   # reused by both layers
        from megatron.usp.packed_documents import build_packed_plan, cpu_costs

        for lengths, causal, segments in packed:
            assert build_packed_plan(lengths, causal, cpu_costs()).segments == segments


def _replayed(record):
    """The kernels one process chooses for the recorded rank's blocks, rebuilt from the same
    segment ids, with a fresh copy of the table that rank priced them with."""
    # loaded where used, as in the ranks
    from megatron.usp.document_choice import choose_block_kernel
    from megatron.usp.document_ring import build_document_ring_plan
    from megatron.usp.packed_documents import costs_from_state

    plans = [build_document_ring_plan(*p) for p in record["plans"]]
    costs = costs_from_state(record["decisions"][0][1])
    return [choose_block_kernel(plans[i].blocks[j], costs, candidates)
            for (i, j), _, candidates, _ in record["decisions"]]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_document_metadata_is_built_once_per_micro_batch(layout, tmp_path):
    run_on_ranks(_count_builds, 4, layout, str(tmp_path), timeout=600)
    if layout != "u2r2":
        return
    from megatron.usp.packed_documents import costs_state, cpu_costs  # as in the ranks

    records = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(4)]
    by_ring_rank = {}
    for rec in records:
        table = costs_state(ring_table(cpu_costs))
        assert {state == table for _, state, _, _ in rec["decisions"]} == {True}
        assert _replayed(rec) == [name for *_, name in rec["decisions"]]
        ring_rank = rec["plans"][0][1]
        by_ring_rank.setdefault(ring_rank, []).append([name for *_, name in rec["decisions"]])
    assert sorted(by_ring_rank) == [0, 1]
    for peers in by_ring_rank.values():                  # the two Ulysses ranks of each
        assert len(peers) == 2 and peers[0] == peers[1]
    chosen = {name for rec in records for *_, name in rec["decisions"]}
    assert chosen == {"tiles", "math"}, chosen


# --------------------------------------------------------------------------- noisy timings
def _agree_on_noisy_tables(rank, world_size, out_dir):
    # loaded in the ranks only, as above
    from megatron.usp.document_choice import BLOCK_KERNELS, choose_block_kernel
    from megatron.usp.packed_documents import agreed_costs, costs_state
    from tests.unit.test_document_choice import blocks_of, gpu_like, mix_segments

    measured = []

    def measure():                  # rank-dependent timings: varlen 10x dearer per rank
        measured.append(rank)
        return gpu_like(build_s=0.0, varlen_scale=10.0 ** (rank - 1.5))

    pair = [dist.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
    blocks = blocks_of(mix_segments("lognormal", 32 * 1024), 2)
    local = [choose_block_kernel(b, measure(), BLOCK_KERNELS) for b in blocks]
    measured.clear()
    world = agreed_costs(measure, dist.group.WORLD)
    assert measured == ([0] if rank == 0 else [])
    measured.clear()
    in_pair = agreed_costs(measure, pair)
    assert measured == ([0] if rank == 0 else [2] if rank == 2 else [])
    with open(f"{out_dir}/noisy{rank}.pkl", "wb") as f:
        pickle.dump({"local": local, "world": costs_state(world), "pair": costs_state(in_pair),
                     "first": costs_state(gpu_like(build_s=0.0, varlen_scale=10.0 ** (
                         (rank // 2) * 2 - 1.5))),
                     "chosen": [choose_block_kernel(b, world, BLOCK_KERNELS) for b in blocks]},
                    f)


def test_noisy_timings_still_give_one_table_and_one_choice(tmp_path):
    run_on_ranks(_agree_on_noisy_tables, 4, str(tmp_path), timeout=300)
    got = [pickle.loads((tmp_path / f"noisy{r}.pkl").read_bytes()) for r in range(4)]
    assert len({tuple(g["local"]) for g in got}) > 1, "the local tables should disagree"
    assert all(g["world"] == got[0]["world"] == got[0]["first"] for g in got)
    assert all(g["pair"] == g["first"] for g in got)
    assert all(g["chosen"] == got[0]["chosen"] for g in got)
