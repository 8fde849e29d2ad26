"""DeepSpeed-Ulysses all-to-alls over the Ulysses group: sequence-sharded <-> head-sharded.

Legend: ``U`` Ulysses degree, ``s`` local tokens per rank (two chunks of ``s/2``, see
:mod:`megatron.usp.layout`), ``b`` batch, ``h``/``hk`` query / KV heads on this (TP) rank,
``d`` head dim, ``S_r = U*s`` tokens of the ring rank after the all-to-all.

Forward (:func:`qkv_seq_to_heads`, one all-to-all for Q, K and V together)::

    q [s, b, h, d], k/v [s, b, hk, d]                         sequence-sharded (megatron)
      -> send  [U, s, b, h/U + 2*hk'/U, d]                    dest-rank major (pack)
      -> all_to_all_single over the Ulysses group
      -> recv  [U, s, b, h/U + 2*hk'/U, d]                    source-rank major
      -> q_h [b, h/U, S_r, d], kv_h [2, b, hk'/U, S_r, d]     head-sharded, zigzag order

and :func:`heads_to_seq` is the reverse for the attention output::

    out_h [b, h/U, S_r, d] -> send [U, s, b, h/U, d] -> all_to_all -> out [s, b, h, d]

The unpack also applies the block permutation :func:`megatron.usp.layout.ulysses_to_zigzag_order`
(and the pack of the way back its inverse), so the ring sees super-chunk r then super-chunk
2R-1-r; the permutation is folded into the copy that the layout change needs anyway (one pass
over the data per direction, no extra copy).

GQA/MQA: K and V travel with their own head count. When the KV heads on this rank are fewer
than U (``hk < U``, e.g. MQA, or 8 KV heads with TP 2 and U 8), each KV head is replicated
``U/hk`` times inside the pack so that every Ulysses rank receives exactly the one KV head its
``h/U`` query heads use (``hk' = U``); the backward sums the replicas' gradients. Otherwise
``hk' = hk`` and ``hk % U == 0`` is required. ``megatron.usp.config`` validates this at start-up.

Bytes per call and rank (element size ``e``): forward sends ``(U-1)/U * s*b*(h + 2*hk')*d*e``
and receives as much; the output all-to-all ``(U-1)/U * s*b*h*d*e``. The backward does the same
volumes in reverse. ``U == 1`` does no communication (only the layout change).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.usp.kernels import accum_dtype
from megatron.usp.layout import invert_order, ulysses_to_zigzag_order

Tensor = torch.Tensor


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Size of a process group; ``None`` stands for a group of one."""
    return 1 if group is None else dist.get_world_size(group)


def kv_replication(num_kv_heads: int, ulysses_size: int) -> int:
    """How many copies of each KV head the all-to-all sends: U/hk when hk < U, else 1."""
    if num_kv_heads >= ulysses_size:
        if num_kv_heads % ulysses_size:
            raise ValueError(
                f"KV heads per TP rank ({num_kv_heads}) must be divisible by --ulysses-degree "
                f"{ulysses_size} (or divide it)"
            )
        return 1
    if ulysses_size % num_kv_heads:
        raise ValueError(
            f"KV heads per TP rank ({num_kv_heads}) must divide --ulysses-degree {ulysses_size} "
            f"(or be divisible by it)"
        )
    return ulysses_size // num_kv_heads


# --------------------------------------------------------------------------- pack / unpack
def _pack_field(dst: Tensor, x: Tensor, rep: int) -> None:
    """Write x [s, b, hx, d] into dst [U, s, b, w, d] (a view): dest rank u gets its heads.

    ``rep == 1``: rank u gets heads u*w .. (u+1)*w-1. ``rep > 1`` (then w == 1): rank u gets
    head u // rep, i.e. each head replicated ``rep`` times.
    """
    U = dst.shape[0]
    if rep == 1:
        dst.copy_(x.unflatten(2, (U, dst.shape[3])).permute(2, 0, 1, 3, 4))
        return
    hx = x.shape[2]
    src = x.permute(2, 0, 1, 3).unsqueeze(1).expand(hx, rep, *x.shape[:2], x.shape[3])
    dst[:, :, :, 0].unflatten(0, (hx, rep)).copy_(src)


def _unpack_field(src: Tensor, rep: int, num_heads: int) -> Tensor:
    """Inverse of :func:`_pack_field`: src [U, s, b, w, d] -> [s, b, num_heads, d].

    Replicated heads (``rep > 1``) are summed (their gradients), in float32 for low precision.
    """
    if rep == 1:
        return src.permute(1, 2, 0, 3, 4).flatten(2, 3)
    summed = src[:, :, :, 0].unflatten(0, (num_heads, rep)).sum(1, dtype=accum_dtype(src.dtype))
    return summed.to(src.dtype).permute(1, 2, 0, 3)


def _scatter_to_zigzag(dst: Tensor, src: Tensor) -> None:
    """src [U, s, b, w, d] (source-rank major) -> dst [b, w, U*s, d] in zigzag block order.

    Block ``2u + half`` of the gathered sequence is ``half`` (0: front chunk, 1: back chunk)
    of source rank u; output slot i takes block ``ulysses_to_zigzag_order(U)[i]``.
    """
    U, s = src.shape[0], src.shape[1]
    halves = src.unflatten(1, (2, s // 2))                          # [U, 2, s/2, b, w, d]
    out_blocks = dst.unflatten(2, (2 * U, s // 2))                  # [b, w, 2U, s/2, d]
    for slot, block in enumerate(ulysses_to_zigzag_order(U)):
        u, half = divmod(block, 2)
        out_blocks[:, :, slot].copy_(halves[u, half].permute(1, 2, 0, 3))


def _gather_from_zigzag(dst: Tensor, src: Tensor) -> None:
    """Inverse of :func:`_scatter_to_zigzag`: src [b, w, U*s, d] -> dst [U, s, b, w, d]."""
    U, s = dst.shape[0], dst.shape[1]
    halves = dst.unflatten(1, (2, s // 2))                          # views: writes land in dst
    in_blocks = src.unflatten(2, (2 * U, s // 2))                   # [b, w, 2U, s/2, d]
    for block, slot in enumerate(invert_order(ulysses_to_zigzag_order(U))):
        u, half = divmod(block, 2)
        halves[u, half].copy_(in_blocks[:, :, slot].permute(2, 0, 1, 3))


def _all_to_all(send: Tensor, group: dist.ProcessGroup) -> Tensor:
    """all_to_all_single along dim 0 (chunk u goes to / comes from Ulysses rank u)."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _widths(heads: Sequence[int], reps: Sequence[int], U: int) -> List[int]:
    return [h * r // U for h, r in zip(heads, reps)]


# --------------------------------------------------------------------------- pure functions
def seq_to_heads(
    xs: Sequence[Tensor], reps: Sequence[int], group: Optional[dist.ProcessGroup],
    outs: Optional[Sequence[Tensor]] = None,
) -> List[Tensor]:
    """Sequence-sharded tensors -> head-sharded, zigzag-ordered, with one all-to-all.

    Args:
        xs: tensors [s, b, h_i, d] (local tokens in the layout of megatron.usp.layout).
        reps: KV replication factor per tensor (:func:`kv_replication`; 1 for queries).
        group: the Ulysses group (``None``: size 1).
        outs: optional destinations [b, h_i*rep_i/U, U*s, d] (e.g. views of one K/V buffer);
            fresh contiguous tensors when omitted.
    Returns:
        one [b, h_i*rep_i/U, U*s, d] tensor per input (``outs`` when given).
    Communication: one all_to_all_single of ``s*b*sum(h_i*rep_i)*d`` elements per rank
    ((U-1)/U of it leaves the rank).
    """
    U = group_size(group)
    s, b, _, d = xs[0].shape
    if s % 2:
        raise ValueError(f"local sequence length {s} must be even (two chunks per rank)")
    widths = _widths([x.shape[2] for x in xs], reps, U)
    if outs is None:
        outs = [torch.empty(b, w, U * s, d, dtype=xs[0].dtype, device=xs[0].device)
                for w in widths]
    if U == 1:   # no communication; the zigzag order is the identity
        for out, x in zip(outs, xs):
            out.copy_(x.permute(1, 2, 0, 3))
        return list(outs)
    send = torch.empty(U, s, b, sum(widths), d, dtype=xs[0].dtype, device=xs[0].device)
    for field, x, rep in zip(send.split(widths, dim=3), xs, reps):
        _pack_field(field, x, rep)
    recv = _all_to_all(send, group)
    for out, field in zip(outs, recv.split(widths, dim=3)):
        _scatter_to_zigzag(out, field)
    return list(outs)


def heads_to_seq(
    ys: Sequence[Tensor], reps: Sequence[int], heads: Sequence[int],
    group: Optional[dist.ProcessGroup],
) -> List[Tensor]:
    """Adjoint of :func:`seq_to_heads`: head-sharded zigzag tensors -> sequence-sharded.

    Args:
        ys: tensors [b, w_i, U*s, d] in zigzag order.
        reps, heads: the replication factors and original head counts ``h_i`` of
            :func:`seq_to_heads`; replicated heads are summed.
        group: the Ulysses group (``None``: size 1).
    Returns:
        one contiguous [s, b, h_i, d] tensor per input.
    Communication: one all_to_all_single of ``s*b*sum(w_i)*U*d`` elements per rank.
    """
    U = group_size(group)
    if U == 1:
        return [y.permute(2, 0, 1, 3).contiguous() for y in ys]
    b, _, seq, d = ys[0].shape
    s = seq // U
    widths = [y.shape[1] for y in ys]
    send = torch.empty(U, s, b, sum(widths), d, dtype=ys[0].dtype, device=ys[0].device)
    for field, y in zip(send.split(widths, dim=3), ys):
        _gather_from_zigzag(field, y)
    recv = _all_to_all(send, group)
    return [
        _unpack_field(field, rep, h).contiguous()
        for field, rep, h in zip(recv.split(widths, dim=3), reps, heads)
    ]


# --------------------------------------------------------------------------- autograd shells
class _QKVSeqToHeads(torch.autograd.Function):
    """(q, k, v) sequence-sharded -> (q_h, kv_h) head-sharded; backward is the reverse."""

    @staticmethod
    def forward(ctx, q, k, v, group, kv_rep):
        U = group_size(group)
        reps = (1, kv_rep, kv_rep)
        s, b, h, d = q.shape
        q_h = torch.empty(b, h // U, U * s, d, dtype=q.dtype, device=q.device)
        # K and V land in one buffer: the ring sends them as one message per step.
        kv_h = torch.empty(2, b, k.shape[2] * kv_rep // U, U * s, d, dtype=k.dtype,
                           device=k.device)
        seq_to_heads((q, k, v), reps, group, outs=(q_h, kv_h[0], kv_h[1]))
        ctx.group, ctx.reps = group, reps
        ctx.heads = (h, k.shape[2], v.shape[2])
        return q_h, kv_h

    @staticmethod
    def backward(ctx, dq_h, dkv_h):
        dq, dk, dv = heads_to_seq((dq_h, dkv_h[0], dkv_h[1]), ctx.reps, ctx.heads, ctx.group)
        return dq, dk, dv, None, None


class _HeadsToSeq(torch.autograd.Function):
    """out_h [b, h/U, U*s, d] -> out [s, b, h, d]; backward is the forward all-to-all."""

    @staticmethod
    def forward(ctx, out_h, group):
        U = group_size(group)
        ctx.group = group
        (out,) = heads_to_seq((out_h,), (1,), (out_h.shape[1] * U,), group)
        return out

    @staticmethod
    def backward(ctx, dout):
        (dout_h,) = seq_to_heads((dout,), (1,), ctx.group)
        return dout_h, None


def qkv_seq_to_heads(
    q: Tensor, k: Tensor, v: Tensor, group: Optional[dist.ProcessGroup]
) -> Tuple[Tensor, Tensor]:
    """Differentiable Ulysses all-to-all of Q, K, V (one collective).

    Args:
        q: [s, b, h, d]; k, v: [s, b, hk, d]; local tokens (megatron layout).
        group: the Ulysses group (``None`` or size 1: layout change only).
    Returns:
        q_h [b, h/U, U*s, d] and kv_h [2, b, hk'/U, U*s, d] (hk' = max(hk, U)), contiguous,
        in zigzag order.
    Communication: one all_to_all_single; per rank ``(U-1)/U * s*b*(h + 2*hk')*d`` elements
    sent and received (backward: the same, reversed).
    """
    U = group_size(group)
    if q.shape[2] % U:
        raise ValueError(
            f"query heads per TP rank ({q.shape[2]}) must be divisible by --ulysses-degree {U}"
        )
    return _QKVSeqToHeads.apply(q, k, v, group, kv_replication(k.shape[2], U))


def out_heads_to_seq(out_h: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Differentiable Ulysses all-to-all of the attention output back to sequence-sharded.

    Args:
        out_h: [b, h/U, U*s, d] in zigzag order.
    Returns:
        [s, b, h, d] contiguous, megatron's local token order.
    Communication: one all_to_all_single of ``(U-1)/U * s*b*h*d`` elements per rank each way.
    """
    return _HeadsToSeq.apply(out_h, group)
