"""Point-to-point ring communicator for ring attention.

One :class:`RingComm` per ring attention call wraps the Ring process group: every exchange
sends one contiguous buffer to the next ring rank and receives one same-shaped buffer from the
previous ring rank, issued together through ``torch.distributed.batch_isend_irecv`` so that the
transfer runs while the caller computes (on CUDA, NCCL runs P2P on its own stream; ``wait()``
makes the current stream wait for it, so no extra stream or event is needed).

Ordering contract: every ring rank must issue the same sequence of exchanges with the same
buffer sizes and dtypes (the ring schedule is symmetric and every rank runs the same head
chunks in the same order, so it does). Up to three exchanges may be in flight at once in the
backward (the previous head chunk's dK/dV on its last hop home, K/V for the next step, the
dK/dV accumulator); messages between a pair of ranks are matched in issue order, so they
cannot cross.

A ring of size 1 (``group is None`` or a one-rank group) never communicates: ``exchange`` is
not called by the ring schedule then, and calling it is an error.

:meth:`RingComm.shift` is the document ring's step (:mod:`megatron.usp.document_ring`): ring
rank ``r`` sends to ``r + offset`` and receives from ``r - offset``, each side only where the
schedule needs the block, so a step may send, receive, both or neither; every rank derives the
same schedule from the same batch, so each send has its matching receive. Because some ranks may
sit a step out, :meth:`RingComm.ensure_ready` first runs one collective over the whole Ring
group (once per group and process): with NCCL, the first point-to-point batch on a group must
involve all of its ranks (``torch.distributed.batch_isend_irecv``'s documentation).

Timeouts. Ranks whose schedules differ (they hold different batches: the document plan is
derived from the batch) would wait for a message that never comes. A wait on host buffers
(gloo) is bounded by the Ring group's own timeout (``--distributed-timeout-minutes``, or the
``timeout`` given) and raises :class:`RingTimeoutError` in one line naming this rank and the
ranks it waited for. On CUDA the wait only orders streams (blocking the host would cost the
overlap), and NCCL's watchdog aborts the group after the same timeout.
"""

from __future__ import annotations

import datetime
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.usp.parallel_dims import ring_neighbours

Tensor = torch.Tensor

# Ring groups that have run a collective with every rank (see the module docstring).
_READY_GROUPS: "weakref.WeakSet" = weakref.WeakSet()


class RingTimeoutError(RuntimeError):
    """A ring exchange whose peer never answered: the ring ranks ran different schedules."""


def group_timeout(group: Optional[dist.ProcessGroup]) -> Optional[datetime.timedelta]:
    """The timeout ``group`` was created with (its gloo backend's), or None when it has none
    on the host."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


class PendingExchange:
    """An in-flight exchange; ``wait()`` returns the received buffer.

    Holds a reference to the send buffer until completion so the caching allocator cannot
    hand its memory to another tensor while the transfer still reads it. ``timeout`` bounds
    a wait on host buffers (module docstring); ``peers`` says who was waited for.
    """

    def __init__(self, requests: List, send_buf: Optional[Tensor],
                 recv_buf: Optional[Tensor], timeout: Optional[datetime.timedelta] = None,
                 peers: str = "") -> None:
        self._requests = requests
        self._send_buf: Optional[Tensor] = send_buf
        self._recv_buf = recv_buf
        on_host = all(b is None or b.device.type == "cpu" for b in (send_buf, recv_buf))
        self._timeout = timeout if on_host else None
        self._peers = peers

    def wait(self) -> Optional[Tensor]:
        """Finish the transfer; the received buffer (None for a send-only transfer).
        Raises :class:`RingTimeoutError` when a host transfer outlives the timeout."""
        for req in self._requests:
            if self._timeout is None:
                req.wait()
                continue
            try:
                req.wait(self._timeout)
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    raise
                raise RingTimeoutError(
                    f"ring exchange timed out after {self._timeout.total_seconds():g} s: "
                    f"{self._peers}; the ring ranks ran different schedules (their batches or "
                    f"document plans differ; --batch-agreement-interval 1 checks the batches)"
                ) from None
        self._requests = []
        self._send_buf = None
        return self._recv_buf


class RingComm:
    """Send-to-next / receive-from-previous on an explicit Ring process group.

    Args:
        group: the Ring group (ranks ordered by ring rank), or ``None`` for a ring of one.
        timeout: the longest wait on host buffers; default the group's own timeout.

    Attributes:
        size, rank: ring size R and this process's ring rank r.
        send_to, recv_from: global ranks of ring ranks (r+1) % R and (r-1) % R.
        bytes_sent: bytes this communicator has sent so far (every exchange and shift), what
            tests and benchmarks read to check a schedule's traffic.
    """

    def __init__(self, group: Optional[dist.ProcessGroup],
                 timeout: Optional[datetime.timedelta] = None) -> None:
        self.group = group
        self.timeout = timeout if timeout is not None else group_timeout(group)
        self.bytes_sent = 0
        if group is None:
            self.size, self.rank = 1, 0
            self.send_to = self.recv_from = None
            return
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        send_to, recv_from = ring_neighbours(self.rank, self.size)
        self.send_to = dist.get_global_rank(group, send_to)
        self.recv_from = dist.get_global_rank(group, recv_from)

    def exchange(self, send_buf: Tensor, recv_buf: Optional[Tensor] = None) -> PendingExchange:
        """Start sending ``send_buf`` to the next rank and receiving into ``recv_buf``.

        Group: the Ring group. Bytes per call: ``send_buf.numel() * element_size`` sent and
        the same received, per rank. ``recv_buf`` defaults to a fresh buffer shaped like
        ``send_buf``. ``send_buf`` must be contiguous and must not be modified before
        ``wait()``.
        """
        if self.size == 1:
            raise RuntimeError("a ring of size 1 has no neighbour to exchange with")
        if not send_buf.is_contiguous():
            raise ValueError("ring exchange buffers must be contiguous")
        if recv_buf is None:
            recv_buf = torch.empty_like(send_buf)
        self.bytes_sent += send_buf.numel() * send_buf.element_size()
        ops = [
            dist.P2POp(dist.isend, send_buf, self.send_to, self.group),
            dist.P2POp(dist.irecv, recv_buf, self.recv_from, self.group),
        ]
        return PendingExchange(dist.batch_isend_irecv(ops), send_buf, recv_buf, self.timeout,
                               self._peers(self.send_to, self.recv_from))

    def _peers(self, dst: Optional[int], src: Optional[int]) -> str:
        """Who this rank exchanges with, for the timeout message."""
        me = f"ring rank {self.rank} (global rank {dist.get_rank()})"
        parts = ([f"sending to global rank {dst}"] if dst is not None else []) + (
            [f"receiving from global rank {src}"] if src is not None else [])
        return f"{me} was {' and '.join(parts)}"

    def ensure_ready(self, device: torch.device) -> None:
        """One all-reduce of one element over the Ring group, the first time only.

        Every rank of the group must call it at the same point (the document ring does, before
        its first exchange of a micro-batch that has any: the plan is the same on every rank).
        """
        if self.group is None or self.group in _READY_GROUPS:
            return
        dist.all_reduce(torch.zeros(1, device=device), group=self.group)
        _READY_GROUPS.add(self.group)

    def shift(self, offset: int, send_buf: Optional[Tensor], recv_buf: Optional[Tensor]
              ) -> Optional[PendingExchange]:
        """Send ``send_buf`` to ring rank ``r + offset`` and receive into ``recv_buf`` from
        ``r - offset`` (mod R); either may be None (that side is skipped), both None: None.

        Bytes: ``send_buf``'s and ``recv_buf``'s sizes. Buffers must be contiguous and
        ``send_buf`` unmodified until ``wait()``.
        """
        if self.size == 1:
            raise RuntimeError("a ring of size 1 has no neighbour to exchange with")
        ops, dst, src = [], None, None
        if send_buf is not None:
            if not send_buf.is_contiguous():
                raise ValueError("ring exchange buffers must be contiguous")
            dst = dist.get_global_rank(self.group, (self.rank + offset) % self.size)
            self.bytes_sent += send_buf.numel() * send_buf.element_size()
            ops.append(dist.P2POp(dist.isend, send_buf, dst, self.group))
        if recv_buf is not None:
            src = dist.get_global_rank(self.group, (self.rank - offset) % self.size)
            ops.append(dist.P2POp(dist.irecv, recv_buf, src, self.group))
        if not ops:
            return None
        return PendingExchange(dist.batch_isend_irecv(ops), send_buf, recv_buf, self.timeout,
                               self._peers(dst, src))
