"""``auto``'s choice of document kernel per block (megatron/usp/document_choice.py).

No timing: every cost table here is written by hand. On the bench's document mixes (fixed 2K
and 8K, lognormal, the corpus, uniform 1..4K) at 32K and 128K, for the whole sequence (one
rank) and for every block of the ring ranks of U2xR2 (balanced assignment): the choice is the
kernel of least modelled cost, the model prices a block's documents exactly as the in-place
path prices them, and the choice follows the table (no fixed threshold). A block is decided
once for every layer and the backward. The cost table survives the trip it makes between
ranks.
"""

import math

import numpy as np
import pytest
import torch

import megatron.usp.document_choice as dc
from megatron.bench.document_bench import mix_lengths, recurring
from megatron.usp import load_balance as lb
from megatron.usp.document_choice import (
    BLOCK_KERNELS,
    block_candidates,
    block_costs,
    cheapest,
    choose_block_kernel,
    get_document_kernel,
)
from megatron.usp.document_kernels import build_document_block
from megatron.usp.document_ring import build_document_ring_plan
from megatron.usp.kernels import get_kernel
from megatron.usp.packed_documents import (
    BATCHED,
    VARLEN,
    KernelCosts,
    agreed_costs,
    build_packed_plan,
    choose_segments,
    costs_from_state,
    costs_state,
    documents_in_order,
    equivalent_length,
)

MIXES = ("fixed:2k", "fixed:8k", "lognormal", "corpus", "uniform:4k")
SEQ_LENS = (32 * 1024, 128 * 1024)
GRID = [2 ** k for k in range(6, 15)]          # 64 .. 16K, the calibration's lengths


def gpu_like(build_s=2e-3, varlen_scale=1.0, masked_element_s=1e-10):
    """A hand-written table shaped like an H200's: calls cost a launch plus their pairs, a
    document in a batched call of many less, the varlen op a little more per pair."""
    one = [30e-6 + 2.0e-12 * n * n for n in GRID]
    many = [5e-6 + 2.0e-12 * n * n for n in GRID]
    var = [varlen_scale * (8e-6 + 2.6e-12 * n * n) for n in GRID]
    return KernelCosts(GRID, one, many, var, has_varlen=True, build_s=build_s, padding=True,
                       masked_element_s=masked_element_s)


def mix_segments(mix, seq_len):
    lengths = mix_lengths(mix, seq_len, 1234)
    if lengths is None:
        pytest.skip("the embedded corpus is not built here")
    return lb.segments_from_lengths(lengths, seq_len, 1)


def blocks_of(seg, ring):
    """Every block the ring ranks of a ring of ``ring`` compute (balanced assignment)."""
    choice = lb.balance_chunks(seg, 2, ring)
    assignment = None if choice.is_zigzag else choice.assignment
    return [b for r in range(ring)
            for b in build_document_ring_plan(seg, r, ring, assignment, True).blocks
            if b is not None]


@pytest.fixture(scope="module", params=[(m, s) for m in MIXES for s in SEQ_LENS],
                ids=lambda p: f"{p[0]}-{p[1] // 1024}k")
def mix_blocks(request):
    mix, seq_len = request.param
    seg = mix_segments(mix, seq_len)
    return seg, blocks_of(seg, 1), blocks_of(seg, 2)


def test_the_choice_is_the_least_modelled_cost(mix_blocks):
    _, whole, ring = mix_blocks
    for block in whole + ring:
        for build_s in (0.0, 2e-3):
            costs = gpu_like(build_s)
            est = block_costs(block, costs, BLOCK_KERNELS)
            assert set(est) == set(BLOCK_KERNELS) and all(v > 0 for v in est.values())
            chosen = choose_block_kernel(block, costs, BLOCK_KERNELS)
            assert est[chosen] == min(est.values())


def test_block_estimates_are_the_in_place_paths(mix_blocks):
    """One rank's block: ``tiles`` is the in-place path's batched price of each length's
    documents in one call, ``varlen`` its price of every document in the varlen call."""
    _, whole, _ = mix_blocks
    (block,) = whole
    (lengths,) = documents_in_order(block)
    costs = gpu_like()
    est = block_costs(block, costs, BLOCK_KERNELS)
    counts = {n: lengths.count(n) for n in set(lengths)}
    assert est["tiles"] == pytest.approx(sum(costs.batched(n, c) for n, c in counts.items()))
    assert est["varlen"] == pytest.approx(sum(costs.varlen(n) for n in lengths))
    all_varlen = KernelCosts(GRID, [math.inf] * 9, [math.inf] * 9, costs._var, True)
    segments = choose_segments(lengths, all_varlen)
    assert est["varlen"] == pytest.approx(sum(costs.varlen(n) for s in segments
                                              for n in s.lengths))
    n = block.sq
    assert est["math"] == (costs.masked(n * n) if n * n <= costs.max_masked_elements
                           else math.inf)


def test_ring_blocks_price_rectangles_as_documents_of_as_many_pairs(mix_blocks):
    _, _, ring = mix_blocks
    costs = gpu_like(build_s=0.0)
    for block in ring:
        want = 0.0
        for g in block.groups:
            if g.causal:
                assert g.q.length == g.k.length
                want += costs.batched(g.q.length, g.q.n)
            else:
                want += costs.batched(equivalent_length(g.q.length * g.k.length), g.q.n)
        assert block_costs(block, costs, ("tiles",))["tiles"] == pytest.approx(want)


@pytest.mark.parametrize("mix", ["fixed:8k", "uniform:4k"])
def test_the_table_decides_not_a_threshold(mix):
    """The same blocks change kernel when the table says another is cheaper."""
    seg = mix_segments(mix, 32 * 1024)
    for block in blocks_of(seg, 1) + blocks_of(seg, 2):
        assert choose_block_kernel(block, gpu_like(varlen_scale=1e-3), BLOCK_KERNELS) == "varlen"
        assert choose_block_kernel(block, gpu_like(varlen_scale=1e3), BLOCK_KERNELS) == "tiles"


def test_fixed_long_documents_tile_and_short_mixed_ones_go_varlen():
    costs = gpu_like(build_s=0.0)              # the plans built (a later micro-batch)
    (long_docs,) = blocks_of(mix_segments("fixed:8k", 32 * 1024), 1)
    (short_mixed,) = blocks_of(mix_segments("uniform:4k", 32 * 1024), 1)
    assert choose_block_kernel(long_docs, costs, BLOCK_KERNELS) == "tiles"
    assert choose_block_kernel(short_mixed, costs, BLOCK_KERNELS) == "varlen"


def test_a_new_tile_shape_pays_its_build_until_it_recurs():
    """As in the in-place path: a tile group's plan is built once tiles has run it."""
    seg = np.repeat(np.arange(4), 64)[None]
    pos = np.arange(256)[None]
    block = build_document_block(pos, seg, pos, seg, True)
    costs = KernelCosts([64, 128], [1.0, 1.0], [1.0, 1.0], [1.5, 1.5], has_varlen=True,
                        build_s=10.0, reuse_before_build=2)
    picks = [choose_block_kernel(block, costs, ("tiles", "varlen")) for _ in range(4)]
    assert picks == ["varlen", "varlen", "tiles", "tiles"]


def test_the_bench_chooses_as_once_shapes_recur_and_forgets_it():
    """bench_attention's ``auto-recurring`` / ``packed-recurring``: the choice once the
    sample's shapes have been seen ``reuse_before_build`` times; the table's sightings are
    put back, so the first-use rows (``auto``, ``packed``) still choose as before."""
    seg = np.repeat(np.arange(4), 64)[None]
    pos = np.arange(256)[None]
    block = build_document_block(pos, seg, pos, seg, True)
    costs = KernelCosts([64, 128], [1.0, 1.0], [1.0, 1.0], [1.5, 1.5], has_varlen=True,
                        build_s=10.0, reuse_before_build=2)
    costs.sighted(64, 4, built=False)            # seen once before: still below the bar
    before = costs.sightings()
    assert recurring(costs, lambda: choose_block_kernel(block, costs, ("tiles", "varlen"))
                     ) == "tiles"
    assert costs.sightings() == before
    assert choose_block_kernel(block, costs, ("tiles", "varlen")) == "varlen"

    lengths = [[64] * 4]
    costs.restore_sightings({})
    plan = recurring(costs, lambda: build_packed_plan(lengths, True, costs))
    assert [(s.kind, s.lengths) for s in plan.segments[0]] == [(BATCHED, (64,) * 4)]
    assert costs.sightings() == {}
    first = build_packed_plan(lengths, True, costs)
    assert [s.kind for s in first.segments[0]] == [VARLEN]


def test_masked_product_only_for_small_blocks_and_where_it_runs():
    costs = gpu_like(masked_element_s=1e-15)
    pos = np.arange(1024)[None]
    seg = pos // 16
    small = build_document_block(pos, seg, pos, seg, True)
    assert choose_block_kernel(small, costs, BLOCK_KERNELS) == "math"
    pos = np.arange(4096)[None]
    large = build_document_block(pos, pos // 16, pos, pos // 16, True)
    assert block_costs(large, costs, BLOCK_KERNELS)["math"] == math.inf
    assert choose_block_kernel(large, costs, BLOCK_KERNELS) != "math"
    unmeasured = KernelCosts(GRID, costs._one, costs._many, costs._var, True)
    assert block_costs(small, unmeasured, BLOCK_KERNELS)["math"] == math.inf


def test_candidates_and_ties():
    assert block_candidates("cuda", torch.bfloat16, True) == ("tiles", "varlen", "math")
    assert block_candidates("cuda", torch.bfloat16, False) == ("tiles", "math")
    assert block_candidates("cuda", torch.float32, True) == ("tiles", "math")
    assert block_candidates("cpu", torch.bfloat16, True) == ("tiles", "math")
    assert cheapest({"math": 1.0, "varlen": 1.0, "tiles": 1.0}) == "tiles"
    assert cheapest({"math": 1.0, "varlen": 1.0}) == "varlen"
    assert cheapest({"math": 0.5, "tiles": 1.0}) == "math"


def test_cost_table_survives_its_trip_between_ranks():
    costs = gpu_like()
    costs.sighted(100, 1, built=True)          # sightings stay with the rank that made them
    copy = costs_from_state(costs_state(costs))
    assert costs_state(copy) == costs_state(costs)
    for n, count in ((100, 1), (3000, 4), (20000, 1)):
        assert copy.varlen(n) == costs.varlen(n)
        assert copy.tile_call(n, n // 2 + 1, False, count) == gpu_like().tile_call(
            n, n // 2 + 1, False, count)
    assert copy.batched(100, 1) == costs.batched(100, 1) + costs.build_s
    assert (copy.has_varlen, copy.padding, copy.masked(10)) == (True, True, costs.masked(10))


def test_each_block_is_decided_once_for_every_layer(monkeypatch):
    """Two layers' auto kernels, forward and backward: one decision per block and head
    shape, cached on the block (built once per micro-batch)."""
    calls = []
    real = dc.choose_block_kernel
    monkeypatch.setattr(dc, "choose_block_kernel",
                        lambda *a: calls.append(a[0]) or real(*a))
    seg = np.repeat(np.arange(8), 8)[None]
    pos = np.arange(64)[None]
    block = build_document_block(pos, seg, pos, seg, True)
    q = torch.randn(1, 4, 64, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 64, 8, dtype=torch.float64)
    layers = [dc.get_document_kernel("auto", get_kernel("torch")) for _ in range(2)]
    for layer in layers:
        out, lse = layer.forward(q, k, k, block, 0.5)
        layer.backward(q, q, k, k, out, lse, block, 0.5)
    assert calls == [block]
    layers[0].choose(q[:, :2], k, block)                 # another head shape decides anew
    assert calls == [block, block]


def test_a_table_without_a_group_is_measured_here():
    measured = []
    table = agreed_costs(lambda: measured.append(1) or gpu_like(), None)
    assert measured == [1] and costs_state(table) == costs_state(gpu_like())


def test_a_new_shapes_build_is_shared_by_the_layers_that_reuse_the_choice():
    """One block's choice serves every layer of the micro-batch: a new tile shape is built
    once for all of them, so each call pays build_s / layers. Here tiles (four documents of
    64 in one call) costs 4 x 1.0 + 10.0 / layers against varlen's 4 x 1.5: varlen for one
    layer, tiles for 32."""
    seg = np.repeat(np.arange(4), 64)[None]
    pos = np.arange(256)[None]
    block = build_document_block(pos, seg, pos, seg, True)
    costs = KernelCosts([64, 128], [1.0, 1.0], [1.0, 1.0], [1.5, 1.5], has_varlen=True,
                        build_s=10.0, reuse_before_build=2)
    many = costs.for_layers(32)
    assert many is costs.for_layers(32) and costs.for_layers(1) is costs
    assert block_costs(block, many, ("tiles",))["tiles"] == pytest.approx(4.0 + 10.0 / 32)
    assert block_costs(block, costs, ("tiles",))["tiles"] == pytest.approx(14.0)
    assert choose_block_kernel(block, costs, ("tiles", "varlen")) == "varlen"
    assert choose_block_kernel(block, many, ("tiles", "varlen")) == "tiles"
    # the views share one record of what was seen and built: tiles ran, so built for both
    assert many.sightings() == costs.sightings()
    assert choose_block_kernel(block, costs, ("tiles", "varlen")) == "tiles"
    costs.restore_sightings({})
    assert many.sightings() == {}
    # the in-place path reads the same view: four 64-token documents batched once amortised
    plan = build_packed_plan([[64] * 4], True, many)
    assert [s.kind for s in plan.segments[0]] == [BATCHED]
    costs.restore_sightings({})
    plan = build_packed_plan([[64] * 4], True, costs)
    assert [s.kind for s in plan.segments[0]] == [VARLEN]


def test_auto_kernels_see_the_table_as_their_layers_do():
    auto = get_document_kernel("auto", get_kernel("math"), layers=12)
    q, k = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)
    assert auto.layers == 12 and auto.costs(q, k, True).layers == 12
    assert get_document_kernel("auto", get_kernel("math")).costs(q, k, True).layers == 1


def test_a_table_counts_the_shapes_it_ran_batched():
    """``new_shapes`` (and the process's ``batched_shapes``, what the training loop records
    per step): each shape counted once, at its first batched call however often it was seen
    before in the varlen call; the layer views of a table share the count."""
    from megatron.usp import packed_documents

    costs = gpu_like()
    view = costs.for_layers(16)
    costs.sighted(100, 2, built=False)
    costs.sighted(100, 2, built=False)
    costs.sighted(100, 2, built=False)
    costs.sighted(100, 2, built=False)        # seen past reuse_before_build, never batched
    assert costs.new_shapes == 0
    view.sighted(100, 2, built=True)          # its first batched call: a plan build
    costs.sighted(100, 2, built=True)
    view.sighted(0, 0, built=True, shape=("tile", 64, 32))
    assert costs.new_shapes == view.new_shapes == 2
    costs.restore_sightings({})               # the benches' reset forgets sightings only
    assert costs.new_shapes == 2
    before = packed_documents.batched_shapes()
    key = ("test", None, torch.float32, 3, 3, 8, True, "counted")
    packed_documents._COSTS[key] = costs
    try:
        assert packed_documents.batched_shapes() == before + 2
    finally:
        del packed_documents._COSTS[key]
