"""DeepSpeed-Ulysses all-to-alls over the Ulysses group: sequence-sharded <-> head-sharded, one
head chunk at a time, asynchronously.

Legend: ``U`` Ulysses degree, ``G`` head chunks (``overlap_chunks``), ``s`` local tokens per
rank (two chunks of ``s/2``, see :mod:`megatron.usp.token_order`), ``b`` batch, ``h``/``hk`` query /
KV heads on this (TP) rank, ``hk'`` KV heads after replication (below), ``d`` head dim,
``S_r = U*s`` tokens of the ring rank after the all-to-all.

Head ownership. Ulysses rank ``u`` owns query heads ``[u*h/U, (u+1)*h/U)`` and KV heads
``[u*hk'/U, (u+1)*hk'/U)``, whatever ``G`` is. Head chunk ``g`` is the ``g``-th sub-block of
every rank's share: query head ``u*h/U + g*h/(U*G) + j`` (``j < h/(U*G)``) travels in chunk
``g`` to rank ``u`` as its local head ``j``, likewise for KV heads. With ``G | hk'/U`` (see
:func:`head_chunk_choices`), a chunk holds on every rank whole KV heads and exactly the query
heads that use them (GQA: query head ``i`` uses KV head ``i // (h/hk)``, and both counts split
alike), so chunks are independent attention problems and can be pipelined: the all-to-all of
one chunk runs while another chunk's attention computes (:mod:`megatron.usp.attention`).

Sequence -> heads (:func:`start_seq_to_heads`; Q, K and V of one chunk in one all-to-all)::

    x [s, b, h_x, d]                              sequence-sharded (megatron), any strides
      -> send [U, s, b, sum_x h_x'/(U*G), d]      dest-rank major (pack: chunk g's heads)
      -> all_to_all_single over the Ulysses group, async_op=True
      -> recv [U, s, b, sum_x h_x'/(U*G), d]      source-rank major
      -> x_h [b, h_x'/(U*G), S_r, d]              head-sharded, contiguous, zigzag order

Heads -> sequence (:func:`start_heads_to_seq`) is the adjoint: ``y_h [b, w, S_r, d]`` -> send
``[U, s, b, w, d]`` -> all-to-all -> written into chunk ``g``'s heads of ``y [s, b, h_y, d]``.

The unpack also applies the block permutation :func:`megatron.usp.token_order.ulysses_to_zigzag_order`
(and the pack of the way back its inverse), so the ring sees super-chunk r then super-chunk
2R-1-r; the permutation is folded into the copy that the change of memory order needs anyway. Each
direction costs one pack pass and one unpack pass over the chunk's data; with ``U == 1`` there
is no all-to-all and a single pass does the reorder.

GQA/MQA: K and V travel with their own head count. When the KV heads on this rank are fewer
than U (``hk < U``, e.g. MQA, or 8 KV heads with TP 2 and U 8), each KV head is replicated
``U/hk`` times inside the pack so that every Ulysses rank receives exactly the one KV head its
``h/U`` query heads use (``hk' = U``); the way back sums the replicas' gradients (in float32
for low precision). That single KV head serves every query head of the rank, so replicated
K/V cannot be cut into chunks: ``G = 1`` then. Otherwise ``hk' = hk`` and ``hk % U == 0`` is
required. :meth:`megatron.usp.parallel_dims.ParallelDims.violations` checks this at start-up.

Bytes per rank (element size ``e``): the Q/K/V all-to-all of one chunk sends
``(U-1)/U * s*b*(h + 2*hk')*d*e / G`` and receives as much; the output all-to-all
``(U-1)/U * s*b*h*d*e / G``. Over the G chunks the volume is that of one unchunked all-to-all;
the backward moves the same volumes in reverse.

CUDA streams: ``all_to_all_single(..., async_op=True)`` runs on NCCL's stream after the work
queued so far on the current stream (the pack); ``PendingAllToAll.wait()`` makes the current
stream wait for it. The send and receive buffers stay referenced until then, so the caching
allocator cannot reuse them while NCCL reads or writes them.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.usp.kernels import accum_dtype
from megatron.usp.token_order import invert_order, ulysses_to_zigzag_order

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


def head_chunk_choices(num_heads: int, num_kv_heads: int, ulysses_size: int) -> List[int]:
    """Valid head-chunk counts G for h query / hk KV heads per TP rank and Ulysses degree U.

    G must divide the KV heads a Ulysses rank owns (``hk/U``), so that every chunk holds whole
    KV heads and the query heads that use them; with replicated KV heads (``hk < U``) only 1.
    """
    if num_heads % ulysses_size:
        raise ValueError(
            f"query heads per TP rank ({num_heads}) must be divisible by --ulysses-degree "
            f"{ulysses_size}"
        )
    if kv_replication(num_kv_heads, ulysses_size) > 1:
        return [1]
    per_rank = num_kv_heads // ulysses_size
    return [g for g in range(1, per_rank + 1) if per_rank % g == 0]


# --------------------------------------------------------------------------- pending transfer
class PendingAllToAll:
    """An in-flight all-to-all of one head chunk; ``wait()`` finishes it and returns the result.

    Holds the send and receive buffers until ``wait()`` so that their memory cannot be handed
    to another tensor while the transfer still uses it.
    """

    def __init__(self, work, send: Optional[Tensor], recv: Optional[Tensor],
                 unpack: Callable[[Optional[Tensor]], Any]) -> None:
        self._work, self._send, self._recv, self._unpack = work, send, recv, unpack

    @classmethod
    def completed(cls, result: Any) -> "PendingAllToAll":
        """A transfer that needed no communication (U == 1): ``wait()`` returns ``result``."""
        return cls(None, None, None, lambda _: result)

    def wait(self) -> Any:
        if self._work is not None:
            self._work.wait()
        result = self._unpack(self._recv)
        self._work = self._send = self._recv = None
        return result


def _start_all_to_all(send: Tensor, group: dist.ProcessGroup,
                      unpack: Callable[[Tensor], Any]) -> PendingAllToAll:
    """Start all_to_all_single along dim 0 (block u goes to / comes from Ulysses rank u)."""
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return PendingAllToAll(work, send, recv, unpack)


# --------------------------------------------------------------------------- pack / unpack
def _dest_major(x: Tensor, ulysses_size: int, num_chunks: int, chunk: int) -> Tensor:
    """View [U, s, b, w, d] of x [s, b, hx, d]: the heads of chunk ``chunk`` owned by each rank.

    Rank u's chunk g is heads ``u*hx/U + g*w + [0, w)`` with ``w = hx/(U*G)``. Only splits
    dims, so it is a view for any strides of x.
    """
    return x.unflatten(2, (ulysses_size, num_chunks, -1))[:, :, :, chunk].permute(2, 0, 1, 3, 4)


def _pack_replicated(dst: Tensor, x: Tensor, rep: int) -> None:
    """Write x [s, b, hx, d] into dst [U, s, b, 1, d] with rank u getting head u // rep."""
    hx = x.shape[2]
    src = x.permute(2, 0, 1, 3).unsqueeze(1).expand(hx, rep, *x.shape[:2], x.shape[3])
    dst[:, :, :, 0].unflatten(0, (hx, rep)).copy_(src)


def _unpack_replicated(dst: Tensor, src: Tensor, rep: int) -> None:
    """Inverse of :func:`_pack_replicated` for gradients: dst [s, b, hx, d] = sum of replicas.

    The replicas are summed in float32 (float64) and rounded once.
    """
    hx = dst.shape[2]
    summed = src[:, :, :, 0].unflatten(0, (hx, rep)).sum(1, dtype=accum_dtype(src.dtype))
    dst.copy_(summed.permute(1, 2, 0, 3))                      # [hx, s, b, d] -> [s, b, hx, d]


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


def _check_chunking(reps: Sequence[int], chunk: int, num_chunks: int) -> None:
    if not 0 <= chunk < num_chunks:
        raise ValueError(f"head chunk {chunk} outside [0, {num_chunks})")
    if num_chunks > 1 and any(r > 1 for r in reps):
        raise ValueError("replicated KV heads (fewer KV heads than --ulysses-degree) cannot be "
                         "cut into head chunks; use overlap_chunks=1")


# --------------------------------------------------------------------------- entry points
def start_seq_to_heads(
    xs: Sequence[Tensor], reps: Sequence[int], group: Optional[dist.ProcessGroup],
    chunk: int = 0, num_chunks: int = 1, outs: Optional[Sequence[Tensor]] = None,
) -> PendingAllToAll:
    """Start moving head chunk ``chunk`` of sequence-sharded tensors to head-sharded zigzag.

    Args:
        xs: tensors [s, b, h_i, d] (local tokens in the order of megatron.usp.token_order; any
            strides), one dtype.
        reps: KV replication factor per tensor (:func:`kv_replication`; 1 for queries).
        group: the Ulysses group (``None``: size 1, no communication).
        chunk, num_chunks: which of the G head chunks (module docstring).
        outs: optional destinations [b, h_i*rep_i/(U*G), U*s, d] (e.g. views of one K/V
            buffer); fresh contiguous tensors when omitted.
    Returns:
        a :class:`PendingAllToAll` whose ``wait()`` gives one [b, h_i*rep_i/(U*G), U*s, d]
        tensor per input (``outs`` when given).
    Communication: one async all_to_all_single of ``s*b*sum(h_i*rep_i)*d/G`` elements per rank
    ((U-1)/U of it leaves the rank).
    """
    _check_chunking(reps, chunk, num_chunks)
    U = group_size(group)
    s, b, _, d = xs[0].shape
    if s % 2:
        raise ValueError(f"local sequence length {s} must be even (two chunks per rank)")
    widths = [x.shape[2] * rep // (U * num_chunks) for x, rep in zip(xs, reps)]
    if outs is None:
        outs = [torch.empty(b, w, U * s, d, dtype=xs[0].dtype, device=xs[0].device)
                for w in widths]

    def unpack(fields: Sequence[Tensor]) -> List[Tensor]:
        for out, field in zip(outs, fields):
            _scatter_to_zigzag(out, field)
        return list(outs)

    if U == 1:   # what rank 0 would receive is the dest-major view itself: one copy
        return PendingAllToAll.completed(unpack([_dest_major(x, 1, num_chunks, chunk)
                                                 for x in xs]))
    send = torch.empty(U, s, b, sum(widths), d, dtype=xs[0].dtype, device=xs[0].device)
    for field, x, rep in zip(send.split(widths, dim=3), xs, reps):
        if rep == 1:
            field.copy_(_dest_major(x, U, num_chunks, chunk))
        else:
            _pack_replicated(field, x, rep)
    return _start_all_to_all(send, group, lambda recv: unpack(recv.split(widths, dim=3)))


def start_heads_to_seq(
    ys: Sequence[Tensor], reps: Sequence[int], group: Optional[dist.ProcessGroup],
    outs: Sequence[Tensor], chunk: int = 0, num_chunks: int = 1,
) -> PendingAllToAll:
    """Adjoint of :func:`start_seq_to_heads`: head chunk ``chunk`` back to sequence-sharded.

    Args:
        ys: tensors [b, w_i, U*s, d] in zigzag order, one dtype (any strides).
        reps: the replication factors of :func:`start_seq_to_heads`; replicated heads are
            summed.
        group: the Ulysses group (``None``: size 1, no communication).
        outs: destinations [s, b, h_i, d] (``h_i = w_i*U*G/rep_i``); ``wait()`` writes chunk
            ``chunk``'s heads of each and returns ``outs``. The other chunks' heads are not
            touched, so the G chunks can fill one tensor.
    Communication: one async all_to_all_single of ``s*b*sum(w_i)*U*d`` elements per rank
    ((U-1)/U of it leaves the rank).
    """
    _check_chunking(reps, chunk, num_chunks)
    U = group_size(group)
    if U == 1:   # the zigzag order is the identity: one copy into the destination heads
        for y, out in zip(ys, outs):
            _gather_from_zigzag(_dest_major(out, 1, num_chunks, chunk), y)
        return PendingAllToAll.completed(outs)
    b, _, seq, d = ys[0].shape
    s = seq // U
    widths = [y.shape[1] for y in ys]
    send = torch.empty(U, s, b, sum(widths), d, dtype=ys[0].dtype, device=ys[0].device)
    for field, y in zip(send.split(widths, dim=3), ys):
        _gather_from_zigzag(field, y)

    def unpack(recv: Tensor) -> Sequence[Tensor]:
        for out, field, rep in zip(outs, recv.split(widths, dim=3), reps):
            if rep == 1:
                _dest_major(out, U, num_chunks, chunk).copy_(field)
            else:
                _unpack_replicated(out, field, rep)
        return outs

    return _start_all_to_all(send, group, unpack)
