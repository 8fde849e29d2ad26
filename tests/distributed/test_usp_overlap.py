"""Head-chunk pipelining of USP attention (``overlap_chunks``): exact, same volume, overlapped.

1. Exactness: for U x R in 2x1, 1x2 (world 2) and 2x2, 4x1 (world 4), MHA / GQA / MQA, causal
   and not, every valid ``overlap_chunks`` in {1, 2, 4}: float64 out, dq, dk, dv equal the
   single-device float64 reference (``reference_attention`` of test_usp_attention.py) to
   1e-10, like the unchunked test. One case per layout goes through ``USPAttention``.
2. Volume: the all-to-alls and ring exchanges are counted (``check_communication``): G
   messages of 1/G each, so the same total as G = 1; the ring's last dK/dV hop travels in the
   inputs' dtype (checked in bf16, where it differs from the float32 accumulator hops; the
   bf16 result is also compared with the float64 reference at bf16 accuracy).
3. Overlap: a log of collective starts / waits and kernel calls shows that every transfer
   meant to overlap a chunk's attention is started before that chunk's first kernel call and
   waited for after its last one (forward and backward; the ring's last dK/dV hop too).
4. Choosing G: :func:`resolve_overlap_chunks`'s auto rule and its errors (no processes).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.training.cpu_shims import apply_cpu_shims
from megatron.usp import token_order
from megatron.usp.attention import resolve_overlap_chunks, usp_attention
from megatron.usp.kernels import AttentionKernel, get_kernel
from megatron.usp.parallel_dims import ParallelDims
from megatron.usp.parallel_state import destroy_usp_parallel, initialize_usp_parallel
from megatron.usp.ulysses import head_chunk_choices
from tests.distributed.test_usp_attention import (
    TOL,
    CommCounter,
    check_communication,
    reference_attention,
)
from tests.helpers import attention_config, rel_err

NUM_HEADS, HEAD_DIM, BATCH = 16, 16, 2
KV_HEADS = (16, 8, 1)          # MHA, GQA, MQA
CHUNKS = (1, 2, 4)
LAYOUTS = {2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1)]}


def overlap_cases(ulysses: int):
    """Every valid (KV heads, G) with both masks; MQA (replicated K/V) only allows G = 1."""
    cases = []
    for hk in KV_HEADS:
        valid = head_chunk_choices(NUM_HEADS, hk, ulysses)
        for chunks in CHUNKS:
            if chunks in valid:
                cases += [dict(num_kv_heads=hk, chunks=chunks, causal=c) for c in (True, False)]
    return cases


def _inputs(seq_len, hk, seed):
    gen = torch.Generator().manual_seed(seed)

    def rand(h):
        return torch.randn(seq_len, BATCH, h, HEAD_DIM, generator=gen, dtype=torch.float64)

    return rand(NUM_HEADS), rand(hk), rand(hk), rand(NUM_HEADS)


def _module(groups, hk, chunks):
    from megatron.core.transformer.enums import AttnMaskType  # megatron-core on first use

    from megatron.usp.core_attention import USPAttention  # megatron-core on first use

    config = attention_config(NUM_HEADS, HEAD_DIM, hk, groups.dims)
    module = USPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                          pg_collection=groups.pg_collection, overlap_chunks=chunks)
    assert module.overlap_chunks == chunks
    return module


def _usp(groups, q, k, v, causal, chunks, backend="auto"):
    return usp_attention(q, k, v, ulysses_group=groups.ulysses, ring_group=groups.ring,
                         causal=causal, backend=backend, overlap_chunks=chunks)


def run_exact_case(groups, case, seq_len, via_module=False, dtype=torch.float64):
    """USP with ``case['chunks']`` head chunks vs the float64 whole-sequence reference."""
    hk, causal, chunks = case["num_kv_heads"], case["causal"], case["chunks"]
    q, k, v, dout = _inputs(seq_len, hk, seed=100 + hk + 3 * chunks + int(causal))
    if dtype != torch.float64:    # the reference sees the same (rounded) values
        q, k, v, dout = (t.to(dtype).double() for t in (q, k, v, dout))
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = reference_attention(*refs, causal)
    out_ref.backward(dout)

    def mine(x):
        return token_order.shard_for_cp_rank(x, 0, groups.cp_rank, groups.dims.cp)

    leaves = [mine(t).to(dtype).requires_grad_() for t in (q, k, v)]
    with CommCounter() as comm:
        if via_module:
            out = _module(groups, hk, chunks)(*leaves, None).view(leaves[0].shape)
        else:
            out = _usp(groups, *leaves, causal, chunks)
        out.backward(mine(dout).to(dtype))
    check_communication(comm, groups, leaves[0], leaves[1], chunks)
    results = [("out", out.detach(), out_ref.detach())] + [
        (n, leaf.grad, ref.grad) for n, leaf, ref in zip(("dq", "dk", "dv"), leaves, refs)]
    for name, got, want in results:
        assert got.dtype == dtype and got.shape == mine(want).shape, name
        if dtype == torch.float64:
            torch.testing.assert_close(got, mine(want), **TOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
        else:   # bf16 inputs: within bf16 accuracy of the float64 result
            assert rel_err(got, mine(want)) < 2e-2, (name, rel_err(got, mine(want)))


# --------------------------------------------------------------------------- overlap log
class _LoggedWork:
    """Wraps a collective's Work so that wait() is logged."""

    def __init__(self, work, log, tag):
        self._work, self._log, self._tag = work, log, tag

    def wait(self, *args, **kwargs):
        self._log.append(("wait",) + self._tag)
        return self._work.wait(*args, **kwargs)


class EventLog(AttentionKernel):
    """Both a kernel (logs each call, computes with the torch kernel) and, as a context
    manager, a recorder of collective starts and waits: one event list in issue order."""

    name = "logged"

    def __init__(self):
        self.events, self._inner = [], get_kernel("torch")
        self._counts = {"a2a": 0, "p2p": 0}

    def forward(self, q, k, v, causal, scale):
        self.events.append(("kernel", "fwd"))
        return self._inner.forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        self.events.append(("kernel", "bwd"))
        return self._inner.backward(dout, q, k, v, out, lse, causal, scale)

    def _tag(self, kind, size):
        tag = (kind, self._counts[kind], size)
        self._counts[kind] += 1
        self.events.append(("start",) + tag)
        return tag

    def __enter__(self):
        self._orig = (dist.all_to_all_single, dist.batch_isend_irecv)

        def a2a(out, inp, *args, **kwargs):
            work = self._orig[0](out, inp, *args, **kwargs)
            return _LoggedWork(work, self.events, self._tag("a2a", inp.numel()))

        def p2p(ops):
            works = self._orig[1](ops)
            tag = self._tag("p2p", ops[0].tensor.numel())
            return [_LoggedWork(w, self.events, tag) for w in works]

        dist.all_to_all_single, dist.batch_isend_irecv = a2a, p2p
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, dist.batch_isend_irecv = self._orig


def _kernel_span(events, phase, chunk, ring):
    """(first, last) event index of chunk ``chunk``'s R kernel calls in ``phase``."""
    idx = [i for i, e in enumerate(events) if e == ("kernel", phase)]
    calls = idx[chunk * ring:(chunk + 1) * ring]
    return calls[0], calls[-1]


def _transfer_span(events, tag):
    """(start index, first wait index) of the transfer with ``tag``."""
    start = events.index(("start",) + tag)
    return start, next(i for i, e in enumerate(events) if e == ("wait",) + tag)


def _assert_overlaps(events, tag, span, what):
    start, wait = _transfer_span(events, tag)
    assert start < span[0] and wait > span[1], (what, tag, start, wait, span)


def check_overlap_schedule(groups, chunks, seq_len):
    """Transfers of neighbouring chunks bracket each chunk's kernel calls (module docstring)."""
    U, R = groups.dims.ulysses, groups.dims.ring
    q, k, v, dout = _inputs(seq_len, NUM_HEADS, seed=7)
    leaves = [token_order.shard_for_cp_rank(t, 0, groups.cp_rank, groups.dims.cp).requires_grad_()
              for t in (q, k, v)]
    log = EventLog()
    with log:
        out = usp_attention(*leaves, ulysses_group=groups.ulysses, ring_group=groups.ring,
                            causal=True, backend=log, overlap_chunks=chunks)
        fwd_events = list(log.events)
        a2a_fwd, p2p_fwd = log._counts["a2a"], log._counts["p2p"]
        out.backward(token_order.shard_for_cp_rank(dout, 0, groups.cp_rank, groups.dims.cp))
    bwd_events = log.events[len(fwd_events):]
    s, b, h, d = leaves[0].shape
    qkv, o = s * b * 3 * h * d // chunks, s * b * h * d // chunks
    a2a = [e[1:] for e in log.events if e[0] == "start" and e[1] == "a2a"]
    inputs = [t for t in a2a if t[1] < a2a_fwd and t[2] == qkv]      # forward, in chunk order
    outputs = [t for t in a2a if t[1] < a2a_fwd and t[2] == o]
    # Backward, issue order: dOut of chunk 0, then per chunk g the dOut of chunk g+1 and, with
    # a ring, g's dQ (its dK/dV go one chunk later); without a ring g's dQ/dK/dV together.
    backward_o = iter([t for t in a2a if t[1] >= a2a_fwd and t[2] == o])
    douts, dqs = [next(backward_o, None)], []
    for g in range(chunks):
        if g + 1 < chunks:
            douts.append(next(backward_o, None))
        if R > 1:
            dqs.append(next(backward_o, None))
    grads = [t for t in a2a if t[1] >= a2a_fwd and t[2] == qkv]      # no ring: dQ/dK/dV
    dkvs = [t for t in a2a if t[1] >= a2a_fwd and t[2] == qkv - o]   # ring: dK/dV
    assert len(a2a) == ((4 if R == 1 else 5) * chunks if U > 1 else 0)
    for g in range(chunks):
        fwd, bwd = _kernel_span(fwd_events, "fwd", g, R), _kernel_span(bwd_events, "bwd", g, R)
        bwd = (bwd[0] + len(fwd_events), bwd[1] + len(fwd_events))
        if U > 1 and g + 1 < chunks:
            _assert_overlaps(log.events, inputs[g + 1], fwd, f"Q/K/V of chunk {g + 1}")
            _assert_overlaps(log.events, douts[g + 1], bwd, f"dOut of chunk {g + 1}")
        if U > 1 and g >= 1:
            _assert_overlaps(log.events, outputs[g - 1], fwd, f"output of chunk {g - 1}")
        if U > 1 and R == 1 and g >= 1:
            _assert_overlaps(log.events, grads[g - 1], bwd, f"dQ/dK/dV of chunk {g - 1}")
        if U > 1 and R > 1 and g >= 1:
            _assert_overlaps(log.events, dqs[g - 1], bwd, f"dQ of chunk {g - 1}")
        if U > 1 and R > 1 and g >= 2:
            _assert_overlaps(log.events, dkvs[g - 2], bwd, f"dK/dV of chunk {g - 2}")
        if R > 1 and g >= 1:
            # the backward issues 2R-1 exchanges per chunk; the last is the dK/dV hop home
            hop = ("p2p", p2p_fwd + (2 * R - 1) * g - 1)
            hop_tag = next(e[1:] for e in log.events if e[0] == "start" and e[1:3] == hop)
            _assert_overlaps(log.events, hop_tag, bwd, f"last dK/dV hop of chunk {g - 1}")


# --------------------------------------------------------------------------- launches
def _overlap_all(rank, world_size, layouts):
    apply_cpu_shims()
    for ulysses, ring in layouts:
        groups = initialize_usp_parallel(ParallelDims(dist.get_world_size(), ulysses=ulysses,
                                                      ring=ring))
        seq_len = 2 * ulysses * ring * 4
        try:
            for case in overlap_cases(ulysses):
                run_exact_case(groups, case, seq_len)
            run_exact_case(groups, dict(num_kv_heads=8, chunks=2, causal=True), seq_len,
                           via_module=True)
            run_exact_case(groups, dict(num_kv_heads=16, chunks=2, causal=True), seq_len,
                           dtype=torch.bfloat16)
            check_overlap_schedule(groups, 4, seq_len)
            if ulysses > 1:   # MQA: K/V replicated over the Ulysses ranks, no chunking
                q = torch.zeros(seq_len // (ulysses * ring), BATCH, NUM_HEADS, HEAD_DIM)
                kv = torch.zeros(q.shape[0], BATCH, 1, HEAD_DIM)
                with pytest.raises(ValueError, match="overlap_chunks=2.*replicated.*\\[1\\]"):
                    _usp(groups, q, kv, kv, True, 2)
        except AssertionError as exc:
            raise AssertionError(f"U={ulysses} R={ring}: {exc}") from None
        destroy_usp_parallel()


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_overlap_chunks_exact_same_volume_and_overlapped(dist_run, world_size):
    dist_run(_overlap_all, world_size, LAYOUTS[world_size], timeout=300)


def test_case_matrix_covers_the_chunk_counts():
    for layouts in LAYOUTS.values():
        for ulysses, _ in layouts:
            seen = {(c["num_kv_heads"], c["chunks"], c["causal"]) for c in overlap_cases(ulysses)}
            assert {(16, g, c) for g in CHUNKS for c in (True, False)} <= seen
            assert {(1, 1, True), (1, 1, False)} <= seen
            assert any(hk == 8 and g > 1 for hk, g, _ in seen)
    assert {ur for ls in LAYOUTS.values() for ur in ls} == {(2, 1), (1, 2), (2, 2), (4, 1)}


# --------------------------------------------------------------------------- choosing G
def test_auto_overlap_chunks():
    # two chunks when something overlaps and each keeps >= 8 query heads per rank
    assert resolve_overlap_chunks(32, 32, 2, 1) == 2
    assert resolve_overlap_chunks(32, 8, 2, 1) == 2
    assert resolve_overlap_chunks(32, 32, 1, 2) == 2
    assert resolve_overlap_chunks(32, 8, 2, 2) == 1        # U>1 and R>1: opt-in only
    assert resolve_overlap_chunks(32, 8, 2, 2, requested=2) == 2
    assert resolve_overlap_chunks(32, 32, 1, 1) == 1        # one rank: nothing to overlap
    assert resolve_overlap_chunks(16, 16, 2, 1) == 1        # 4 heads per chunk: too small
    assert resolve_overlap_chunks(32, 8, 8, 1) == 1         # 1 KV head per rank: no split
    assert resolve_overlap_chunks(32, 1, 2, 1) == 1         # MQA: K/V replicated
    assert resolve_overlap_chunks(64, 2, 4, 1) == 1         # GQA with hk < U


def test_explicit_overlap_chunks_are_checked():
    assert resolve_overlap_chunks(16, 16, 2, 1, 4) == 4
    assert resolve_overlap_chunks(16, 16, 1, 1, 16) == 16
    assert head_chunk_choices(32, 8, 2) == [1, 2, 4]
    with pytest.raises(ValueError, match=r"overlap_chunks=3 .*whole KV heads.*\[1, 2, 4, 8\]"):
        resolve_overlap_chunks(16, 16, 2, 1, 3)
    with pytest.raises(ValueError, match=r"overlap_chunks=2 .*replicated.*\[1\]"):
        resolve_overlap_chunks(32, 1, 2, 1, 2)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="overlap_chunks"):
            resolve_overlap_chunks(16, 16, 2, 1, bad)


def test_single_rank_chunks_and_module_validation():
    """U = R = 1 with chunks (pure reorder pipeline) is exact; a bad value fails at build."""
    from megatron.core.transformer.enums import AttnMaskType  # megatron-core on first use

    from megatron.usp.core_attention import USPAttention  # megatron-core on first use

    q, k, v, dout = _inputs(16, 8, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = usp_attention(*leaves, ulysses_group=None, ring_group=None, overlap_chunks=8)
    out.backward(dout)
    want = reference_attention(*refs, True)
    want.backward(dout)
    torch.testing.assert_close(out, want.detach(), **TOL)
    for leaf, ref in zip(leaves, refs):
        torch.testing.assert_close(leaf.grad, ref.grad, **TOL)

    config = attention_config(4, 16, 2, params_dtype=torch.float32)
    build = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal)
    assert USPAttention(**build).overlap_chunks == 1
    assert USPAttention(**build, overlap_chunks=2).overlap_chunks == 2
    with pytest.raises(ValueError, match=r"overlap_chunks=4 .*\[1, 2\]"):
        USPAttention(**build, overlap_chunks=4)
