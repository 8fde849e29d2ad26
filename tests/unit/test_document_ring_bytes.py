"""Ring bytes of packed documents: the document ring sends a ring rank only the keys its
queries see, never more than the whole blocks it needs.

The document mixes of the attention bench (fixed length, lognormal, uniform) packed into
sequences of S tokens, in the zigzag order and the balanced chunk assignment, at a few
(S, R). The expected traffic is counted from the segment ids and each ring rank's chunks
alone (``tests.helpers.ring_tokens_needed``: a key at position p of ring rank j goes to ring
rank r iff r holds a position q >= p of p's document), independent of the plan's own search;
no process group. A
block on the halo's keys gives the whole block's numbers (bit for bit with the tile kernel).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.bench.document_bench import mix_lengths
from megatron.usp import load_balance as lb
from megatron.usp.document_kernels import (
    MathDocumentKernel,
    TileDocumentKernel,
    build_document_block,
)
from megatron.usp.document_ring import build_document_ring_plan, halo_matrix, ring_positions
from megatron.usp.kernels import get_kernel
from tests.helpers import ring_owners, ring_tokens_needed

CASES = [(8 * 1024, 2), (32 * 1024, 4), (16 * 1024, 8)]
MIXES = ("fixed:2k", "fixed:3000", "lognormal", "uniform:4k")


def _segments(mix, seq_len, batch=1, seed=1234):
    return lb.segments_from_lengths(mix_lengths(mix, seq_len * batch, seed), seq_len, batch)


def _assignment(seg, ring, kind):
    if kind == "zigzag":
        return None
    return lb.balance_chunks(seg, 1, ring).assignment


@pytest.mark.parametrize("seq_len,ring", CASES)
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("order", ("zigzag", "balanced"))
def test_sliced_bytes_equal_the_dense_count_and_never_exceed_whole_blocks(seq_len, ring, mix,
                                                                           order):
    seg = _segments(mix, seq_len)
    assignment = _assignment(seg, ring, order)
    plan = build_document_ring_plan(seg, 0, ring, assignment)
    n = ring_tokens_needed(seg, ring_owners(seq_len, ring, assignment), ring)
    whole = int((n > 0).sum()) * (seq_len // ring)
    assert plan.ring_kv_tokens() == int(n.sum()) <= whole
    assert plan.kv_messages() == int((n > 0).sum())
    assert plan.kv_tokens_sent() == int(n[:, 0].sum())       # what rank 0 sends its successors
    assert [plan.recv_tokens(i) for i in range(1, ring) if plan.receives(i)] == \
        [int(n[0, -i % ring]) for i in range(1, ring) if n[0, -i % ring]]


@pytest.mark.parametrize("mix", ("lognormal", "uniform:4k", "fixed:3000"))
def test_documents_crossing_ring_ranks_send_less_than_whole_blocks(mix):
    """Mixed or unaligned documents cross ring ranks but a rank needs only part of a block."""
    seq_len, ring = 32 * 1024, 4
    seg = _segments(mix, seq_len, batch=2)
    for order in ("zigzag", "balanced"):
        plan = build_document_ring_plan(seg, 0, ring, _assignment(seg, ring, order))
        assert 0 < plan.ring_kv_tokens() < plan.kv_messages() * seq_len // ring, order


def test_documents_that_tile_the_chunks_send_nothing():
    seg = _segments("fixed:2k", 32 * 1024)
    plan = build_document_ring_plan(seg, 1, 4, None)
    assert plan.ring_kv_tokens() == plan.kv_messages() == 0


def test_one_document_over_the_sequence_sends_three_quarters_of_the_whole_blocks():
    """Zigzag, one document: a later rank needs all of an earlier one's K/V (sent as it is, no
    gather) and an earlier rank only the later one's front chunk."""
    seq_len, ring = 64, 4
    for rank in range(ring):
        plan = build_document_ring_plan(np.zeros((1, seq_len), dtype=np.int64), rank, ring, None)
        assert plan.kv_messages() == ring * (ring - 1)
        assert 4 * plan.ring_kv_tokens() == 3 * plan.kv_messages() * seq_len // ring
        for step in range(1, ring):
            whole = plan.send_index(step, "cpu") is None
            assert whole == ((rank + step) % ring < rank), (rank, step)
            assert plan.send_tokens(step) == seq_len // ring // (1 if whole else 2)


# --------------------------------------------------------------------------- same numbers
def _sliced_and_whole(seg, ring, r, j, kernel, gen, batch=2, heads=2, dim=8):
    """(out, lse, dq, dk, dv) of ring rank r's queries on ring rank j's keys, from the whole
    block and from its halo (dk, dv of the halo's keys)."""
    pos = ring_positions(seg.shape[1], ring, None)
    idx = halo_matrix(seg, pos, None)[r][j]
    q_pos = np.broadcast_to(pos[r], (batch, pos[r].size))

    def block(keys):
        return build_document_block(q_pos, seg[:, pos[r]], np.broadcast_to(keys, (batch,
                                    keys.size)), seg[:, keys], True)

    q, dout = (torch.randn(batch, heads, pos[r].size, dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(batch, heads, pos[j].size, dim, generator=gen) for _ in range(2))
    results = []
    for keys, k_b, v_b in ((pos[j], k, v), (pos[j][idx], k[:, :, idx], v[:, :, idx])):
        blk = block(keys)
        out, lse = kernel.forward(q, k_b, v_b, blk, 0.3)
        dq, dk, dv = kernel.backward(dout, q, k_b, v_b, out, lse, blk, 0.3)
        results.append((out, lse, dq, dk, dv))
    (out, lse, dq, dk, dv), sliced = results
    return sliced, (out, lse, dq, dk[:, :, idx], dv[:, :, idx]), (dk, dv), idx


@pytest.mark.parametrize("kernel_name", ("tiles", "math"))
def test_a_halo_block_gives_the_whole_blocks_numbers(kernel_name):
    """The kernel on the halo's keys against the kernel on the whole block (float32): tiles
    computes the same tiles, so bit for bit; the dense masked product reduces over fewer
    masked columns, so to rounding. Keys outside the halo get no gradient."""
    kernel = (TileDocumentKernel(get_kernel("torch")) if kernel_name == "tiles"
              else MathDocumentKernel())
    rng, gen = np.random.default_rng(7), torch.Generator().manual_seed(7)
    seq_len, ring = 512, 4
    seg = np.stack([np.cumsum(rng.random(seq_len) < p) for p in (0.01, 0.03)])
    pos = ring_positions(seq_len, ring, None)
    halo = halo_matrix(seg, pos, None)
    partial = [(r, j) for r in range(ring) for j in range(ring)
               if r != j and halo[r][j] is not None and halo[r][j].size > 0]
    assert len(partial) >= 3
    for r, j in partial:
        sliced, whole, (dk_all, dv_all), idx = _sliced_and_whole(seg, ring, r, j, kernel, gen)
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), sliced, whole):
            if kernel_name == "tiles":
                assert torch.equal(got, want), (name, r, j)
            else:
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        outside = np.setdiff1d(np.arange(pos[j].size), idx)
        assert not dk_all[:, :, outside].any() and not dv_all[:, :, outside].any()
