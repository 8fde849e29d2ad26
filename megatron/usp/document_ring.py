"""Document-masked ring attention: only the K/V blocks that share a document move or compute.

Shapes on ring rank ``r`` of ``R`` (after the Ulysses all-to-all; legend of
:mod:`megatron.usp.ring_attention`)::

    q, out, dout : [b, hq, S_r, d]      this ring rank's tokens in the order of
    kv, dkv      : [2, b, hk, S_r, d]   token_order.positions_for_ring_rank (any assignment)
    lse          : [b, hq, S_r]         float32 (float64 for float64 inputs)

Schedule (:class:`DocumentRingPlan`, built once per micro-batch from the batch's segment ids
and chunk assignment, the same on every rank). ``needs[r][j]``: some query of ring rank ``r``
sees some key of ring rank ``j`` (a shared document, and causally a key not after the query).
Step 0 is the local block. At step ``i`` (1 <= i < R) rank ``r`` computes on the K/V of
``j = r - i`` and, unlike the zigzag ring, receives them from ``j`` directly (each rank sends
its own K/V to ``r + i``), so that a block nobody needs is never sent: ``r`` receives iff
``needs[r][j]``, sends iff ``needs[r+i][r]``. When no document crosses ring ranks there is no
exchange at all. The backward sends each block's dK/dV share straight back to its owner (``r``
to ``j`` at step ``i``), where it is added to the owner's accumulator.

Per rank and call, with ``n_in`` = sources this rank needs and ``n_out`` = ranks that need this
rank's K/V: forward ``n_in`` K/V receives and ``n_out`` sends (``kv.numel()`` elements each);
backward the same K/V traffic plus ``n_in`` dK/dV shares sent and ``n_out`` received (kv's
dtype). Every transfer of step ``i + 1`` is started before step ``i`` computes. Bytes skipped
against the zigzag ring: :meth:`DocumentRingPlan.skipped_kv_messages`.

Accumulators: a row merges at most ``1 + n_in`` blocks and an owner sums ``1 + n_out`` dK/dV
shares; as in the zigzag ring (:func:`megatron.usp.ring_attention.ring_accum_dtype`) two terms
are summed in the input dtype (exact), more in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron.usp import token_order
from megatron.usp.document_kernels import DocumentBlock, DocumentKernel, build_document_block
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


def _segment_bounds(seg: np.ndarray, pos: np.ndarray) -> List[dict]:
    """Per sample: segment -> (first position, last position) among the given tokens."""
    out = []
    for row_seg, row_pos in zip(seg, pos):
        order = np.argsort(row_seg, kind="stable")
        s, p = row_seg[order], row_pos[order]
        starts = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
        ends = np.concatenate([starts[1:], [s.size]])
        out.append({int(s[a]): (int(p[a:b].min()), int(p[a:b].max()))
                    for a, b in zip(starts, ends)})
    return out


def needs_matrix(segments: np.ndarray, positions: Sequence[np.ndarray], causal: bool
                 ) -> Tuple[Tuple[bool, ...], ...]:
    """``needs[r][j]``: a query of ring rank ``r`` sees a key of ring rank ``j`` (docstring)."""
    bounds = [_segment_bounds(segments[:, pos], np.broadcast_to(pos, (segments.shape[0],
                                                                       pos.size)))
              for pos in positions]
    R = len(positions)
    needs = [[r == j for j in range(R)] for r in range(R)]
    for r in range(R):
        for j in range(R):
            if r == j:
                continue
            for q_b, k_b in zip(bounds[r], bounds[j]):
                if any(s in k_b and (not causal or k_b[s][0] <= q_b[s][1]) for s in q_b):
                    needs[r][j] = True
                    break
    return tuple(tuple(row) for row in needs)


@dataclass(frozen=True)
class DocumentRingPlan:
    """This ring rank's document ring schedule for one micro-batch (module docstring).

    Attributes:
        ring_rank, ring_size: r and R.
        needs: the R x R matrix (the same on every rank).
        blocks: ``blocks[j]``: this rank's queries on ring rank ``j``'s keys (None: no pair).
        seq_len, batch: the micro-batch's S and b.
        causal: causal within documents (else bidirectional within documents).
    """

    ring_rank: int
    ring_size: int
    needs: Tuple[Tuple[bool, ...], ...]
    blocks: Tuple[Optional[DocumentBlock], ...]
    seq_len: int
    batch: int
    causal: bool = True

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
                             device=None) -> DocumentRingPlan:
    """The plan of ``ring_rank`` for full-sequence segment ids ``[b, S]`` (host numpy).

    ``assignment`` is the micro-batch's chunk assignment (None: the default zigzag order).
    """
    seg = np.atleast_2d(np.asarray(segments, dtype=np.int64))
    batch, seq_len = seg.shape
    positions = ring_positions(seq_len, ring_size, assignment)
    needs = needs_matrix(seg, positions, causal)
    mine = positions[ring_rank]
    q_pos = np.broadcast_to(mine, (batch, mine.size))
    blocks = []
    for j in range(ring_size):
        if not needs[ring_rank][j]:
            blocks.append(None)
            continue
        k_pos = np.broadcast_to(positions[j], (batch, positions[j].size))
        blocks.append(build_document_block(q_pos, seg[:, mine], k_pos, seg[:, positions[j]],
                                           causal, device))
    return DocumentRingPlan(ring_rank, ring_size, needs, tuple(blocks), seq_len, batch, causal)


# --------------------------------------------------------------------------- forward
def _start_kv(comm: RingComm, kv: Tensor, plan: DocumentRingPlan, step: int
              ) -> Optional[PendingExchange]:
    """Step ``step``'s K/V transfer: our own K/V out, the source's in, each where needed."""
    if step >= comm.size:
        return None
    recv = torch.empty_like(kv) if plan.receives(step) else None
    return comm.shift(step, kv if plan.sends(step) else None, recv)


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
        self._pending: List[PendingExchange] = []

    def add(self, pending: Optional[PendingExchange]) -> None:
        if pending is not None:
            self._pending.append(pending)

    def settle(self, keep: int = 0) -> None:
        """Wait for all but the ``keep`` newest transfers and add what they brought."""
        while len(self._pending) > keep:
            share = self._pending.pop(0).wait()
            if share is not None:
                self._acc.add_(share)

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
        incoming = torch.empty_like(kv) if plan.sends(step) else None
        shares.add(comm.shift(-step, mine, incoming))
        shares.settle(keep=1)                        # the newest overlaps the next step
    return RingGrads(dq_acc.to(q.dtype), home=shares)
