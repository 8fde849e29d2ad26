"""Packed documents in the planner: ``--docs MIX`` (``--reset-attention-mask
--reset-position-ids``, EOD-delimited documents, attention inside each document).

The plan is costed on a few representative packed samples of the planned length: the
document lengths of the mix (:func:`megatron.bench.document_bench.mix_lengths`, the mixes of
``bench_attention --docs`` and ``bench_e2e --docs``, seed :data:`SEED`) packed back to back,
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

The mix and the packing live in modules that import torch (``load_balance`` imports
``token_order``); they are imported inside the functions, so the planner without ``--docs``
stays torch-free.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from megatron.planner.errors import PlannerError
from megatron.shapes import ModelShape, document_pairs, shape_pairs, window_pairs

SEED = 0
SAMPLE_MICRO_BATCHES = 4
DOCUMENT_FLAGS = ("--reset-attention-mask", "--reset-position-ids")
MIX_HELP = ("fixed:N (e.g. fixed:2k), uniform:N (lengths uniform in 1..N-1), lognormal "
            "(median 2K) or corpus (the embedded corpus's documents)")

Rows = Tuple[Tuple[int, ...], ...]


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


@functools.lru_cache(maxsize=64)
def packed_samples(mix: str, seq_len: int, samples: int):
    """Segment ids ``[samples, seq_len]`` of the mix packed as the data loader packs it."""
    # torch-importing modules (mixes, and load_balance via token_order); only with --docs
    from megatron.bench.document_bench import mix_lengths
    from megatron.usp.load_balance import segments_from_lengths

    check_mix(mix)
    lengths = mix_lengths(mix, seq_len * samples, SEED)
    if lengths is None:
        raise PlannerError(f"--docs {mix}: the embedded corpus is not available here "
                           f"(megatron/training/data/corpus.py cannot build it); try --docs "
                           f"lognormal")
    return segments_from_lengths(lengths, seq_len, samples)


@functools.lru_cache(maxsize=64)
def sample_lengths(mix: str, seq_len: int, samples: int) -> Rows:
    """Document lengths of each packed sample (a sample's ends cut its first and last)."""
    import numpy as np  # with the packing: the planner without --docs needs no numpy

    # the packing numbers each sample's documents 0, 1, ... in order
    return tuple(tuple(int(n) for n in np.bincount(row))
                 for row in packed_samples(mix, seq_len, samples))


def plan_samples(micro_batch_size: int) -> int:
    return SAMPLE_MICRO_BATCHES * micro_batch_size


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
def document_ring(mix: str, seq_len: int, micro_batch_size: int, ulysses: int,
                  ring: int) -> DocumentRing:
    """:class:`DocumentRing` of ``mix`` at ``seq_len`` under ``ulysses x ring``."""
    # torch-importing module (load_balance imports token_order); only with --docs
    from megatron.usp.load_balance import balance_chunks, ring_rank_kv_tokens

    b = micro_batch_size
    seg = packed_samples(mix, seq_len, plan_samples(b))
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
