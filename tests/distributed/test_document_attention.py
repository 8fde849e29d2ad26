"""Document-masked USP attention on gloo ranks equals single-device document attention.

Every rank draws the same full-sequence float64 q, k, v, output gradient and document
boundaries (same seed), keeps its tokens under the case's chunk assignment
(``token_order.shard_for_cp_rank``), builds its ring rank's plan from the full segment ids
(``document_ring.build_document_ring_plan``, what ``get_batch`` does) and runs USP attention
forward and backward. The reference is attention on the whole sequence with a dense document
mask written here (same segment and, causally, key position <= query position), plain autograd
ops in float64, independent of megatron.usp. Tolerance 1e-10 (float64).

Cases per layout (U x R in 1x2, 2x1, 2x2, 1x4, 4x1, 2x4): MHA, GQA and MQA (K/V replicated when
KV heads < U); documents with random boundaries (1-token documents included), documents
shorter than a chunk, documents crossing every rank, one document over the whole sequence, all
1-token documents, and documents that never cross a ring rank; the zigzag order, the
balanced assignment of :func:`megatron.usp.load_balance.balance_chunks` and a random one; the
``tiles`` kernel (PyTorch's CPU kernel per tile group) and ``math``; batch 2 with different
documents per sample; one case through megatron-core's module (``USPAttention`` with
``DocumentParams``).

Communication is counted: the all-to-alls are those of plain USP; the ring sends and receives
exactly the messages a dense count written here asks for: to each ring rank, the keys of this
rank that some query there sees (K/V forward and backward, dK/dV shares back), none at all when
no document crosses a ring rank, and on some case of every ring less than the whole block.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.usp import load_balance, token_order
from megatron.usp.attention import resolve_overlap_chunks, usp_attention
from megatron.usp.document_ring import build_document_ring_plan
from megatron.usp.parallel_dims import ParallelDims
from megatron.usp.parallel_state import destroy_usp_parallel, initialize_usp_parallel
from tests.distributed.test_usp_attention import CommCounter
from tests.helpers import attention_config

TOL = dict(atol=1e-10, rtol=1e-10)
NUM_HEADS = 8
HEAD_DIM = 8
LAYOUTS = {2: [(1, 2), (2, 1)], 4: [(2, 2), (1, 4), (4, 1)], 8: [(2, 4)]}
PATTERNS = ("random", "short", "crossing", "whole", "ones", "local")


# --------------------------------------------------------------------------- documents
def _lengths_to_segments(lengths, seq_len):
    seg = np.repeat(np.arange(len(lengths)), lengths)
    assert seg.size == seq_len
    return seg


def _cut(rng, seq_len, n_cuts, include_ones=True):
    cuts = set(rng.choice(np.arange(1, seq_len), size=min(n_cuts, seq_len - 1),
                          replace=False).tolist())
    if include_ones:                      # a few 1-token documents
        for c in rng.choice(np.arange(1, seq_len - 1), size=3, replace=False):
            cuts.update({int(c), int(c) + 1})
    bounds = [0] + sorted(cuts) + [seq_len]
    return np.diff(bounds)


def document_segments(pattern, seq_len, cp, ring, rng):
    """Segment ids [S] of one sample for a named boundary pattern."""
    chunk = seq_len // (2 * cp)
    if pattern == "random":
        lengths = _cut(rng, seq_len, int(rng.integers(2, 8)))
    elif pattern == "short":         # every document shorter than a chunk
        lengths, left = [], seq_len
        while left:
            n = min(left, int(rng.integers(1, max(2, chunk))))
            lengths.append(n)
            left -= n
    elif pattern == "crossing":      # documents longer than S/R: each crosses every rank
        a = int(rng.integers(1, seq_len // 4))
        lengths = [a, seq_len - a] if ring > 1 else [seq_len]
    elif pattern == "whole":
        lengths = [seq_len]
    elif pattern == "ones":
        lengths = [1] * seq_len
    elif pattern == "local":         # documents inside zigzag super-chunks of S/(2R)
        sup = seq_len // (2 * ring)
        lengths = []
        for _ in range(2 * ring):
            lengths.extend(_cut(rng, sup, 2, include_ones=False) if sup > 2 else [sup])
    else:
        raise ValueError(pattern)
    return _lengths_to_segments(lengths, seq_len)


def reference_document_attention(q, k, v, seg, causal=True):
    """Whole-sequence document attention on [S, b, h, d] / [S, b, hk, d]; seg [b, S]."""
    seq, _, h, d = q.shape
    g = h // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)
    visible = seg[:, :, None] == seg[:, None, :]                 # [b, S, S]
    if causal:
        pos = torch.arange(seq)
        visible = visible & (pos[None, :] <= pos[:, None])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", torch.softmax(scores, dim=-1), v)


def random_assignment(ulysses, ring, group_chunks, rng):
    n = 2 * ulysses * ring * group_chunks
    perm = rng.permutation(n).reshape(ring, -1)
    return token_order.ChunkAssignment(ulysses, tuple(tuple(sorted(row.tolist())) for row in perm))


# --------------------------------------------------------------------------- one case
def ring_rank_tokens(seq_len, ulysses, ring, assignment):
    """Global positions held by each ring rank after the Ulysses all-to-all: the union of its
    Ulysses peers' shards (the sharding the inputs go through)."""
    cp, everything = ulysses * ring, torch.arange(seq_len)
    return [np.concatenate([token_order.shard_for_cp_rank(
        everything, 0, token_order.cp_rank_of(u, j, ulysses), cp, assignment).numpy()
        for u in range(ulysses)]) for j in range(ring)]


def keys_needed(seg, q_positions, k_positions, causal=True):
    """Keys at ``k_positions`` some query at ``q_positions`` sees, by the dense mask: same
    segment in some sample and, causally, key position <= query position."""
    visible = seg[:, q_positions][:, :, None] == seg[:, k_positions][:, None, :]   # [b, q, k]
    if causal:
        visible &= k_positions[None, None, :] <= q_positions[None, :, None]
    return int(visible.any(axis=(0, 1)).sum())


def expected_p2p(seg, held, ring_rank, numel_per_token, dtype, chunks):
    """The ring messages one rank issues in one forward + backward (per head chunk): to each
    rank that needs some of its keys, those keys (K/V, forward and backward) and their dK/dV
    share back; from each rank it needs, the same the other way."""
    R = len(held)
    out = [keys_needed(seg, held[(ring_rank + i) % R], held[ring_rank]) for i in range(1, R)]
    into = [keys_needed(seg, held[ring_rank], held[(ring_rank - i) % R]) for i in range(1, R)]
    msgs = []
    for n in filter(None, out):    # K/V out forward and backward, their dK/dV share back
        msgs += [("isend", n * numel_per_token, dtype)] * 2 + [("irecv", n * numel_per_token,
                                                                dtype)]
    for n in filter(None, into):   # K/V in forward and backward, our dK/dV share home
        msgs += [("irecv", n * numel_per_token, dtype)] * 2 + [("isend", n * numel_per_token,
                                                                dtype)]
    return Counter(msgs * chunks), sum(out), sum(n > 0 for n in out)


def run_case(groups, case, seq_len, batch=2):
    U, R, cp = groups.dims.ulysses, groups.dims.ring, groups.dims.cp
    hk = case["kv_heads"]
    rng = np.random.default_rng(case["seed"])
    seg = np.stack([document_segments(p, seq_len, cp, R, rng) for p in case["patterns"]])
    if case["assignment"] == "balanced":
        assignment = load_balance.balance_chunks(seg, U, R).assignment
    elif case["assignment"] == "random":
        assignment = random_assignment(U, R, 2, rng)
    else:
        assignment = None
    gen = torch.Generator().manual_seed(case["seed"])

    def rand(h):
        return torch.randn(seq_len, batch, h, HEAD_DIM, generator=gen, dtype=torch.float64)

    q, k, v, dout = rand(NUM_HEADS), rand(hk), rand(hk), rand(NUM_HEADS)
    q_ref, k_ref, v_ref = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref = reference_document_attention(q_ref, k_ref, v_ref, torch.as_tensor(seg))
    out_ref.backward(dout)

    def mine(x):
        return token_order.shard_for_cp_rank(x, 0, groups.cp_rank, cp, assignment)

    plan = build_document_ring_plan(seg, groups.ring_rank, R, assignment)
    q_l, k_l, v_l = (mine(t).clone().requires_grad_() for t in (q, k, v))
    with CommCounter() as comm:
        if case.get("via_module"):
            out_l = _module_call(groups, hk, q_l, k_l, v_l, plan, case["kernel"])
        else:
            out_l = usp_attention(q_l, k_l, v_l, ulysses_group=groups.ulysses,
                                  ring_group=groups.ring, causal=True, documents=plan,
                                  document_kernel=case["kernel"])
        out_l.backward(mine(dout))
    for name, got, want in (("out", out_l, mine(out_ref.detach())), ("dq", q_l.grad,
                            mine(q_ref.grad)), ("dk", k_l.grad, mine(k_ref.grad)),
                            ("dv", v_l.grad, mine(v_ref.grad))):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")

    chunks = resolve_overlap_chunks(NUM_HEADS, hk, U, R)
    hk_sent = max(hk, U)
    per_token = 2 * batch * (hk_sent // U) * HEAD_DIM // chunks
    held = ring_rank_tokens(seq_len, U, R, assignment)
    want, sent, blocks = expected_p2p(seg, held, groups.ring_rank, per_token, torch.float64,
                                      chunks)
    got = Counter(m for call in comm.p2p for m in call)
    assert got == want, (got, want, plan.needs)
    assert sent == plan.kv_tokens_sent() <= blocks * seq_len // R
    if "local" in case["patterns"] and len(set(case["patterns"])) == 1 and assignment is None:
        assert comm.p2p == [] and plan.kv_messages() == 0      # no document crosses a ring rank
    if U == 1:
        assert comm.a2a == []
    else:
        assert len(comm.a2a) == 4 * chunks + (chunks if R > 1 else 0)
    return plan


def _module_call(groups, hk, q, k, v, plan, kernel):
    from megatron.core.transformer.enums import AttnMaskType  # megatron-core on first use

    from megatron.usp.core_attention import (  # megatron-core on first use
        DocumentParams,
        USPAttention,
    )

    config = attention_config(NUM_HEADS, HEAD_DIM, hk, groups.dims)
    module = USPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                          pg_collection=groups.pg_collection, document_kernel=kernel)
    params = DocumentParams.for_plan(plan)
    return module(q, k, v, None, packed_seq_params=params).view(q.shape)


def cases_for(ulysses, ring):
    kv_choices = [h for h in (NUM_HEADS, 2, 1) if h % ulysses == 0 or ulysses % h == 0]
    cases = []
    pairs = [("random", "short"), ("crossing", "whole"), ("ones", "random"), ("local", "local"),
             ("short", "crossing")]
    assignments = ("zigzag", "balanced", "random", "zigzag", "balanced")
    for i, (patterns, assignment) in enumerate(zip(pairs, assignments)):
        cases.append(dict(patterns=patterns, assignment=assignment,
                          kv_heads=kv_choices[i % len(kv_choices)],
                          kernel="math" if i == 2 else "tiles", seed=100 * ulysses + 10 * ring + i,
                          via_module=(i == 4)))
    return cases


def _all_layouts(rank, world_size, layouts):
    for ulysses, ring in layouts:
        groups = initialize_usp_parallel(ParallelDims(dist.get_world_size(), ulysses=ulysses,
                                                      ring=ring))
        seq_len = 2 * ulysses * ring * 16 if ulysses * ring < 8 else 128
        skipped = trimmed = 0
        for case in cases_for(ulysses, ring):
            try:
                plan = run_case(groups, case, seq_len)
            except AssertionError as exc:
                raise AssertionError(f"U={ulysses} R={ring} {case}: {exc}") from None
            skipped += plan.skipped_kv_messages()
            trimmed += plan.ranks_needing_me * seq_len // ring - plan.kv_tokens_sent()
        if ring > 1:
            assert skipped > 0, "no case skipped a ring block"
            assert trimmed > 0, "no case sent less than the whole block it was asked for"
        destroy_usp_parallel()


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_document_attention_matches_single_device(dist_run, world_size):
    dist_run(_all_layouts, world_size, LAYOUTS[world_size], timeout=400)


def test_case_matrix_covers_the_issue():
    seen = set()
    for layouts in LAYOUTS.values():
        for u, r in layouts:
            for case in cases_for(u, r):
                seen.update(case["patterns"])
                seen.add(case["assignment"])
                seen.add(case["kernel"])
                hk = case["kv_heads"]
                seen.add("mha" if hk == NUM_HEADS else "mqa" if hk == 1 else "gqa")
                if case["via_module"]:
                    seen.add("module")
    assert set(PATTERNS) <= seen
    assert {"zigzag", "balanced", "random", "tiles", "math", "mha", "gqa", "mqa",
            "module"} <= seen
    assert {lay for ls in LAYOUTS.values() for lay in ls} == {
        (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4)}
