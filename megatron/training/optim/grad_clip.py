"""The optimizer step's gradient norm and clipping, on the device, with PyTorch's multi-tensor kernels.

megatron-core 0.16.1 computes the norm (``get_grad_norm_fp32``) and clips
(``clip_grad_by_total_norm_fp32``) with TransformerEngine's or apex's multi-tensor kernels.
Without either (a pip-only install, our GPU machine) it falls back to
``megatron.core.utils.local_multi_tensor_l2_norm``, which builds ``torch.tensor`` from one
CUDA scalar per parameter tensor (a device-to-host read each: ~100 for the 0.85B model) and
reads the result back, and to ``local_multi_tensor_scale``, ``dst.copy_(src * coeff)`` per
tensor (a temporary and a copy each). A one-H200 profile at 32K tokens shows the GPU idle for those reads and the extra passes.

Here the same quantities come from ``torch._foreach_norm`` / ``torch._foreach_mul_`` (one
multi-tensor kernel per device and dtype, in place), and the norm stays a device tensor:
the training loop reads it together with the loss in one transfer
(:func:`megatron.training.loop.guarded_optimizer_step`).

Same definition as megatron-core: the grads are each sub-optimizer's
``get_main_grads_for_grad_norm()`` (shared and tensor-parallel duplicates already left out),
their squared L2 norms summed in float32, all-reduced (SUM) over the sub-optimizer's
``get_grad_stats_parallel_group()`` (first over the FSDP data-parallel group for DTensor
grads), summed over the sub-optimizers and square-rooted (``ChainedOptimizer``'s rule);
clipping multiplies every main grad of ``get_parameters()`` by
``max_norm / (norm + 1e-6)`` when that is below 1.

The division by the global number of loss tokens (megatron-core's ``finalize_model_grads``
with ``calculate_per_token_loss``) moves here as well, so that the step can do all of it in
PyTorch's fused Adam kernel. That kernel takes a ``grad_scale`` tensor it divides each
gradient by as it reads it, and a ``found_inf`` tensor on which it leaves parameters, moments
and step count untouched (the arguments ``torch.amp.GradScaler`` hands it as optimizer
attributes). With ``grad_scale = num_tokens / clip_coefficient`` and ``found_inf`` = "loss or
norm not finite", the step needs no host read before it: :func:`scaled_in_adam`. That saves
a pass over the grads for the division (megatron-core's ``scale_gradients``) and one for the
clip, and the host sync in ``finalize_model_grads`` (``if num_tokens > 0``), after which the
GPU waited for the host to queue the rest of the step: ~2.5 + 1.9 ms and the waits per 32K
step of the 0.85B model on one H200 in a profile, though an
alternating end-to-end A/B did not show it faster. Where a sub-optimizer steps
with anything else (SGD, a loss scaler, the CPU-offload optimizer, Megatron-FSDP's DTensors,
TransformerEngine's precision-aware Adam), :func:`fused_adams` says so and the training loop
divides and clips the grads in megatron-core's order before the step.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def sub_optimizers(optimizer) -> List:
    """The megatron-core optimizers inside ``optimizer`` (a ``ChainedOptimizer``) or itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _by_device_and_dtype(tensors: Iterable[Tensor]) -> Dict[Tuple, List[Tensor]]:
    groups: Dict[Tuple, List[Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return groups


def sum_of_squares(tensors: Iterable[Tensor], device: torch.device) -> Tensor:
    """``sum_i ||t_i||_2^2`` in float32 as a 0-dim tensor on ``device`` (0 for no tensors)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group in _by_device_and_dtype(tensors).values():
        norms = torch._foreach_norm(group)
        total += torch.stack(norms).float().pow(2).sum().to(device)
    return total


def _local(grad: Tensor) -> Tensor:
    from megatron.core.utils import to_local_if_dtensor  # megatron-core on first use

    return to_local_if_dtensor(grad)


def grad_norm(optimizer, device: torch.device) -> Tensor:
    """The total L2 norm of the main grads (module docstring), a 0-dim float32 tensor on
    ``device``; every rank of the grad-stats groups gets the same value. Collective: every
    rank of those groups must call it."""
    from megatron.core.utils import get_data_parallel_group_if_dtensor  # megatron-core on first use

    # Sub-optimizers reducing over the same groups share one all-reduce (the sum of their
    # squares); the insertion order is the sub-optimizers' order, the same on every rank.
    by_groups: Dict[Tuple, Tensor] = {}
    for sub in sub_optimizers(optimizer):
        grads = sub.get_main_grads_for_grad_norm()
        fsdp_group = None
        for g in grads:
            fsdp_group = get_data_parallel_group_if_dtensor(g, fsdp_group)
        squares = sum_of_squares([_local(g) for g in grads], device)
        key = (fsdp_group, sub.get_grad_stats_parallel_group())
        by_groups[key] = by_groups[key] + squares if key in by_groups else squares
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (fsdp_group, stats_group), squares in by_groups.items():
        if fsdp_group is not None:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=fsdp_group)
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=stats_group)
        total += squares
    return total.sqrt()


def main_grads(sub) -> List[Tensor]:
    """The main grads the sub-optimizer steps with (``decoupled_grad`` for the precision-aware
    optimizer, as megatron-core reads them)."""
    decoupled = sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    out = []
    for p in sub.get_parameters():
        g = getattr(p, "decoupled_grad", None) if decoupled else p.grad
        if g is not None:
            out.append(_local(g).detach())
    return out


def clip_grads(optimizer, norm: float) -> None:
    """Scale the main grads of every sub-optimizer with ``clip_grad > 0`` by
    ``clip_grad / (norm + 1e-6)`` when that is below 1 (in place)."""
    for sub in sub_optimizers(optimizer):
        max_norm = sub.config.clip_grad
        if max_norm <= 0.0:
            continue
        coeff = max_norm / (norm + 1.0e-6)
        if coeff < 1.0:
            for group in _by_device_and_dtype(main_grads(sub)).values():
                torch._foreach_mul_(group, coeff)


def fused_adams(optimizer) -> Optional[List[torch.optim.Optimizer]]:
    """The PyTorch Adam(W) of each sub-optimizer when all of them run its fused kernel on
    plain tensors with no loss scaler (then :func:`scaled_in_adam` applies); else None."""
    from torch.distributed.tensor import DTensor  # torch.distributed.tensor on first use

    adams = []
    for sub in sub_optimizers(optimizer):
        opt = getattr(sub, "optimizer", None)
        if (getattr(sub, "grad_scaler", None) is not None
                or not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))
                or sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                or not all(group.get("fused") for group in opt.param_groups)
                or any(isinstance(p, DTensor)
                       for group in opt.param_groups for p in group["params"])):
            return None
        adams.append(opt)
    return adams


def step_divisors(optimizer, num_tokens: Tensor, norm: Tensor) -> List[Tensor]:
    """Per sub-optimizer, the 0-dim tensor its grads are divided by: ``num_tokens`` over the
    clip coefficient ``min(1, clip_grad / (norm + 1e-6))`` (``num_tokens`` alone without
    clipping). ``norm`` is the norm of the already divided grads."""
    out = []
    for sub in sub_optimizers(optimizer):
        max_norm = sub.config.clip_grad
        if max_norm > 0.0:
            coeff = torch.clamp(max_norm / (norm + 1.0e-6), max=1.0)
            out.append(num_tokens / coeff)
        else:
            out.append(num_tokens)
    return out


@contextmanager
def scaled_in_adam(optimizer, adams: List[torch.optim.Optimizer], num_tokens: Tensor,
                   norm: Tensor, ok: Tensor) -> Iterator[None]:
    """Inside the block each fused Adam of :func:`fused_adams` divides its grads by
    :func:`step_divisors` and skips its update unless ``ok`` (a 0-dim bool tensor: the loss
    and the norm are finite). All device tensors: nothing is read on the host."""
    found_inf = (~ok).to(torch.float32)
    try:
        for opt, divisor in zip(adams, step_divisors(optimizer, num_tokens, norm)):
            # A NaN divisor is never used (found_inf skips the update); 1 keeps it harmless.
            opt.grad_scale = torch.where(ok, divisor, torch.ones_like(divisor))
            opt.found_inf = found_inf
        yield
    finally:
        for opt in adams:
            for name in ("grad_scale", "found_inf"):
                if hasattr(opt, name):
                    delattr(opt, name)
