"""Balancing document-masked causal attention over the ring ranks: work model and assignment.

Work model. Under the causal document mask a query at offset ``p`` inside its document (0 for
the first token) sees ``p + 1`` keys, so its attention work is ``p + 1`` (FLOPs are proportional
to visible pairs; the kernels skip masked pairs). After the Ulysses all-to-all a ring rank
computes attention for every token of its U context-parallel ranks (on ``heads/U`` heads), so
the work to balance is per *ring rank*; the U ranks of one ring rank share its work equally and
every rank holds ``S/CP`` tokens, so the per-token parts of the model stay balanced.

With documents the zigzag order (:func:`megatron.usp.token_order.zigzag_assignment`) is no
longer balanced: a 2K-token document in chunk 0 costs as much as one in chunk 2R-1.
:func:`balance_chunks` first tries contiguous ranges (each ring rank one ``1/R`` of the
sequence: few documents cross ranks, so the document ring skips most K/V blocks) and keeps
them when they are within ``target``; else it cuts the sequence into ``2*U*R*m`` equal chunks
for a few ``m`` and assigns them to ring ranks (``2*U*m`` each) by greedy largest-first
placement followed by pairwise swaps between the heaviest and the lightest rank, keeping the
assignment with the smallest spread. Zigzag is returned when it is at least as good. The data loader calls it once per
micro-batch (``megatron.training.data.documents``); :mod:`megatron.usp.token_order` describes the
result, and everything sharded (tokens, labels, loss mask, positions, segments) follows it.

``spread`` = ``max |w_r - mean| / mean`` over ring ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from megatron.usp.token_order import ChunkAssignment, zigzag_assignment

# Prefer the coarsest chunking whose spread is at most this (fewer, longer runs per rank).
BALANCE_TARGET = 0.02
# Chunks finer than the zigzag order's (m > 1) must hold at least this many tokens. Long
# sequences never get near it (128K tokens over 2*8*16 chunks are 512 each); it keeps short
# ones from degenerating into single tokens.
MIN_CHUNK_TOKENS = 4
GROUP_CHUNK_CHOICES = (1, 2, 4, 8, 16)


def token_work(segment_ids: np.ndarray, causal: bool = True) -> np.ndarray:
    """Attention work of every token, summed over the batch: ``[b, s]`` or ``[s]`` -> ``[s]``.

    Causal: offset inside the document + 1; bidirectional: the document's length.
    """
    seg = np.atleast_2d(np.asarray(segment_ids, dtype=np.int64))
    b, s = seg.shape
    work = np.zeros(s, dtype=np.float64)
    for row in seg:
        starts = np.flatnonzero(np.concatenate([[True], row[1:] != row[:-1]]))
        lengths = np.diff(np.concatenate([starts, [s]]))
        if causal:
            first = np.repeat(starts, lengths)
            work += np.arange(s) - first + 1
        else:
            work += np.repeat(lengths, lengths)
    return work


def segments_from_lengths(doc_lengths: Sequence[int], seq_len: int, num_samples: int
                          ) -> np.ndarray:
    """Pack documents back to back into ``num_samples`` samples of ``seq_len`` tokens.

    As megatron-core's ``GPTDataset``: a document that does not fit continues in the next
    sample, where it is a new segment (attention restarts at a sample boundary); the lengths
    are cycled when they run out. Returns segment ids ``[num_samples, seq_len]``.
    """
    lengths = [int(n) for n in doc_lengths if int(n) > 0]
    if not lengths:
        raise ValueError("no document of positive length")
    total = seq_len * num_samples
    reps = -(-total // sum(lengths))
    doc_of_token = np.repeat(np.arange(len(lengths) * reps), np.tile(lengths, reps))[:total]
    seg = doc_of_token.reshape(num_samples, seq_len)
    return seg - seg[:, :1]


def ring_rank_work(work: np.ndarray, assignment: ChunkAssignment) -> np.ndarray:
    """Work of each ring rank under ``assignment`` (``work``: per token, :func:`token_work`)."""
    chunks = chunk_work(work, assignment.num_chunks)
    return np.array([chunks[list(ids)].sum() for ids in assignment.ring_chunks])


def chunk_work(work: np.ndarray, num_chunks: int) -> np.ndarray:
    if work.size % num_chunks:
        raise ValueError(f"{work.size} tokens do not cut into {num_chunks} equal chunks")
    return work.reshape(num_chunks, -1).sum(axis=1)


def spread(rank_work: Sequence[float]) -> float:
    """``max |w - mean| / mean`` (0 for perfect balance)."""
    w = np.asarray(rank_work, dtype=np.float64)
    mean = w.mean()
    return float(np.abs(w - mean).max() / mean) if mean > 0 else 0.0


def document_rank_work(doc_lengths: Sequence[int], seq_len: int, assignment: ChunkAssignment,
                       num_samples: int = 1) -> np.ndarray:
    """Per-ring-rank attention work of documents of ``doc_lengths`` packed into samples."""
    return ring_rank_work(token_work(segments_from_lengths(doc_lengths, seq_len, num_samples)),
                          assignment)


def _greedy(chunks: np.ndarray, ring: int, per_rank: int) -> List[List[int]]:
    """Largest first onto the lightest ring rank that still has room."""
    bins: List[List[int]] = [[] for _ in range(ring)]
    sums = np.zeros(ring)
    for cid in np.argsort(-chunks, kind="stable"):
        open_bins = [r for r in range(ring) if len(bins[r]) < per_rank]
        r = min(open_bins, key=lambda i: (sums[i], i))
        bins[r].append(int(cid))
        sums[r] += chunks[cid]
    return bins


def _improve(chunks: np.ndarray, bins: List[List[int]], rounds: int = 64) -> None:
    """Swap one chunk between the heaviest and the lightest rank while that narrows them."""
    for _ in range(rounds):
        sums = np.array([chunks[b].sum() for b in bins])
        hi, lo = int(sums.argmax()), int(sums.argmin())
        gap = sums[hi] - sums[lo]
        if gap <= 0:
            return
        a = chunks[bins[hi]][:, None]
        b = chunks[bins[lo]][None, :]
        delta = a - b                              # what moves from hi to lo
        gain = np.where((delta > 0) & (delta < gap), np.abs(gap - 2 * delta), np.inf)
        i, j = np.unravel_index(np.argmin(gain), gain.shape)
        if not np.isfinite(gain[i, j]) or gain[i, j] >= gap:
            return
        bins[hi][i], bins[lo][j] = bins[lo][j], bins[hi][i]


@dataclass(frozen=True)
class Balance:
    """What :func:`balance_chunks` chose: the assignment, its spread and zigzag's."""

    assignment: ChunkAssignment
    spread: float
    zigzag_spread: float

    @property
    def is_zigzag(self) -> bool:
        return self.assignment.is_zigzag()


def contiguous_assignment(ulysses: int, ring: int) -> ChunkAssignment:
    """Ring rank ``r`` holds the ``r``-th contiguous ``1/R`` of the sequence (``2*U*R``
    chunks, ``2U`` each)."""
    per = 2 * ulysses
    return ChunkAssignment(ulysses, tuple(tuple(range(r * per, (r + 1) * per))
                                          for r in range(ring)))


def assign_chunks(work: np.ndarray, ulysses: int, ring: int, group_chunks: int
                  ) -> ChunkAssignment:
    """A balanced assignment of ``2*U*R*m`` chunks (``m = group_chunks``) to the ring ranks."""
    n = 2 * ulysses * ring * group_chunks
    chunks = chunk_work(work, n)
    bins = _greedy(chunks, ring, n // ring)
    _improve(chunks, bins)
    return ChunkAssignment(ulysses, tuple(tuple(sorted(b)) for b in bins))


def balance_chunks(work: np.ndarray, ulysses: int, ring: int,
                   group_choices: Sequence[int] = GROUP_CHUNK_CHOICES,
                   min_chunk_tokens: int = MIN_CHUNK_TOKENS,
                   target: float = BALANCE_TARGET) -> Balance:
    """The chunk assignment to use for a micro-batch whose per-token work is ``work``.

    Tries each ``m`` of ``group_choices`` whose chunks divide the sequence (coarsest first;
    ``m > 1`` only while chunks hold at least ``min_chunk_tokens`` tokens), keeps the first one
    within ``target`` or
    else the best; returns zigzag when its spread is not larger. With one ring rank there is
    nothing to balance (zigzag).
    """
    zig = zigzag_assignment(ulysses, ring)
    zig_spread = spread(ring_rank_work(work, zig))
    if ring == 1:
        return Balance(zig, zig_spread, zig_spread)
    # Contiguous ranges first: when they balance, at most R-1 documents cross a ring rank.
    contiguous = contiguous_assignment(ulysses, ring)
    contiguous_spread = spread(ring_rank_work(work, contiguous))
    if contiguous_spread <= target and contiguous_spread < zig_spread:
        return Balance(contiguous, contiguous_spread, zig_spread)
    best: Optional[Balance] = None
    for m in sorted(group_choices):
        n = 2 * ulysses * ring * m
        if work.size % n or (m > 1 and work.size // n < min_chunk_tokens):
            continue
        cand = assign_chunks(work, ulysses, ring, m)
        s = spread(ring_rank_work(work, cand))
        if best is None or s < best.spread:
            best = Balance(cand, s, zig_spread)
        if s <= target:
            break
    if best is None or zig_spread <= best.spread:
        return Balance(zig, zig_spread, zig_spread)
    return best
