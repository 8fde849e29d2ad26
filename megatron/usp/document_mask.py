"""Document masks of packed sequences, described by boundaries, never by a dense [S, S] mask.

Megatron-LM's meaning (``--reset-attention-mask``): documents are delimited by EOD tokens; the
EOD token is the last token of its document, and a token attends only to earlier tokens of its
own document (``--reset-position-ids``: positions restart after each EOD). A sample starts a new
document at its first token, also when the document began in the previous sample (megatron-core's
``GPTDataset`` packs documents across samples that way).

Per token two integers describe everything: its global ``position`` in the sample (0..S-1) and
its ``segment`` (document index in the sample, :func:`segment_ids_from_tokens`). Query token
``i`` sees key token ``j`` iff ``segment[i] == segment[j]`` and (causal) ``position[j] <=
position[i]``, and with a sliding window of ``left`` keys (megatron-core's ``window_size =
(left, 0)``) also ``position[i] - position[j] <= left``.

A rank's tokens are a list of *runs* (:func:`token_runs`): maximal stretches of local indices
whose positions are consecutive and whose segment is one. Between a query run and a key run of
the same document the visible pairs decompose into at most three *tiles* (:func:`tiles_for_block`),
each a dense rectangle (no mask) or a square with the causal mask on its diagonal, so that any
document mask is computed by ordinary attention kernels on slices, with no padding and no
token dropped. With a window each tile is first trimmed to the rows and columns the window
reaches and, where the window still cuts it, carries the flash convention's left window
(:attr:`Tile.window`: query row ``i`` of ``sq`` sees key column ``j`` of ``sk`` iff
``j >= i + sk - sq - window``), what the single-device kernels' own window support takes. :func:`dense_document_mask` builds the dense mask for tiny shapes only (tests and
the exact ``math`` path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

Tensor = torch.Tensor


def segment_ids_from_tokens(tokens: Tensor, eod: int) -> Tensor:
    """Document index of every token, Megatron-LM's meaning: ``[..., s]`` int64 -> int32.

    ``segment[t]`` = number of EOD tokens among ``tokens[..., :t]`` (the EOD closes its own
    document; the next token opens the next one).
    """
    is_eod = (tokens == eod).to(torch.int32)
    seg = torch.cumsum(is_eod, dim=-1, dtype=torch.int32) - is_eod
    return seg



# --------------------------------------------------------------------------- runs and tiles
@dataclass(frozen=True)
class Run:
    """``length`` local tokens from local index ``start``: positions ``position..+length``, one
    ``segment``."""

    start: int
    length: int
    position: int
    segment: int


def token_runs(positions: Sequence[int], segments: Sequence[int]) -> List[Run]:
    """Cut a rank's tokens (local order) into runs (module docstring)."""
    pos = np.asarray(positions, dtype=np.int64)
    seg = np.asarray(segments, dtype=np.int64)
    if pos.shape != seg.shape or pos.ndim != 1:
        raise ValueError(f"positions {pos.shape} and segments {seg.shape} must be equal 1-D")
    if pos.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(pos) != 1) | (np.diff(seg) != 0)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [pos.size]])
    return [Run(int(a), int(b - a), int(pos[a]), int(seg[a])) for a, b in zip(starts, ends)]


@dataclass(frozen=True)
class Tile:
    """Query rows ``q_start..+q_len`` x key columns ``k_start..+k_len`` (local indices of the
    block); ``causal``: a square (q_len == k_len) with the same positions on both sides, the
    causal mask on its diagonal; else every pair is visible. ``window``: a left window in
    flash's bottom-right convention (row i sees columns j >= i + k_len - q_len - window) still
    cutting the tile; None when the window (if any) reaches all of it."""

    q_start: int
    k_start: int
    q_len: int
    k_len: int
    causal: bool
    window: Optional[int] = None

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs: the useful attention work of the tile."""
        if self.window is None:
            return self.q_len * (self.q_len + 1) // 2 if self.causal else self.q_len * self.k_len
        base = np.arange(self.q_len) + self.k_len - self.q_len       # row i's diagonal column
        lo = np.maximum(0, base - self.window)
        hi = np.minimum(self.k_len - 1, base) if self.causal else np.full_like(base, self.k_len - 1)
        return int(np.maximum(0, hi - lo + 1).sum())


def window_tile(q_start: int, q_pos: int, q_len: int, k_start: int, k_pos: int, k_len: int,
                causal: bool, window: Optional[int]) -> Optional[Tile]:
    """The tile of query positions ``q_pos..+q_len`` on key positions ``k_pos..+k_len`` (local
    starts ``q_start`` / ``k_start``) under a left window, trimmed to what the window reaches;
    None when it reaches nothing.

    ``causal``: a square with the same positions on both sides; otherwise every key precedes
    every query (the rectangles of :func:`_causal_pair_tiles`). ``window`` None: no window.
    """
    if window is None:
        return Tile(q_start, k_start, q_len, k_len, causal)
    if causal:
        return Tile(q_start, k_start, q_len, k_len, True, window if q_len - 1 > window else None)
    k_first = max(k_pos, q_pos - window)             # keys further back than the window go
    k_end = k_pos + k_len
    if k_first >= k_end:
        return None
    q_end = min(q_pos + q_len, k_end + window)       # queries past the last key's reach go
    sq, sk = q_end - q_pos, k_end - k_first
    binding = (q_end - 1) - k_first > window
    return Tile(q_start, k_start + k_first - k_pos, sq, sk, False,
                k_end + window - q_end if binding else None)


def _causal_pair_tiles(q: Run, k: Run, window: Optional[int] = None) -> List[Tile]:
    """Tiles of query run ``q`` on key run ``k`` (same document) under the causal mask.

    Keys before the first query position are seen by every query (a rectangle); keys in the
    overlap of the two position ranges form a causal square, seen fully by the later queries
    (a second rectangle); keys after the last query position are never seen.
    """
    qa, qb = q.position, q.position + q.length
    ka, kb = k.position, k.position + k.length
    out: List[Optional[Tile]] = []
    before_end = min(kb, qa)
    if before_end > ka:
        out.append(window_tile(q.start, qa, q.length, k.start, ka, before_end - ka, False,
                               window))
    m0, m1 = max(ka, qa), min(kb, qb)
    if m1 > m0:
        out.append(window_tile(q.start + m0 - qa, m0, m1 - m0, k.start + m0 - ka, m0, m1 - m0,
                               True, window))
        if qb > m1:
            out.append(window_tile(q.start + m1 - qa, m1, qb - m1, k.start + m0 - ka, m0,
                                   m1 - m0, False, window))
    return [t for t in out if t is not None]


def tiles_for_block(q_runs: Sequence[Run], k_runs: Sequence[Run], causal: bool,
                    window: Optional[int] = None) -> List[Tile]:
    """Every visible (query, key) pair of a block, as tiles (each pair in exactly one tile).

    ``causal=False`` is the bidirectional document mask (every pair of one document);
    ``window``: the left window (causal only).
    """
    by_segment: Dict[int, List[Run]] = {}
    for run in k_runs:
        by_segment.setdefault(run.segment, []).append(run)
    tiles: List[Tile] = []
    for qr in q_runs:
        for kr in by_segment.get(qr.segment, ()):
            if causal:
                tiles.extend(_causal_pair_tiles(qr, kr, window))
            else:
                tiles.append(Tile(qr.start, kr.start, qr.length, kr.length, False))
    return tiles


def dense_document_mask(q_pos: Tensor, q_seg: Tensor, k_pos: Tensor, k_seg: Tensor,
                        causal: bool, window: Optional[int] = None) -> Tensor:
    """Dense boolean mask ``[..., sq, sk]`` (True: visible). Tiny shapes only (tests, ``math``)."""
    visible = q_seg.unsqueeze(-1) == k_seg.unsqueeze(-2)
    if causal:
        visible &= k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
    if window is not None:
        visible &= q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2) <= window
    return visible
