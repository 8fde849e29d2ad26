"""Packed-document metadata is built once per micro-batch, and kernels are chosen alike.

U2xR2 on 4 gloo ranks and DP4 (U = R = 1, the in-place path), the tiny model of
``test_training_parity.py`` with the three document flags, 2 steps of 2 micro-batches per rank:

* every rank builds one document ring plan per micro-batch (not per layer, not again for the
  backward or the recompute), its blocks once each, and (U = R = 1) one in-place plan per
  block, reused by both layers;
* every block kernel chosen by ``--document-attention-kernel auto`` on a ring rank is the one a
  single process chooses for the same block (the choice depends on the block alone), and the
  in-place plans are the ones a single process builds from the same document lengths.
"""

from __future__ import annotations

import pytest

from tests.distributed.test_training_parity import MODEL
from tests.harness import run_on_ranks

STEPS, MICRO = 2, 2
DOCS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
TRAINING = ["--global-batch-size", "8", "--train-iters", str(STEPS), "--lr", "1e-3",
            "--seed", "1234", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
            "--device", "cpu"] + DOCS
LAYOUTS = {"u2r2": ["--ulysses-degree", "2", "--ring-degree", "2", "--micro-batch-size", "4"],
           "dp4": ["--micro-batch-size", "1"]}


def _count_builds(rank, world_size, layout):
    import megatron.training.data.batch as batch_mod
    import megatron.usp.document_kernels as dk
    import megatron.usp.document_ring as dr
    import megatron.usp.packed_documents as pd
    from megatron.training.cli.arguments import parse_args
    from megatron.training.loop import pretrain

    counts = {"plans": 0, "blocks": 0, "packed": 0}
    chosen, packed = [], []
    real_plan, real_block, real_packed = (dr.build_document_ring_plan, dr.build_document_block,
                                          pd.build_packed_plan)
    real_choose = dk.AutoDocumentKernel.choose

    def plan(*a, **k):
        counts["plans"] += 1
        return real_plan(*a, **k)

    def block(*a, **k):
        counts["blocks"] += 1
        return real_block(*a, **k)

    def packed_plan(lengths, causal, costs, device=None):
        counts["packed"] += 1
        result = real_packed(lengths, causal, costs, device)
        packed.append(([list(r) for r in lengths], causal, result.segments))
        return result

    def choose(self, q, blk):
        kernel = real_choose(self, q, blk)
        chosen.append((blk, q.shape, q.dtype, kernel.name))
        return kernel

    dr.build_document_ring_plan, dr.build_document_block = plan, block
    batch_mod.build_document_ring_plan = plan             # get_batch's own reference
    pd.build_packed_plan = packed_plan
    dk.AutoDocumentKernel.choose = choose
    try:
        pretrain(parse_args(MODEL + TRAINING + LAYOUTS[layout]))
    finally:
        dr.build_document_ring_plan, dr.build_document_block = real_plan, real_block
        batch_mod.build_document_ring_plan = real_plan
        pd.build_packed_plan = real_packed
        dk.AutoDocumentKernel.choose = real_choose
    micro_batches = STEPS * MICRO
    assert counts["plans"] == micro_batches, (rank, counts)
    if layout == "u2r2":
        # at most one block per source ring rank and micro-batch, and none rebuilt
        assert micro_batches <= counts["blocks"] <= 2 * micro_batches, (rank, counts)
        assert chosen, "the ring ranks' blocks go through the auto block kernel"
        import torch

        from megatron.usp.document_kernels import AutoDocumentKernel
        from megatron.usp.kernels import get_kernel

        fresh = AutoDocumentKernel(get_kernel("torch"))
        for blk, shape, dtype, name in chosen:
            assert fresh.choose(torch.empty(shape, dtype=dtype), blk).name == name
    else:
        assert counts["blocks"] == micro_batches, (rank, counts)
        assert counts["packed"] == micro_batches, (rank, counts)   # reused by both layers
        from megatron.usp.packed_documents import build_packed_plan, cpu_costs

        for lengths, causal, segments in packed:
            assert build_packed_plan(lengths, causal, cpu_costs()).segments == segments


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_document_metadata_is_built_once_per_micro_batch(layout):
    run_on_ranks(_count_builds, 4, layout, timeout=600)
