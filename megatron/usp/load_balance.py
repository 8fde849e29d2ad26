"""Balancing document-masked causal attention over the ring ranks: work model, ring traffic
and the chunk assignment.

Work model. Under the causal document mask a query at offset ``p`` inside its document (0 for
the first token) sees ``p + 1`` keys, so its attention work is ``p + 1`` (FLOPs are proportional
to visible pairs; the kernels skip masked pairs). After the Ulysses all-to-all a ring rank
computes attention for every token of its U context-parallel ranks (on ``heads/U`` heads), so
the work to balance is per *ring rank*; the U ranks of one ring rank share its work equally and
every rank holds ``S/CP`` tokens, so the per-token parts of the model stay balanced. With
documents the zigzag order (:func:`megatron.usp.token_order.zigzag_assignment`) is no longer
balanced: a 2K-token document in chunk 0 costs as much as one in chunk 2R-1.

Ring traffic. The document ring (:mod:`megatron.usp.document_ring`) sends ring rank ``r`` the
key at position ``p`` of another ring rank iff ``r`` holds a position ``q >= p`` of ``p``'s
document. Documents are contiguous runs of a sample (EOD cuts make them), so with the sequence
cut into ``N`` equal chunks the count splits over ring ranks: walking through ring rank ``r``'s
chunks in order, chunk ``k`` adds the tokens between ``r``'s previous chunk and ``k`` whose
document reaches ``k`` in some sample, ``gaps[prev + 1, k]`` (:func:`gap_tokens`). A run of
consecutive chunks pays only at its start, and nothing when it starts on a document boundary:
the ring moves (at most) the front part of each document cut where a run starts.

Assignment. :func:`balance_chunks` (once per micro-batch, in the data loader) first balances the
work alone (:func:`work_balance`): contiguous ranges when within ``target``, else ``2*U*R*m``
equal chunks for ``m = 1, 2, 4, ...`` (the first within ``target``, else the best) placed
largest-first with swaps between the heaviest and the lightest ring rank, zigzag when not
worse. Its spread ``s0`` sets the bound ``max(target, s0)``. Then it searches, on ``2*U*R*m``
chunks with the largest ``m`` that gives at most :data:`SEARCH_CHUNKS`, for assignments within
the bound that move fewer K/V tokens (:func:`local_assignments`), from two starts: contiguous
ranges, and the cheapest *nested* assignment (ring rank ``r`` holds the interval ``I_r`` minus
``I_{r+1}``, ``I_0`` the whole sequence, ``|I_r| = (R - r) S / R``: contiguous ranges and
zigzag are two of them), found exactly by dynamic programming over the interval starts with
the bound widened in steps until one exists. Each start is brought within half the bound,
then within the bound (:data:`SEARCH_BANDS`): a start outside the band is repaired by chunk
swaps out of the ring rank furthest outside it (the fewest added tokens among swaps that
bring both ranks in, else the swap that removes the most excess); then swaps that keep both
ranks within the band and lower the count are made, best first, one per pair of disjoint
ranks per round, until none is left. Of the work-only assignment, zigzag and the searched
ones within the bound, those that move at most :data:`TOKEN_SLACK` of the whole blocks more
than the fewest (and no more than the work-only one) are as good, and the lowest spread
among them wins (then fewer tokens, fewer chunks, the earlier candidate). Ring ranks of a
searched assignment are numbered in the order of their first chunk and it is written with
the fewest chunks that express it, so zigzag comes back as zigzag.
:mod:`megatron.usp.token_order` describes the result, and everything sharded (tokens,
labels, loss mask, positions, segments) follows it.

Every step is a function of (segment ids, U, R): integer token counts, work sums of integers
(exact in float64), a fixed order of candidates and ties broken by the lowest index, bounded
rounds and no clock, so every rank of a context-parallel group computes the same assignment
bit for bit.

``spread`` = ``max |w_r - mean| / mean`` over ring ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from megatron.usp.token_order import ChunkAssignment, zigzag_assignment

# Prefer the coarsest chunking whose spread is at most this (fewer, longer runs per rank).
BALANCE_TARGET = 0.02
# Chunks finer than the zigzag order's (m > 1) must hold at least this many tokens. Long
# sequences never get near it (128K tokens over 2*8*16 chunks are 512 each); it keeps short
# ones from degenerating into single tokens.
MIN_CHUNK_TOKENS = 4
GROUP_CHUNK_CHOICES = (1, 2, 4, 8, 16)
# The locality search runs on at most this many chunks (the largest m of the choices with
# 2*U*R*m <= it; m = 1 when even that is more): each swap round prices every pair of chunks.
SEARCH_CHUNKS = 128
# Nested starts: the band the dynamic programme must meet, as multiples of the allowed
# spread, tried in turn until one admits a nested assignment (inf: any spread).
NESTED_BAND_STEPS = (1.0, 2.5, 5.0, 10.0, 25.0, float("inf"))
# Assignments whose ring moves at most this fraction of the zigzag ring's whole blocks
# ((R-1)*S tokens per forward) more than the fewest count as moving as few: the lowest
# spread among them wins (one document over the sequence stays zigzag, exactly balanced,
# rather than trading 1.5 % of balance for 0.3 % of its bytes).
TOKEN_SLACK = 0.01
# The search keeps each start within these fractions of the spread bound in turn, the next
# continuing from the previous one's result: a tighter band's assignment often moves
# nearly as few tokens (TOKEN_SLACK then prefers it).
SEARCH_BANDS = (0.5, 1.0)
# Bound on the swap rounds of a repair or an improvement, per chunk (each round strictly
# lowers the excess or the token count, so they end sooner in practice).
ROUNDS_PER_CHUNK = 4


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


# --------------------------------------------------------------------------- ring traffic
def document_ends(segment_ids: np.ndarray) -> np.ndarray:
    """Last position of every token's document, the latest over the samples: ``[b, s]`` or
    ``[s]`` -> ``[s]`` (a document is a run of equal segment ids, as in :func:`token_work`)."""
    seg = np.atleast_2d(np.asarray(segment_ids, dtype=np.int64))
    s = seg.shape[1]
    ends = np.zeros(s, dtype=np.int64)
    for row in seg:
        starts = np.flatnonzero(np.concatenate([[True], row[1:] != row[:-1]]))
        bounds = np.concatenate([starts, [s]])
        ends = np.maximum(ends, np.repeat(bounds[1:] - 1, np.diff(bounds)))
    return ends


def _reach(ends: np.ndarray, n: int) -> np.ndarray:
    """``reach[c, k]`` (``[n, n]`` int64): the tokens of chunk ``c`` whose document reaches
    chunk ``k > c`` in some sample (zero for ``k <= c``: a chunk's own tokens never move to
    it), the sequence cut into ``n`` equal chunks (``ends``: :func:`document_ends`)."""
    if ends.size % n:
        raise ValueError(f"{ends.size} tokens do not cut into {n} equal chunks")
    chunk = ends.size // n
    last = ends // chunk                              # chunk of each token's document end
    count = np.bincount(np.arange(ends.size) // chunk * n + last, minlength=n * n)
    return np.triu(np.cumsum(count.reshape(n, n)[:, ::-1], axis=1)[:, ::-1], 1)


def gap_tokens(ends: np.ndarray, num_chunks: int) -> np.ndarray:
    """``gaps[i, k]`` (``[N + 1, N + 1]`` int64, ``N = num_chunks``): the tokens of chunks
    ``i .. k-1`` whose document reaches chunk ``k`` in some sample (``ends``:
    :func:`document_ends`); zero for ``i >= k`` and in column ``N`` (no chunk)."""
    n = num_chunks
    reach = _reach(ends, n)
    gaps = np.zeros((n + 1, n + 1), dtype=np.int64)
    gaps[:n, :n] = np.cumsum(reach[::-1], axis=0)[::-1]
    return gaps


def ring_rank_kv_tokens(segment_ids: np.ndarray, ring: int,
                        assignment: Optional[ChunkAssignment] = None) -> np.ndarray:
    """:func:`ring_kv_tokens` split by ring rank: ``[2, R]`` int64, row 0 the tokens whose K/V
    each ring rank sends in one forward, row 1 those it receives (each row sums to
    :func:`ring_kv_tokens`). Receiver ``r``'s chunk ``k`` after its chunk ``p`` gets the
    tokens of chunks ``p+1 .. k-1`` whose document reaches ``k``, each from its chunk's owner."""
    assignment = assignment or zigzag_assignment(1, ring)
    if ring == 1:
        return np.zeros((2, 1), dtype=np.int64)
    n = assignment.num_chunks
    reach = _reach(document_ends(segment_ids), n)
    owner = _owners(assignment)
    _, _, prev, _ = _neighbours(owner, ring)
    idx = np.arange(n)
    moved = reach * ((idx[:, None] > prev[None, :]) & (owner[:, None] != owner[None, :]))
    out = np.zeros((2, ring), dtype=np.int64)
    out[0] = np.bincount(owner, weights=moved.sum(axis=1), minlength=ring).astype(np.int64)
    out[1] = np.bincount(owner, weights=moved.sum(axis=0), minlength=ring).astype(np.int64)
    return out


def _owners(assignment: ChunkAssignment) -> np.ndarray:
    owner = np.empty(assignment.num_chunks, dtype=np.int64)
    for r, chunks in enumerate(assignment.ring_chunks):
        owner[list(chunks)] = r
    return owner


def _neighbours(owner: np.ndarray, ring: int):
    """``pred[x, c]`` / ``succ[x, c]``: ring rank ``x``'s last chunk before / first after
    ``c`` (-1 / N when none), and each chunk's previous / next chunk of its own rank."""
    n = owner.size
    idx = np.arange(n)
    mine = owner[None, :] == np.arange(ring)[:, None]
    upto = np.maximum.accumulate(np.where(mine, idx, -1), axis=1)
    onward = np.minimum.accumulate(np.where(mine, idx, n)[:, ::-1], axis=1)[:, ::-1]
    pred = np.concatenate([np.full((ring, 1), -1), upto[:, :-1]], axis=1)
    succ = np.concatenate([onward[:, 1:], np.full((ring, 1), n)], axis=1)
    return pred, succ, pred[owner, idx], succ[owner, idx]


def _kv_tokens(gaps: np.ndarray, owner: np.ndarray, ring: int) -> int:
    _, _, prev, _ = _neighbours(owner, ring)
    return int(gaps[prev + 1, np.arange(owner.size)].sum())


def ring_kv_tokens(segment_ids: np.ndarray, ring: int,
                   assignment: Optional[ChunkAssignment] = None) -> int:
    """Tokens whose K/V the document ring moves in one forward over the whole ring
    (``DocumentRingPlan.ring_kv_tokens``) under ``assignment`` (None: zigzag), for segment
    ids ``[b, s]`` whose documents are contiguous runs."""
    if ring == 1:
        return 0
    assignment = assignment or zigzag_assignment(1, ring)
    gaps = gap_tokens(document_ends(segment_ids), assignment.num_chunks)
    return _kv_tokens(gaps, _owners(assignment), ring)


# --------------------------------------------------------------------------- search
def _swap_costs(flat_gaps: np.ndarray, owner: np.ndarray, ring: int, rows: np.ndarray
                ) -> np.ndarray:
    """``cost[i, b]``: change of the token count when chunk ``a = rows[i]`` and chunk ``b``
    trade ring ranks (meaningless where they share one). Only the two ranks' counts change:
    ``a`` leaves its rank (its neighbours there close up) and ``b`` enters it between its
    new neighbours, and the other way round."""
    n = owner.size
    width = n + 1                                     # gaps is [n + 1, n + 1], flattened
    idx = np.arange(n)
    pred, succ, prev, nxt = _neighbours(owner, ring)
    leave = (flat_gaps[(prev + 1) * width + nxt] - flat_gaps[(prev + 1) * width + idx]
             - flat_gaps[(idx + 1) * width + nxt])
    a = rows[:, None]

    def enter(chunk, before, after, gone, gone_prev, gone_next):
        """``chunk`` joins the rank whose chunks around it are ``before`` / ``after``,
        skipping ``gone`` (the chunk it replaces)."""
        before = np.where(before == gone, gone_prev, before)
        after = np.where(after == gone, gone_next, after)
        row = (before + 1) * width
        return (flat_gaps[row + chunk] + flat_gaps[(chunk + 1) * width + after]
                - flat_gaps[row + after])

    b_in = enter(idx[None, :], pred[owner[rows]], succ[owner[rows]], a,
                 prev[rows][:, None], nxt[rows][:, None])
    a_in = enter(a, pred[owner[None, :], a], succ[owner[None, :], a], idx[None, :],
                 prev[None, :], nxt[None, :])
    return leave[rows][:, None] + leave[None, :] + b_in + a_in


def _excess(work, mean: float, band: float):
    return np.maximum(0.0, np.abs(work - mean) - band)


def _repair(chunks: np.ndarray, flat_gaps: np.ndarray, owner: np.ndarray, ring: int,
            band: float) -> bool:
    """Swap chunks (in place) until every ring rank is within ``band`` of the mean work;
    False when no swap lowers the excess any more."""
    mean = chunks.sum() / ring
    for _ in range(ROUNDS_PER_CHUNK * owner.size):
        work = np.bincount(owner, weights=chunks, minlength=ring)
        excess = _excess(work, mean, band)
        if not excess.any():
            return True
        x = int(np.argmax(excess))
        rows = np.flatnonzero(owner == x)
        moved = chunks[rows][:, None] - chunks[None, :]          # work x hands to b's rank
        out_x = _excess(work[x] - moved, mean, band)
        out_y = _excess(work[owner][None, :] + moved, mean, band)
        gain = excess[x] + excess[owner][None, :] - out_x - out_y
        valid = (owner[None, :] != x) & (gain > 0)
        if not valid.any():
            return False
        inside = valid & (out_x == 0) & (out_y == 0)
        if inside.any():
            cost = _swap_costs(flat_gaps, owner, ring, rows)
            k = int(np.argmin(np.where(inside, cost, np.iinfo(np.int64).max)))
        else:
            k = int(np.argmax(np.where(valid, gain, -1.0)))
        i, b = divmod(k, owner.size)
        a = int(rows[i])
        owner[a], owner[b] = owner[b], owner[a]
    return not _excess(np.bincount(owner, weights=chunks, minlength=ring),
                       mean, band).any()


def _improve_locality(chunks: np.ndarray, flat_gaps: np.ndarray, owner: np.ndarray,
                      ring: int, band: float) -> None:
    """Swaps (in place) that keep both ranks within ``band`` and move fewer tokens: per
    round the best swap of each pair of ring ranks, best first, on disjoint ranks."""
    n = owner.size
    mean = chunks.sum() / ring
    everything = np.arange(n)
    moved = chunks[:, None] - chunks[None, :]
    for _ in range(ROUNDS_PER_CHUNK * n):
        work = np.bincount(owner, weights=chunks, minlength=ring)
        cost = _swap_costs(flat_gaps, owner, ring, everything)
        x, y = owner[:, None], owner[None, :]
        ok = ((x < y) & (cost < 0) & (np.abs(work[x] - moved - mean) <= band)
              & (np.abs(work[y] + moved - mean) <= band))
        found = np.flatnonzero(ok)
        if not found.size:
            return
        pair = (x * ring + y).ravel()[found]
        order = np.lexsort((found, cost.ravel()[found], pair))   # per pair, cheapest first
        first = order[np.concatenate([[True], pair[order][1:] != pair[order][:-1]])]
        best = found[first[np.lexsort((found[first], cost.ravel()[found[first]]))]]
        used = np.zeros(ring, dtype=bool)
        for k in best:
            a, b = divmod(int(k), n)
            if not (used[owner[a]] or used[owner[b]]):
                used[owner[a]] = used[owner[b]] = True
                owner[a], owner[b] = owner[b], owner[a]


def _nested(chunks: np.ndarray, gaps: np.ndarray, ring: int, band: float
            ) -> Optional[np.ndarray]:
    """The cheapest nested assignment within ``band`` (module docstring), or None.

    ``I_r`` starts at chunk ``s_r`` (``s_0 = 0``) and holds ``(R - r) K`` chunks, ``K = N/R``;
    ``s_r - s_{r-1} = d`` in ``0 .. K``. Ring rank ``r - 1`` holds ``[s_{r-1}, s_r)`` and
    ``[s_r + (R - r) K, s_{r-1} + (R - r + 1) K)``; its work and tokens depend on
    ``(s_{r-1}, s_r)`` only, so the best path over ``s_1 .. s_{R-1}`` is exact.
    """
    n = chunks.size
    per = n // ring
    prefix = np.concatenate([[0.0], np.cumsum(chunks)])
    mean = prefix[-1] / ring
    step = np.arange(per + 1)
    best = np.zeros(1)                                # over s_{r-1}; s_0 = 0
    choices = []
    for r in range(1, ring):
        a = np.arange((r - 1) * per + 1)[:, None]     # s_{r-1}
        b = a + step[None, :]                         # s_r
        inner_end = b + (ring - r) * per
        work = (prefix[a + (ring - r + 1) * per] - prefix[a]) - (prefix[inner_end] - prefix[b])
        front = b > a
        tokens = (np.where(front, gaps[0, a], 0)
                  + np.where(step[None, :] < per, gaps[np.where(front, b, 0), inner_end], 0))
        total = np.where(np.abs(work - mean) <= band, best[:, None] + tokens, np.inf)
        # best over s_{r-1} for each s_r: s_{r-1} = s_r - d, lowest d on ties
        s = np.arange(r * per + 1)[:, None]
        src = s - step[None, :]
        valid = (src >= 0) & (src <= (r - 1) * per)
        reach = np.where(valid, total[np.clip(src, 0, (r - 1) * per), step[None, :]], np.inf)
        pick = np.argmin(reach, axis=1)
        best = reach[np.arange(s.size), pick]
        choices.append(s[:, 0] - pick)
    s = np.arange((ring - 1) * per + 1)
    last = np.where(np.abs(prefix[s + per] - prefix[s] - mean) <= band,
                    best + gaps[0, s], np.inf)
    end = int(np.argmin(last))
    if not np.isfinite(last[end]):
        return None
    starts = [end]
    for pick in reversed(choices):
        starts.append(int(pick[starts[-1]]))
    starts.reverse()
    owner = np.empty(n, dtype=np.int64)
    for r, s_r in enumerate(starts):
        owner[s_r:s_r + (ring - r) * per] = r
    return owner


def _assignment(owner: np.ndarray, ulysses: int, ring: int) -> ChunkAssignment:
    """The assignment of ``owner`` with ring ranks numbered by their first chunk, on the
    fewest chunks that express it (``2*U*R*m'`` for a divisor ``m'`` of ``m``)."""
    m = owner.size // (2 * ulysses * ring)
    for f in range(m, 0, -1):
        if m % f == 0 and (owner.reshape(-1, f) == owner[::f, None]).all():
            owner = owner[::f]
            break
    first = np.full(ring, owner.size)
    np.minimum.at(first, owner, np.arange(owner.size))
    label = np.empty(ring, dtype=np.int64)
    label[np.argsort(first, kind="stable")] = np.arange(ring)
    owner = label[owner]
    return ChunkAssignment(ulysses, tuple(tuple(np.flatnonzero(owner == r).tolist())
                                          for r in range(ring)))


def _search_group_chunks(seq_len: int, ulysses: int, ring: int, group_choices: Sequence[int],
                         min_chunk_tokens: int) -> int:
    usable = [m for m in sorted(group_choices) if m == 1 or (
        seq_len % (2 * ulysses * ring * m) == 0
        and seq_len // (2 * ulysses * ring * m) >= min_chunk_tokens)]
    small = [m for m in usable if 2 * ulysses * ring * m <= SEARCH_CHUNKS]
    return max(small) if small else 1


def local_assignments(work: np.ndarray, gaps: np.ndarray, ulysses: int, ring: int,
                      spread_bound: float) -> List[ChunkAssignment]:
    """The searched assignments within ``spread_bound`` (module docstring), from contiguous
    ranges and from the cheapest nested assignment, on the ``N`` chunks of ``gaps``
    (:func:`gap_tokens`, ``[N + 1, N + 1]``; ``N`` a multiple of ``2*U*R``)."""
    n = gaps.shape[0] - 1
    chunks = chunk_work(work, n)
    band = spread_bound * chunks.sum() / ring
    flat = gaps.ravel()
    starts = [np.repeat(np.arange(ring), n // ring)]
    for widen in NESTED_BAND_STEPS:
        nested = _nested(chunks, gaps, ring, np.inf if np.isinf(widen) else band * widen)
        if nested is not None:
            if not np.array_equal(nested, starts[0]):
                starts.append(nested)
            break
    found = []
    for owner in starts:
        for share in SEARCH_BANDS:
            if _repair(chunks, flat, owner, ring, band * share):
                _improve_locality(chunks, flat, owner, ring, band * share)
                found.append(_assignment(owner, ulysses, ring))
    return found


# --------------------------------------------------------------------------- assignment
@dataclass(frozen=True)
class Balance:
    """What :func:`balance_chunks` chose: the assignment, its spread and zigzag's, and the
    tokens whose K/V the document ring moves in one forward under each (0 from
    :func:`work_balance`, which does not count them)."""

    assignment: ChunkAssignment
    spread: float
    zigzag_spread: float
    kv_tokens: int = 0
    zigzag_kv_tokens: int = 0

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


def work_balance(work: np.ndarray, ulysses: int, ring: int,
                 group_choices: Sequence[int] = GROUP_CHUNK_CHOICES,
                 min_chunk_tokens: int = MIN_CHUNK_TOKENS,
                 target: float = BALANCE_TARGET) -> Balance:
    """The assignment that balances the per-token ``work`` alone (documents not kept local).

    Contiguous ranges when within ``target`` and better than zigzag; else each ``m`` of
    ``group_choices`` whose chunks divide the sequence (coarsest first; ``m > 1`` only while
    chunks hold at least ``min_chunk_tokens`` tokens), the first within ``target`` or else the
    best; zigzag when its spread is not larger. With one ring rank: zigzag.
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


def balance_chunks(segment_ids: np.ndarray, ulysses: int, ring: int,
                   group_choices: Sequence[int] = GROUP_CHUNK_CHOICES,
                   min_chunk_tokens: int = MIN_CHUNK_TOKENS,
                   target: float = BALANCE_TARGET) -> Balance:
    """The chunk assignment to use for a micro-batch of segment ids ``[b, s]`` (or ``[s]``).

    Among :func:`work_balance`'s assignment, zigzag and :func:`local_assignments`' (module
    docstring), those with a spread of at most ``max(target, work_balance's spread)``; of
    them, those whose document ring moves at most :data:`TOKEN_SLACK` of the whole blocks more
    K/V tokens than the fewest, and no more than work_balance's: the lowest spread wins, then
    fewer tokens, fewer chunks, the earlier candidate. With one ring rank: zigzag.
    """
    seg = np.atleast_2d(np.asarray(segment_ids))
    if not np.issubdtype(seg.dtype, np.integer):
        raise TypeError(f"balance_chunks takes segment ids (integers), not {seg.dtype} "
                        f"values (per-token work: work_balance)")
    work = token_work(seg)
    base = work_balance(work, ulysses, ring, group_choices, min_chunk_tokens, target)
    if ring == 1:
        return base
    bound = max(target, base.spread)
    ends = document_ends(seg)
    gaps: Dict[int, np.ndarray] = {}

    def gaps_of(n: int) -> np.ndarray:
        if n not in gaps:
            gaps[n] = gap_tokens(ends, n)
        return gaps[n]

    def tokens(assignment: ChunkAssignment) -> int:
        return _kv_tokens(gaps_of(assignment.num_chunks), _owners(assignment), ring)

    zig = zigzag_assignment(ulysses, ring)
    m = _search_group_chunks(work.size, ulysses, ring, group_choices, min_chunk_tokens)
    candidates = [base.assignment, zig] + local_assignments(
        work, gaps_of(2 * ulysses * ring * m), ulysses, ring, bound)
    scored = []                                   # (tokens, spread, chunks, order)
    for i, cand in enumerate(candidates):
        s = spread(ring_rank_work(work, cand))
        if s <= bound:                            # the work-only candidate always is
            scored.append((tokens(cand), s, cand.num_chunks, i))
    fewest = min(t for t, *_ in scored)
    near = fewest + TOKEN_SLACK * (ring - 1) * work.size
    best = min((s, t, n, i) for t, s, n, i in scored if t <= min(near, scored[0][0]))
    return Balance(candidates[best[3]], best[0], base.zigzag_spread, best[1], tokens(zig))
