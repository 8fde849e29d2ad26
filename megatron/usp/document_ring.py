"""Document-masked ring attention: only the keys some query sees move, only visible pairs compute.

Shapes on ring rank ``r`` of ``R`` (after the Ulysses all-to-all; legend of
:mod:`megatron.usp.ring_attention`)::

    q, out, dout : [b, hq, S_r, d]      this ring rank's tokens in the order of
    kv, dkv      : [2, b, hk, S_r, d]   token_order.positions_for_ring_rank (any assignment)
    lse          : [b, hq, S_r]         float32 (float64 for float64 inputs)

Schedule (:class:`DocumentRingPlan`, built once per micro-batch from the batch's segment ids
and chunk assignment, the same on every rank). ``halo[r][j]`` lists the local indices of ring
rank ``j``'s tokens that some query of ring rank ``r`` sees: a key at position ``p`` is needed
iff a query of ``r`` lies in ``p``'s document and, causally, at a position ``q >= p`` (with a
window also ``q - p <= left`` for the first such ``q``). ``needs[r][j]``: that list is not
empty. Step 0 is the local block. At step ``i`` (1 <= i < R) rank ``r`` computes on the keys
of ``j = r - i`` and, unlike the zigzag ring, receives them from ``j`` directly (each rank
sends its own to ``r + i``), so that a key nobody needs is never sent: ``r`` receives iff
``needs[r][j]``, sends iff ``needs[r+i][r]``, and the message holds only the halo, gathered
to ``[2, b, hk, n, d]`` (when every key of the block is needed, ``halo`` says None and the
block goes as it is, without the gather copy). The backward sends each halo's dK/dV share
straight back to its owner (``r`` to ``j`` at step ``i``), which adds it at the same indices.
When no document crosses ring ranks nothing moves.

Per rank and call, forward: ``n_out`` K/V sends of :meth:`DocumentRingPlan.send_tokens`
tokens each (:meth:`~DocumentRingPlan.kv_tokens_sent` in all) and ``n_in`` receives of
:meth:`~DocumentRingPlan.recv_tokens`; backward the same K/V traffic plus, per received
halo, its dK/dV share sent back, and per sent halo one received (kv's dtype). A token costs
``2 x b x hk x d`` elements. Without a window only the keys of documents that cross ring
ranks move (docs/packed_documents.md); with a window ``O(left)`` tokens per rank and layer
(docs/sliding_window.md). Every transfer of step ``i + 1`` is started before step ``i``
computes. Messages skipped against the zigzag ring:
:meth:`DocumentRingPlan.skipped_kv_messages`.

Sliding window (``window`` = left, megatron-core's ``window_size = (left, 0)``, causal only,
contiguous documents): the same plan with the window in its predicate
(:meth:`DocumentRingPlan.with_window`); in the zigzag order a rank's two chunks reach back into
up to two predecessors' chunks (more when ``left`` exceeds a chunk).

Accumulators: a row merges at most ``1 + n_in`` blocks and an owner sums ``1 + n_out`` dK/dV
shares; as in the zigzag ring (:func:`megatron.usp.ring_attention.ring_accum_dtype`) two terms
are summed in the input dtype (exact), more in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron.shapes.window import effective_window
from megatron.usp import token_order
from megatron.usp.document_kernels import (
    DocumentBlock,
    DocumentKernel,
    build_document_block,
    pinned_to_device,
)
from megatron.usp.kernels import accum_dtype, merge_block_
from megatron.usp.ring_attention import RingGrads, ring_accum_dtype
from megatron.usp.ring_comm import PendingExchange, RingComm
from megatron.usp.token_order import ChunkAssignment

Tensor = torch.Tensor


# --------------------------------------------------------------------------- plan
def ring_positions(seq_len: int, ring_size: int, assignment: Optional[ChunkAssignment]
                   ) -> List[np.ndarray]:
    """Global positions of every ring rank's tokens, in local order (the token order module's)."""
    return [token_order.ring_rank_positions(seq_len, j, ring_size, assignment).numpy()
            for j in range(ring_size)]


def monotone_segments(segments: np.ndarray) -> bool:
    """Segment ids never decrease along a sample (documents are contiguous, as EOD cuts make
    them): what a window's halo (:func:`halo_indices`) assumes."""
    return bool(np.all(np.diff(segments, axis=-1) >= 0))


def _document_reach(segments: np.ndarray, q_positions: np.ndarray, k_positions: np.ndarray,
                    causal: bool) -> np.ndarray:
    """Mask over ``k_positions``: some query at ``q_positions`` shares the key's document and,
    causally, sits at or after it (any segment order; union over samples)."""
    need = np.zeros(k_positions.size, dtype=bool)
    for row in segments:
        q_seg, k_seg = row[q_positions], row[k_positions]
        order = np.lexsort((q_positions, q_seg))         # by document, then position
        seg_sorted, pos_sorted = q_seg[order], q_positions[order]
        last = np.searchsorted(seg_sorted, k_seg, side="right") - 1   # document's last query
        found = last >= 0
        last = np.maximum(last, 0)
        found &= seg_sorted[last] == k_seg
        if causal:
            found &= pos_sorted[last] >= k_positions
        need |= found
    return need


def _window_reach(segments: np.ndarray, q_positions: np.ndarray, k_positions: np.ndarray,
                  window: int) -> np.ndarray:
    """Mask over ``k_positions``: the first query ``q >= p`` lies in ``p``'s document and
    ``q - p <= window`` (contiguous documents; union over samples)."""
    queries = np.sort(q_positions)
    nxt = np.searchsorted(queries, k_positions, side="left")      # first query >= the key
    has = nxt < queries.size
    q_next = queries[np.minimum(nxt, queries.size - 1)]
    same_doc = (segments[:, q_next] == segments[:, k_positions]).any(axis=0)
    return has & (q_next - k_positions <= window) & same_doc


def halo_indices(segments: np.ndarray, q_positions: np.ndarray, k_positions: np.ndarray,
                 window: Optional[int], causal: bool = True) -> np.ndarray:
    """Local indices (into ``k_positions``) of the keys some query at ``q_positions`` sees: same
    document, causally not after the query and, with ``window``, at most ``window`` positions
    back (``segments`` [b, S]; a window needs monotone segments; union over samples)."""
    if window is None:
        return np.flatnonzero(_document_reach(segments, q_positions, k_positions, causal))
    return np.flatnonzero(_window_reach(segments, q_positions, k_positions, window))


def halo_matrix(segments: np.ndarray, positions: Sequence[np.ndarray], window: Optional[int],
                causal: bool = True) -> Tuple[Tuple[Optional[np.ndarray], ...], ...]:
    """``halo[r][j]``: ring rank ``j``'s local token indices that rank ``r`` needs; None
    where all of them (the local block, or every key needed: the block moves as it is, with
    no gather copy), an empty array where none."""
    R = len(positions)
    out = []
    for r in range(R):
        row = []
        for j in range(R):
            idx = None if r == j else halo_indices(segments, positions[r], positions[j],
                                                   window, causal)
            row.append(None if idx is not None and idx.size == positions[j].size else idx)
        out.append(tuple(row))
    return tuple(out)


def needs_from_halo(halo: Sequence[Sequence[Optional[np.ndarray]]]
                    ) -> Tuple[Tuple[bool, ...], ...]:
    """``needs[r][j]``: rank ``r`` needs at least one key of rank ``j`` (module docstring)."""
    return tuple(tuple(idx is None or idx.size > 0 for idx in row) for row in halo)


@dataclass(frozen=True)
class DocumentRingPlan:
    """This ring rank's document ring schedule for one micro-batch (module docstring).

    Attributes:
        ring_rank, ring_size: r and R.
        needs: the R x R matrix (the same on every rank).
        blocks: ``blocks[j]``: this rank's queries on ring rank ``j``'s keys (None: no pair).
        seq_len, batch: the micro-batch's S and b.
        causal: causal within documents (else bidirectional within documents).
        window: the left window (None: none).
        halo: :func:`halo_matrix`, the same on every rank: which of ring rank ``j``'s keys
            rank ``r`` needs (None: the whole block, sent as it is).
        segments, assignment, device: what the plan was built from (:meth:`with_window`).
    """

    ring_rank: int
    ring_size: int
    needs: Tuple[Tuple[bool, ...], ...]
    blocks: Tuple[Optional[DocumentBlock], ...]
    seq_len: int
    batch: int
    causal: bool = True
    window: Optional[int] = None
    halo: tuple = field(default=(), compare=False, repr=False)
    segments: Optional[np.ndarray] = field(default=None, compare=False, repr=False)
    assignment: Optional[ChunkAssignment] = field(default=None, compare=False, repr=False)
    device: object = field(default=None, compare=False, repr=False)
    _cache: Dict[object, object] = field(default_factory=dict, compare=False, repr=False)

    def _tokens(self, r: int, j: int) -> int:
        idx = self.halo[r][j]
        return self.seq_len // self.ring_size if idx is None else int(idx.size)

    def send_tokens(self, step: int) -> int:
        """Tokens of our K/V that ring rank ``r + step`` needs (sent at ``step``)."""
        return self._tokens((self.ring_rank + step) % self.ring_size, self.ring_rank)

    def recv_tokens(self, step: int) -> int:
        """Tokens of the source's K/V received at ``step``."""
        return self._tokens(self.ring_rank, self.source(step))

    def send_index(self, step: int, device) -> Optional[Tensor]:
        """Local indices of our tokens sent at ``step`` (int64 on ``device``; None: all)."""
        idx = self.halo[(self.ring_rank + step) % self.ring_size][self.ring_rank]
        if idx is None:
            return None
        key = ("send", step, str(device))
        if key not in self._cache:
            self._cache[key] = pinned_to_device(idx, torch.int64, device)
        return self._cache[key]  # type: ignore[return-value]

    def kv_tokens_sent(self) -> int:
        """Tokens whose K/V this rank sends in one forward (the backward sends as many K/V
        and receives as many dK/dV back); bytes = tokens x 2 x b x hk x d x element size."""
        return sum(self.send_tokens(i) for i in range(1, self.ring_size) if self.sends(i))

    def ring_kv_tokens(self) -> int:
        """Tokens whose K/V move over the whole ring in one forward (every rank's
        :meth:`kv_tokens_sent` summed; whole blocks would move ``kv_messages() * S / R``)."""
        R = self.ring_size
        return sum(self._tokens(r, j) for r in range(R) for j in range(R)
                   if r != j and self.needs[r][j])

    def with_window(self, window: Optional[int]) -> "DocumentRingPlan":
        """The same micro-batch's plan with a left window (built once, cached)."""
        if window == self.window:
            return self
        if self.segments is None:
            raise ValueError("this document plan was built without its segment ids; build it "
                             "with build_document_ring_plan to derive a windowed plan")
        if window not in self._cache:
            self._cache[window] = build_document_ring_plan(
                self.segments, self.ring_rank, self.ring_size, self.assignment, self.causal,
                self.device, window)
        return self._cache[window]  # type: ignore[return-value]

    def source(self, step: int) -> int:
        return (self.ring_rank - step) % self.ring_size

    def receives(self, step: int) -> bool:
        return self.needs[self.ring_rank][self.source(step)]

    def sends(self, step: int) -> bool:
        dst = (self.ring_rank + step) % self.ring_size
        return self.needs[dst][self.ring_rank]

    @property
    def sources_needed(self) -> int:
        """``n_in``: remote ring ranks whose K/V this rank's queries need."""
        return sum(self.receives(i) for i in range(1, self.ring_size))

    @property
    def ranks_needing_me(self) -> int:
        """``n_out``: remote ring ranks that need this rank's K/V."""
        return sum(self.sends(i) for i in range(1, self.ring_size))

    def kv_messages(self) -> int:
        """K/V blocks moved over the whole ring in one forward (the backward moves as many)."""
        return sum(self.needs[r][j] for r in range(self.ring_size)
                   for j in range(self.ring_size) if r != j)

    def skipped_kv_messages(self) -> int:
        """K/V messages of one forward the zigzag ring sends and this schedule does not."""
        return self.ring_size * (self.ring_size - 1) - self.kv_messages()


def build_document_ring_plan(segments: np.ndarray, ring_rank: int, ring_size: int,
                             assignment: Optional[ChunkAssignment], causal: bool = True,
                             device=None, window: Optional[int] = None) -> DocumentRingPlan:
    """The plan of ``ring_rank`` for full-sequence segment ids ``[b, S]`` (host numpy).

    ``assignment`` is the micro-batch's chunk assignment (None: the default zigzag order);
    ``window``: a left window (module docstring; causal only, documents contiguous).
    """
    seg = np.atleast_2d(np.asarray(segments, dtype=np.int64))
    batch, seq_len = seg.shape
    window = effective_window(window, seq_len)
    positions = ring_positions(seq_len, ring_size, assignment)
    if window is not None and (not causal or not monotone_segments(seg)):
        raise ValueError("a sliding window needs causal attention over contiguous "
                         "documents (segment ids that never decrease along a sample)")
    halo = halo_matrix(seg, positions, window, causal)
    needs = needs_from_halo(halo)
    mine = positions[ring_rank]
    q_pos = np.broadcast_to(mine, (batch, mine.size))
    blocks = []
    for j in range(ring_size):
        if not needs[ring_rank][j]:
            blocks.append(None)
            continue
        keys = positions[j] if halo[ring_rank][j] is None else positions[j][halo[ring_rank][j]]
        k_pos = np.broadcast_to(keys, (batch, keys.size))
        blocks.append(build_document_block(q_pos, seg[:, mine], k_pos, seg[:, keys],
                                           causal, device, window))
    return DocumentRingPlan(ring_rank, ring_size, needs, tuple(blocks), seq_len, batch, causal,
                            window, halo, seg, assignment, device)


_WINDOW_PLANS: Dict[tuple, DocumentRingPlan] = {}


def window_ring_plan(seq_len: int, batch: int, ring_rank: int, ring_size: int, window: int,
                     device=None) -> DocumentRingPlan:
    """The windowed plan of a sequence without documents in the zigzag order (one segment),
    built once per shape and cached."""
    key = (seq_len, batch, ring_rank, ring_size, window, str(device))
    if key not in _WINDOW_PLANS:
        _WINDOW_PLANS[key] = build_document_ring_plan(
            np.zeros((batch, seq_len), dtype=np.int64), ring_rank, ring_size, None, True,
            device, window)
    return _WINDOW_PLANS[key]


# --------------------------------------------------------------------------- forward
def _halo_buffer(kv: Tensor, tokens: int) -> Tensor:
    """An empty [2, b, hk, tokens, d] buffer like ``kv`` [2, b, hk, S_r, d]."""
    if tokens == kv.shape[3]:
        return torch.empty_like(kv)
    return kv.new_empty(kv.shape[:3] + (tokens,) + kv.shape[4:])


def _start_kv(comm: RingComm, kv: Tensor, plan: DocumentRingPlan, step: int
              ) -> Optional[PendingExchange]:
    """Step ``step``'s K/V transfer: our own K/V (or the receiver's halo of it, gathered to
    [2, b, hk, n, d]) out, the source's in, each where needed."""
    if step >= comm.size:
        return None
    recv = _halo_buffer(kv, plan.recv_tokens(step)) if plan.receives(step) else None
    send = None
    if plan.sends(step):
        idx = plan.send_index(step, kv.device)
        send = kv if idx is None else kv.index_select(3, idx)
    return comm.shift(step, send, recv)


def _row_span(block: DocumentBlock) -> Tuple[int, int]:
    starts = [g.q.starts.min() for g in block.groups]
    ends = [g.q.starts.max() + g.q.length for g in block.groups]
    return int(min(starts)), int(max(ends))


def document_ring_forward(q: Tensor, kv: Tensor, comm: RingComm, kernel: DocumentKernel,
                          plan: DocumentRingPlan, scale: float) -> Tuple[Tensor, Tensor]:
    """Document ring attention forward.

    Args:
        q: [b, hq, S_r, d]; kv: [2, b, hk, S_r, d] contiguous; this ring rank's tokens.
        comm: the Ring group's communicator; plan: this rank's :class:`DocumentRingPlan`.
    Returns:
        out [b, hq, S_r, d] in q's dtype, lse [b, hq, S_r] float32 (float64 for float64 q).
    Communication: see the module docstring.
    """
    r = plan.ring_rank
    out, lse = kernel.forward(q, kv[0], kv[1], plan.blocks[r], scale)
    lse = lse.to(accum_dtype(q.dtype))
    if comm.size == 1 or plan.kv_messages() == 0:
        return out, lse
    comm.ensure_ready(q.device)
    acc_out = out.to(ring_accum_dtype(q.dtype, 1 + plan.sources_needed))
    pending = _start_kv(comm, kv, plan, 1)
    for step in range(1, comm.size):
        received = pending.wait() if pending is not None else None
        pending = _start_kv(comm, kv, plan, step + 1)
        block = plan.blocks[plan.source(step)] if received is not None else None
        if block is None:
            continue
        out_b, lse_b = kernel.forward(q, received[0], received[1], block, scale)
        del received
        a, b = _row_span(block)
        merge_block_(acc_out[:, :, a:b], lse[:, :, a:b], out_b[:, :, a:b], lse_b[:, :, a:b])
        del out_b, lse_b
    return acc_out.to(q.dtype), lse


# --------------------------------------------------------------------------- backward
class _PendingShares:
    """The dK/dV shares still travelling home; ``wait()`` adds them and returns [2, ...]."""

    def __init__(self, acc: Tensor, out_dtype: torch.dtype) -> None:
        self._acc = acc
        self._dtype = out_dtype
        self._pending: List[Tuple[PendingExchange, Optional[Tensor]]] = []

    def add(self, pending: Optional[PendingExchange], index: Optional[Tensor] = None) -> None:
        """A transfer bringing a share of our dK/dV, for our tokens ``index`` (None: all)."""
        if pending is not None:
            self._pending.append((pending, index))

    def settle(self, keep: int = 0) -> None:
        """Wait for all but the ``keep`` newest transfers and add what they brought."""
        while len(self._pending) > keep:
            pending, index = self._pending.pop(0)
            share = pending.wait()
            if share is None:
                continue
            if index is None:
                self._acc.add_(share)
            else:                          # a halo's share: scatter-add to its tokens
                self._acc.index_add_(3, index, share.to(self._acc.dtype))

    def wait(self) -> Tensor:
        self.settle()
        return self._acc.to(self._dtype)


def document_ring_backward(dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor,
                           comm: RingComm, kernel: DocumentKernel, plan: DocumentRingPlan,
                           scale: float) -> RingGrads:
    """Document ring attention backward.

    Args:
        dout, q, out: [b, hq, S_r, d]; kv: [2, b, hk, S_r, d]; lse: [b, hq, S_r] (forward's).
    Returns:
        :class:`~megatron.usp.ring_attention.RingGrads`: dq in q's dtype; ``dkv()`` waits for
        the last dK/dV shares from other ranks and gives dk, dv in kv's dtype.
    Communication: see the module docstring.
    """
    r = plan.ring_rank
    dq, dk, dv = kernel.backward(dout, q, kv[0], kv[1], out, lse, plan.blocks[r], scale)
    if comm.size == 1 or plan.kv_messages() == 0:
        return RingGrads(dq, dkv=(dk, dv))
    comm.ensure_ready(q.device)
    dq_acc = dq.to(ring_accum_dtype(q.dtype, 1 + plan.sources_needed))
    dkv_acc = torch.empty((2, *dk.shape), dtype=ring_accum_dtype(kv.dtype,
                                                                 1 + plan.ranks_needing_me),
                          device=dk.device)
    dkv_acc[0].copy_(dk)
    dkv_acc[1].copy_(dv)
    del dq, dk, dv
    shares = _PendingShares(dkv_acc, kv.dtype)
    pending = _start_kv(comm, kv, plan, 1)
    for step in range(1, comm.size):
        received = pending.wait() if pending is not None else None
        pending = _start_kv(comm, kv, plan, step + 1)
        block = plan.blocks[plan.source(step)] if received is not None else None
        mine = None
        if block is not None:
            dq_b, dk_b, dv_b = kernel.backward(dout, q, received[0], received[1], out, lse,
                                               block, scale)
            a, b = _row_span(block)
            dq_acc[:, :, a:b].add_(dq_b[:, :, a:b])
            mine = torch.stack([dk_b, dv_b])          # [2, b, hk, S_r, d], kv's dtype
            del dq_b, dk_b, dv_b
        del received
        # Our share of the source's dK/dV goes straight home; the ranks that used our K/V at
        # this step send theirs back to us.
        incoming = _halo_buffer(kv, plan.send_tokens(step)) if plan.sends(step) else None
        shares.add(comm.shift(-step, mine, incoming), plan.send_index(step, kv.device))
        shares.settle(keep=1)                        # the newest overlaps the next step
    return RingGrads(dq_acc.to(q.dtype), home=shares)
