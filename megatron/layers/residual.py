"""The residual stream's gradient added inside the RMSNorm backward instead of by autograd.

Each sublayer of a pre-norm transformer reads its input ``h`` twice: through the norm (before
QKV or FC1) and as the residual of the addition after the sublayer (``h + out``). In the
backward, autograd adds the two gradients of ``h`` with a kernel of its own, reading two
``[s, b, h]`` tensors and writing one, after the norm's backward has written its part. With
the ``usp`` RMSNorm (:mod:`megatron.layers.lean_kernels`) that addition happens inside the
norm's backward kernel instead, which reads the residual's gradient as one more input and
writes the sum, rounded once: two passes over ``[s, b, h]`` fewer per norm.

How the gradient gets there:

* the norm :func:`offer`\\ s a :class:`ResidualGrad` for its input tensor;
* the bias-dropout-add of the layer spec (:func:`residual_bda`, megatron-core's
  ``get_bias_dropout_add`` with this in front) :func:`claim`\\ s it when that same tensor comes
  as its residual, and routes the residual through :class:`_HandOver`, whose backward puts
  the residual's gradient into the channel and gives autograd none;
* the norm's backward takes it and adds it in.

The order is safe by construction: the norm's output feeds the sublayer whose output the
addition reads, so the addition's backward (which fills the channel) runs before the norm's
backward (which empties it). A channel filled after its norm's backward has run would lose
the gradient; :meth:`ResidualGrad.put` raises instead. A residual that no norm offered (other
norms, or none) takes autograd's usual path, as does everything without gradients (a
full recompute's first pass, evaluation).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from torch.utils.weak import WeakTensorKeyDictionary

Tensor = torch.Tensor


class ResidualGrad:
    """A one-gradient channel from the residual addition's backward to the norm's backward."""

    __slots__ = ("grad", "norm_done_without")

    def __init__(self):
        self.grad: Optional[Tensor] = None
        self.norm_done_without = False

    def put(self, grad: Tensor) -> None:
        if self.norm_done_without:
            raise RuntimeError(
                "the residual's gradient reached the norm after the norm's backward had run: "
                "the norm's output does not feed the sublayer whose residual addition read "
                "its input (megatron.layers.residual)")
        if self.grad is not None:
            raise RuntimeError("the residual's gradient was handed over twice before the "
                               "norm's backward took it (megatron.layers.residual)")
        self.grad = grad

    def take(self) -> Optional[Tensor]:
        """The gradient handed over, or None (then a later :meth:`put` raises)."""
        grad, self.grad = self.grad, None
        if grad is None:
            self.norm_done_without = True
        return grad


_offered = WeakTensorKeyDictionary()


def offer(x: Tensor) -> Optional[ResidualGrad]:
    """A channel for the gradient ``x`` will receive as a residual, or None when ``x``
    gets no gradient (no autograd graph is being recorded)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return None
    channel = ResidualGrad()
    _offered[x] = channel
    return channel


def claim(residual: Tensor) -> Optional[ResidualGrad]:
    """The channel a norm offered for ``residual`` (this very tensor), once."""
    if not torch.is_grad_enabled():
        return None
    return _offered.pop(residual, None)


class _HandOver(torch.autograd.Function):
    """Identity on the residual; its gradient goes to the channel, not to autograd."""

    @staticmethod
    def forward(ctx, residual: Tensor, channel: ResidualGrad) -> Tensor:
        ctx.channel = channel
        return residual.view_as(residual)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.channel.put(grad)
        return None, None


def residual_bda(training: bool, fused: bool):
    """megatron-core's ``get_bias_dropout_add(training, fused)`` whose residual's gradient
    goes to the norm that offered it (same signature; the layer spec's ``self_attn_bda`` and
    ``mlp_bda`` slots)."""
    inner = get_bias_dropout_add(training, fused)

    def bias_dropout_add(x_with_bias, residual: Tensor, prob: float) -> Tensor:
        channel = claim(residual)
        if channel is not None:
            residual = _HandOver.apply(residual, channel)
        return inner(x_with_bias, residual, prob)

    return bias_dropout_add
