"""Load-balanced (zigzag) ring attention over the Ring group: forward and backward.

Shapes on ring rank ``r`` of ``R`` (legend: ``b`` batch, ``hq``/``hk`` local query / KV heads,
``c`` tokens per super-chunk, ``d`` head dim)::

    q, out, dout : [b, hq, 2c, d]        zigzag order: super-chunk r, then super-chunk 2R-1-r
    kv, dkv      : [2, b, hk, 2c, d]     K and V packed in one buffer (one transfer per step)
    lse          : [b, hq, 2c]           float32 (float64 for float64 inputs)

The sequence is cut into 2R super-chunks of c tokens; this is what
:func:`megatron.usp.token_order.positions_for_ring_rank` gives after the Ulysses all-to-all.

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

Communication per rank and call (legend above; ``e`` the element size of q/kv, ``e_acc`` that
of the accumulator dtype (:func:`ring_accum_dtype`): ``e`` for R = 2, else 4 bytes for
fp16/bf16/fp32 and 8 for fp64):

* forward: R-1 exchanges of ``kv``: ``2*b*hk*2c*d*e`` bytes sent and received per step, each
  started before the step's compute so it overlaps it.
* backward: R-1 exchanges of ``kv`` (as forward) plus R hops of the travelling dK/dV
  accumulator, ``2*b*hk*2c*d`` elements each: the first R-1 hops in the accumulator dtype
  (``e_acc``; with R > 2 every partial sum stays float32 while it collects the ranks'
  shares), the R-th hop, which only delivers the finished sum to the rank that owns its K/V, in kv's dtype
  (``e``: the owner would cast it on arrival anyway, so casting before sending gives the same
  bits at half the bytes for bf16). :func:`ring_attention_backward` returns with that last hop
  still in flight (:class:`RingGrads`), so the caller can overlap it with other work.

Backward recomputes nothing of the forward but each block's attention probabilities inside
the kernel's backward, using the saved final ``out`` and ``lse`` (see
:mod:`megatron.usp.kernels`). dQ is accumulated locally, dK/dV in the travelling accumulator.

Accumulator precision (:func:`ring_accum_dtype`). With R > 2 the output, dQ and dK/dV
accumulators are float32 (float64 for float64 inputs): a sum of up to R partial results is
rounded once, at the end. With R = 2 every sum has exactly two terms (the local block and one
remote block), and the sum of two bf16/fp16 values computed in float32 and rounded once is what
a float32 accumulator rounded at the end gives too, bit for bit; so with R = 2 the accumulators
keep the input dtype, computing each merge and addition in float32 (PyTorch's ``add_`` on
bf16/fp16 does; :func:`megatron.usp.kernels.merge_block_` does for the output). That halves the
ring's dK/dV traffic and removes the float32 copies of out, dQ, dK and dV from the peak memory;
``tests/distributed/test_usp_attention.py`` checks the bits against float32 accumulators.

Local memory traffic per step besides the kernel (elements of out-sized [b, hq, rows, d]
tensors): the forward merge reads the block output and the accumulator and rewrites the
accumulator twice (:func:`megatron.usp.kernels.merge_block_`); the backward adds the block's
dQ into the dQ accumulator and dK/dV into the received accumulator, in place. The
``torch`` kernel makes its inputs contiguous, which copies the ``back`` query rows (q, out,
dout, lse) and the ``front`` key columns (K, V) of the steps that use a half.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

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


# --------------------------------------------------------------------------- precision
def ring_accum_dtype(dtype: torch.dtype, ring_size: int) -> torch.dtype:
    """Dtype of the output / dQ / dK-dV accumulators for a ring of ``ring_size`` (module doc).

    ``dtype`` itself when ``ring_size <= 2`` (every sum then has at most two terms, computed in
    float32 and rounded once either way), else :func:`megatron.usp.kernels.accum_dtype`.
    """
    return dtype if ring_size <= 2 else accum_dtype(dtype)


# --------------------------------------------------------------------------- forward / backward
# A causal forward over at least this many local tokens (ring of one) is computed as three
# half-size blocks (:func:`split_causal_forward`).
SPLIT_CAUSAL_FORWARD_TOKENS = 128 * 1024


def split_causal_forward(q: Tensor, kv: Tensor, kernel: AttentionKernel, scale: float
                         ) -> Tuple[Tensor, Tensor]:
    """Causal attention of q [b, h, S, d] on kv [2, b, hk, S, d] as three half-size blocks.

    Front query half on front keys (causal), back half on front keys (no mask) and on back keys
    (causal), the two back blocks merged by log-sum-exp (two terms: exact in the input dtype,
    :func:`ring_accum_dtype`). Same FLOPs as one causal call. Why: cuDNN's causal forward
    slows down on long sequences (on an H200 its rate falls by about a sixth from 64K to 256K;
    ``docs/performance.md``), while half-length blocks keep the 64K rate; the
    backward needs only the merged out and lse, so it stays one call.

    Returns out [b, h, S, d] in q's dtype and lse [b, h, S] float32 (float64).
    """
    half = q.shape[2] // 2
    front_q, back_q = q[:, :, :half], q[:, :, half:]
    front_kv, back_kv = kv[:, :, :, :half], kv[:, :, :, half:]
    out_f, lse_f = kernel.forward(front_q, front_kv[0], front_kv[1], True, scale)
    out_b, lse_b = kernel.forward(back_q, front_kv[0], front_kv[1], False, scale)
    lse_b = lse_b.to(accum_dtype(q.dtype))
    diag_out, diag_lse = kernel.forward(back_q, back_kv[0], back_kv[1], True, scale)
    merge_block_(out_b, lse_b, diag_out, diag_lse)
    del diag_out, diag_lse
    out = torch.cat([out_f, out_b], dim=2)
    lse = torch.cat([lse_f.to(lse_b.dtype), lse_b], dim=2)
    return out, lse


def ring_attention_forward(
    q: Tensor, kv: Tensor, comm: RingComm, kernel: AttentionKernel, causal: bool, scale: float,
    acc_dtype: Optional[torch.dtype] = None,
    split_causal_tokens: int = SPLIT_CAUSAL_FORWARD_TOKENS,
) -> Tuple[Tensor, Tensor]:
    """Zigzag ring attention forward.

    Args:
        q: [b, hq, 2c, d] local queries in zigzag order.
        kv: [2, b, hk, 2c, d] contiguous local K and V (same order).
        comm: the Ring group's communicator (size 1: no communication).
        acc_dtype: the output accumulator's dtype; default :func:`ring_accum_dtype`.
        split_causal_tokens: with a ring of one, a causal forward over at least this many
            tokens runs as :func:`split_causal_forward`.
    Returns:
        out [b, hq, 2c, d] in q's dtype, lse [b, hq, 2c] float32 (float64 for float64 q).
    Communication: R-1 steps, each sending and receiving ``kv.numel()`` elements over the Ring
    group, overlapped with the step's block.
    """
    size = comm.size
    lse_dtype = accum_dtype(q.dtype)
    if size == 1:
        if causal and q.shape[2] % 2 == 0 and q.shape[2] >= max(2, split_causal_tokens):
            return split_causal_forward(q, kv, kernel, scale)
        out, lse = kernel.forward(q, kv[0], kv[1], causal, scale)
        return out, lse.to(lse_dtype)
    acc = acc_dtype or ring_accum_dtype(q.dtype, size)
    kv_cur = kv
    for step in range(size):
        pending = _pass_kv_on(comm, kv_cur, step)
        plan = zigzag_block_plan(step, comm.rank, size, causal)
        kv_blk = _cols(kv_cur, plan)
        out_b, lse_b = kernel.forward(_rows(q, plan), kv_blk[0], kv_blk[1], plan.causal, scale)
        del kv_blk
        if pending is None:
            kv_cur = None      # last step: the received K/V are used up, free them now
        if step == 0:
            # Step 0 covers every row and every row sees its own diagonal: start from it. The
            # kernel's outputs are fresh tensors, so they may become the accumulators (no copy
            # when they already have the accumulator dtype).
            acc_out, acc_lse = out_b.to(acc), lse_b.to(lse_dtype)
        else:
            merge_block_(_rows(acc_out, plan), _rows(acc_lse, plan), out_b, lse_b)
        del out_b, lse_b
        if pending is not None:
            kv_cur = pending.wait()
    return acc_out.to(q.dtype), acc_lse


def _pass_kv_on(comm: RingComm, kv_cur: Tensor, step: int) -> Optional[PendingExchange]:
    """Start passing the current K/V on, unless this is the last step (it would come home)."""
    if step + 1 >= comm.size:
        return None
    return comm.exchange(kv_cur)


class RingGrads:
    """What :func:`ring_attention_backward` returns: dQ, and dK/dV possibly still travelling.

    Attributes:
        dq: [b, hq, 2c, d] in q's dtype, final.
    ``dkv()`` waits (once) for the dK/dV accumulator's last hop home and returns ``(dk, dv)``,
    each [b, hk, 2c, d] in kv's dtype. Call it as late as possible: until then the transfer
    overlaps whatever the caller computes.
    """

    def __init__(self, dq: Tensor, dkv: Optional[Tuple[Tensor, Tensor]] = None,
                 home: Optional[PendingExchange] = None) -> None:
        self.dq = dq
        self._dkv = dkv
        self._home = home

    def dkv(self) -> Tuple[Tensor, Tensor]:
        if self._home is not None:
            arrived = self._home.wait()          # [2, b, hk, 2c, d], kv's dtype
            self._dkv, self._home = (arrived[0], arrived[1]), None
        return self._dkv


def _start_dkv_accumulator(dk: Tensor, dv: Tensor, acc: torch.dtype) -> Tensor:
    """[2, b, hk, 2c, d] contiguous accumulator holding dk, dv (one cast-copy each)."""
    buf = torch.empty((2, *dk.shape), dtype=acc, device=dk.device)
    buf[0].copy_(dk)
    buf[1].copy_(dv)
    return buf


def ring_attention_backward(
    dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, comm: RingComm,
    kernel: AttentionKernel, causal: bool, scale: float, acc_dtype: Optional[torch.dtype] = None,
) -> RingGrads:
    """Zigzag ring attention backward.

    Args:
        dout, q, out: [b, hq, 2c, d]; kv: [2, b, hk, 2c, d]; lse: [b, hq, 2c] (from forward).
        acc_dtype: the dQ and dK/dV accumulators' dtype; default :func:`ring_accum_dtype`.
    Returns:
        :class:`RingGrads`: dq [b, hq, 2c, d] in q's dtype; ``dkv()`` gives dk, dv
        [b, hk, 2c, d] in kv's dtype once the last hop has arrived.
    Communication over the Ring group: R-1 K/V exchanges (``kv.numel()`` elements of kv's
    dtype per step) and R hops of the dK/dV accumulator (``kv.numel()`` elements each; the
    first R-1 in the accumulator dtype, the last, still in flight on return, in kv's dtype).
    """
    size = comm.size
    if size == 1:
        dq, dk, dv = kernel.backward(dout, q, kv[0], kv[1], out, lse, causal, scale)
        return RingGrads(dq, dkv=(dk, dv))
    acc = acc_dtype or ring_accum_dtype(q.dtype, size)
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
        del kv_blk
        if pending_kv is None:
            # Last step: the received K/V are used up. Freeing them before the dK/dV hop lets
            # the caching allocator hand their memory to that hop's receive buffer.
            kv_cur = None
        if step == 0:
            # Step 0 covers all rows and all of our own K/V: it starts both accumulators,
            # the dK/dV one on its journey round the ring.
            dq_acc = dq_b.to(acc)
            dkv_acc = _start_dkv_accumulator(dk_b, dv_b, acc)
        else:
            _rows(dq_acc, plan).add_(dq_b)
            # The accumulator of K/V source j arrives from the previous rank; add our share.
            dkv_acc = pending_dkv.wait()
            dkv_blk = _cols(dkv_acc, plan)
            dkv_blk[0].add_(dk_b)
            dkv_blk[1].add_(dv_b)
            del dkv_blk
        del dq_b, dk_b, dv_b
        if step == size - 1:
            # Every share is in: the next hop only delivers the sum to its owner, who wants it
            # in kv's dtype. Casting before the send gives the same bits with half the bytes
            # (bf16); with R > 2 the earlier hops stay float32 because they still accumulate.
            dkv_acc = dkv_acc.to(kv.dtype)
        pending_dkv = comm.exchange(dkv_acc)
        if pending_kv is not None:
            kv_cur = pending_kv.wait()
    return RingGrads(dq_acc.to(q.dtype), home=pending_dkv)
