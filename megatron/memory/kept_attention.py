"""Core attention that runs once under full recompute (``--recompute-keep-core-attn``).

Full recompute runs every layer twice: in the forward without autograd, and again in the
backward to rebuild its graph. At long sequences attention dominates that second run (at 512K
tokens it is ~ a fifth of the step). With this option the first run keeps each USP attention's
output ``out [s, b, h, d]`` (an :class:`~megatron.memory.activation_offload.ActivationOffloader`
item: on the device, or in host memory with ``--recompute-cpu-offload core_attn``) and the
log-sum-exp of every head chunk (``[b, h/(UG), S_r]`` float32, a 1/d-th of the output, kept on
the device); the recompute takes them back instead of calling the kernel and rebuilds only what
the backward needs:

    q, k, v (recomputed) -- Q/K/V all-to-all (as in the forward) --> q_h, kv_h
    out (kept)           -- sequence -> heads all-to-all, the one dOut also takes --> out_h

then :func:`megatron.usp.attention.usp_attention_backward` runs on (q_h, kv_h, out_h, lse) as
it does after a normal forward. Every step of this is a permutation of what the forward had,
so the gradients are bitwise those of recomputing the attention. Costs per layer: the kept
bytes (output + lse) until the backward reaches the layer, and the output's all-to-all (for
U > 1; a local reorder copy for U = 1) in place of the attention forward and its output
all-to-all.

Which call is which: a :class:`AttentionKeeper` (one per USPAttention module) keeps when its
module trains, grad mode is off (inside megatron-core's ``CheckpointFunction`` forward) and the
decoder forward is recording (the offloader's group is open); it replays when grad mode is on,
nothing records, and it holds a kept result, oldest first (micro-batches go backward in the
order they went forward, with or without pipelining). Anything else (evaluation, layers that
megatron's ``block`` method does not recompute) is plain USP attention.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import List

import torch

from megatron.memory.activation_offload import ActivationOffloader, OffloadItem
from megatron.usp.attention import (
    USPSchedule,
    _start_qkv,
    usp_attention_backward,
    usp_attention_forward,
    usp_attention_with_schedule,
)
from megatron.usp.ulysses import start_seq_to_heads

Tensor = torch.Tensor


@dataclass(frozen=True)
class RecomputeKeep:
    """What USPAttention's spec passes: the model's offloader, and where outputs go."""

    offloader: ActivationOffloader
    to_host: bool = False

    def make_keeper(self) -> "AttentionKeeper":
        """One layer's keeper (what ``USPAttention`` calls in training under full recompute)."""
        return AttentionKeeper(self)


@dataclass
class _Kept:
    out: OffloadItem          # [s, b, h, d], q's dtype
    lses: List[Tensor]        # per head chunk [b, h/(UG), S_r] float32
    q_shape: torch.Size


class _ReplayFunction(torch.autograd.Function):
    """Forward: rebuild the backward's inputs from the kept output; backward: USP's."""

    @staticmethod
    def forward(ctx, q, k, v, sched: USPSchedule, out: Tensor, lses: List[Tensor]):
        saved = []
        for g in range(sched.chunks):
            pending, q_h, kv_h = _start_qkv(q, k, v, sched, g)
            pending.wait()
            (out_h,) = start_seq_to_heads((out,), (1,), sched.ulysses, g, sched.chunks).wait()
            saved.append((q_h, kv_h, out_h, lses[g]))
        ctx.save_for_backward(*(t for chunk in saved for t in chunk))
        ctx.sched, ctx.kv_shape = sched, k.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        flat = ctx.saved_tensors
        saved = [flat[i:i + 4] for i in range(0, len(flat), 4)]
        dq, dk, dv = usp_attention_backward(dout, saved, ctx.kv_shape, ctx.sched)
        return dq, dk, dv, None, None, None


class AttentionKeeper:
    """Per-module FIFO of kept attention results (module docstring)."""

    def __init__(self, keep: RecomputeKeep) -> None:
        self.offloader = keep.offloader
        self.to_host = keep.to_host
        self._kept: deque = deque()
        self.replayed = 0          # recomputes that reused a kept output (read by tests)

    @property
    def pending(self) -> int:
        return len(self._kept)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, sched: USPSchedule) -> Tensor:
        """USP attention of q [s, b, h, d], k / v [s, b, hk, d]; returns out [s, b, h, d]."""
        if not torch.is_grad_enabled() and self.offloader.recording:
            out, saved = usp_attention_forward(q, k, v, sched)
            lses = [lse for (_, _, _, lse) in saved]
            del saved
            self._kept.append(_Kept(self.offloader.keep(out, self.to_host), lses, q.shape))
            return out
        if torch.is_grad_enabled() and self._kept:
            if self.offloader.recording:
                raise RuntimeError(
                    "USP attention holds a kept output for recompute but is running a "
                    "forward with autograd: the layer was recomputed out of order")
            kept = self._kept.popleft()
            if kept.q_shape != q.shape:
                raise RuntimeError(f"kept attention output is for q{tuple(kept.q_shape)}, the "
                                   f"recompute has q{tuple(q.shape)}")
            out = self.offloader.take(kept.out)
            self.replayed += 1
            return _ReplayFunction.apply(q, k, v, sched, out, kept.lses)
        return usp_attention_with_schedule(q, k, v, sched)


__all__ = ["RecomputeKeep", "AttentionKeeper"]
