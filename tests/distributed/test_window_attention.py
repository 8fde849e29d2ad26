"""Sliding-window USP attention on gloo ranks equals single-device windowed attention.

Every rank draws the same full-sequence float64 q, k, v and output gradient (same seed), keeps
its tokens (``token_order.shard_for_cp_rank``) and runs USP attention with ``window = W``
forward and backward. The reference, written here and independent of megatron.usp, is a plain
masked softmax over the whole sequence in float64: query i sees key j iff ``i - W <= j <= i``
(and, with packed documents, the same document). Tolerance 1e-10.

Windows per layout, with ``c = S / (2R)`` the tokens of one zigzag chunk of a ring rank:
1, c - 1, c, c + 1 (the chunk boundary), 2c + 3 (reaching into several predecessors) and
S (>= the sequence: full causal attention); 128 in a longer sequence on U1 x R2. Layouts
U1xR2, U2xR1, U1xR3, U3xR1, U2xR2, U1xR4, U2xR4, U1xR8; MHA, GQA and MQA; without documents,
and with packed documents in the zigzag order and the balanced assignment.

The ring's bytes are counted (``RingComm.bytes_sent``) against the plan: each rank sends, in
one forward and backward, the K/V halo its successors need twice and the dK/dV shares of the
halos it received, and nothing else; on U1xR2 the bytes measured double from W = 64 to 128,
stay the same from S = 1024 to 2048, and are zero when documents keep every window inside a
ring rank. One case per layout where whole KV heads allow it pipelines two head chunks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.usp import load_balance, token_order
from megatron.usp.attention import make_schedule, usp_attention_with_schedule
from megatron.usp.document_ring import build_document_ring_plan
from megatron.usp.parallel_dims import ParallelDims
from megatron.usp.parallel_state import destroy_usp_parallel, initialize_usp_parallel

TOL = dict(atol=1e-10, rtol=1e-10)
NUM_HEADS = 6
HEAD_DIM = 4
BATCH = 2


def reference_window_attention(q, k, v, window, seg=None):
    """[S, b, h, d] / [S, b, hk, d] -> [S, b, h, d]; ``seg`` [b, S] or None."""
    seq, _, h, d = q.shape
    g = h // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    visible = ((j <= i) & (i - j <= window))[None].expand(q.shape[1], seq, seq)
    if seg is not None:
        visible = visible & (seg[:, :, None] == seg[:, None, :])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", torch.softmax(scores, dim=-1), v)


def _segments(rng, seq_len):
    cuts = sorted(rng.choice(np.arange(1, seq_len), size=4, replace=False).tolist())
    return np.repeat(np.arange(5), np.diff([0] + cuts + [seq_len]))


def expected_ring_bytes(plan, kv_per_token):
    """Bytes one rank sends in forward + backward: its halos out twice (K/V), the dK/dV
    shares of what it received."""
    received = sum(plan.recv_tokens(i) for i in range(1, plan.ring_size)
                   if plan.receives(i) and plan.blocks[plan.source(i)] is not None)
    return (2 * plan.kv_tokens_sent() + received) * kv_per_token


def run_case(groups, case, seq_len):
    U, R, cp = groups.dims.ulysses, groups.dims.ring, groups.dims.cp
    hk, window = case["kv_heads"], case["window"]
    rng = np.random.default_rng(case["seed"])
    seg = np.stack([_segments(rng, seq_len) for _ in range(BATCH)]) if case["docs"] else None
    assignment = None
    if case["docs"] == "balanced":
        assignment = load_balance.balance_chunks(seg, U, R).assignment
    gen = torch.Generator().manual_seed(case["seed"])

    def rand(h):
        return torch.randn(seq_len, BATCH, h, HEAD_DIM, generator=gen, dtype=torch.float64)

    q, k, v, dout = rand(NUM_HEADS), rand(hk), rand(hk), rand(NUM_HEADS)
    q_ref, k_ref, v_ref = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref = reference_window_attention(q_ref, k_ref, v_ref, window,
                                         None if seg is None else torch.as_tensor(seg))
    out_ref.backward(dout)

    def mine(x):
        return token_order.shard_for_cp_rank(x, 0, groups.cp_rank, cp, assignment)

    plan = None
    if seg is not None:
        plan = build_document_ring_plan(seg, groups.ring_rank, R, assignment)
    q_l, k_l, v_l = (mine(t).clone().requires_grad_() for t in (q, k, v))
    sched = make_schedule(q_l, k_l, ulysses_group=groups.ulysses, ring_group=groups.ring,
                          causal=True, softmax_scale=None, backend="torch",
                          overlap_chunks=case.get("chunks"),
                          documents=plan, document_kernel=case["kernel"], window=window)
    out_l = usp_attention_with_schedule(q_l, k_l, v_l, sched)
    out_l.backward(mine(dout))
    for name, got, want in (("out", out_l, mine(out_ref.detach())), ("dq", q_l.grad,
                            mine(q_ref.grad)), ("dk", k_l.grad, mine(k_ref.grad)),
                            ("dv", v_l.grad, mine(v_ref.grad))):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    if window >= seq_len - 1:
        assert sched.window is None          # a window over everything is full attention
        return
    assert sched.window == window
    if R > 1:
        hk_sent = max(hk, U)
        per_token = 2 * BATCH * (hk_sent // U) * HEAD_DIM * 8
        assert sched.ring.bytes_sent == expected_ring_bytes(sched.documents, per_token)


def cases_for(ulysses, ring, seq_len):
    chunk = seq_len // (2 * ring)
    kv_choices = [h for h in (NUM_HEADS, 2, 1) if h % ulysses == 0 or ulysses % h == 0]
    windows = [1, chunk - 1, chunk, chunk + 1, 2 * chunk + 3, seq_len]
    if seq_len > 128:
        windows.append(128)
    docs = [None, None, "zigzag", None, "balanced", None, "zigzag"]
    kernels = ["tiles", "math", "tiles", "auto", "math", "tiles", "tiles"]
    cases = [dict(window=max(1, w), kv_heads=kv_choices[i % len(kv_choices)],
                  docs=docs[i] if ring * ulysses > 1 else None, kernel=kernels[i],
                  seed=1000 * ulysses + 100 * ring + i)
             for i, w in enumerate(windows)]
    for case in cases:       # two head chunks pipelined where whole KV heads allow it
        if (case["kv_heads"] // ulysses) % 2 == 0 and case["kv_heads"] >= ulysses:
            case["chunks"] = 2
            break
    return cases


def _all_layouts(rank, world_size, layouts):
    for ulysses, ring, seq_len in layouts:
        groups = initialize_usp_parallel(ParallelDims(dist.get_world_size(), ulysses=ulysses,
                                                      ring=ring))
        for case in cases_for(ulysses, ring, seq_len):
            try:
                run_case(groups, case, seq_len)
            except AssertionError as exc:
                raise AssertionError(f"U={ulysses} R={ring} S={seq_len} {case}: {exc}") from None
        destroy_usp_parallel()


LAYOUTS = {
    2: [(1, 2, 256), (2, 1, 32)],
    3: [(1, 3, 48), (3, 1, 36)],
    4: [(2, 2, 64), (1, 4, 64)],
    8: [(2, 4, 64), (1, 8, 96)],
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_window_attention_matches_single_device(dist_run, world_size):
    dist_run(_all_layouts, world_size, LAYOUTS[world_size], timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 8])
def test_window_attention_matches_single_device_odd_and_eight(dist_run, world_size):
    dist_run(_all_layouts, world_size, LAYOUTS[world_size], timeout=600)


def test_case_matrix_covers_the_windows():
    seen = set()
    for world, layouts in LAYOUTS.items():
        for u, r, s in layouts:
            assert u * r == world and s % (2 * u * r) == 0 and NUM_HEADS % u == 0
            chunk = s // (2 * r)
            for case in cases_for(u, r, s):
                w = case["window"]
                seen.add("one" if w == 1 else "chunk" if abs(w - chunk) <= 1 else
                         "full" if w >= s - 1 else "128" if w == 128 else
                         "several" if w > chunk + 1 else "small")
                hk = case["kv_heads"]
                seen.add("mha" if hk == NUM_HEADS else "mqa" if hk == 1 else "gqa")
                seen.add(case["docs"])
                seen.add(("chunks", case.get("chunks", 1)))
    assert {"one", "chunk", "several", "full", "128", "mha", "gqa", "mqa", "zigzag",
            "balanced", None, ("chunks", 2)} <= seen


# --------------------------------------------------------------------------- bytes on the wire
def _ring_bytes(groups, seq_len, window, seg=None):
    """Bytes this rank's ring sends in one forward + backward at U1 x R2, float32."""
    gen = torch.Generator().manual_seed(seq_len + window)
    q, k, v = (torch.randn(seq_len, 1, 2, 8, generator=gen) for _ in range(3))
    plan = None if seg is None else build_document_ring_plan(seg, groups.ring_rank, 2, None)

    def mine(x):
        return token_order.shard_for_cp_rank(x, 0, groups.cp_rank, 2).clone().requires_grad_()

    q_l, k_l, v_l = mine(q), mine(k), mine(v)
    sched = make_schedule(q_l, k_l, ulysses_group=None, ring_group=groups.ring, causal=True,
                          softmax_scale=None, backend="torch", overlap_chunks=1,
                          documents=plan, document_kernel="auto", window=window)
    usp_attention_with_schedule(q_l, k_l, v_l, sched).sum().backward()
    return sched.ring.bytes_sent


def _measure_bytes(rank, world_size):
    groups = initialize_usp_parallel(ParallelDims(world_size, ulysses=1, ring=2))
    w64, w128 = _ring_bytes(groups, 1024, 64), _ring_bytes(groups, 1024, 128)
    assert w64 > 0 and w128 == 2 * w64, (w64, w128)             # bytes grow with W ...
    assert _ring_bytes(groups, 2048, 64) == w64                   # ... and not with S
    # Per rank: one halo of W tokens out twice (K/V forward and backward) and one dK/dV share
    # back, each 2 (K, V) x 1 x 2 heads x 8 dims x 4 bytes per token.
    assert w64 == 3 * 64 * 2 * 2 * 8 * 4
    chunks = np.repeat(np.arange(4), 256)[None]                   # documents = zigzag chunks
    assert _ring_bytes(groups, 1024, 64, chunks) == 0              # no window crosses a rank
    destroy_usp_parallel()


def test_ring_bytes_grow_with_the_window_not_the_sequence(dist_run):
    dist_run(_measure_bytes, 2, timeout=300)
