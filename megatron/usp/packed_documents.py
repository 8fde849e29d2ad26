"""Document attention read in place: a rank that holds whole documents in order.

When one rank holds every token its documents attend to, contiguously and in sequence order
(U = R = 1: the whole micro-batch), each document is a square on the diagonal and attention
needs no gather, no scatter and no head-major copy. This module computes it straight on
megatron's tensors::

    q, dq, out, dout : [s, b, h,  d]   sample i's tokens are x[:, i], a [s, h, d] view
    k, v, dk, dv     : [s, b, hk, d]
    lse (saved)      : per segment, float32

A sample's documents are cut into *segments*, each one kernel call:

* ``batched``: n consecutive documents of one length L, one call of the run's
  :class:`~megatron.usp.kernels.AttentionKernel` on the ``[n, h, L, d]`` view of their tokens
  (on CUDA PyTorch's cuDNN op, which reads this sequence-major view as it is);
* ``varlen``: consecutive documents of mixed lengths, one call of PyTorch's flash varlen op
  on the ``[T, h, d]`` view with the documents' cumulative lengths (CUDA fp16/bf16); elsewhere
  the exact masked product of the segment (tiny CPU shapes).

A micro-batch of one sample whose documents are one call (one varlen call, or one batched
call of equal documents) takes the call's output and gradients as the layer's tensors, with
no buffer and no copy where the kernel wrote them ``[T, h, d]`` in token order, which is
``[s, 1, h, d]`` (the CUDA kernels); otherwise (the CPU's exact product) one contiguous copy.

Which documents go to which kind is chosen per micro-batch from measured costs
(:class:`KernelCosts`): on CUDA each kernel is timed once per process and shape (heads, head
dim, dtype) on documents of 64 to 16K tokens and the costs are interpolated between them; a
run of equal-length documents goes to whichever kind costs less, and consecutive ``varlen``
runs share one call. cuDNN wins on long documents and long runs of equal ones, the varlen op
on many short mixed ones. cuDNN also builds an execution plan for every new shape (a length
and a count), which costs more than the attention of a document it saves on, even spread
over the layers that reuse it in one micro-batch (:attr:`KernelCosts.layers`): a shape goes to
cuDNN only once it has recurred (fixed-length data at once), and a causal document of any
length runs as a call of its length rounded up to one of a few shapes
(:func:`padded_length`, at most 1/16 longer), reading the tokens after it as extra rows whose
results are dropped (its own rows never see later keys) and whose output gradients are zero
(so they add nothing to its keys' gradients); where the call would run past the sample's end
it reads a zero-padded copy of the document laid out as the layer's tensors
(:func:`_call_inputs`). The plans of the padded lengths are built ahead, on the first
micro-batch of a length and layout, within a time budget (:func:`prebuild_padded_plans`);
longer padded lengths are counted as seen for every document of their bucket, whichever kind
the document ran in, and their build is spread over the calls an exact length waits for.
Packed documents of random lengths thus run at cuDNN's rate from the first step, with no
plan built per step. The same cost table prices the document
ring's blocks (:mod:`megatron.usp.document_choice`); with a group, one rank measures it for
all.

A sliding-window layer (:attr:`PackedPlan.window` ``W``, causal) keeps the window inside each
document: a document of at most ``W + 1`` tokens sees its whole causal prefix and runs as
above; a longer one runs in a varlen call with the op's own window where the op exists (in
place, blocks outside the band skipped) and otherwise in a batched call of the window kernel
(:mod:`megatron.usp.window_kernel`); it is never padded.

The plan (:class:`PackedPlan`: segments and the varlen calls' cumulative lengths, copied to the
device from pinned memory without blocking) is built once per micro-batch and reused by every
layer and by the backward. Nothing here communicates.
"""

from __future__ import annotations

import bisect
import copy
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.usp import flash_varlen
from megatron.usp.document_kernels import (
    DocumentBlock,
    MathDocumentKernel,
    build_document_block,
    pinned_to_device,
)
from megatron.usp.kernels import AttentionKernel
from megatron.usp.window_kernel import window_backward, window_forward

Tensor = torch.Tensor

BATCHED, VARLEN = "batched", "varlen"
# The dense masked product keeps float32 scores of every (query, key) element of a block, with
# its temporaries about 16 bytes per element and head: beyond this many it is not a candidate.
MAX_MASKED_ELEMENTS = 1 << 22


# --------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Segment:
    """``lengths`` consecutive documents from token ``start`` of one sample, one kernel call.

    ``span``: a batched call of one causal document may read ``span`` > its length tokens
    (its length rounded up to a shape the kernel has already built, :func:`padded_length`);
    the rows past the document are computed and dropped, and their output gradients are
    zero, so they change nothing of the document's (causal: its rows never see later keys).
    A call that would run past the sample's end reads a zero-padded copy instead.
    """

    kind: str
    start: int
    lengths: Tuple[int, ...]
    span: int = 0

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def call_len(self) -> int:
        """Tokens per document the call computes (batched kinds)."""
        return max(self.span, self.lengths[0])

    @property
    def end(self) -> int:
        return self.start + self.tokens


@dataclass
class PackedPlan:
    """Per sample, the segments covering its ``seq_len`` tokens (module docstring).

    ``cu`` holds each varlen segment's cumulative lengths (int32, on the device) under the
    segment's (sample, start) key. ``window``: the left window of a sliding-window layer
    (causal only; None: none), applied inside each document.
    """

    batch: int
    seq_len: int
    causal: bool
    segments: Tuple[Tuple[Segment, ...], ...]
    cu: Dict[Tuple[int, int], Tensor] = field(default_factory=dict, repr=False)
    window: Optional[int] = None

    def segment_window(self, seg: Segment) -> Optional[int]:
        """The window ``seg``'s call needs: the plan's, if one of its documents is longer
        than the window reaches (``n - 1 > window``); else None (plain causal)."""
        if self.window is None or max(seg.lengths) - 1 <= self.window:
            return None
        return self.window

    def counts(self) -> Dict[str, int]:
        """Documents per kind (what the bench prints beside the choice)."""
        out = {BATCHED: 0, VARLEN: 0}
        for row in self.segments:
            for seg in row:
                out[seg.kind] += len(seg.lengths)
        return out


def documents_in_order(block: DocumentBlock) -> Optional[List[List[int]]]:
    """Per sample, the lengths of the documents of ``block`` when its tiles are exactly the
    diagonal squares of consecutive documents covering every query and key in sequence order
    (what :mod:`megatron.usp.document_mask` gives at U = R = 1); else None."""
    if block.sq != block.sk:
        return None
    ident = np.arange(block.sq)
    if not all(np.array_equal(p, ident) for p in (*block.q_pos, *block.k_pos)):
        return None
    out = []
    for tiles in block.tiles:
        lengths, at = [], 0
        for t in sorted(tiles, key=lambda t: t.q_start):
            if (t.q_start != at or t.k_start != at or t.q_len != t.k_len
                    or t.causal != block.causal):
                return None
            lengths.append(t.q_len)
            at += t.q_len
        if at != block.sq:
            return None
        out.append(lengths)
    return out


def equal_runs(lengths: Sequence[int]) -> List[Tuple[int, int]]:
    """``lengths`` as maximal runs of one length: [(length, count), ...]."""
    runs: List[Tuple[int, int]] = []
    for n in lengths:
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    return runs


def padded_length(n: int) -> int:
    """A document length rounded up to one of few call shapes: multiples of 128 tokens to 2K,
    then 16 shapes per doubling (multiples of 128 to 4K, of 256 to 8K, ..., of 4K to 128K), so
    a call computes at most 1/16 more rows than its document has (about 100 shapes up to 64K,
    16 more per doubling beyond)."""
    if n <= 2048:
        return -(-n // 128) * 128
    step = 1 << ((n - 1).bit_length() - 5)
    return -(-n // step) * step


def _batched_choice(n: int, count: int, causal: bool, costs: "KernelCosts"
                    ) -> Tuple[float, int, bool]:
    """(cost, candidate, padded) of the best batched call for a run: ``candidate`` is the
    recurring shape one causal document may be padded to (0: none), ``padded`` whether that
    call is the cheaper one (else the exact call). A padded call that would read past the
    sample's end runs on a zero-padded copy of the document (:func:`_call_inputs`)."""
    exact = costs.batched(n, count)
    if count > 1 or not (causal and costs.padding):
        return exact, 0, False
    candidate = costs.padded_length(n)
    if candidate == n:
        return exact, 0, False
    padded = costs.batched(candidate, 1, recurring=True)
    return (padded, candidate, True) if padded < exact else (exact, candidate, False)


def choose_segments(lengths: Sequence[int], costs: "KernelCosts", causal: bool = True,
                    window: Optional[int] = None) -> List[Segment]:
    """Cut one sample's documents into segments by cost (module docstring). ``window``: a
    document longer than the window reaches goes to the varlen kind where it exists (the op's
    own window, in place), else to a batched call of the window kernel; neither is padded."""
    labelled: List[Tuple[str, int, int, int]] = []
    for n, count in equal_runs(lengths):
        if window is not None and n - 1 > window:
            labelled.append((VARLEN if costs.has_varlen else BATCHED, n, count, 0))
            continue
        batched, candidate, padded = _batched_choice(n, count, causal, costs)
        varlen = costs.varlen(n) * count if costs.has_varlen else math.inf
        kind = VARLEN if varlen < batched else BATCHED
        span = candidate if kind == BATCHED and padded else 0
        # the padded shape is sighted whatever ran: every document of its bucket would run at
        # it, so it recurs where exact lengths do not
        costs.sighted(n, count, built=kind == BATCHED and not span)
        if candidate:
            costs.sighted(candidate, 1, built=bool(span))
        labelled.append((kind, n, count, span))
    segments: List[Segment] = []
    start = 0
    for kind, n, count, span in labelled:
        if kind == BATCHED:
            segments.append(Segment(BATCHED, start, (n,) * count, span))
            start += n * count
            continue
        for _ in range(count):          # varlen: consecutive documents share a call
            last = segments[-1] if segments else None
            if (last is not None and last.kind == VARLEN
                    and last.tokens + n <= costs.max_varlen_tokens):
                segments[-1] = Segment(VARLEN, last.start, last.lengths + (n,))
            else:
                segments.append(Segment(VARLEN, start, (n,)))
            start += n
    return segments


def build_packed_plan(lengths: Sequence[Sequence[int]], causal: bool, costs: "KernelCosts",
                      device=None, window: Optional[int] = None) -> PackedPlan:
    """The :class:`PackedPlan` of per-sample document lengths (each sample's sum is S);
    ``window``: a sliding window's left size (causal only)."""
    if window is not None and not causal:
        raise ValueError("a sliding window needs the causal document mask")
    rows = tuple(tuple(choose_segments(row, costs, causal, window)) for row in lengths)
    seq_len = sum(lengths[0]) if lengths else 0
    plan = PackedPlan(len(rows), seq_len, causal, rows, window=window)
    for i, row in enumerate(rows):
        for seg in row:
            if seg.kind == VARLEN:
                cu = np.concatenate([[0], np.cumsum(seg.lengths)])
                plan.cu[(i, seg.start)] = pinned_to_device(cu, torch.int32, device)
    return plan


# --------------------------------------------------------------------------- costs
class KernelCosts:
    """Seconds per call of each kind, interpolated in log-log between measured lengths.

    ``batched_one[L]``: one document of L tokens in one batched call; ``batched_many[L]``: per
    document, many of L tokens in one call; ``varlen_per_doc[L]``: per document of L tokens in
    a varlen call of many. ``has_varlen``: the varlen kind can run here;
    ``max_varlen_tokens``: the most tokens one varlen call takes (the CPU's masked product
    grows with the square of its tokens).

    ``build_s``: what the first batched call of a new shape costs on top (cuDNN builds an
    execution plan per shape, then caches it). Packed documents of random lengths bring new
    shapes every micro-batch, so a shape pays for its build only once it has been seen
    ``reuse_before_build`` times (:meth:`sighted`): a recurring length (fixed-length data,
    long runs) moves to the batched kind, a length seen once stays in the varlen call.
    ``layers``: the calls one choice serves in a micro-batch (the model's layers on this rank
    that share the micro-batch's blocks): a new shape's plan is built by the first of them
    and reused by the others, so each call is charged ``build_s / layers``
    (:meth:`for_layers`).
    ``padding``: a causal document may run batched at its :func:`padded_length`, a shape
    that recurs whatever the lengths (on CUDA, where plans are built per shape).

    ``masked_call_s`` + ``masked_element_s`` per (query, key) element: the dense masked product
    of a block (:class:`~megatron.usp.document_kernels.MathDocumentKernel`), which holds
    float32 scores of every element, so it is refused (infinite cost) past
    ``max_masked_elements``; unmeasured it is infinite.

    The same table prices the blocks of the document ring (:mod:`megatron.usp.document_choice`):
    a tile group is a batched call (:meth:`tile_call`), each tile a document of the varlen call.
    """

    def __init__(self, lengths: Sequence[int], batched_one: Sequence[float],
                 batched_many: Sequence[float], varlen_per_doc: Sequence[float],
                 has_varlen: bool, max_varlen_tokens: float = math.inf, build_s: float = 0.0,
                 reuse_before_build: int = 3, padding: bool = False,
                 masked_call_s: float = 0.0, masked_element_s: float = math.inf,
                 max_masked_elements: float = MAX_MASKED_ELEMENTS, layers: int = 1) -> None:
        self.lengths = [float(n) for n in lengths]
        self._one = list(batched_one)
        self._many = list(batched_many)
        self._var = list(varlen_per_doc)
        self.has_varlen = has_varlen
        self.max_varlen_tokens = max_varlen_tokens
        self.build_s = build_s
        self.reuse_before_build = reuse_before_build
        self.padding = padding
        self.masked_call_s = masked_call_s
        self.masked_element_s = masked_element_s
        self.max_masked_elements = max_masked_elements
        self.layers = layers
        self._sightings: Dict[tuple, int] = {}
        self._built: set = set()             # shapes run batched so far (shared by the views)
        self._ready: set = set()             # shapes whose plans were built ahead (prebuild)
        self.prebuilt: Dict[tuple, Tuple[int, int, int, float]] = {}   # prebuild records
        self._views: Dict[int, "KernelCosts"] = {}

    def for_layers(self, layers: int) -> "KernelCosts":
        """This table as ``layers`` calls per micro-batch see it: the same timings and the
        same sightings (shared, not copied), the build of a new shape spread over the calls.
        One view per count, kept."""
        layers = max(1, int(layers))
        if layers == self.layers:
            return self
        if layers not in self._views:
            view = copy.copy(self)
            view.layers, view._views = layers, {}
            self._views[layers] = view
        return self._views[layers]

    def sightings(self) -> Dict[tuple, int]:
        """A copy of the shapes seen so far and how often (:meth:`restore_sightings`)."""
        return dict(self._sightings)

    def restore_sightings(self, saved: Dict[tuple, int]) -> None:
        """Put back what :meth:`sightings` returned (choices made since are forgotten), for
        every :meth:`for_layers` view of the table."""
        self._sightings.clear()
        self._sightings.update(saved)

    def padded_length(self, n: int) -> int:
        """The call shape a padded document of ``n`` tokens runs at."""
        return padded_length(n)

    def mark_ready(self, n: int) -> None:
        """The plan of one document of ``n`` tokens in a batched call exists (built ahead by
        :func:`prebuild_padded_plans`): no build is charged for it, whatever the sightings
        (:meth:`restore_sightings` leaves this as it is)."""
        self._ready.add((n, 1))
        self._built.add((n, 1))

    def sighted(self, n: int, count: int, built: bool, shape: Optional[tuple] = None) -> None:
        """Record a run of ``count`` documents of ``n`` tokens, or a call of another ``shape``
        (:meth:`tile_call`); ``built``: it ran batched, so its plan exists from now on."""
        key = (n, count) if shape is None else shape
        seen = self._sightings.get(key, 0) + 1
        self._sightings[key] = max(seen, self.reuse_before_build) if built else seen
        if built:
            self._built.add(key)

    @property
    def new_shapes(self) -> int:
        """How many shapes this table has put in a batched call so far in the process: on
        CUDA each one's first call built a cuDNN plan (:func:`batched_shapes`)."""
        return len(self._built)

    def _at(self, table: Sequence[float], n: int) -> float:
        xs = self.lengths
        if n <= xs[0]:
            return table[0] * n / xs[0] if n < xs[0] else table[0]
        if n >= xs[-1]:
            return table[-1] * (n / xs[-1]) ** 2
        j = bisect.bisect_right(xs, n) - 1
        t = (math.log(n) - math.log(xs[j])) / (math.log(xs[j + 1]) - math.log(xs[j]))
        return math.exp((1 - t) * math.log(table[j]) + t * math.log(table[j + 1]))

    def batched(self, n: int, count: int, shape: Optional[tuple] = None,
                recurring: bool = False) -> float:
        """Seconds for ``count`` documents of ``n`` tokens in one batched call (the build of
        its plan, shared by :attr:`layers` calls, included until the call's ``shape``, by
        default ``(n, count)``, recurs). ``recurring``: a shape that recurs by construction
        (a padded length, which every document of its bucket runs at) has its build spread
        over the ``reuse_before_build`` calls an exact length must wait for."""
        if count == 1:
            cost = self._at(self._one, n)
        else:
            cost = min(self._at(self._one, n) * count, self._at(self._many, n) * count)
        key = (n, count) if shape is None else shape
        if key not in self._ready and self._sightings.get(key, 0) < self.reuse_before_build:
            uses = self.reuse_before_build if recurring else 1
            cost += self.build_s / (self.layers * max(1, uses))
        return cost

    def tile_call(self, q_len: int, k_len: int, causal: bool, count: int) -> float:
        """Seconds for one batched call of ``count`` tiles of ``q_len`` x ``k_len`` tokens: a
        causal square is a document (:meth:`batched`); a rectangle is priced as the causal
        document of as many visible pairs (:func:`equivalent_length`)."""
        if causal and q_len == k_len:
            return self.batched(q_len, count)
        return self.batched(equivalent_length(q_len * k_len), count,
                            tile_shape(q_len, k_len, causal, count))

    def masked(self, elements: int) -> float:
        """Seconds for the dense masked product of ``elements`` (query, key) elements."""
        if elements > self.max_masked_elements:
            return math.inf
        return self.masked_call_s + self.masked_element_s * elements

    def varlen(self, n: int) -> float:
        """Seconds per document of ``n`` tokens inside a varlen call."""
        return self._at(self._var, n)


def equivalent_length(pairs: int) -> int:
    """The length of the causal document with ``pairs`` visible pairs (``L(L+1)/2``), at least
    1: how a rectangle of visible pairs is priced from tables timed on causal documents."""
    return max(1, int(round((math.sqrt(8 * pairs + 1) - 1) / 2)))


def tile_shape(q_len: int, k_len: int, causal: bool, count: int) -> tuple:
    """The plan key of a batched call of tiles (a causal square's is the document's)."""
    return (q_len, count) if causal and q_len == k_len else (q_len, k_len, causal, count)


# On the CPU the batched kind is PyTorch's CPU attention op, a few milliseconds a call at the
# tiny shapes that run there, and the varlen kind the masked product of the segment, which
# grows with the square of its tokens: fixed costs say so (nothing to measure; 2 cores,
# torch 2.13, fp32), so that only runs of documents of a dozen tokens or fewer share a masked
# product, of at most 512 tokens.
_CPU_CALL_S = 4e-3
_CPU_PAIR_S = 1e-9
_CPU_MASKED_TOKEN_S = 3e-4
CPU_MAX_MASKED_TOKENS = 512
# A block's dense masked product is one call of float32 products and a softmax over all its
# elements, forward and backward (a few heads of the tests' sizes).
_CPU_MASKED_ELEMENT_S = 1e-7


def cpu_costs() -> KernelCosts:
    lengths = [2 ** k for k in range(0, 15)]
    one = [_CPU_CALL_S + _CPU_PAIR_S * n * n for n in lengths]
    var = [_CPU_MASKED_TOKEN_S * n for n in lengths]
    return KernelCosts(lengths, one, one, var, has_varlen=True,
                       max_varlen_tokens=CPU_MAX_MASKED_TOKENS, masked_call_s=_CPU_CALL_S,
                       masked_element_s=_CPU_MASKED_ELEMENT_S)


_COSTS: Dict[tuple, KernelCosts] = {}
CALIBRATION_LENGTHS = tuple(2 ** k for k in range(6, 15))     # 64 .. 16K tokens
CALIBRATION_TOKENS = 16384


def costs_for(kernel: AttentionKernel, q: Tensor, k: Tensor, causal: bool,
              group: Optional[dist.ProcessGroup] = None, layers: int = 1) -> KernelCosts:
    """The costs for q [.., h, d] / k [.., hk, d] (:func:`costs_for_shape`), as ``layers``
    calls per micro-batch see them (:meth:`KernelCosts.for_layers`)."""
    return costs_for_shape(kernel, q.device, q.dtype, q.shape[-2], k.shape[-2], q.shape[-1],
                           causal, group).for_layers(layers)


def costs_for_shape(kernel: AttentionKernel, device, dtype: torch.dtype, hq: int, hk: int,
                    d: int, causal: bool, group: Optional[dist.ProcessGroup] = None
                    ) -> KernelCosts:
    """The costs of ``hq`` query / ``hk`` KV heads of ``d`` in ``dtype`` on ``device``, once
    per process and shape (cached): measured on CUDA, fixed on the CPU. With ``group`` (a gloo
    group of the ranks that read the same micro-batch; every rank of it asks for the same
    shapes in the same order) the table comes from the group's first rank
    (:func:`agreed_costs`), on the CPU as on CUDA."""
    device = torch.device(device)
    key = (device.type, device.index, dtype, hq, hk, d, causal, kernel.name)
    if key not in _COSTS:
        if device.type == "cuda":
            def measure() -> KernelCosts:
                return measure_costs(kernel, device, dtype, hq, hk, d, causal)
        else:
            measure = cpu_costs
        _COSTS[key] = agreed_costs(measure, group)
    return _COSTS[key]


DESCRIBED_LENGTHS = (256, 1024, 4096, 16384)


def describe_costs(key: tuple, costs: KernelCosts) -> str:
    """One log line of a cost table (:func:`costs_for_shape`'s ``key``): where it comes from,
    its plan build (shared by the layers that reuse a choice), and per document, forward + backward, its kinds' costs at a few
    lengths, so a run's log shows what its document kernels were chosen by."""
    device, _, dtype, hq, hk, d, causal, kernel = key
    where = "measured" if device == "cuda" else "fixed"

    def us(xs):
        return "/".join(f"{1e6 * x:.0f}" if math.isfinite(x) else "-" for x in xs)
    lengths = "/".join(f"{n // 1024}K" if n >= 1024 else str(n) for n in DESCRIBED_LENGTHS)
    return (f"document kernel costs ({where}, {device} {str(dtype).replace('torch.', '')}, "
            f"{hq}/{hk} heads of {d}, {'causal' if causal else 'full'}, {kernel} kernel): "
            f"a new shape's plan build {1e3 * costs.build_s:.2f} ms per micro-batch; "
            f"per document fwd+bwd in us at {lengths} tokens: "
            f"batched alone {us(costs._at(costs._one, n) for n in DESCRIBED_LENGTHS)}, "
            f"batched with others {us(costs._at(costs._many, n) for n in DESCRIBED_LENGTHS)}, "
            f"varlen {us(costs.varlen(n) for n in DESCRIBED_LENGTHS)}"
            + "".join(f"; plans of {count} padded lengths ({low}-{high} tokens) built ahead "
                      f"for {s}-token micro-batches in {seconds:.1f} s"
                      for (s, *_), (count, low, high, seconds) in costs.prebuilt.items()
                      if count))


def cost_tables() -> List[Tuple[tuple, KernelCosts]]:
    """The cost tables this process has measured or fixed so far (key, table)."""
    return list(_COSTS.items())


def batched_shapes() -> int:
    """The distinct shapes this process's cost tables have put in batched calls so far: the
    training loop records how many each step added (``new_plan_shapes``), the steps that
    built cuDNN plans."""
    return sum(costs.new_shapes for _, costs in cost_tables())


def costs_state(costs: KernelCosts) -> List[float]:
    """The table as numbers (what :func:`agreed_costs` sends); sightings are not part of it."""
    return ([float(len(costs.lengths))] + list(costs.lengths) + [float(x) for x in costs._one]
            + [float(x) for x in costs._many] + [float(x) for x in costs._var]
            + [float(costs.has_varlen), float(costs.max_varlen_tokens), float(costs.build_s),
               float(costs.reuse_before_build), float(costs.padding),
               float(costs.masked_call_s), float(costs.masked_element_s),
               float(costs.max_masked_elements)])


def costs_from_state(state: Sequence[float]) -> KernelCosts:
    """The inverse of :func:`costs_state` (a fresh table, no sightings)."""
    n = int(state[0])
    tables = [list(state[1 + i * n:1 + (i + 1) * n]) for i in range(4)]
    (has_varlen, max_varlen, build_s, reuse, padding, masked_call, masked_element,
     max_masked) = state[1 + 4 * n:]
    return KernelCosts(tables[0], tables[1], tables[2], tables[3], bool(has_varlen),
                       max_varlen, build_s, int(reuse), bool(padding), masked_call,
                       masked_element, max_masked)


def agreed_costs(measure: Callable[[], KernelCosts], group: Optional[dist.ProcessGroup]
                 ) -> KernelCosts:
    """One cost table for every rank of ``group``: ``measure()`` runs on its first rank only
    and the table is broadcast over ``group`` (gloo, host tensors: two messages, the length
    then ``8 * len(costs_state)`` bytes). Timings are noisy; ranks that computed the same block
    with tables measured apart could choose different kernels (and round differently), so
    one measurement decides for all. Every rank, the first included, returns the received
    copy. ``group`` None or of one rank: ``measure()`` here."""
    if group is None or dist.get_world_size(group) == 1:
        return measure()
    src = dist.get_global_rank(group, 0)
    mine = dist.get_rank() == src
    state = costs_state(measure()) if mine else []
    size = torch.tensor([len(state)], dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    payload = (torch.tensor(state, dtype=torch.float64) if mine
               else torch.empty(int(size), dtype=torch.float64))
    dist.broadcast(payload, src, group=group)
    return costs_from_state(payload.tolist())


def _time_s(fn: Callable[[], None], reps: int = 3) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def measure_costs(kernel: AttentionKernel, device, dtype, hq: int, hk: int, d: int,
                  causal: bool) -> KernelCosts:
    """Time forward + backward of each kind on synthetic documents (module docstring)."""
    scale = 1.0 / math.sqrt(d)
    has_varlen = flash_varlen.available() and dtype in (torch.float16, torch.bfloat16)
    one, many, var = [], [], []
    for n in CALIBRATION_LENGTHS:
        count = max(1, CALIBRATION_TOKENS // n)
        x = _synthetic(count * n, hq, hk, d, device, dtype)
        for docs, table in ((1, one), (count, many)):
            plan = build_packed_plan([[n] * docs], causal, _ALWAYS_BATCHED, device)
            table.append(_time_s(_round_trip(x, docs * n, plan, kernel, scale)) / docs)
        if has_varlen:
            plan = build_packed_plan([[n] * count], causal, _ALWAYS_VARLEN, device)
            var.append(_time_s(_round_trip(x, count * n, plan, kernel, scale)) / count)
        else:
            var.append(math.inf)
        del x
    return KernelCosts(CALIBRATION_LENGTHS, one, many, var, has_varlen,
                       build_s=_build_cost_s(kernel, device, dtype, hq, hk, d, causal, scale),
                       padding=causal,
                       masked_element_s=_masked_element_s(device, dtype, hq, hk, d, causal,
                                                          scale))


MASKED_CALIBRATION_TOKENS = 1024


def _masked_element_s(device, dtype, hq, hk, d, causal, scale) -> float:
    """Seconds per (query, key) element of the dense masked product, forward + backward, on a
    block of :data:`MASKED_CALIBRATION_TOKENS` tokens (four documents)."""
    n = MASKED_CALIBRATION_TOKENS
    pos = np.arange(n)[None]
    seg = pos // (n // 4)
    block = build_document_block(pos, seg, pos, seg, causal, device)

    def r(h):
        return torch.randn(1, h, n, d, device=device, dtype=dtype)
    q, k, v, dout = r(hq), r(hk), r(hk), r(hq)

    def run() -> None:
        out, lse = _MATH.forward(q, k, v, block, scale)
        _MATH.backward(dout, q, k, v, out, lse, block, scale)
    return _time_s(run) / (n * n)


def _build_cost_s(kernel, device, dtype, hq, hk, d, causal, scale) -> float:
    """The first call of a shape not run before, less the same call once its plan exists."""
    n = 3 * 1000 + 7                       # a length no calibration call used
    x = _synthetic(n, hq, hk, d, device, dtype)
    run = _round_trip(x, n, build_packed_plan([[n]], causal, _ALWAYS_BATCHED, device), kernel,
                      scale)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    first = start.elapsed_time(end) / 1e3
    return max(0.0, first - _time_s(run))


PREBUILD_BUDGET_S = 20.0


def padded_shapes(costs: KernelCosts, seq_len: int, budget_s: float = PREBUILD_BUDGET_S
                  ) -> List[int]:
    """The padded lengths (:func:`padded_length`) up to ``seq_len`` whose plans
    :func:`prebuild_padded_plans` builds, shortest first: those where one document in a
    batched call costs less than in the varlen call, while the estimated time of building
    them (per shape three plan builds, a forward and a backward one counted as the table's
    ``build_s``, the second forward one as half of it, and two calls) stays within
    ``budget_s``. Longer ones wait for their documents to recur, as exact lengths do."""
    shapes: List[int] = []
    spent, n = 0.0, 1
    while n <= seq_len:
        p = costs.padded_length(n)
        n = p + 1
        if p > seq_len:
            break
        one = costs._at(costs._one, p)
        if costs.has_varlen and costs.varlen(p) <= one:
            continue
        spent += 1.5 * costs.build_s + 2 * one
        if spent > budget_s:
            break
        shapes.append(p)
    return shapes


def prebuild_padded_plans(costs: KernelCosts, kernel: AttentionKernel, q: Tensor, k: Tensor,
                          v: Tensor, scale: float, budget_s: float = PREBUILD_BUDGET_S
                          ) -> List[int]:
    """Build the cuDNN plans of the padded shapes a micro-batch like ``q`` [s, b, h, d], ``k``,
    ``v`` [s, b, hk, d] can call (:func:`padded_shapes`), once per table, length and layout,
    on zeros laid out with the layer's strides (the output and its gradient contiguous, as in
    training), so training's calls find their plans and no step builds one. PyTorch keeps
    cuDNN's attention plans per thread, and on CUDA the autograd engine runs the backward (and
    the forward recomputed inside it) on a thread of its own: each shape's forward runs here
    and its forward and backward run again inside a backward pass (:class:`_InBackward`).
    Returns the lengths built now (none on a table without padding, or a second time); the
    record goes to :attr:`KernelCosts.prebuilt` (what :func:`describe_costs` prints)."""
    s, b = q.shape[0], q.shape[1]
    key = (s, b, q.shape[-2], k.shape[-2], q.shape[-1], q.dtype, q.stride(), k.stride(),
           v.stride())
    if not costs.padding or key in costs.prebuilt:
        return []
    shapes = padded_shapes(costs, s, budget_s)
    start = time.perf_counter()
    if shapes:
        top = shapes[-1]
        qz, kz, vz = (_zeros_laid_out(x, top) for x in (q, k, v))
        oz = torch.zeros((top,) + tuple(q.shape[1:]), dtype=q.dtype, device=q.device)

        def calls(backward: bool) -> None:
            for p in shapes:
                seg = Segment(BATCHED, 0, (p - 1,), p)
                plan = PackedPlan(b, top, True, ((seg,),) + ((),) * (b - 1))
                _, lse = _batched_forward(seg, 0, qz, kz, vz, plan, kernel, scale)
                if backward:
                    _batched_backward(seg, 0, (oz, qz, kz, vz, oz), lse, plan, kernel, scale)

        with torch.no_grad():
            calls(backward=False)
        with torch.enable_grad():
            anchor = torch.zeros((), device=q.device, requires_grad=True)
            _InBackward.apply(anchor, lambda: calls(backward=True)).backward()
        for p in shapes:
            costs.mark_ready(p)
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
    costs.prebuilt[key] = (len(shapes), shapes[0] if shapes else 0,
                           shapes[-1] if shapes else 0, time.perf_counter() - start)
    return shapes


class _InBackward(torch.autograd.Function):
    """``apply(anchor, work)``: the identity on ``anchor`` whose backward calls ``work()``, so
    that it runs where the autograd engine runs backward passes."""

    @staticmethod
    def forward(ctx, anchor, work):
        ctx.work = work
        return anchor.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.work()
        return grad, None


def _zeros_laid_out(x: Tensor, rows: int) -> Tensor:
    """Zeros of ``x``'s shape with ``rows`` tokens, with ``x``'s strides."""
    out = torch.empty_strided((rows,) + tuple(x.shape[1:]), x.stride(), dtype=x.dtype,
                              device=x.device)
    return out.zero_()


def _synthetic(tokens: int, hq: int, hk: int, d: int, device, dtype) -> Dict[str, Tensor]:
    def r(h):
        return torch.randn(tokens, 1, h, d, device=device, dtype=dtype)
    return {"q": r(hq), "k": r(hk), "v": r(hk), "dout": r(hq)}


def _round_trip(x: Dict[str, Tensor], tokens: int, plan: PackedPlan, kernel: AttentionKernel,
                scale: float) -> Callable[[], None]:
    q, k, v, dout = (x[name][:tokens] for name in ("q", "k", "v", "dout"))

    def run() -> None:
        out, lses = packed_forward(q, k, v, plan, kernel, scale)
        packed_backward(dout, q, k, v, out, lses, plan, kernel, scale)
    return run


_ALWAYS_BATCHED = KernelCosts([1, 2], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0], has_varlen=False)
_ALWAYS_VARLEN = KernelCosts([1, 2], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0], has_varlen=True)


# --------------------------------------------------------------------------- compute
def _docs_view(x: Tensor, n: int, length: int) -> Tensor:
    """[n*L, h, d] tokens -> the [n, h, L, d] view (no copy)."""
    return x.unflatten(0, (n, length)).transpose(1, 2)


def _math_segment_forward(q, k, v, lengths, causal, scale, window=None):
    """The segment's masked product: [T, h, d] -> out [T, h, d], lse [h, T] (exact)."""
    block = _segment_block(lengths, causal, window)
    out, lse = _MATH.forward(_heads(q), _heads(k), _heads(v), block, scale)
    return out[0].transpose(0, 1), lse[0]


def _math_segment_backward(dout, q, k, v, out, lse, lengths, causal, scale, window=None):
    block = _segment_block(lengths, causal, window)
    grads = _MATH.backward(_heads(dout), _heads(q), _heads(k), _heads(v), _heads(out),
                           lse[None], block, scale)
    return tuple(g[0].transpose(0, 1) for g in grads)


_MATH = MathDocumentKernel()


def _heads(x: Tensor) -> Tensor:
    """[T, h, d] -> [1, h, T, d] view."""
    return x.transpose(0, 1)[None]


def _segment_block(lengths: Sequence[int], causal: bool, window: Optional[int] = None
                   ) -> DocumentBlock:
    seg = np.repeat(np.arange(len(lengths)), lengths)[None]
    pos = np.arange(seg.size)[None]
    return build_document_block(pos, seg, pos, seg, causal, window=window)


def packed_forward(q: Tensor, k: Tensor, v: Tensor, plan: PackedPlan, kernel: AttentionKernel,
                   scale: float) -> Tuple[Tensor, List[Tensor]]:
    """out [s, b, h, d] (q's dtype) and each segment's lse, in plan order. A plan of one call
    (:func:`_one_call`) returns that call's output as ``out``, uncopied where its layout is
    already ``[s, 1, h, d]``."""
    if _one_call(plan):
        o, lse = _segment_forward(plan.segments[0][0], 0, q, k, v, plan, kernel, scale)
        return _as_layer(o, q), [lse]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lses: List[Tensor] = []
    for i, row in enumerate(plan.segments):
        for seg in row:
            o, lse = _segment_forward(seg, i, q, k, v, plan, kernel, scale)
            out[seg.start:seg.end, i].view(o.shape).copy_(o)
            lses.append(lse)
    return out, lses


def packed_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    lses: Sequence[Tensor], plan: PackedPlan, kernel: AttentionKernel,
                    scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """dq [s, b, h, d], dk, dv [s, b, hk, d] in the inputs' dtypes (a plan of one call: that
    call's gradients, uncopied where their layout allows)."""
    xs = (dout, q, k, v, out)
    if _one_call(plan):
        grads = _segment_backward(plan.segments[0][0], 0, xs, lses[0], plan, kernel, scale)
        return tuple(_as_layer(g, x) for g, x in zip(grads, (q, k, v)))  # type: ignore
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    lse_iter = iter(lses)
    for i, row in enumerate(plan.segments):
        for seg in row:
            grads = _segment_backward(seg, i, xs, next(lse_iter), plan, kernel, scale)
            for dst, g in zip((dq, dk, dv), grads):
                dst[seg.start:seg.end, i].view(g.shape).copy_(g)
    return dq, dk, dv


def _segment_forward(seg: Segment, i: int, q: Tensor, k: Tensor, v: Tensor, plan: PackedPlan,
                     kernel: AttentionKernel, scale: float) -> Tuple[Tensor, Tensor]:
    """Segment ``seg`` of sample ``i``: its output in token order (``[T, h, d]``, or
    ``[n, L, h, d]`` for a batched call) and its lse."""
    if seg.kind == BATCHED:
        o, lse = _batched_forward(seg, i, q, k, v, plan, kernel, scale)
        return o.transpose(1, 2), lse
    a, e = seg.start, seg.end
    return _unbatched_forward(q[a:e, i], k[a:e, i], v[a:e, i], seg, plan, i, scale)


def _segment_backward(seg: Segment, i: int, xs: Sequence[Tensor], lse: Tensor,
                      plan: PackedPlan, kernel: AttentionKernel, scale: float
                      ) -> Tuple[Tensor, ...]:
    """:func:`_segment_forward`'s dq, dk, dv in token order; ``xs`` = (dout, q, k, v, out)
    of the whole batch."""
    if seg.kind == BATCHED:
        return tuple(g.transpose(1, 2)
                     for g in _batched_backward(seg, i, xs, lse, plan, kernel, scale))
    return _unbatched_backward([x[seg.start:seg.end, i] for x in xs], lse, seg, plan, i, scale)


def _as_layer(t: Tensor, like: Tensor) -> Tensor:
    """A call's result ``[T, h, d]`` (or ``[n, L, h, d]``) as the layer's contiguous
    ``[s, 1, h, d]``: a view where the kernel wrote it in that order, else a copy."""
    return t.contiguous().view(like.shape)


def _one_call(plan: PackedPlan) -> bool:
    """One sample whose tokens are one call: an unbatched (varlen or exact) segment, or a
    batched one that reads no padding. The call's results then hold exactly the layer's
    ``[s, 1, h, d]`` tensors, and are returned as they are."""
    if plan.batch != 1 or len(plan.segments[0]) != 1:
        return False
    seg = plan.segments[0][0]
    return seg.kind != BATCHED or seg.call_len == seg.lengths[0]


def _call_inputs(xs: Sequence[Tensor], seg: Segment, i: int, zero_rows: int = 0
                 ) -> List[Tensor]:
    """The ``[n * call, h, d]`` tokens a batched segment's call reads from each ``[s, b, h, d]``
    tensor of ``xs``: a view where the call ends inside the sample; else (a padded document
    near the sample's end) a copy of the document with zero rows after it, laid out with the
    view's strides, so it runs on the same cuDNN plan. ``zero_rows``: the first this many
    of ``xs`` get zero rows past the document even where they are views (the output gradient
    of a padded call)."""
    n, length, call = len(seg.lengths), seg.lengths[0], seg.call_len
    a, s = seg.start, xs[0].shape[0]
    out = []
    for j, x in enumerate(xs):
        if a + n * call <= s and (j >= zero_rows or call == length):
            out.append(x[a:a + n * call, i])
            continue
        buf = torch.empty_strided((call,) + tuple(x.shape[2:]),
                                  (x.stride(0),) + tuple(x.stride()[2:]), dtype=x.dtype,
                                  device=x.device)
        buf[:length].copy_(x[a:a + length, i])
        buf[length:].zero_()
        out.append(buf)
    return out


def _batched_forward(seg: Segment, i: int, q: Tensor, k: Tensor, v: Tensor, plan: PackedPlan,
                     kernel: AttentionKernel, scale: float) -> Tuple[Tensor, Tensor]:
    """A batched segment of sample ``i``: its documents' output ``[n, h, L, d]`` (a padded
    call's extra rows dropped) and the call's lse."""
    n, length, call = len(seg.lengths), seg.lengths[0], seg.call_len
    q_c, k_c, v_c = (_docs_view(x, n, call) for x in _call_inputs((q, k, v), seg, i))
    window = plan.segment_window(seg)
    if window is None:
        o, lse = kernel.forward(q_c, k_c, v_c, plan.causal, scale)
    else:
        o, lse = window_forward(q_c, k_c, v_c, True, window, scale)
    return o[:, :, :length], lse


def _batched_backward(seg: Segment, i: int, xs: Sequence[Tensor], lse: Tensor,
                      plan: PackedPlan, kernel: AttentionKernel, scale: float
                      ) -> Tuple[Tensor, Tensor, Tensor]:
    """A batched segment's dq, dk, dv ``[n, h(k), L, d]`` from ``xs`` = (dout, q, k, v, out)
    of the whole batch; a padded call's extra rows get a zero output gradient, so they add
    nothing to the document's keys, and their gradients are dropped."""
    n, length, call = len(seg.lengths), seg.lengths[0], seg.call_len
    views = [_docs_view(x, n, call) for x in _call_inputs(xs, seg, i, zero_rows=1)]
    window = plan.segment_window(seg)
    if window is None:
        grads = kernel.backward(*views, lse, plan.causal, scale)
    else:
        grads = window_backward(*views, lse, True, window, scale)
    return tuple(g[:, :, :length] for g in grads)  # type: ignore[return-value]


def _unbatched_forward(qs: Tensor, ks: Tensor, vs: Tensor, seg: Segment, plan: PackedPlan,
                       i: int, scale: float) -> Tuple[Tensor, Tensor]:
    """A varlen segment's ``[T, h, d]`` output and lse: PyTorch's flash varlen op where it
    runs, else the exact masked product."""
    window = plan.segment_window(seg)
    if flash_varlen.usable(qs):
        cu, longest = plan.cu[(i, seg.start)], max(seg.lengths)
        return flash_varlen.forward(qs, ks, vs, cu, cu, longest, longest, plan.causal, scale,
                                    window)
    return _math_segment_forward(qs, ks, vs, seg.lengths, plan.causal, scale, window)


def _unbatched_backward(parts: Sequence[Tensor], lse: Tensor, seg: Segment, plan: PackedPlan,
                        i: int, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`_unbatched_forward`'s gradients ``[T, h(k), d]``; ``parts``: dout, q, k, v, out
    of the segment."""
    window = plan.segment_window(seg)
    if flash_varlen.usable(parts[1]):
        cu, longest = plan.cu[(i, seg.start)], max(seg.lengths)
        return flash_varlen.backward(*parts, lse, cu, cu, longest, longest, plan.causal, scale,
                                     window)
    return _math_segment_backward(*parts, lse, seg.lengths, plan.causal, scale, window)


class PackedDocumentAttention(torch.autograd.Function):
    """Differentiable :func:`packed_forward`: ``apply(q, k, v, plan, kernel, scale) -> out``."""

    @staticmethod
    def forward(ctx, q, k, v, plan, kernel, scale):
        out, lses = packed_forward(q, k, v, plan, kernel, scale)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.plan, ctx.kernel, ctx.scale = plan, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, *lses = ctx.saved_tensors
        dq, dk, dv = packed_backward(dout.contiguous(), q, k, v, out, lses, ctx.plan,
                                     ctx.kernel, ctx.scale)
        return dq, dk, dv, None, None, None


def packed_plan_for(block: Optional[DocumentBlock], kernel: AttentionKernel, q: Tensor,
                    k: Tensor, group: Optional[dist.ProcessGroup] = None, layers: int = 1,
                    v: Optional[Tensor] = None, scale: Optional[float] = None
                    ) -> Optional[PackedPlan]:
    """The block's :class:`PackedPlan` when its documents are whole and in order (built once
    per block and head shape, cached on the block), else None. ``group``: the ranks that
    share one cost table (:func:`costs_for_shape`); ``layers``: the calls that reuse the plan
    (:meth:`KernelCosts.for_layers`). A windowed block's plan carries its window
    (:attr:`PackedPlan.window`). The first plan of a table with padding for a length and
    layout of ``q``, ``k``, ``v`` (default: ``k``'s) first builds the padded shapes' plans
    (:func:`prebuild_padded_plans`, ``scale`` the layer's, default ``d ** -0.5``)."""
    if block is None:
        return None
    key = ("packed", q.dtype, q.shape[-2], k.shape[-2], q.shape[-1], kernel.name)
    if key not in block._cache:
        lengths = documents_in_order(block)
        plan = None
        if lengths is not None:
            costs = costs_for(kernel, q, k, block.causal, group, layers)
            if block.causal:
                prebuild_padded_plans(costs, kernel, q, k, k if v is None else v,
                                      q.shape[-1] ** -0.5 if scale is None else scale)
            plan = build_packed_plan(lengths, block.causal, costs, q.device, block.window)
        block._cache[key] = plan
    return block._cache[key]  # type: ignore[return-value]
