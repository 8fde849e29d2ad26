"""Token order: which global sequence positions each (Ulysses rank, Ring rank) holds.

This module is the single source of truth for the load-balanced token order. It adopts
megatron-core's context-parallel token order, so megatron-core's ``RotaryEmbedding``
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
super-chunks of ``U`` chunks each: exactly the zigzag order the load-balanced ring
schedule needs, in increasing position order inside each half.

Chunk assignments (packed documents). With a document mask the zigzag order no longer
balances the causal work, so the data loader may choose another :class:`ChunkAssignment`:
the sequence is cut into ``N = 2*CP*m`` equal chunks and ring rank ``r`` holds a set of
``2*U*m`` of them, in increasing order. Cut that sorted list into ``2U`` groups of ``m``
chunks ``G_0 .. G_{2U-1}``; CP rank ``c = u + U*r`` holds ``G_u`` then ``G_{2U-1-u}``. The
Ulysses all-to-all and its permutation (unchanged) then give ring rank ``r`` its chunks in
increasing position order. :func:`zigzag_assignment` is the default (zigzag) order above written
this way (``m = 1``); every function below that takes ``assignment=None`` means it.
"""

from __future__ import annotations

from dataclasses import dataclass
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
                f"for the load-balanced token order; try {what} {sugg}")
    return None


def check_seq_divisible(seq_len: int, cp_size: int, what: str = "--seq-length") -> None:
    """Raise a ValueError naming ``what`` if ``seq_len`` cannot be cut into 2*CP chunks."""
    problem = seq_length_problem(seq_len, cp_size, what)
    if problem:
        raise ValueError(problem)


def positions_for_cp_rank(seq_len: int, cp_rank: int, cp_size: int,
                          assignment: Optional["ChunkAssignment"] = None) -> List[int]:
    """Global positions held by a context-parallel rank, in local order."""
    if assignment is not None:
        _check_assignment(assignment, seq_len, cp_size)
        return _chunk_positions(seq_len, assignment, assignment.cp_rank_chunks(cp_rank))
    if cp_size == 1:
        return list(range(seq_len))
    check_seq_divisible(seq_len, cp_size, "seq_len")
    chunk = seq_len // (2 * cp_size)
    out: List[int] = []
    for cid in cp_chunk_ids(cp_rank, cp_size):
        out.extend(range(cid * chunk, (cid + 1) * chunk))
    return out


def positions_for_ring_rank(seq_len: int, ring_rank: int, ring_size: int,
                            assignment: Optional["ChunkAssignment"] = None) -> List[int]:
    """Global positions a ring rank holds after the Ulysses all-to-all and permutation.

    Default (zigzag) order: super-chunk ``ring_rank`` then super-chunk ``2R-1-ring_rank`` of ``2R``,
    independent of the Ulysses degree. With an ``assignment``: its chunks of ``ring_rank``,
    in increasing order.
    """
    if assignment is not None:
        return ring_rank_positions(seq_len, ring_rank, ring_size, assignment).tolist()
    return positions_for_cp_rank(seq_len, ring_rank, ring_size)


def ring_rank_positions(seq_len: int, ring_rank: int, ring_size: int,
                        assignment: Optional["ChunkAssignment"] = None) -> torch.Tensor:
    """:func:`positions_for_ring_rank` as an int64 tensor (no Python list for long sequences)."""
    if assignment is None:      # the zigzag order's ring ranks do not depend on U
        check_seq_divisible(seq_len, ring_size, "seq_len")
        assignment = zigzag_assignment(1, ring_size)
    if assignment.ring_size != ring_size:
        raise ValueError(f"the chunk assignment is for {assignment.ring_size} ring ranks, "
                         f"not {ring_size}")
    _check_assignment(assignment, seq_len, assignment.cp_size)
    chunk = seq_len // assignment.num_chunks
    ids = torch.tensor(assignment.ring_chunks[ring_rank], dtype=torch.int64)
    return (ids[:, None] * chunk + torch.arange(chunk)).reshape(-1)


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


def shard_for_cp_rank(x: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int,
                      assignment: Optional["ChunkAssignment"] = None) -> torch.Tensor:
    """Take the tokens of ``x`` (full sequence along ``seq_dim``) that ``cp_rank`` holds.

    Their order is that of :func:`positions_for_cp_rank` (same ``assignment``).
    """
    if assignment is not None:
        _check_assignment(assignment, x.size(seq_dim), cp_size)
        chunk = x.size(seq_dim) // assignment.num_chunks
        return torch.cat([x.narrow(seq_dim, c * chunk, chunk)
                          for c in assignment.cp_rank_chunks(cp_rank)], dim=seq_dim)
    if cp_size == 1:
        return x
    seq_len = x.size(seq_dim)
    check_seq_divisible(seq_len, cp_size, "sequence length")
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    a, b = cp_chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[a], chunks[b]], dim=seq_dim)


def unshard_from_cp_ranks(shards: Sequence[torch.Tensor], seq_dim: int,
                          assignment: Optional["ChunkAssignment"] = None) -> torch.Tensor:
    """Inverse of :func:`shard_for_cp_rank`: rebuild the full sequence from all ranks' shards."""
    cp_size = len(shards)
    if assignment is not None:
        _check_assignment(assignment, None, cp_size)
        pieces_by_chunk: List[torch.Tensor] = [None] * assignment.num_chunks  # type: ignore
        for c, shard in enumerate(shards):
            ids = assignment.cp_rank_chunks(c)
            for cid, piece in zip(ids, shard.chunk(len(ids), dim=seq_dim)):
                pieces_by_chunk[cid] = piece
        return torch.cat(pieces_by_chunk, dim=seq_dim)
    if cp_size == 1:
        return shards[0]
    pieces: List[torch.Tensor] = [None] * (2 * cp_size)  # type: ignore[list-item]
    for c, shard in enumerate(shards):
        a, b = cp_chunk_ids(c, cp_size)
        front, back = shard.chunk(2, dim=seq_dim)
        pieces[a], pieces[b] = front, back
    return torch.cat(pieces, dim=seq_dim)


# --------------------------------------------------------------------------- chunk assignments
@dataclass(frozen=True)
class ChunkAssignment:
    """Which of ``num_chunks`` equal chunks of the sequence each ring rank holds.

    Attributes:
        ulysses_size: U (the CP ranks of one ring rank split its chunks, module docstring).
        ring_chunks: per ring rank, its chunk ids in increasing order; together a partition of
            ``range(num_chunks)`` into ``R`` sets of ``2*U*m`` chunks.
    """

    ulysses_size: int
    ring_chunks: Tuple[Tuple[int, ...], ...]

    def __post_init__(self) -> None:
        sizes = {len(c) for c in self.ring_chunks}
        flat = sorted(i for c in self.ring_chunks for i in c)
        if (self.ulysses_size < 1 or not self.ring_chunks or len(sizes) != 1
                or flat != list(range(len(flat)))):
            raise ValueError(f"not a chunk assignment: every ring rank must hold the same "
                             f"number of distinct chunks covering 0..N-1; got {self.ring_chunks}")
        per_ring = sizes.pop()
        if per_ring % (2 * self.ulysses_size):
            raise ValueError(f"each ring rank's {per_ring} chunks must split into 2*U = "
                             f"{2 * self.ulysses_size} equal groups")
        if any(list(c) != sorted(c) for c in self.ring_chunks):
            raise ValueError("each ring rank's chunk ids must be in increasing order")

    @property
    def ring_size(self) -> int:
        return len(self.ring_chunks)

    @property
    def cp_size(self) -> int:
        return self.ulysses_size * self.ring_size

    @property
    def num_chunks(self) -> int:
        return sum(len(c) for c in self.ring_chunks)

    @property
    def group_chunks(self) -> int:
        """m: chunks per half of a CP rank's tokens."""
        return len(self.ring_chunks[0]) // (2 * self.ulysses_size)

    def cp_rank_chunks(self, cp_rank: int) -> Tuple[int, ...]:
        """Chunk ids CP rank ``c = u + U*r`` holds, in local order: ``G_u`` then ``G_{2U-1-u}``."""
        if not 0 <= cp_rank < self.cp_size:
            raise ValueError(f"cp_rank {cp_rank} outside [0, {self.cp_size})")
        u, r = cp_rank % self.ulysses_size, cp_rank // self.ulysses_size
        m, mine = self.group_chunks, self.ring_chunks[r]
        back = 2 * self.ulysses_size - 1 - u
        return mine[u * m:(u + 1) * m] + mine[back * m:(back + 1) * m]

    def is_zigzag(self) -> bool:
        """Whether this is the default zigzag order (:func:`zigzag_assignment`)."""
        return self == zigzag_assignment(self.ulysses_size, self.ring_size)


def zigzag_assignment(ulysses_size: int, ring_size: int) -> ChunkAssignment:
    """The default zigzag order as a :class:`ChunkAssignment` (``2*U*R`` chunks, ``m = 1``)."""
    U, R = ulysses_size, ring_size
    return ChunkAssignment(U, tuple(
        tuple(range(r * U, (r + 1) * U)) + tuple(range((2 * R - 1 - r) * U, (2 * R - r) * U))
        for r in range(R)))


def assignment_problem(assignment: ChunkAssignment, seq_len: Optional[int],
                       cp_size: int) -> Optional[str]:
    """Why ``assignment`` does not fit a sequence of ``seq_len`` on ``cp_size`` ranks, or None."""
    if assignment.cp_size != cp_size:
        return (f"the chunk assignment is for {assignment.cp_size} context-parallel ranks, "
                f"not {cp_size}")
    if seq_len is not None and seq_len % assignment.num_chunks:
        return (f"sequence length {seq_len} is not divisible by the assignment's "
                f"{assignment.num_chunks} chunks")
    return None


def _check_assignment(assignment: ChunkAssignment, seq_len: Optional[int], cp_size: int) -> None:
    problem = assignment_problem(assignment, seq_len, cp_size)
    if problem:
        raise ValueError(problem)


def _chunk_positions(seq_len: int, assignment: ChunkAssignment, ids: Sequence[int]) -> List[int]:
    chunk = seq_len // assignment.num_chunks
    return [p for c in ids for p in range(c * chunk, (c + 1) * chunk)]
