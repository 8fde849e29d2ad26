"""Token layout: which global sequence positions each (Ulysses rank, Ring rank) holds.

This module is the single source of truth for the load-balanced layout. It adopts
megatron-core's context-parallel layout, so megatron-core's ``RotaryEmbedding``
(which slices its position table with ``get_pos_emb_on_this_cp_rank``) and the
loss code work unchanged:

* The sequence of length ``S`` is cut into ``2*CP`` equal chunks, ``CP = U*R``.
* Context-parallel rank ``c = u + U*r`` (Ulysses rank ``u``, Ring rank ``r``) holds
  chunk ``c`` followed by chunk ``2*CP-1-c``: ``S/CP`` tokens.

After the Ulysses all-to-all over the Ulysses group of ring rank ``r`` the gathered
local sequence is, in Ulysses-rank order::

    [chunk(rU+0), chunk(2CP-1-rU-0), chunk(rU+1), chunk(2CP-1-rU-1), ...]

USP attention permutes it (see :func:`ulysses_to_zigzag_order`) into::

    [chunk(rU) .. chunk(rU+U-1)] + [chunk((2R-1-r)U) .. chunk((2R-r)U-1)]

i.e. the ring rank holds "super-chunk" ``r`` and super-chunk ``2R-1-r`` of ``2R``
super-chunks of ``U`` chunks each: exactly the zigzag layout the load-balanced ring
schedule needs, in increasing position order inside each half.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def cp_chunk_ids(cp_rank: int, cp_size: int) -> Tuple[int, int]:
    """The two chunk indices (of ``2*cp_size``) held by context-parallel rank ``cp_rank``."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_rank_of(ulysses_rank: int, ring_rank: int, ulysses_size: int) -> int:
    """Context-parallel rank of (Ulysses rank u, Ring rank r): ``u + U*r``."""
    return ulysses_rank + ulysses_size * ring_rank


def seq_length_problem(seq_len: int, cp_size: int, what: str = "--seq-length") -> Optional[str]:
    """Why ``seq_len`` cannot be cut into 2*CP chunks (naming ``what``), or None."""
    if cp_size > 1 and seq_len % (2 * cp_size):
        step = 2 * cp_size
        lower = (seq_len // step) * step
        upper = lower + step
        sugg = f"{upper}" if lower == 0 else f"{lower} or {upper}"
        return (f"{what}={seq_len} must be divisible by 2*ulysses_degree*ring_degree = {step} "
                f"for the load-balanced layout; try {what} {sugg}")
    return None


def check_seq_divisible(seq_len: int, cp_size: int, what: str = "--seq-length") -> None:
    """Raise a ValueError naming ``what`` if ``seq_len`` cannot be cut into 2*CP chunks."""
    problem = seq_length_problem(seq_len, cp_size, what)
    if problem:
        raise ValueError(problem)


def positions_for_cp_rank(seq_len: int, cp_rank: int, cp_size: int) -> List[int]:
    """Global positions held by a context-parallel rank, in local order."""
    if cp_size == 1:
        return list(range(seq_len))
    check_seq_divisible(seq_len, cp_size, "seq_len")
    chunk = seq_len // (2 * cp_size)
    out: List[int] = []
    for cid in cp_chunk_ids(cp_rank, cp_size):
        out.extend(range(cid * chunk, (cid + 1) * chunk))
    return out


def positions_for_ring_rank(seq_len: int, ring_rank: int, ring_size: int) -> List[int]:
    """Global positions a ring rank holds after the Ulysses all-to-all and permutation.

    Super-chunk ``ring_rank`` then super-chunk ``2R-1-ring_rank`` of ``2R``.
    Independent of the Ulysses degree.
    """
    return positions_for_cp_rank(seq_len, ring_rank, ring_size)


def ulysses_to_zigzag_order(ulysses_size: int) -> List[int]:
    """Block permutation applied after the sequence->heads all-to-all.

    The gathered local sequence consists of ``2*U`` equal blocks; block ``2u+h`` is
    half ``h`` (0: front chunk, 1: back chunk) of Ulysses rank ``u``. The returned
    list ``order`` says which gathered block goes to each output slot:
    ``out_block[i] = gathered_block[order[i]]``.
    """
    front = [2 * u for u in range(ulysses_size)]
    back = [2 * u + 1 for u in reversed(range(ulysses_size))]
    return front + back


def invert_order(order: Sequence[int]) -> List[int]:
    """Inverse of a block permutation."""
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return inv


def permute_blocks(x: torch.Tensor, order: Sequence[int], dim: int) -> torch.Tensor:
    """Cut ``x`` into ``len(order)`` equal blocks along ``dim`` and reorder them.

    Identity orders return ``x`` itself (no copy).
    """
    n = len(order)
    if list(order) == list(range(n)):
        return x
    blocks = x.chunk(n, dim=dim)
    return torch.cat([blocks[i] for i in order], dim=dim)


def shard_for_cp_rank(x: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Take the tokens of ``x`` (full sequence along ``seq_dim``) that ``cp_rank`` holds."""
    if cp_size == 1:
        return x
    seq_len = x.size(seq_dim)
    check_seq_divisible(seq_len, cp_size, "sequence length")
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    a, b = cp_chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[a], chunks[b]], dim=seq_dim)


def unshard_from_cp_ranks(shards: Sequence[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """Inverse of :func:`shard_for_cp_rank`: rebuild the full sequence from all ranks' shards."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    pieces: List[torch.Tensor] = [None] * (2 * cp_size)  # type: ignore[list-item]
    for c, shard in enumerate(shards):
        a, b = cp_chunk_ids(c, cp_size)
        front, back = shard.chunk(2, dim=seq_dim)
        pieces[a], pieces[b] = front, back
    return torch.cat(pieces, dim=seq_dim)
