"""Document attention read in place (megatron/usp/packed_documents.py) against an fp64 oracle.

The oracle is per-document softmax attention with plain autograd ops in float64; the packed
path must match it to 1e-10 in out and in every gradient, whatever kinds the plan mixes
(batched calls of PyTorch's CPU kernel on strided views, the masked product standing in for the
varlen op), for 1-token documents, GQA and MQA, batch 2 with different documents per sample,
causal and full masks. The segment choice is a pure function of lengths and costs.
"""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.usp import packed_documents as pd
from megatron.usp.attention import usp_attention
from megatron.usp.document_ring import build_document_ring_plan
from megatron.usp.kernels import get_kernel
from megatron.usp.packed_documents import (
    _ALWAYS_BATCHED,
    _ALWAYS_VARLEN,
    BATCHED,
    VARLEN,
    KernelCosts,
    PackedDocumentAttention,
    Segment,
    build_packed_plan,
    choose_segments,
    cpu_costs,
    documents_in_order,
    equal_runs,
    padded_length,
)

TOL = dict(atol=1e-10, rtol=1e-10)
# The flash op's lse is float32 (tests/fake_flash.py keeps that): its backward is exact to
# float32 rounding; a wrong mask is off by O(1).
FAKE_FLASH_TOL = dict(atol=1e-6, rtol=1e-6)


def oracle(q, k, v, lengths, causal, scale, window=None):
    """[s, b, h, d] attention confined to each sample's documents (and to the ``window`` keys
    before each query), plain autograd ops."""
    s, b, h, d = q.shape
    g = h // k.shape[2]
    outs = []
    for i in range(b):
        seg = torch.as_tensor(np.repeat(np.arange(len(lengths[i])), lengths[i]))
        visible = seg[:, None] == seg[None, :]
        if causal:
            visible &= torch.ones(s, s, dtype=torch.bool).tril()
        if window is not None:
            visible &= torch.ones(s, s, dtype=torch.bool).triu(-window)
        qi = q[:, i].transpose(0, 1)
        ki = k[:, i].transpose(0, 1).repeat_interleave(g, 0)
        vi = v[:, i].transpose(0, 1).repeat_interleave(g, 0)
        scores = (qi @ ki.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
        outs.append((torch.softmax(scores, -1) @ vi).transpose(0, 1))
    return torch.stack(outs, 1)


def random_lengths(rng, s, b):
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s), int(rng.integers(0, 7)), replace=False))
        rows.append(list(np.diff(np.concatenate([[0], cuts, [s]]))))
    return rows


def _inputs(seed, s, b, h, hk, d):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, b, n, d, generator=gen, dtype=torch.float64, requires_grad=True)
            for n in (h, hk, hk)]


class _PreferPadded(KernelCosts):
    """Batched calls only, longer calls cheaper: every causal document that can be padded is."""

    def __init__(self):
        super().__init__([1, 2], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], has_varlen=False,
                         padding=True)

    def batched(self, n, count, shape=None, recurring=False):
        return 1.0 / n

    def padded_length(self, n):               # tiny shapes: multiples of 4 tokens
        return -(-n // 4) * 4


@pytest.mark.parametrize("costs", ["batched", "varlen", "cpu", "padded"])
@pytest.mark.parametrize("seed", range(6))
def test_packed_matches_per_document_oracle(seed, costs):
    rng = np.random.default_rng(seed)
    s, b, d = 24, 2, 8
    h, hk = [(4, 2), (4, 1), (2, 2)][seed % 3]
    causal = seed % 4 != 3
    lengths = random_lengths(rng, s, b)
    if seed == 0:
        lengths[0] = [1] * 6 + [6] * 3                   # 1-token documents, an equal run
    plan = build_packed_plan(lengths, causal, {"batched": _ALWAYS_BATCHED,
                                               "varlen": _ALWAYS_VARLEN,
                                               "cpu": cpu_costs(),
                                               "padded": _PreferPadded()}[costs])
    if costs == "padded" and causal:
        assert any(seg.span for row in plan.segments for seg in row)
    q, k, v = _inputs(seed, s, b, h, hk, d)
    scale = 1 / math.sqrt(d)
    out = PackedDocumentAttention.apply(q, k, v, plan, get_kernel("torch"), scale)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = oracle(q, k, v, lengths, causal, scale)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(out, want, **TOL)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, **TOL)


def test_padded_lengths_are_few_and_not_shorter():
    shapes = {padded_length(n) for n in range(1, 65537)}
    assert len(shapes) == 96                              # 16 to 2K, then 16 per doubling
    assert all(padded_length(n) >= n for n in (1, 127, 128, 129, 1000, 4097, 20000, 65536))
    assert padded_length(129) == 256 and padded_length(1025) == 1152
    assert padded_length(2049) == 2176 and padded_length(20000) == 20480
    assert padded_length(131072) == 131072 and padded_length(131073) == 139264
    # past 2K a call computes at most 1/16 more rows than its document has
    assert max(padded_length(n) / n for n in range(2049, 65537)) <= 1 + 1 / 16
    assert all(padded_length(p) == p for p in shapes)


def test_padding_reaches_the_documents_at_the_sample_end():
    """A causal document whose padded call would read past the sample's end is padded too (on
    a copy); full masks are never padded."""
    costs = KernelCosts([64, 128, 256], [1.0, 1.0, 1.0], [1.0] * 3, [9.0] * 3, has_varlen=True,
                        padding=True)
    costs.batched = lambda n, count, **_: 1.0 / n      # a longer call is cheaper here
    segs = choose_segments([100, 30, 50], costs)        # 50 -> 128 runs past the end
    assert [(s.start, s.span) for s in segs] == [(0, 128), (100, 128), (130, 128)]
    assert all(s.span == 0 for s in choose_segments([100, 30, 50], costs, causal=False))


def test_documents_padded_past_the_sample_end_match_the_oracle():
    """The last documents of each sample padded past its end (a zero-padded copy with the
    tensors' strides), GQA, a value tensor that is a view of a wider one (as megatron splits
    its fused QKV output): exact in out and grads."""
    s, b, d, h, hk = 24, 2, 8, 4, 2
    lengths = [[5, 7, 10, 2], [13, 11]]
    plan = build_packed_plan(lengths, True, _PreferPadded())
    past = [(i, seg) for i, row in enumerate(plan.segments) for seg in row
            if seg.start + seg.call_len > s]
    assert [(i, seg.lengths, seg.span) for i, seg in past] == [(0, (2,), 4), (1, (11,), 12)]
    q, k, _ = _inputs(11, s, b, h, hk, d)
    wide = torch.randn(s, b, hk, 2 * d, dtype=torch.float64, generator=torch.Generator()
                       .manual_seed(5))
    v = wide[..., :d].detach().requires_grad_()          # not contiguous
    scale = 1 / math.sqrt(d)
    out = PackedDocumentAttention.apply(q, k, v, plan, get_kernel("torch"), scale)
    dout = torch.randn_like(out)
    want = oracle(q, k, v, lengths, True, scale)
    torch.testing.assert_close(out, want, **TOL)
    for got, ref in zip(torch.autograd.grad(out, (q, k, v), dout),
                        torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(got, ref, **TOL)


def test_equal_runs():
    assert equal_runs([3, 3, 1, 5, 5, 5]) == [(3, 2), (1, 1), (5, 3)]
    assert equal_runs([]) == []


def test_choose_segments_by_cost():
    # cuDNN-like: batched is cheap per document only for long documents; varlen flat.
    lengths = [1, 2, 4, 8, 16, 32, 64]
    one = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    var = [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4]
    costs = KernelCosts(lengths, one, [0.5] * 7, var, has_varlen=True)
    segs = choose_segments([4, 2, 64, 64, 64, 3, 32, 5], costs)
    assert segs == [Segment(VARLEN, 0, (4, 2)), Segment(BATCHED, 6, (64, 64, 64)),
                    Segment(VARLEN, 198, (3,)), Segment(BATCHED, 201, (32,)),
                    Segment(VARLEN, 233, (5,))]
    # without the varlen op everything is batched, runs of equal length kept together
    no_var = KernelCosts(lengths, one, [0.5] * 7, var, has_varlen=False)
    assert [s.kind for s in choose_segments([4, 2, 2], no_var)] == [BATCHED, BATCHED]
    assert [s.lengths for s in choose_segments([4, 2, 2], no_var)] == [(4,), (2, 2)]


def test_costs_interpolate_between_measured_lengths():
    costs = KernelCosts([64, 256], [1.0, 16.0], [1.0, 16.0], [2.0, 32.0], has_varlen=True)
    assert costs.batched(128, 1) == pytest.approx(4.0)          # log-log: quadratic here
    assert costs.varlen(128) == pytest.approx(8.0)
    assert costs.batched(512, 1) == pytest.approx(64.0)         # past the grid: n^2
    assert costs.batched(256, 3) == pytest.approx(48.0)


def test_documents_in_order_only_for_the_whole_sequence_in_order():
    seg = np.repeat(np.arange(4), [5, 1, 7, 3])[None].repeat(2, 0)
    seg[1] = np.repeat(np.arange(2), [10, 6])
    one_rank = build_document_ring_plan(seg, 0, 1, None, True)
    assert documents_in_order(one_rank.blocks[0]) == [[5, 1, 7, 3], [10, 6]]
    two_ranks = build_document_ring_plan(seg, 0, 2, None, True)   # zigzag: not in order
    assert documents_in_order(two_ranks.blocks[0]) is None


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 2), (True, 6)])
def test_usp_attention_reads_documents_in_place_at_one_rank(monkeypatch, causal, window):
    """U = R = 1 with the auto kernel takes the packed path (with the layer's window, if any)
    and equals the block path's ``math`` kernel and the oracle."""
    rng = np.random.default_rng(3)
    s, b, d = 32, 2, 8
    lengths = random_lengths(rng, s, b)
    lengths[0] = [12, 20]                              # both cut by either window
    seg = np.stack([np.repeat(np.arange(len(r)), r) for r in lengths])
    plan = build_document_ring_plan(seg, 0, 1, None, causal)
    q, k, v = _inputs(7, s, b, 4, 2, d)
    plans = []
    original = PackedDocumentAttention.apply
    monkeypatch.setattr(PackedDocumentAttention, "apply",
                        lambda *a: plans.append(a[3]) or original(*a))
    kw = dict(ulysses_group=None, ring_group=None, causal=causal, documents=plan, window=window)
    out = usp_attention(q, k, v, document_kernel="auto", **kw)
    assert [p.window for p in plans] == [window], "auto at U = R = 1 reads documents in place"
    ref = usp_attention(q, k, v, document_kernel="math", **kw)
    assert len(plans) == 1
    torch.testing.assert_close(ref, oracle(q, k, v, lengths, causal, 1 / math.sqrt(d), window),
                               **TOL)
    dout = torch.randn_like(out)
    torch.testing.assert_close(out, ref, **TOL)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout),
                         torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kind", ["varlen", "flash", "batched", "one"])
@pytest.mark.parametrize("causal", [True, False])
def test_one_call_is_returned_uncopied(request, monkeypatch, kind, causal):
    """One sample in one call (the varlen op, the exact product, or one batched call of equal
    documents): the layer's out and gradients are the call's own results, with the values of
    the oracle; a padded call is not one call (its extra rows are dropped)."""
    if kind == "flash":
        request.getfixturevalue("fake_flash")
    lengths = {"batched": [[6, 6, 6, 6]], "one": [[24]]}.get(kind, [[5, 1, 9, 3, 6]])
    plan = build_packed_plan(lengths, causal, _ALWAYS_BATCHED if kind in ("batched", "one")
                             else _ALWAYS_VARLEN)
    assert len(plan.segments[0]) == 1 and pd._one_call(plan)
    made = []
    for name in ("_unbatched_forward", "_unbatched_backward"):
        original = getattr(pd, name)
        monkeypatch.setattr(pd, name, lambda *a, f=original: made.append(f(*a)) or made[-1])
    q, k, v = _inputs(11, 24, 1, 4, 2, 8)
    scale = 1 / math.sqrt(8)
    out = PackedDocumentAttention.apply(q, k, v, plan, get_kernel("torch"), scale)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    if kind == "flash":                # the stand-in's tensors are [T, h, d] like the op's
        assert out.data_ptr() == made[0][0].data_ptr()
        assert [g.data_ptr() for g in grads] == [g.data_ptr() for g in made[1]]
    assert out.is_contiguous() and all(g.is_contiguous() for g in grads)
    want = oracle(q, k, v, lengths, causal, scale)
    tol = FAKE_FLASH_TOL if kind == "flash" else TOL
    torch.testing.assert_close(out, want, **tol)
    for got, ref in zip(grads, torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(got, ref, **tol)
    padded = SimpleNamespace(batch=1, segments=((Segment(BATCHED, 0, (5, 5), span=6),),))
    assert not pd._one_call(padded)


def test_cpu_masks_only_tiny_documents_in_small_segments():
    segs = choose_segments([3] * 2000, cpu_costs())
    assert all(s.kind == VARLEN and s.tokens <= 512 for s in segs)
    assert sum(s.tokens for s in segs) == 6000
    assert [s.kind for s in choose_segments([300, 700, 2, 5], cpu_costs())] == [
        BATCHED, BATCHED, VARLEN]


def test_a_new_batched_shape_waits_until_it_recurs():
    """A plan build costs more than one document saves: only recurring shapes go batched."""
    lengths = [64, 128]
    costs = KernelCosts(lengths, [1.0, 1.0], [1.0, 1.0], [2.0, 2.0], has_varlen=True,
                        build_s=10.0, reuse_before_build=2)
    kinds = [choose_segments([100], costs)[0].kind for _ in range(4)]
    assert kinds == [VARLEN, VARLEN, BATCHED, BATCHED]
    # another count of the same length is another shape
    assert choose_segments([100, 100], costs)[0].kind == VARLEN


def test_random_lengths_reach_their_padded_shape():
    """Documents of distinct lengths in one bucket: their exact shapes never recur, the padded
    shape they share does, so it is sighted whichever kind ran and goes batched once it has
    recurred (the documents before it run in the varlen call)."""
    def costs(build_s):
        return KernelCosts([64, 128, 256], [1.0] * 3, [1.0] * 3, [2.0] * 3, has_varlen=True,
                           build_s=build_s, reuse_before_build=3, padding=True)

    table = costs(10.0)
    first = [choose_segments([n], table)[0] for n in (100, 101, 102, 103, 104)]
    assert [(s.kind, s.span) for s in first] == [(VARLEN, 0)] * 3 + [(BATCHED, 128)] * 2
    assert table.new_shapes == 1                       # one plan for the bucket, not one a length
    # a padded shape's build is spread over the calls an exact one waits for: here 1 + 2.4/3
    # beats the varlen call's 2 at once, where an exact shape would cost 1 + 2.4
    assert [(s.kind, s.span) for s in choose_segments([100, 60], costs(2.4))] == [
        (BATCHED, 128), (BATCHED, 128)]
    assert choose_segments([100, 60], costs(2.4), causal=False)[0].kind == VARLEN


# --------------------------------------------------------------------------- sliding window
@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("costs", ["batched", "varlen", "cpu"])
@pytest.mark.parametrize("window,seed", [(1, 0), (3, 1), (5, 2), (9, 3)])
def test_windowed_packed_matches_per_document_oracle(request, flash, costs, window, seed):
    """A window inside each document, read in place: documents the window cuts run on the
    varlen op's own window (``flash``: tests/fake_flash.py's stand-in, else the masked product)
    or on batched calls of the window kernel; the rest as without a window."""
    if flash:
        request.getfixturevalue("fake_flash")
    rng = np.random.default_rng(seed)
    s, b, d = 32, 2, 8
    h, hk = [(4, 2), (4, 1), (2, 2), (4, 4)][seed]
    lengths = random_lengths(rng, s, b)
    lengths[1] = [window + 1, window + 1, 2] + [s - 2 * window - 4]   # an equal run at the edge
    plan = build_packed_plan(lengths, True, {"batched": _ALWAYS_BATCHED,
                                             "varlen": _ALWAYS_VARLEN,
                                             "cpu": cpu_costs()}[costs], window=window)
    windowed = [seg for row in plan.segments for seg in row if plan.segment_window(seg)]
    assert windowed and all(seg.span == 0 for seg in windowed)
    q, k, v = _inputs(seed, s, b, h, hk, d)
    scale = 1 / math.sqrt(d)
    out = PackedDocumentAttention.apply(q, k, v, plan, get_kernel("torch"), scale)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = oracle(q, k, v, lengths, True, scale, window)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    tol = FAKE_FLASH_TOL if flash else TOL
    torch.testing.assert_close(out, want, **tol)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, **tol)


def test_windowed_documents_go_to_the_varlen_window_and_are_not_padded():
    costs = _PreferPadded()                               # batched, padded where it can be
    segs = choose_segments([10, 3, 3, 10], costs, window=4)
    assert [(seg.kind, seg.lengths, seg.span) for seg in segs] == [
        (BATCHED, (10,), 0), (BATCHED, (3, 3), 0), (BATCHED, (10,), 0)]
    with_varlen = KernelCosts([1, 2], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0], has_varlen=True)
    segs = choose_segments([10, 3, 3, 10, 10], with_varlen, window=4)
    assert [(seg.kind, seg.lengths) for seg in segs] == [
        (VARLEN, (10,)), (BATCHED, (3, 3)), (VARLEN, (10, 10))]
    plan = build_packed_plan([[10, 5, 5]], True, with_varlen, window=4)
    assert [plan.segment_window(seg) for seg in plan.segments[0]] == [4, None]
    with pytest.raises(ValueError, match="causal"):
        build_packed_plan([[10]], False, with_varlen, window=4)


def test_a_cost_table_is_described_in_one_log_line():
    """What a run with documents logs after its first step: where the table comes from, the
    plan build, and per document each kind's cost at 256 / 1K / 4K / 16K tokens."""
    costs = KernelCosts([256, 1024, 4096, 16384], [1e-5, 2e-5, 1e-4, 1e-3],
                        [5e-6, 1e-5, 8e-5, 9e-4], [2e-5, 4e-5, 2e-4, 2e-3], has_varlen=True,
                        build_s=0.0123)
    key = ("cuda", 0, torch.bfloat16, 32, 8, 128, True, "cudnn")
    line = pd.describe_costs(key, costs)
    assert "\n" not in line
    assert line == (
        "document kernel costs (measured, cuda bfloat16, 32/8 heads of 128, causal, cudnn "
        "kernel): a new shape's plan build 12.30 ms per micro-batch; per document fwd+bwd in "
        "us at 256/1K/4K/16K tokens: batched alone 10/20/100/1000, batched with others "
        "5/10/80/900, varlen 20/40/200/2000")
    cpu = pd.describe_costs(("cpu", None, torch.float32, 4, 2, 16, False, "math"),
                            pd.cpu_costs())
    assert cpu.startswith("document kernel costs (fixed, cpu float32, 4/2 heads of 16, full")


# --------------------------------------------------------------------------- plans built ahead
def _padding_table(short_varlen=True, grid=None):
    """A CUDA-like table on the CPU: one document in a batched call costs n^2 / 1e8 s, in the
    varlen call twice that (``short_varlen``: far less below 1K tokens); plans cost 0.1 s.
    ``grid``: pad to multiples of it instead of :func:`padded_length`."""
    lengths = [64, 256, 1024, 4096]
    one = [n * n / 1e8 + 1e-4 for n in lengths]
    var = [2 * x for x in one]
    if short_varlen:
        var[:2] = [1e-5, 1e-4]
    costs = KernelCosts(lengths, one, one, var, has_varlen=True, build_s=0.1, padding=True)
    if grid:
        costs.padded_length = lambda n: -(-n // grid) * grid
    return costs


def test_padded_shapes_are_the_batched_ones_within_the_budget():
    costs = _padding_table()
    shapes = pd.padded_shapes(costs, 4096, budget_s=100.0)
    assert shapes == sorted(shapes) and shapes[-1] == 4096
    assert all(padded_length(p) == p for p in shapes)
    assert all(costs.batched(p, 1) - costs.build_s < costs.varlen(p) for p in shapes)
    assert 256 not in shapes                        # the varlen call is cheaper there
    # the budget counts per shape one and a half plan builds and two calls, shortest first
    three = sum(1.5 * costs.build_s + 2 * costs._at(costs._one, p) for p in shapes[:3])
    assert pd.padded_shapes(costs, 4096, budget_s=three + 1e-9) == shapes[:3]
    assert pd.padded_shapes(costs, 4096, budget_s=three - 1e-6) == shapes[:2]
    assert pd.padded_shapes(costs, 1000, budget_s=100.0)[-1] == 896   # none past the sample


class _Recording:
    """A kernel that records the layout of every call it passes on."""

    name = "torch"

    def __init__(self):
        self.inner, self.calls, self.passes = get_kernel("torch"), [], []

    @staticmethod
    def _layout(*xs):
        return tuple((tuple(x.shape), x.stride()) for x in xs)

    def forward(self, q, k, v, causal, scale):
        self.calls.append(("fwd",) + self._layout(q, k, v))
        self.passes.append(("fwd", self._in_backward()))
        return self.inner.forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        self.calls.append(("bwd",) + self._layout(dout, q, k, v, out))
        self.passes.append(("bwd", self._in_backward()))
        return self.inner.backward(dout, q, k, v, out, lse, causal, scale)

    @staticmethod
    def _in_backward():
        """Whether the call runs inside an autograd backward pass (on CUDA: the engine's
        device thread, whose cuDNN plan cache is not the main thread's)."""
        return torch._C._current_autograd_node() is not None


def _layer_tensors(s, b, h, hk, d):
    """q, k, v laid out as megatron's layer hands them over: q and k new tensors (after the
    rotary embedding), v a view of the fused QKV output."""
    q = torch.randn(s, b, h, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(s, b, hk, d, dtype=torch.float64, requires_grad=True)
    fused = torch.randn(s, b, hk, 3 * d, dtype=torch.float64)
    return q, k, fused[..., 2 * d:].detach().requires_grad_()


def test_prebuilt_plans_are_the_layouts_training_calls():
    """Every padded call training makes, in place or on a copy at the sample's end, in the
    forward and the backward, has a layout the prebuild ran, in the same kind of pass (so its
    cuDNN plan exists in that thread's cache); the prebuilt shapes are charged no build even
    as a fresh process would see the sightings."""
    s, b, h, hk, d = 96, 2, 4, 2, 8
    costs = _padding_table(short_varlen=False, grid=16)
    q, k, v = _layer_tensors(s, b, h, hk, d)
    kernel = _Recording()
    built = pd.prebuild_padded_plans(costs, kernel, q, k, v, 0.3, budget_s=100.0)
    assert built == list(range(16, 97, 16))
    prebuilt = set(kernel.calls)
    assert len(prebuilt) == 2 * len(built)
    # every forward outside and inside a backward pass, every backward inside one
    assert kernel.passes == ([("fwd", False)] * len(built)
                             + [("fwd", True), ("bwd", True)] * len(built))
    assert pd.prebuild_padded_plans(costs, kernel, q, k, v, 0.3) == []     # once per layout
    costs.restore_sightings({})
    assert costs.batched(48, 1) == pytest.approx(costs._at(costs._one, 48))  # no build
    assert costs.batched(40, 1) > costs._at(costs._one, 40) + 0.01           # exact: a build

    lengths = [[30, 20, 35, 11], [70, 26]]               # 11 and 26 run past the end
    plan = build_packed_plan(lengths, True, costs)
    spans = [(seg.lengths, seg.span) for row in plan.segments for seg in row]
    assert spans == [((30,), 32), ((20,), 32), ((35,), 48), ((11,), 16), ((70,), 80),
                     ((26,), 32)]
    kernel.calls.clear()
    kernel.passes.clear()
    out = PackedDocumentAttention.apply(q, k, v, plan, kernel, 0.3)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert len(kernel.calls) == 12 and set(kernel.calls) <= prebuilt
    assert kernel.passes == [("fwd", False)] * 6 + [("bwd", True)] * 6
    torch.testing.assert_close(out, oracle(q, k, v, lengths, True, 0.3), **TOL)


def test_the_first_packed_plan_builds_the_padded_shapes_ahead(monkeypatch):
    """packed_plan_for builds the padded plans once per table and layout, before the plan that
    uses them, and the log line says so; the CPU's own table pads nothing and builds none."""
    s, b, h, hk, d = 64, 1, 4, 2, 8
    costs = _padding_table(short_varlen=False, grid=32)
    monkeypatch.setattr(pd, "costs_for", lambda *a, **kw: costs)
    q, k, v = _layer_tensors(s, b, h, hk, d)
    seg = np.repeat(np.arange(3), [30, 20, 14])[None]
    block = build_document_ring_plan(seg, 0, 1, None, True).blocks[0]
    plan = pd.packed_plan_for(block, get_kernel("torch"), q, k, v=v, scale=0.3)
    assert [(s.kind, s.span) for s in plan.segments[0]] == [      # 14: cheaper in varlen
        (BATCHED, 32), (BATCHED, 32), (VARLEN, 0)]
    ((count, low, high, seconds),) = costs.prebuilt.values()
    assert (count, low, high) == (2, 32, 64) and seconds >= 0
    block2 = build_document_ring_plan(seg, 0, 1, None, True).blocks[0]
    pd.packed_plan_for(block2, get_kernel("torch"), q, k, v=v, scale=0.3)
    assert len(costs.prebuilt) == 1
    line = pd.describe_costs(("cuda", 0, torch.float64, h, hk, d, True, "torch"), costs)
    assert line.endswith("; plans of 2 padded lengths (32-64 tokens) built ahead for "
                         f"64-token micro-batches in {seconds:.1f} s")
    monkeypatch.undo()
    cpu_block = build_document_ring_plan(seg, 0, 1, None, True).blocks[0]
    pd.packed_plan_for(cpu_block, get_kernel("torch"), q, k, v=v)
    assert all(not t.prebuilt for _, t in pd.cost_tables())
