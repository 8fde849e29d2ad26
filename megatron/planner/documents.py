"""Packed documents in the planner (``--reset-attention-mask --reset-position-ids``,
EOD-delimited documents, attention inside each document): :class:`Documents`, a mix of
``--docs MIX`` or the document lengths of a run's data.

The plan is costed on a few representative packed samples of the planned length: the
documents' lengths (of a mix, :func:`megatron.bench.document_bench.mix_lengths`, the mixes of
``bench_attention --docs`` and ``bench_e2e --docs``, seed :data:`SEED`; or the lengths given,
cycled when they run out) packed back to back,
a document cut at a sample end continuing in the next sample
(:func:`megatron.usp.load_balance.segments_from_lengths`, megatron-core's dataset packing).
:data:`SAMPLE_MICRO_BATCHES` micro-batches of ``b`` samples each. From them:

* attention pairs per sample and layer (:func:`layer_pairs`): ``sum n^2/2`` over the
  documents, or :func:`~megatron.shapes.window_pairs` on a window layer; the FLOP count's
  pairs (:func:`mean_shape_pairs`, the training loop's :func:`~megatron.shapes.shape_pairs`);
* the kernel length whose rate the attention runs at (:func:`kernel_tokens`): the
  pair-weighted mean document length ``sum n^3 / sum n^2``;
* the document ring of a ``U x R`` split (:func:`document_ring`): the chunk assignment the
  data loader chooses for each micro-batch (:func:`~megatron.usp.load_balance.balance_chunks`),
  its work spread, and the K/V tokens the busiest ring rank sends and receives under it
  (:func:`~megatron.usp.load_balance.ring_rank_kv_tokens`), each the mean over the micro-batches.

The mixes and the packing live in modules that import torch (``load_balance`` imports
``token_order``); they are imported inside the functions, so the planner without packed
documents stays torch-free.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

from megatron.planner.errors import PlannerError
from megatron.shapes import ModelShape, document_pairs, shape_pairs, window_pairs

SEED = 0
SAMPLE_MICRO_BATCHES = 4
DOCUMENT_FLAGS = ("--reset-attention-mask", "--reset-position-ids")
MIX_HELP = ("fixed:N (e.g. fixed:2k), uniform:N (lengths uniform in 1..N-1), lognormal "
            "(median 2K) or corpus (the embedded corpus's documents)")

Rows = Tuple[Tuple[int, ...], ...]


@dataclass(frozen=True)
class Documents:
    """The packed documents a plan is costed on: a ``mix`` of ``--docs MIX``, or explicit
    ``lengths`` (tokens per document, EOD included) in the order the data loader packs them;
    ``label`` is how the plan's reasons name them (default: ``--docs MIX``)."""

    mix: Optional[str] = None
    lengths: Optional[Tuple[int, ...]] = None
    label: Optional[str] = None

    def __post_init__(self) -> None:
        if (self.mix is None) == (self.lengths is None):
            raise PlannerError("packed documents: give either a mix (--docs MIX) or document "
                               "lengths, e.g. --docs lognormal")
        if self.mix is not None:
            check_mix(self.mix)
            return
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        if not any(n > 0 for n in self.lengths):
            raise PlannerError("packed documents: no document of positive length; give "
                               "lengths >= 1 or a mix, e.g. --docs lognormal")

    def name(self) -> str:
        return self.label or (f"--docs {self.mix}" if self.mix is not None
                              else "the given document lengths")


def as_documents(docs: Union[None, str, Documents]) -> Optional[Documents]:
    """``docs`` as :class:`Documents` (a mix's spelling is a mix); None stays None."""
    if docs is None or isinstance(docs, Documents):
        return docs
    if isinstance(docs, str):
        return Documents(mix=docs)
    raise PlannerError(f"documents {docs!r}: give a mix (--docs MIX, e.g. --docs lognormal) "
                       f"or Documents(lengths=...)")


def check_mix(mix: str) -> None:
    """Refuse a mix spelling ``bench_attention --docs`` would refuse, or a list of them."""
    # torch-importing module (the benchmark's mix parser); only reached with --docs
    from megatron.bench.cli import BenchConfigError
    from megatron.bench.document_bench import parse_doc_mixes

    if not isinstance(mix, str) or "," in mix:
        raise PlannerError(f"--docs {mix!r}: one mix, e.g. --docs lognormal; use {MIX_HELP}")
    try:
        parse_doc_mixes(mix)
    except BenchConfigError:
        raise PlannerError(f"--docs {mix!r}: use {MIX_HELP}") from None


def _source_lengths(docs: Documents, tokens: int) -> Sequence[int]:
    """The documents' lengths, at least ``tokens`` of them unless given explicitly."""
    if docs.lengths is not None:
        return docs.lengths
    # torch-importing module (the benchmark's mixes); only with packed documents
    from megatron.bench.document_bench import mix_lengths

    lengths = mix_lengths(docs.mix, tokens, SEED)
    if lengths is None:
        raise PlannerError(f"--docs {docs.mix}: the embedded corpus is not available here "
                           f"(megatron/training/data/corpus.py cannot build it); try --docs "
                           f"lognormal")
    return lengths


@functools.lru_cache(maxsize=64)
def packed_lengths(docs: Documents, seq_len: int, samples: int) -> Tuple[int, ...]:
    """The whole documents that ``samples`` packed samples of ``seq_len`` hold, in packing
    order (cycled when they run out; the last may run past the samples' end)."""
    lengths = [int(n) for n in _source_lengths(docs, seq_len * samples) if int(n) > 0]
    out, total = [], 0
    while total < seq_len * samples:
        out.append(lengths[len(out) % len(lengths)])
        total += out[-1]
    return tuple(out)


@functools.lru_cache(maxsize=64)
def packed_samples(docs: Documents, seq_len: int, samples: int):
    """Segment ids ``[samples, seq_len]`` of the documents packed as the data loader packs
    them."""
    # torch-importing module (load_balance via token_order); only with packed documents
    from megatron.usp.load_balance import segments_from_lengths

    return segments_from_lengths(packed_lengths(docs, seq_len, samples), seq_len, samples)


@functools.lru_cache(maxsize=64)
def sample_lengths(docs: Documents, seq_len: int, samples: int) -> Rows:
    """Document lengths of each packed sample (a sample's ends cut its first and last)."""
    import numpy as np  # with the packing: the planner without --docs needs no numpy

    # the packing numbers each sample's documents 0, 1, ... in order
    return tuple(tuple(int(n) for n in np.bincount(row))
                 for row in packed_samples(docs, seq_len, samples))


def plan_samples(micro_batch_size: int) -> int:
    """Packed samples the plan is costed on: :data:`SAMPLE_MICRO_BATCHES` micro-batches."""
    return SAMPLE_MICRO_BATCHES * micro_batch_size


def plan_tokens(seq_len: int, micro_batch_size: int) -> int:
    """Tokens of the plan's packed samples: how many a caller's lengths should fill."""
    return seq_len * plan_samples(micro_batch_size)


def describe(docs: Documents, seq_len: int, micro_batch_size: int) -> str:
    """The documents in the plan's words: their name, median length and how many documents
    the plan's samples hold."""
    samples = plan_samples(micro_batch_size)
    lengths = sorted(packed_lengths(docs, seq_len, samples))
    mid = len(lengths) // 2
    median = lengths[mid] if len(lengths) % 2 else (lengths[mid - 1] + lengths[mid]) / 2
    size = f"{median / 1024:.1f}K" if median >= 1024 else f"{median:g}"
    return (f"{docs.name()}, median {size}, {len(lengths)} documents in {samples} samples "
            f"of {seq_len}")


def layer_pairs(rows: Rows, window: Optional[int] = None) -> float:
    """Attention pairs of one layer per sample, the mean over the samples: causal documents,
    or inside the left ``window`` on a window layer."""
    per = [document_pairs(r) if window is None else window_pairs(r, window) for r in rows]
    return sum(per) / len(per)


def mean_shape_pairs(model: ModelShape, rows: Rows) -> float:
    """The training loop's pairs per sample (:func:`~megatron.shapes.shape_pairs`: the mean
    over the model's layers), the mean over the samples."""
    return sum(shape_pairs(model, r) for r in rows) / len(rows)


def kernel_tokens(rows: Rows) -> float:
    """The pair-weighted mean document length ``sum n^3 / sum n^2`` (a document's share of the
    attention work is its ``n^2/2`` pairs)."""
    flat: Sequence[int] = [n for r in rows for n in r]
    return float(sum(n ** 3 for n in flat)) / float(sum(n * n for n in flat))


@dataclass(frozen=True)
class DocumentRing:
    """The document ring of one ``U x R`` split, the mean over the plan's micro-batches:
    the work ``spread`` of the loader's assignment (busiest ring rank over the mean, less
    one) and the K/V tokens its busiest ring rank ``sent`` and ``received`` in one forward."""

    spread: float
    sent: float
    received: float


@functools.lru_cache(maxsize=256)
def document_ring(docs: Documents, seq_len: int, micro_batch_size: int, ulysses: int,
                  ring: int) -> DocumentRing:
    """:class:`DocumentRing` of ``docs`` at ``seq_len`` under ``ulysses x ring``."""
    # torch-importing module (load_balance imports token_order); only with --docs
    from megatron.usp.load_balance import balance_chunks, ring_rank_kv_tokens

    b = micro_batch_size
    seg = packed_samples(docs, seq_len, plan_samples(b))
    spreads, sent, received = [], [], []
    for i in range(SAMPLE_MICRO_BATCHES):
        batch = seg[i * b:(i + 1) * b]
        bal = balance_chunks(batch, ulysses, ring)
        counts = ring_rank_kv_tokens(batch, ring, bal.assignment)
        spreads.append(bal.spread)
        sent.append(int(counts[0].max()))
        received.append(int(counts[1].max()))
    k = float(SAMPLE_MICRO_BATCHES)
    return DocumentRing(sum(spreads) / k, sum(sent) / k, sum(received) / k)
