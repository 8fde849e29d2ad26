"""Sliding-window attention's pure pieces, without any process group.

The window's tiles cover exactly the visible pairs; the window kernel's masked product equals
a float64 masked softmax in flash's bottom-right convention; the ring plan is counted: every
visible (query, key) pair is computed by exactly one block on exactly one rank, and the halo
bytes grow with the window and not with the sequence (zero when no window crosses a ring
rank), and the planner counts the same halo; megatron-core's per-layer rule decides which
layers are windowed.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from megatron.planner.cost_model import window_halo
from megatron.training.data.batch import BatchContext, _document_params
from megatron.usp import window_kernel as wk
from megatron.usp.core_attention import USPAttention, layer_window, layers_sharing_blocks
from megatron.usp.document_kernels import MathDocumentKernel, VarlenDocumentKernel
from megatron.usp.document_mask import dense_document_mask, tiles_for_block, token_runs
from megatron.usp.document_ring import (
    build_document_ring_plan,
    effective_window,
    ring_positions,
    window_ring_plan,
)
from megatron.usp.window_kernel import window_backward, window_forward, window_mask
from tests.helpers import attention_config


# --------------------------------------------------------------------------- tiles
def _covered(tiles, sq, sk):
    """How many tiles (with their own window / causal mask) cover each [sq, sk] pair."""
    count = np.zeros((sq, sk), dtype=np.int64)
    for t in tiles:
        if t.window is None and not t.causal:
            local = np.ones((t.q_len, t.k_len), dtype=bool)
        elif t.window is None:
            local = np.tril(np.ones((t.q_len, t.k_len), dtype=bool))
        else:
            local = window_mask(t.q_len, t.k_len, t.causal, t.window).numpy()
        count[t.q_start:t.q_start + t.q_len, t.k_start:t.k_start + t.k_len] += local
    return count


@pytest.mark.parametrize("window", [1, 3, 7, 8, 9, 20, None])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_window_tiles_cover_each_visible_pair_once(window, seed):
    rng = np.random.default_rng(seed)
    seq = 64
    seg = np.repeat(np.arange(4), np.diff([0, *sorted(rng.choice(np.arange(1, seq), 3,
                                                                 replace=False)), seq]))
    positions = ring_positions(seq, 4, None)
    for qp in positions:
        for kp in positions:
            tiles = tiles_for_block(token_runs(qp, seg[qp]), token_runs(kp, seg[kp]), True,
                                    window)
            want = dense_document_mask(torch.as_tensor(qp), torch.as_tensor(seg[qp]),
                                       torch.as_tensor(kp), torch.as_tensor(seg[kp]), True,
                                       window).numpy()
            got = _covered(tiles, qp.size, kp.size)
            assert np.array_equal(got, want.astype(np.int64))
            assert sum(t.pairs for t in tiles) == int(want.sum())


# --------------------------------------------------------------------------- the kernel
def _reference(q, k, v, causal, left, scale):
    """Masked softmax in float64, flash's bottom-right window, written out per pair."""
    sq, sk = q.shape[2], k.shape[2]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    visible = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            diag = i + sk - sq
            visible[i, j] = j >= diag - left and (not causal or j <= diag)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return probs @ v


@pytest.mark.parametrize("sq,sk,causal,left", [(16, 16, True, 0), (16, 16, True, 5),
                                               (12, 20, False, 4), (20, 12, False, 3),
                                               (8, 8, True, 100)])
def test_window_kernel_matches_masked_softmax(sq, sk, causal, left):
    gen = torch.Generator().manual_seed(sq + sk + left)
    q = torch.randn(2, 4, sq, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, sk, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, sk, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    dout = torch.randn(2, 4, sq, 8, dtype=torch.float64, generator=gen)
    want = _reference(q, k, v, causal, left, 0.3)
    want.backward(dout)
    out, lse = window_forward(q.detach(), k.detach(), v.detach(), causal, left, 0.3)
    torch.testing.assert_close(out, want.detach(), atol=1e-12, rtol=1e-12)
    grads = window_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, causal, left,
                            0.3)
    for got, ref in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


# --------------------------------------------------------------------------- the plan
def _visible_pairs(seg_row, window):
    seq = seg_row.size
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    return int(((j <= i) & (i - j <= window) & (seg_row[:, None] == seg_row[None, :])).sum())


@pytest.mark.parametrize("ring,window", [(2, 1), (3, 7), (4, 8), (4, 9), (4, 19), (8, 3)])
def test_plan_computes_every_visible_pair_once(ring, window):
    seq = 96 if ring == 3 else 128
    seg = np.repeat(np.arange(3), [40, 50, seq - 90])[None]
    plans = [build_document_ring_plan(seg, r, ring, None, window=window) for r in range(ring)]
    pairs = sum(b.pairs for p in plans for b in p.blocks if b is not None)
    assert pairs == _visible_pairs(seg[0], window)
    assert all(p.needs == plans[0].needs for p in plans)


def _halo_tokens(seq, ring, window):
    return [window_ring_plan(seq, 1, r, ring, window).kv_tokens_sent() for r in range(ring)]


def test_halo_bytes_grow_with_the_window_not_the_sequence():
    ring = 4
    w64, w128 = _halo_tokens(4096, ring, 64), _halo_tokens(4096, ring, 128)
    assert w128 == [2 * t for t in w64]                 # doubling W doubles every rank's halo
    assert _halo_tokens(8192, ring, 64) == w64          # doubling S at fixed W changes nothing
    # Zigzag: chunk c needs the last W tokens of chunk c-1; the 2R-2 such pairs on two ranks
    # are the halos. The end ranks send one, the middle ones two.
    assert w64 == [64, 128, 128, 64] and sum(w64) == (2 * ring - 2) * 64
    full = (4096 // ring) * (ring - 1)
    assert max(w64) < full / 20


def test_halo_spans_several_predecessors_when_the_window_exceeds_a_chunk():
    seq, ring = 256, 4
    chunk = seq // (2 * ring)                           # 32 tokens per zigzag chunk
    plan = window_ring_plan(seq, 1, 2, ring, 2 * chunk + 5)
    sources = [plan.source(i) for i in range(1, ring) if plan.receives(i)]
    assert len(sources) == 3                            # every other ring rank
    assert plan.kv_tokens_sent() > 2 * chunk


@pytest.mark.parametrize("ring", [2, 3, 4, 8])
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 90])
def test_the_planners_halo_is_the_plans(ring, window):
    """The planner's halo (counted on chunks) is the ring plan's on its busiest rank: the
    tokens it sends and the tokens it receives in a forward, for windows within a chunk,
    one chunk, and several."""
    seq = 192
    plans = [window_ring_plan(seq, 1, r, ring, window) for r in range(ring)]
    received = [sum(p.recv_tokens(i) for i in range(1, ring) if p.receives(i)) for p in plans]
    halo = window_halo(seq, ring, window)
    assert (halo.sent, halo.received) == (max(p.kv_tokens_sent() for p in plans), max(received))
    assert halo.ring_tokens == seq / ring


def test_no_ring_traffic_when_no_window_crosses_a_ring_rank():
    seq, ring = 128, 4
    chunk = seq // (2 * ring)
    seg = np.repeat(np.arange(2 * ring), chunk)[None]   # one document per zigzag chunk
    for r in range(ring):
        plan = build_document_ring_plan(seg, r, ring, None, window=5)
        assert plan.kv_tokens_sent() == 0 and plan.kv_messages() == 0
    assert window_ring_plan(seq, 1, 0, 1, 5).kv_tokens_sent() == 0      # one ring rank


def test_a_window_over_the_whole_sequence_is_full_attention():
    assert effective_window(127, 128) is None and effective_window(500, 128) is None
    assert effective_window(126, 128) == 126 and effective_window(None, 128) is None
    seg = np.zeros((1, 64), dtype=np.int64)
    assert build_document_ring_plan(seg, 0, 2, None, window=63).window is None


# --------------------------------------------------------------------------- layers
def _config(window_size, skip):
    return SimpleNamespace(window_size=window_size, window_attn_skip_freq=skip)


def test_layers_follow_megatron_cores_pattern():
    assert [layer_window(_config((16, 0), 2), n) for n in range(1, 5)] == [16, None, 16, None]
    assert [layer_window(_config((16, 0), [1, 1, 0, 1]), n) for n in range(1, 5)] == [
        16, 16, None, 16]
    assert [layer_window(_config((16, 0), None), n) for n in range(1, 3)] == [16, 16]
    assert layer_window(_config(None, 2), 1) is None


def test_layers_sharing_a_micro_batchs_blocks():
    """The layers of one stage with this layer's window (they reuse its kernel choices)."""
    def cfg(window_size, skip, layers, stages=1):
        return SimpleNamespace(window_size=window_size, window_attn_skip_freq=skip,
                               num_layers=layers, pipeline_model_parallel_size=stages)
    assert layers_sharing_blocks(cfg(None, None, 16), None) == 16
    assert layers_sharing_blocks(cfg(None, None, 16, 4), None) == 4
    assert layers_sharing_blocks(cfg((16, 0), 2, 16), 16) == 8
    assert layers_sharing_blocks(cfg((16, 0), 2, 16), None) == 8
    assert layers_sharing_blocks(cfg((16, 0), [1, 1, 0, 1], 4), 16) == 3
    assert layers_sharing_blocks(cfg((16, 0), [1, 1, 0, 1], 4), None) == 1
    assert layers_sharing_blocks(cfg(None, None, 3, 2), None) == 2
    assert layers_sharing_blocks(SimpleNamespace(window_size=None), None) == 1
    # a layer's auto document kernel prices builds over the layers that share its blocks
    config = attention_config(4, 8, 2, num_layers=6, window_size=(16, 0),
                              window_attn_skip_freq=3)
    assert USPAttention(config, 1, AttnMaskType.causal).document_kernel.layers == 4
    assert USPAttention(config, 3, AttnMaskType.causal).document_kernel.layers == 2


@pytest.mark.parametrize("bad", [(16, 4), (0, 0), (-1, 0)])
def test_layer_window_refuses_what_it_cannot_run(bad):
    with pytest.raises(ValueError, match="--window-size"):
        layer_window(_config(bad, None), 1)


def test_window_mask_is_the_causal_band():
    mask = window_mask(6, 6, True, 2)
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    assert np.array_equal(mask.numpy(), (j <= i) & (i - j <= 2))
    assert math.isclose(float(mask.sum()), 6 + 5 + 4)


def test_a_window_layer_refuses_a_non_causal_mask():
    config = attention_config(4, 8, 2, window_size=(16, 0), window_attn_skip_freq=2)
    assert USPAttention(config, 1, AttnMaskType.causal).window == 16
    assert USPAttention(config, 2, AttnMaskType.causal).window is None
    USPAttention(config, 2, AttnMaskType.no_mask)            # a full layer may be bidirectional
    with pytest.raises(ValueError, match="--window-size 16 needs causal attention"):
        USPAttention(config, 1, AttnMaskType.no_mask)


# --------------------------------------------------------------------------- the flash plumbing
# ``fake_flash`` (tests/unit/conftest.py): the op replaced by a float64 stand-in that follows
# flash-attn's documented window convention.
@pytest.mark.parametrize("sq,sk,causal,left", [(16, 16, True, 3), (12, 20, False, 4),
                                               (16, 16, True, 15)])
def test_flash_path_plumbing_matches_the_masked_product(fake_flash, sq, sk, causal, left):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, sq, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(3, 2, sk, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    dout = torch.randn(3, 4, sq, 8, dtype=torch.float64, generator=gen)
    assert wk.flash_window_usable(q)                  # the flash path, not the masked product
    out, lse = wk.window_forward(q, k, v, causal, left, 0.3)
    want_out, want_lse = wk._masked_forward(q, k, v, causal, left, 0.3)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-6, rtol=1e-6)
    got = wk.window_backward(dout, q, k, v, want_out, want_lse, causal, left, 0.3)
    want = wk._masked_backward(dout, q, k, v, want_out, want_lse, causal, left, 0.3)
    for a, b in zip(got, want):                      # the op takes a float32 lse
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("ring,window,docs", [(2, 3, False), (3, 5, True), (4, 13, True),
                                              (4, 40, False)])
def test_varlen_kernel_on_windowed_ring_blocks_matches_math(fake_flash, ring, window, docs):
    """The ``varlen`` document kernel on every block of a windowed ring plan (squares,
    rectangles and halo tiles, each with its own window in the op's bottom-right convention)
    equals the ``math`` kernel on the same block, forward and backward."""
    seq = 16 * ring
    seg = (np.repeat(np.arange(3), [seq // 2, 5, seq - seq // 2 - 5]) if docs
           else np.zeros(seq, dtype=np.int64))[None].repeat(2, 0)
    varlen, exact = VarlenDocumentKernel(), MathDocumentKernel()
    gen = torch.Generator().manual_seed(ring + window)
    checked = 0
    for rank in range(ring):
        plan = build_document_ring_plan(seg, rank, ring, None, True, window=window)
        for block in plan.blocks:
            if block is None:
                continue
            q, dout = (torch.randn(2, 4, block.sq, 8, dtype=torch.float64, generator=gen)
                       for _ in range(2))
            k, v = (torch.randn(2, 2, block.sk, 8, dtype=torch.float64, generator=gen)
                    for _ in range(2))
            out, lse = varlen.forward(q, k, v, block, 0.3)
            want_out, want_lse = exact.forward(q, k, v, block, 0.3)
            # Rows of several calls merge by the op's float32 lse: float32 rounding, no more.
            torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
            seen = torch.isfinite(want_lse)
            torch.testing.assert_close(lse[seen], want_lse[seen], atol=1e-6, rtol=1e-6)
            got = varlen.backward(dout, q, k, v, want_out, want_lse, block, 0.3)
            want = exact.backward(dout, q, k, v, want_out, want_lse, block, 0.3)
            for a, b in zip(got, want):                  # the op takes a float32 lse
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
            checked += any(t.window is not None for row in block.tiles for t in row)
    assert checked, "no block of the plan needed its window"


# --------------------------------------------------------------------------- the batch
def test_the_batch_builds_the_windowed_plan_with_the_micro_batch():
    seg = torch.as_tensor(np.repeat(np.arange(3), [20, 30, 14])[None])
    ctx = BatchContext(cp_rank=0, cp_size=2, device=torch.device("cpu"), first_stage=True,
                       last_stage=True, ring_rank=1, ring_size=2, documents=True, window=5)
    plan = _document_params({"segment_ids": seg}, ctx).plan
    assert plan.window is None and 5 in plan._cache           # built here, not in a layer
    assert plan.with_window(5) is plan._cache[5] and plan.with_window(5).window == 5
    ctx_full = BatchContext(**{**ctx.__dict__, "window": 63})  # reaches everything: no plan
    assert _document_params({"segment_ids": seg}, ctx_full).plan._cache == {}
