"""USP core attention: Ulysses all-to-all x load-balanced ring attention (USP, Algorithm 1),
pipelined over head chunks so that the all-to-alls overlap attention compute.

:func:`usp_attention` is the entry point (torch only); megatron-core's core-attention module
:class:`megatron.usp.core_attention.USPAttention` calls it.

Data flow on one rank for head chunk g of G (Ulysses group of size U, Ring group of size R,
legend and head-chunk ownership in :mod:`megatron.usp.ulysses`, ring shapes in
:mod:`megatron.usp.ring_attention`)::

    q [s, b, h, d], k/v [s, b, hk, d]        local tokens: chunks c and 2CP-1-c (token_order.py)
      -- Ulysses all-to-all of chunk g (Q, K, V in one collective), zigzag permutation -->
    q_h [b, h/(UG), S/R, d], kv_h [2, b, hk'/(UG), S/R, d]    ring rank r's super-chunks
      -- zigzag ring attention over the Ring group (K/V travel, LSE merge in fp32) -->
    out_h [b, h/(UG), S/R, d]
      -- inverse permutation, Ulysses all-to-all of chunk g -->
    out [s, b, h, d] (chunk g's heads)        same tokens as the input

Pipeline (``overlap_chunks`` = G; :func:`usp_attention_forward`, :func:`usp_attention_backward`).
Forward: while chunk g's attention computes, the Q/K/V all-to-all of chunk g+1 and the output
all-to-all of chunk g-1 are in flight; only chunk 0's input and chunk G-1's output transfers
are exposed. Backward, the mirror image: the dOut all-to-all of chunk g+1 and the dQ/dK/dV
all-to-all of chunk g-1 run while chunk g's backward computes. With R > 1 the ring's last
dK/dV hop of chunk g (see :mod:`megatron.usp.ring_attention`) is left in flight across chunk
g+1's backward, and chunk g's gradients go home in two all-to-alls: dQ at once (overlapping
chunk g+1's backward, as without a ring), dK/dV, which need that hop, one chunk later
(overlapping chunk g+2's): one more exposed all-to-all (the last chunk's dK/dV) for one hidden
ring hop, the better trade whenever the ring link is not faster than the Ulysses link (U = 1:
no all-to-all at all; U x R: the ring usually spans nodes). Every transfer is issued with
``async_op=True`` *before* the compute it should overlap is queued: on CUDA, NCCL's stream
then waits only for the work queued so far (the packing copy), and ``wait()`` makes the
compute stream wait only where the data is needed. G = 1 is the plain sequence (all-to-all,
attention, all-to-all). Chunks hold whole KV heads
(:func:`megatron.usp.ulysses.head_chunk_choices`); with K/V replicated over Ulysses ranks
(hk < U) G is 1.

Packed documents (``documents``, a :class:`megatron.usp.document_ring.DocumentRingPlan`): the
all-to-alls and the head-chunk pipeline are unchanged; the ring step is the document ring of
:mod:`megatron.usp.document_ring` (only the keys another rank's queries see move) with the
document-masked kernels of :mod:`megatron.usp.document_kernels`.

Sliding window (``window`` = left, causal only): the same pipeline with the document ring's
windowed plan (:meth:`~megatron.usp.document_ring.DocumentRingPlan.with_window` of the
micro-batch's plan, or :func:`~megatron.usp.document_ring.window_ring_plan`, one segment,
without documents): only the halo of keys the window reaches moves. With U = R = 1 and no
documents the local kernel's window runs on the whole sequence
(:mod:`megatron.usp.window_kernel`). A window reaching the whole sequence is full causal
attention, run as such.

``overlap_chunks=None`` (auto) picks G = 2 when something can overlap (U > 1 or R > 1), two
chunks are valid, and each chunk keeps at least ``AUTO_MIN_HEADS_PER_CHUNK`` (8) query heads
per rank, so that every kernel call keeps enough heads to fill the GPU; else 1. Two chunks
hide half of the all-to-all volume (forward; backward too when R = 1) and, with a ring, half
of the last dK/dV hops, at the cost of kernel calls of half the heads; more chunks hide more
but shrink the calls further. When both U > 1 and R > 1, auto keeps G = 1: pipelining then
runs Ulysses all-to-alls and ring transfers on two NCCL communicators at once, which is exact
on the CPU (gloo) but has not yet been run on 4+ GPUs; pass ``overlap_chunks`` explicitly to
opt in.

No rank ever holds the full-sequence K/V: after the all-to-all a rank holds U*s = S/R tokens of
hk'/U KV heads (of which one chunk at a time is in flight), and the ring passes such blocks
along.

Communication per rank and layer (element counts; the modules give the derivation). Ulysses
forward ``(U-1)/U * s*b*(2h + 2hk')*d`` (Q, K, V in, output back), backward the same, split in
G all-to-alls per direction of 1/G each. Ring forward ``(R-1) * 2*b*(hk'/U)*(S/R)*d``, backward
``(R-1)`` K/V-sized messages plus R dK/dV hops (R-1 in the ring's accumulator dtype, the
last in the input dtype); every ring message is split in G, one per chunk. Peak memory over
plain Ulysses: the transfers of at most two chunks are in flight at a time (their buffers are
1/G of the unchunked ones), and the ring's accumulators (the input dtype for R = 2, float32
for R > 2, :func:`megatron.usp.ring_attention.ring_accum_dtype`) exist for one chunk at a
time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron.usp.document_choice import get_document_kernel
from megatron.usp.document_kernels import DocumentKernel
from megatron.usp.document_ring import (
    DocumentRingPlan,
    document_ring_backward,
    document_ring_forward,
    effective_window,
    window_ring_plan,
)
from megatron.usp.kernels import AttentionKernel, get_kernel
from megatron.usp.packed_documents import PackedDocumentAttention, PackedPlan, packed_plan_for
from megatron.usp.ring_attention import (
    RingGrads,
    ring_attention_backward,
    ring_attention_forward,
)
from megatron.usp.ring_comm import RingComm
from megatron.usp.ulysses import (
    PendingAllToAll,
    group_size,
    head_chunk_choices,
    kv_replication,
    start_heads_to_seq,
    start_seq_to_heads,
)
from megatron.usp.window_kernel import window_backward, window_forward

Tensor = torch.Tensor

AUTO_MIN_HEADS_PER_CHUNK = 8


def resolve_overlap_chunks(num_heads: int, num_kv_heads: int, ulysses_size: int,
                           ring_size: int, requested: Optional[int] = None) -> int:
    """The number of head chunks G USP attention pipelines (module docstring).

    Args:
        num_heads, num_kv_heads: query / KV heads on this TP rank.
        ulysses_size, ring_size: U and R.
        requested: ``overlap_chunks``: ``None`` for auto, else a value of
            :func:`megatron.usp.ulysses.head_chunk_choices` (checked).
    Raises:
        ValueError naming ``overlap_chunks`` and the valid values.
    """
    choices = head_chunk_choices(num_heads, num_kv_heads, ulysses_size)
    if requested is None:
        # Both groups active at once is not yet GPU-verified (module docstring): opt-in only.
        overlappable = (ulysses_size > 1) != (ring_size > 1)
        big_enough = num_heads // (ulysses_size * 2) >= AUTO_MIN_HEADS_PER_CHUNK
        return 2 if overlappable and big_enough and 2 in choices else 1
    if isinstance(requested, bool) or not isinstance(requested, int) or requested not in choices:
        why = ("KV heads are replicated over Ulysses ranks (fewer KV heads than U)"
               if choices == [1] and num_kv_heads < ulysses_size else
               f"a chunk must hold whole KV heads: it must divide the {num_kv_heads // ulysses_size}"
               f" KV heads per Ulysses rank")
        raise ValueError(
            f"overlap_chunks={requested!r} is not valid for {num_heads} query / {num_kv_heads} KV "
            f"heads per TP rank and --ulysses-degree {ulysses_size}: {why}; choose one of "
            f"{choices} (or None for auto)"
        )
    return requested


# --------------------------------------------------------------------------- pipeline
@dataclass(frozen=True)
class USPSchedule:
    """Everything one USP attention call needs besides its tensors.

    Attributes:
        ulysses: the Ulysses group (``None`` for U = 1).
        ring: the Ring group's communicator (size 1: no ring communication).
        kv_rep: KV replication factor of the all-to-all (:func:`kv_replication`).
        chunks: head chunks G (:func:`resolve_overlap_chunks`).
        kernel, causal, scale: the local attention kernel and its arguments.
        documents, document_kernel: the micro-batch's document ring plan and the
            document-masked kernel (None: no document mask); with a window, the windowed plan.
        window: the left window (None: none; then only with U = R = 1 and no documents is it
            read, by the local kernel, the plans carrying it otherwise).
    """

    ulysses: Optional[dist.ProcessGroup]
    ring: RingComm
    kv_rep: int
    chunks: int
    kernel: AttentionKernel
    causal: bool
    scale: float
    documents: Optional[DocumentRingPlan] = None
    document_kernel: Optional[DocumentKernel] = None
    window: Optional[int] = None


def _ring_forward(q_h: Tensor, kv_h: Tensor, sched: USPSchedule) -> Tuple[Tensor, Tensor]:
    if sched.documents is not None:
        return document_ring_forward(q_h, kv_h, sched.ring, sched.document_kernel,
                                     sched.documents, sched.scale)
    return ring_attention_forward(q_h, kv_h, sched.ring, sched.kernel, sched.causal, sched.scale)


def _ring_backward(dout_h, q_h, kv_h, out_h, lse, sched: USPSchedule) -> RingGrads:
    if sched.documents is not None:
        return document_ring_backward(dout_h, q_h, kv_h, out_h, lse, sched.ring,
                                      sched.document_kernel, sched.documents, sched.scale)
    return ring_attention_backward(dout_h, q_h, kv_h, out_h, lse, sched.ring, sched.kernel,
                                   sched.causal, sched.scale)


SavedChunk = Tuple[Tensor, Tensor, Tensor, Tensor]   # q_h, kv_h, out_h, lse of one chunk


def _start_qkv(q: Tensor, k: Tensor, v: Tensor, sched: USPSchedule, chunk: int
               ) -> Tuple[PendingAllToAll, Tensor, Tensor]:
    """Start chunk ``chunk``'s Q/K/V all-to-all; q_h and kv_h are valid after ``wait()``.

    Returns (pending, q_h [b, h/(UG), S_r, d], kv_h [2, b, hk'/(UG), S_r, d]); K and V land
    in one contiguous buffer because the ring sends them as one message per step.
    """
    U, G = group_size(sched.ulysses), sched.chunks
    s, b, h, d = q.shape
    q_h = torch.empty(b, h // (U * G), U * s, d, dtype=q.dtype, device=q.device)
    kv_h = torch.empty(2, b, k.shape[2] * sched.kv_rep // (U * G), U * s, d, dtype=k.dtype,
                       device=k.device)
    pending = start_seq_to_heads((q, k, v), (1, sched.kv_rep, sched.kv_rep), sched.ulysses,
                                 chunk, G, outs=(q_h, kv_h[0], kv_h[1]))
    return pending, q_h, kv_h


def usp_attention_forward(q: Tensor, k: Tensor, v: Tensor, sched: USPSchedule
                          ) -> Tuple[Tensor, List[SavedChunk]]:
    """Pipelined USP attention forward (module docstring), outside autograd.

    Args:
        q: [s, b, h, d]; k, v: [s, b, hk, d]; local tokens in megatron's order, any strides.
    Returns:
        out [s, b, h, d] contiguous in q's dtype, and per chunk (q_h, kv_h, out_h, lse) for the
        backward (shapes of :mod:`megatron.usp.ring_attention`).
    Communication: per chunk one Q/K/V and one output all-to-all over the Ulysses group and
    R-1 K/V exchanges over the Ring group, each 1/G of the unchunked volume.
    """
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    incoming = _start_qkv(q, k, v, sched, 0)
    outgoing: Optional[PendingAllToAll] = None
    saved: List[SavedChunk] = []
    for g in range(sched.chunks):
        # Chunk g+1's input transfer goes out before chunk g's compute is queued.
        upcoming = _start_qkv(q, k, v, sched, g + 1) if g + 1 < sched.chunks else None
        pending, q_h, kv_h = incoming
        pending.wait()
        out_h, lse = _ring_forward(q_h, kv_h, sched)              # [b, h/(UG), S_r, d]
        saved.append((q_h, kv_h, out_h, lse))
        if outgoing is not None:   # chunk g-1's output, in flight during chunk g's compute
            outgoing.wait()
        outgoing = start_heads_to_seq((out_h,), (1,), sched.ulysses, (out,), g, sched.chunks)
        incoming = upcoming
    outgoing.wait()
    return out, saved


def _wait_all(transfers: List[PendingAllToAll]) -> None:
    for transfer in transfers:
        transfer.wait()
    transfers.clear()


def usp_attention_backward(dout: Tensor, saved: Sequence[SavedChunk], kv_shape: torch.Size,
                           sched: USPSchedule) -> Tuple[Tensor, Tensor, Tensor]:
    """Pipelined USP attention backward (module docstring), outside autograd.

    Args:
        dout: [s, b, h, d] gradient of the output (any strides).
        saved: the per-chunk tensors :func:`usp_attention_forward` returned.
        kv_shape: k's shape [s, b, hk, d].
    Returns:
        dq [s, b, h, d], dk, dv [s, b, hk, d], contiguous, dout's dtype (= q's = k's).
    Communication: per chunk one dOut all-to-all and the gradients' all-to-all over the
    Ulysses group (dQ, dK, dV in one; with a ring dQ in one and dK/dV in another), and the ring
    backward's messages, each 1/G of the unchunked volume.
    """
    G, rep = sched.chunks, sched.kv_rep
    dq = torch.empty(dout.shape, dtype=dout.dtype, device=dout.device)
    dk, dv = (torch.empty(kv_shape, dtype=dout.dtype, device=dout.device) for _ in range(2))
    # With a ring, chunk g's last dK/dV hop is hidden behind chunk g+1's backward: dQ goes
    # home at once, dK/dV one chunk later (so only they, not dQ, wait through that chunk).
    lagging = sched.ring.size > 1
    incoming = start_seq_to_heads((dout,), (1,), sched.ulysses, 0, G)
    held: Optional[Tuple[int, RingGrads]] = None   # chunk whose dK/dV are on their last hop
    outgoing: List[PendingAllToAll] = []            # gradient transfers of the previous chunk

    def send_home(chunk, grads, reps, dests):
        outgoing.append(start_heads_to_seq(grads, reps, sched.ulysses, dests, chunk, G))

    for g in range(G):
        upcoming = start_seq_to_heads((dout,), (1,), sched.ulysses, g + 1, G) if g + 1 < G else None
        (dout_h,) = incoming.wait()                              # [b, h/(UG), S_r, d]
        incoming = upcoming
        q_h, kv_h, out_h, lse = saved[g]
        grads = _ring_backward(dout_h, q_h, kv_h, out_h, lse, sched)
        del dout_h
        # The previous chunk's transfers had this chunk's backward to hide behind.
        _wait_all(outgoing)
        if not lagging:
            send_home(g, (grads.dq, *grads.dkv()), (1, rep, rep), (dq, dk, dv))
            continue
        if held is not None:
            send_home(held[0], held[1].dkv(), (rep, rep), (dk, dv))
        send_home(g, (grads.dq,), (1,), (dq,))
        grads.dq = None
        held = (g, grads)
    _wait_all(outgoing)
    if held is not None:
        send_home(held[0], held[1].dkv(), (rep, rep), (dk, dv))
        _wait_all(outgoing)
    return dq, dk, dv


class _USPAttentionFunction(torch.autograd.Function):
    """Thin autograd shell; the schedule lives in usp_attention_forward/backward."""

    @staticmethod
    def forward(ctx, q, k, v, sched):
        out, saved = usp_attention_forward(q, k, v, sched)
        ctx.save_for_backward(*(t for chunk in saved for t in chunk))
        ctx.sched = sched
        ctx.kv_shape = k.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        flat = ctx.saved_tensors
        saved = [flat[i:i + 4] for i in range(0, len(flat), 4)]
        dq, dk, dv = usp_attention_backward(dout, saved, ctx.kv_shape, ctx.sched)
        return dq, dk, dv, None


def _heads_view(x: Tensor) -> Tensor:
    """[s, b, h, d] -> the kernels' [b, h, s, d] as a view of sequence-major storage (a
    contiguous copy first only when ``x`` is not contiguous, e.g. megatron's V, a view into the
    QKV projection that would otherwise stay alive with it)."""
    return (x if x.is_contiguous() else x.contiguous()).permute(1, 2, 0, 3)


class _LocalAttentionFunction(torch.autograd.Function):
    """U = R = 1: the kernel straight on [b, h, s, d] views of megatron's [s, b, h, d] tensors.

    Nothing is communicated, so no head-major copy is needed: cuDNN reads sequence-major
    operands natively (:func:`megatron.usp.kernels.cudnn_strides`) and PyTorch allocates its
    output with q's strides, so the returned ``[s, b, h, d]`` output is the very tensor the kernel
    keeps for its backward (one copy of it in memory, not two). Kernels that return head-major
    outputs (the CPU ones) get one reorder copy, as before.
    """

    @staticmethod
    def forward(ctx, q, k, v, sched):
        q_b, k_b, v_b = _heads_view(q), _heads_view(k), _heads_view(v)
        if sched.window is not None:
            out_b, lse = window_forward(q_b, k_b, v_b, True, sched.window, sched.scale)
        else:
            out_b, lse = sched.kernel.forward(q_b, k_b, v_b, sched.causal, sched.scale)
        out = out_b.permute(2, 0, 1, 3)                                   # [s, b, h, d]
        if not out.is_contiguous():
            out = out.contiguous()
        ctx.save_for_backward(q_b, k_b, v_b, out_b, lse)
        ctx.sched = sched
        return out

    @staticmethod
    def backward(ctx, dout):
        q_b, k_b, v_b, out_b, lse = ctx.saved_tensors
        sched = ctx.sched
        if sched.window is not None:
            dq, dk, dv = window_backward(_heads_view(dout), q_b, k_b, v_b, out_b, lse, True,
                                         sched.window, sched.scale)
        else:
            dq, dk, dv = sched.kernel.backward(_heads_view(dout), q_b, k_b, v_b, out_b, lse,
                                               sched.causal, sched.scale)
        return dq.permute(2, 0, 1, 3), dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3), None


def usp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    ulysses_group: Optional[dist.ProcessGroup],
    ring_group: Optional[dist.ProcessGroup],
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    backend: Union[str, AttentionKernel] = "auto",
    overlap_chunks: Optional[int] = None,
    documents: Optional[DocumentRingPlan] = None,
    document_kernel: Union[str, DocumentKernel] = "auto",
    window: Optional[int] = None,
) -> Tensor:
    """Unified sequence-parallel attention on this rank's tokens; differentiable.

    Args:
        q: [s, b, h, d] queries of the local tokens (RoPE applied), in the order of
            :mod:`megatron.usp.token_order` (chunks c and 2CP-1-c, c = u + U*r).
        k, v: [s, b, hk, d]; ``h % hk == 0``; hk and U must divide one another.
        ulysses_group: the Ulysses group (U adjacent ranks), or ``None`` for U = 1.
        ring_group: the Ring group (R ranks strided by U), or ``None`` for R = 1.
        causal: causal (True) or full (False) attention over the whole sequence.
        softmax_scale: defaults to 1/sqrt(d).
        backend: ``--attention-backend`` name or an :class:`AttentionKernel`.
        overlap_chunks: head chunks G pipelined against the all-to-alls; ``None`` picks
            (:func:`resolve_overlap_chunks`), 1 runs unpipelined; the result is the same.
        documents: the micro-batch's :class:`~megatron.usp.document_ring.DocumentRingPlan`
            (this ring rank's): attention confined to documents (its ``causal`` must equal
            ``causal``); q, k, v then hold the tokens of the plan's chunk assignment. None:
            no document mask.
        document_kernel: ``--document-attention-kernel`` name or a
            :class:`~megatron.usp.document_kernels.DocumentKernel` (with ``documents`` or
            ``window``).
        window: sliding window, megatron-core's ``window_size[0]`` (``left``): a query at
            position i sees keys j with ``i - left <= j <= i`` (causal only; None: none).
    Returns:
        [s, b, h, d] contiguous attention output of the local tokens, q's dtype: what
        single-device attention on the whole sequence gives for these tokens.
    Communication: see the module docstring.
    """
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"usp_attention takes q [s, b, h, d] and k, v [s, b, hk, d]; got q{tuple(q.shape)} "
            f"k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q{tuple(q.shape)} and k{tuple(k.shape)} must share tokens, batch and head dim, "
            f"and query heads must be a multiple of KV heads"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    sched = make_schedule(q, k, ulysses_group=ulysses_group, ring_group=ring_group,
                          causal=causal, softmax_scale=softmax_scale, backend=backend,
                          overlap_chunks=overlap_chunks, documents=documents,
                          document_kernel=document_kernel, window=window)
    return usp_attention_with_schedule(q, k, v, sched)


def make_schedule(q: Tensor, k: Tensor, *, ulysses_group: Optional[dist.ProcessGroup],
                  ring_group: Optional[dist.ProcessGroup], causal: bool,
                  softmax_scale: Optional[float], backend: Union[str, AttentionKernel],
                  overlap_chunks: Optional[int], documents: Optional[DocumentRingPlan] = None,
                  document_kernel: Union[str, DocumentKernel] = "auto",
                  window: Optional[int] = None) -> USPSchedule:
    """The :class:`USPSchedule` of a call with q [s, b, h, d] and k [s, b, hk, d] (arguments as
    for :func:`usp_attention`)."""
    U, R = group_size(ulysses_group), group_size(ring_group)
    kernel = get_kernel(backend)
    ring_rank = dist.get_rank(ring_group) if R > 1 else 0
    if documents is not None:
        _check_documents(documents, q, U, R, ring_rank, causal)
    window = _check_window(window, causal, q.shape[0] * U * R)
    if window is not None:
        documents = (documents.with_window(window) if documents is not None else
                     _window_plan(q, U, R, ring_rank, window))
    return USPSchedule(
        ulysses=ulysses_group if U > 1 else None,
        ring=RingComm(ring_group if R > 1 else None),
        kv_rep=kv_replication(k.shape[2], U),
        chunks=resolve_overlap_chunks(q.shape[2], k.shape[2], U, R, overlap_chunks),
        kernel=kernel,
        causal=causal,
        scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3]),
        documents=documents,
        document_kernel=(get_document_kernel(document_kernel, kernel)
                         if documents is not None else None),
        window=window,
    )


def _check_window(window: Optional[int], causal: bool, seq_len: int) -> Optional[int]:
    """The window the call runs with (None for a window reaching the whole sequence)."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r}: a sliding window is a number of keys >= 1 "
                         f"(megatron-core's window_size[0]), e.g. window=4096")
    if not causal:
        raise ValueError("a sliding window needs causal attention (window_size = (left, 0)); "
                         "use causal=True or window=None")
    return effective_window(window, seq_len)


def _window_plan(q: Tensor, U: int, R: int, ring_rank: int, window: int
                 ) -> Optional[DocumentRingPlan]:
    """The windowed ring plan of a call without documents; None for U = R = 1 (the local
    kernel's window then runs on the whole sequence)."""
    if U == 1 and R == 1:
        return None
    s, b = q.shape[:2]
    return window_ring_plan(s * U * R, b, ring_rank, R, window, q.device)


def usp_attention_with_schedule(q: Tensor, k: Tensor, v: Tensor, sched: USPSchedule) -> Tensor:
    """:func:`usp_attention` for an already built schedule (differentiable)."""
    if sched.ulysses is None and sched.ring.size == 1:
        if sched.documents is None:
            return _LocalAttentionFunction.apply(q, k, v, sched)
        packed = _packed_plan(q, k, v, sched)
        if packed is not None:
            return PackedDocumentAttention.apply(q, k, v, packed, sched.kernel, sched.scale)
    return _USPAttentionFunction.apply(q, k, v, sched)


def _packed_plan(q: Tensor, k: Tensor, v: Tensor, sched: USPSchedule
                 ) -> Optional[PackedPlan]:
    """U = R = 1 with ``--document-attention-kernel auto``: whole documents in order are read
    in place (:mod:`megatron.usp.packed_documents`); other kernels keep the block path."""
    if sched.document_kernel is None or sched.document_kernel.name != "auto":
        return None
    return packed_plan_for(sched.documents.blocks[0], sched.kernel, q, k,
                           getattr(sched.document_kernel, "costs_group", None),
                           getattr(sched.document_kernel, "layers", 1), v, sched.scale)


def _check_documents(plan: DocumentRingPlan, q: Tensor, ulysses: int, ring: int,
                     ring_rank: int, causal: bool) -> None:
    """The plan must describe these tokens: same ring, batch, tokens and mask type."""
    s, b = q.shape[:2]
    if ring_rank != plan.ring_rank:
        raise ValueError(f"the document plan is ring rank {plan.ring_rank}'s; this is ring "
                         f"rank {ring_rank}")
    if plan.ring_size != ring or plan.batch != b or plan.seq_len != s * ulysses * ring:
        raise ValueError(
            f"the document plan is for a ring of {plan.ring_size}, batch {plan.batch} and "
            f"{plan.seq_len} tokens; this call has a ring of {ring}, batch {b} and "
            f"{s * ulysses * ring} tokens (s={s} x U={ulysses} x R={ring})")
    if plan.causal != causal:
        raise ValueError(f"the document plan was built with causal={plan.causal}, the "
                         f"attention call has causal={causal}")
