"""Load-balanced (zigzag) ring attention over the Ring group: forward and backward.

Layout on ring rank ``r`` of ``R`` (legend: ``b`` batch, ``hq``/``hk`` local query / KV heads,
``c`` tokens per super-chunk, ``d`` head dim)::

    q, out, dout : [b, hq, 2c, d]        zigzag order: super-chunk r, then super-chunk 2R-1-r
    kv, dkv      : [2, b, hk, 2c, d]     K and V packed in one buffer (one transfer per step)
    lse          : [b, hq, 2c]           float32 (float64 for float64 inputs)

The sequence is cut into 2R super-chunks of c tokens; this is what
:func:`megatron.usp.layout.positions_for_ring_rank` gives after the Ulysses all-to-all.

Block schedule (:func:`zigzag_block_plan`). At step ``i`` (0 <= i < R) rank ``r`` holds the
K/V of ring rank ``j = (r - i) mod R``; with ``front``/``back`` the two c-token halves:

==============  =======================  ===================  ==========================
case            query rows               key columns           mask
==============  =======================  ===================  ==========================
causal, i = 0   all 2c                   all 2c                causal (square, diagonal)
causal, j < r   all 2c                   front c (chunk j)     none
causal, j > r   back c (chunk 2R-1-r)    all 2c                none
non-causal      all 2c                   all 2c                none
==============  =======================  ===================  ==========================

Why this is exact: local positions increase inside each half, and chunk r < chunk 2R-1-r, so the
square causal mask on the local indices is the global causal mask at i = 0; for j < r every
query follows chunk j and precedes chunk 2R-1-j; for j > r only the back query half
(chunk 2R-1-r) follows any key, and it follows both chunk j and chunk 2R-1-j.

Why it is balanced: counting work in c x c blocks (a causal diagonal block is half a block, the
masked half being skipped), every causal step costs exactly 2 blocks on every rank
(i = 0: two half diagonal blocks + one full; j < r: 2c x c; j > r: c x 2c), and every
non-causal step 4. ``tests/unit/test_ring_schedule.py`` checks this by counting pairs.

Communication per rank (elements; multiply by the element size):

* forward: R-1 exchanges of ``kv``: ``2*b*hk*2c*d`` sent and received per step, each started
  before the step's compute so it overlaps it.
* backward: R-1 exchanges of ``kv`` (as forward) plus R exchanges of the travelling dK/dV
  accumulator ``2*b*hk*2c*d`` in float32 (float64); after the R-th hop each accumulator is back
  on the rank that owns its K/V.

Backward recomputes nothing of the forward but each block's attention probabilities inside
the kernel's backward, using the saved final ``out`` and ``lse`` (see
:mod:`megatron.usp.kernels`). dQ is accumulated locally in float32, dK/dV in the travelling
float32 accumulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.usp.kernels import AttentionKernel, accum_dtype, merge_block_
from megatron.usp.ring_comm import PendingExchange, RingComm

Tensor = torch.Tensor


# --------------------------------------------------------------------------- schedule
@dataclass(frozen=True)
class BlockPlan:
    """What ring rank ``rank`` computes at ``step``.

    Attributes:
        source: ring rank whose K/V are used (``(rank - step) mod R``).
        q_rows: ``"all"`` (2c rows) or ``"back"`` (the last c rows).
        kv_cols: ``"all"`` (2c columns) or ``"front"`` (the first c columns).
        causal: whether the (square) block is causally masked.
    """

    step: int
    rank: int
    source: int
    q_rows: str
    kv_cols: str
    causal: bool

    @property
    def work_units(self) -> float:
        """Work in c x c blocks; a causal (diagonal) block pair counts half of its area."""
        rows = 2 if self.q_rows == "all" else 1
        cols = 2 if self.kv_cols == "all" else 1
        area = rows * cols
        return area / 2 if self.causal else float(area)


def zigzag_block_plan(step: int, rank: int, size: int, causal: bool) -> BlockPlan:
    """The block ring rank ``rank`` of ``size`` computes at ``step`` (see module docstring)."""
    if not (0 <= step < size and 0 <= rank < size):
        raise ValueError(f"step {step} / rank {rank} outside a ring of size {size}")
    source = (rank - step) % size
    if not causal:
        return BlockPlan(step, rank, source, "all", "all", False)
    if step == 0:
        return BlockPlan(step, rank, source, "all", "all", True)
    if source < rank:
        return BlockPlan(step, rank, source, "all", "front", False)
    return BlockPlan(step, rank, source, "back", "all", False)


def _rows(x: Tensor, plan: BlockPlan) -> Tensor:
    """Query-side slice along the sequence dim (dim 2 of [b, h, s(, d)])."""
    if plan.q_rows == "all":
        return x
    return x[:, :, x.shape[2] // 2:]


def _cols(kv: Tensor, plan: BlockPlan) -> Tensor:
    """Key-side slice along the sequence dim (dim 3 of [2, b, hk, s, d])."""
    if plan.kv_cols == "all":
        return kv
    return kv[:, :, :, : kv.shape[3] // 2]


# --------------------------------------------------------------------------- forward / backward
def ring_attention_forward(
    q: Tensor, kv: Tensor, comm: RingComm, kernel: AttentionKernel, causal: bool, scale: float
) -> Tuple[Tensor, Tensor]:
    """Zigzag ring attention forward.

    Args:
        q: [b, hq, 2c, d] local queries in zigzag order.
        kv: [2, b, hk, 2c, d] contiguous local K and V (same order).
        comm: the Ring group's communicator (size 1: no communication).
    Returns:
        out [b, hq, 2c, d] in q's dtype, lse [b, hq, 2c] float32 (float64 for float64 q).
    Communication: R-1 steps, each sending and receiving ``kv.numel()`` elements over the Ring
    group, overlapped with the previous step's block.
    """
    size = comm.size
    acc = accum_dtype(q.dtype)
    kv_cur = kv
    for step in range(size):
        pending = _pass_kv_on(comm, kv_cur, step)
        plan = zigzag_block_plan(step, comm.rank, size, causal)
        kv_blk = _cols(kv_cur, plan)
        out_b, lse_b = kernel.forward(_rows(q, plan), kv_blk[0], kv_blk[1], plan.causal, scale)
        if size == 1:
            return out_b, lse_b.to(acc)
        if step == 0:
            # Step 0 covers every row and every row sees its own diagonal: start from it.
            acc_out, acc_lse = out_b.to(acc, copy=True), lse_b.to(acc, copy=True)
        else:
            merge_block_(_rows(acc_out, plan), _rows(acc_lse, plan), out_b, lse_b)
        if pending is not None:
            kv_cur = pending.wait()
    return acc_out.to(q.dtype), acc_lse


def _pass_kv_on(comm: RingComm, kv_cur: Tensor, step: int) -> Optional[PendingExchange]:
    """Start passing the current K/V on, unless this is the last step (it would come home)."""
    if step + 1 >= comm.size:
        return None
    return comm.exchange(kv_cur)


def ring_attention_backward(
    dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, comm: RingComm,
    kernel: AttentionKernel, causal: bool, scale: float,
) -> Tuple[Tensor, Tensor]:
    """Zigzag ring attention backward.

    Args:
        dout, q, out: [b, hq, 2c, d]; kv: [2, b, hk, 2c, d]; lse: [b, hq, 2c] (from forward).
    Returns:
        dq [b, hq, 2c, d] in q's dtype and dkv [2, b, hk, 2c, d] in kv's dtype.
    Communication over the Ring group: R-1 K/V exchanges (``kv.numel()`` elements per step)
    and R exchanges of the float32 dK/dV accumulator (``kv.numel()`` float32 elements per
    step); the last one delivers each accumulator to the owner of its K/V.
    """
    size = comm.size
    acc = accum_dtype(q.dtype)
    kv_cur = kv
    pending_dkv: Optional[PendingExchange] = None
    for step in range(size):
        pending_kv = _pass_kv_on(comm, kv_cur, step)
        plan = zigzag_block_plan(step, comm.rank, size, causal)
        kv_blk = _cols(kv_cur, plan)
        dq_b, dk_b, dv_b = kernel.backward(
            _rows(dout, plan), _rows(q, plan), kv_blk[0], kv_blk[1], _rows(out, plan),
            _rows(lse, plan), plan.causal, scale,
        )
        if size == 1:
            return dq_b.to(q.dtype), torch.stack([dk_b, dv_b]).to(kv.dtype)
        if step == 0:
            # Step 0 covers all rows and all of our own K/V: it starts both accumulators,
            # the dK/dV one on its journey round the ring.
            dq_acc = dq_b.to(acc, copy=True)
            dkv_acc = torch.stack([dk_b, dv_b]).to(acc)
        else:
            _rows(dq_acc, plan).add_(dq_b)
            # The accumulator of K/V source j arrives from the previous rank; add our share.
            dkv_acc = pending_dkv.wait()
            dkv_blk = _cols(dkv_acc, plan)
            dkv_blk[0].add_(dk_b)
            dkv_blk[1].add_(dv_b)
        pending_dkv = comm.exchange(dkv_acc)
        if pending_kv is not None:
            kv_cur = pending_kv.wait()
    return dq_acc.to(q.dtype), pending_dkv.wait().to(kv.dtype)


# --------------------------------------------------------------------------- autograd shell
class _RingAttentionFunction(torch.autograd.Function):
    """Thin autograd wrapper; the math lives in ring_attention_forward/backward."""

    @staticmethod
    def forward(ctx, q, kv, comm, kernel, causal, scale):
        out, lse = ring_attention_forward(q, kv, comm, kernel, causal, scale)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.comm, ctx.kernel, ctx.causal, ctx.scale = comm, kernel, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        dq, dkv = ring_attention_backward(
            dout, q, kv, out, lse, ctx.comm, ctx.kernel, ctx.causal, ctx.scale
        )
        return dq, dkv, None, None, None, None


def ring_attention(
    q: Tensor, kv: Tensor, ring_group: Optional[dist.ProcessGroup], kernel: AttentionKernel,
    causal: bool, scale: float,
) -> Tensor:
    """Differentiable zigzag ring attention (layout and volumes: module docstring).

    Args:
        q: [b, hq, 2c, d]; kv: [2, b, hk, 2c, d] contiguous; both in zigzag order.
        ring_group: the Ring group, or ``None`` for a ring of one (no communication).
    Returns:
        out [b, hq, 2c, d], q's dtype.
    """
    return _RingAttentionFunction.apply(q, kv.contiguous(), RingComm(ring_group), kernel,
                                        causal, scale)
