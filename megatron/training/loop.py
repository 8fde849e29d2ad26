"""The pretraining loop: :func:`pretrain` is what ``pretrain_gpt.py`` calls.

One iteration (:func:`train_step`)::

    zero the DDP grad buffers and the optimizer
    megatron-core schedule (get_forward_backward_func: no pipelining, or 1F1B with PP > 1):
        for each of the G / (micro * DP) micro-batches (gradient accumulation):
            forward_step -> per-token losses -> backward of the sum over loss tokens
        finalize_model_grads: DP x CP all-reduce (or reduce-scatter with the distributed
        optimizer), embedding / sequence-parallel reductions; the grads stay sums over
        the global batch's loss tokens
    lm loss = (sum of loss sums) / (sum of loss tokens) over micro-batches and DP x CP,
        broadcast from the last pipeline stage: the same number on every rank
    megatron-core's optimizer step in its pieces (guarded_optimizer_step): prepare_grads,
        the grad norm (megatron.training.optim.grad_clip), the division by the loss tokens and
        grad-norm clipping, Adam, (ZeRO-1 parameter all-gather); a non-finite loss or norm
        changes nothing and raises an error naming the iteration, or (--skip-nan-steps)
        skips the update. With PyTorch's fused Adam (the default) division, clipping and
        the skip run inside its kernel and the host reads loss and norm once, after the step
    LR scheduler step (in samples, as Megatron-LM)

Around it: validation every ``--eval-interval`` over ``--eval-iters`` global batches,
checkpoints every ``--save-interval`` and at the end, a SIGTERM and SIGINT handler that
saves at the end of the current iteration (SIGTERM only when ``--save`` is set; SIGINT
without it stops there unsaved) and returns, the same stop at an iteration
``--exit-interval`` divides or after ``--exit-duration-in-mins``, and the metrics of
:mod:`megatron.training.observe.metrics`. Every way out (the end, an error, a
lost peer) stops the DataLoader workers first, so no exit waits on them.

The loop never branches on the device: CPU runs go through the same megatron-core calls,
with the stand-ins of :mod:`megatron.training.cpu_shims` installed by start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import optimizer as mcore_optimizer
from megatron.core.distributed import finalize_model_grads
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch.distributed.tensor import DTensor

from megatron.errors import UsageError
from megatron.planner.hardware import peak_tflops_for_device
from megatron.training.checkpoint.save_load import (
    TrainState,
    load_checkpoint,
    plain_args,
    save_checkpoint,
    set_rng_state,
    start_writer_manager,
    zero_adam_state,
)
from megatron.training.cli.config import RunConfig
from megatron.training.data import batch as batch_mod
from megatron.training.data.documents import DocumentBatching, documents_enabled
from megatron.training.data.loader import (
    build_data_iterator,
    build_gpt_datasets,
    shut_down_data_iterators,
    worker_start_method,
)
from megatron.training.exit_paths import keep_own_exit_status
from megatron.training.initialize import Runtime, initialize, launch_env, shutdown
from megatron.training.model.build import (
    build_model,
    configure_float8,
    count_parameters,
    reserve_offload_buffers,
)
from megatron.training.observe.memory_snapshot import MemoryHistory
from megatron.training.observe.metrics import (
    MetricsWriter,
    StepStats,
    Throughput,
    memory_report,
    peak_host_memory_gib,
    peak_memory_gib,
)
from megatron.training.observe.profiling import StepProfiler
from megatron.training.optim import grad_clip
from megatron.training.optim.offload_optimizer import (
    build_fraction,
    gpu_free_bytes,
    install_staged_offload,
)
from megatron.training.peer_faults import PeerLostError, peer_lost
from megatron.training.process_guard import children_ignore_stop_signals, stop_with_the_rank
from megatron.usp.backend_names import backend_installed
from megatron.usp.core_attention import layer_window
from megatron.usp.document_kernels import pinned_to_device
from megatron.usp.packed_documents import batched_shapes, cost_tables, describe_costs
from megatron.usp.parallel_state import USPGroups

logger = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; the message names the iteration."""


RUN_ERRORS = (UsageError, NonFiniteLossError, PeerLostError)
"""Every error ``pretrain_gpt.py`` reports in one line instead of a traceback: bad input
from any subsystem (flags, layout, data, ``--save``, ``--load``; raised identically on every
rank before any collective that could hang, or a failed save), a non-finite loss, and a
collective that failed because another rank died or went silent."""


def exit_status(exc: BaseException) -> int:
    """The error's own status (2 for bad input, 1 for a failed save, 3 for a lost peer),
    1 for the other :data:`RUN_ERRORS`."""
    return getattr(exc, "exit_status", 1)


def reported_here(exc: BaseException, rank: int) -> bool:
    """Whether this rank prints ``exc``: rank 0 (every rank raises the same start-up and
    loss errors), and a rank where a save fault arose itself (it may be the only one)."""
    return rank == 0 or bool(getattr(exc, "primary", False))


@dataclass
class TrainResult:
    """What a run did (every rank returns the same numbers)."""

    iteration: int
    losses: Dict[int, float] = field(default_factory=dict)
    valid_losses: Dict[int, float] = field(default_factory=dict)
    skipped_iterations: List[int] = field(default_factory=list)
    loaded_from: Optional[str] = None
    saved: List[str] = field(default_factory=list)
    stopped_by_signal: bool = False
    stop_signal: int = 0   # the signal that stopped it (SIGTERM, SIGINT), 0 for none
    stopped_by_time: bool = False   # --exit-duration-in-mins ended it


def print_rank_0(rt: Runtime, msg: str) -> None:
    if rt.rank == 0:
        print(msg, flush=True)


# --------------------------------------------------------------------------- setup
def build_optimizer(config: RunConfig, model):
    """megatron-core optimizer (Adam/SGD; ZeRO-1 with --use-distributed-optimizer; state and
    step on the CPU with --optimizer-cpu-offload)."""
    args = config.args
    no_te = bool(args.use_precision_aware_optimizer) and not backend_installed("te")
    config = mcore_optimizer.OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr,
        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad, bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather_with_optimizer_step=False,
        # --optimizer-cpu-offload: megatron-core's HybridDeviceOptimizer (memory_args.py),
        # built where its transient copies fit and then replaced by the staged one with the
        # asked fraction (offload_optimizer.py says why).
        optimizer_cpu_offload=args.optimizer_cpu_offload,
        optimizer_offload_fraction=_build_fraction(config, model),
        use_precision_aware_optimizer=args.use_precision_aware_optimizer and not no_te,
        overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d,
    )
    if no_te:
        precision_aware_without_te(config)
    optimizer = mcore_optimizer.get_megatron_optimizer(config, model)
    if args.optimizer_cpu_offload:
        install_staged_offload(optimizer, config.optimizer_offload_fraction)
    use_fused_adam(optimizer)
    allocate_adam_state(optimizer)
    return optimizer


def _build_fraction(config: RunConfig, model) -> float:
    """The fraction megatron-core builds its HybridDeviceOptimizer with before the staged one
    replaces it (``offload_optimizer.build_fraction``); 0 without ``--optimizer-cpu-offload``."""
    args = config.args
    if not args.optimizer_cpu_offload:
        return 0.0

    params = sum(p.numel() for chunk in model for p in chunk.parameters() if p.requires_grad)
    return build_fraction(params, gpu_free_bytes())


def precision_aware_without_te(config) -> None:
    """Turn ``use_precision_aware_optimizer`` on in an ``OptimizerConfig`` built with it off.

    megatron-core 0.16.1's ``OptimizerConfig.__post_init__`` asks ``is_te_min_version("2.1.0")``
    under ``use_precision_aware_optimizer``, and that raises ``TypeError`` (``None >= Version``)
    when TransformerEngine is not installed, although the question has a fixed answer then
    (no: so ``store_param_remainders`` goes off) and the only precision-aware path that needs
    no TE, ``optimizer_cpu_offload`` (HybridDeviceOptimizer), returns right after it. So the
    config is built with the flag off and given here what ``__post_init__`` would have set for
    that path; ``memory_args.validate`` has already refused the flag without
    ``--optimizer-cpu-offload``, without the distributed optimizer and without Adam.
    """
    if not config.optimizer_cpu_offload:
        raise ValueError("the precision-aware optimizer without TransformerEngine exists only "
                         "with optimizer_cpu_offload (HybridDeviceOptimizer)")
    config.use_precision_aware_optimizer = True
    config.store_param_remainders = False
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True   # the offload case's value


def use_fused_adam(optimizer) -> int:
    """Run the Adam steps inside megatron-core's optimizer with PyTorch's fused kernel.

    Without TransformerEngine or apex, megatron-core 0.16.1 steps its main parameters with
    ``torch.optim.AdamW`` in its default (``foreach``) implementation, several kernels per
    parameter chunk; TE's / apex's ``FusedAdam``, which it uses when installed, is one kernel.
    PyTorch's own ``fused`` implementation of the same update is that kernel (on an H200 it
    made the 0.85B model's optimizer step about three times faster, docs/performance.md), and
    it takes the division and clipping of the grads and the skip of a non-finite step as arguments
    (:func:`guarded_optimizer_step`). This sets the optimizer's documented ``fused`` option on
    every param group whose parameters are all floating-point tensors of one device type that
    PyTorch's fused Adam supports (CUDA, and the CPU, so that CPU runs take the same path).
    Returns how many torch optimizers were switched.
    """
    supported = {"cuda", "cpu"}
    switched = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", None)
        if not isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        params = [p for g in torch_opt.param_groups for p in g["params"]]
        kinds = {p.device.type for p in params}
        if (not params or len(kinds) != 1 or not kinds <= supported
                or not all(p.is_floating_point() for p in params)):
            continue
        for group in torch_opt.param_groups:
            group["foreach"], group["fused"] = False, True
        torch_opt.defaults.update(foreach=False, fused=True)
        switched += 1
    return switched


def allocate_adam_state(optimizer) -> int:
    """Give every PyTorch Adam(W) inside megatron-core's optimizer its state now: zero
    moments and a zero step count, what Adam creates at its first step.

    Left to Adam, the float32 moments (8 bytes per parameter: 6.4 GiB for the 0.85B model of
    ``tools/bench_e2e.py``) appear in the first step's optimizer step, after that step's
    forward and backward have reached their peak; from the second step on they are there
    during both. So a run whose first step fits could run out of memory in its second (at
    512K on one H200 the peak went from 102.5 to 108.9 GiB, docs/long_sequences.md), and
    a one-step memory measurement missed them. Allocated here, the first step already holds
    the memory of every later one, and start-up's memory report ("after building the
    optimizer") includes it. The state is
    :func:`megatron.training.checkpoint.save_load.zero_adam_state`'s (the staged CPU-offload
    optimizer's too: a fused or capturable Adam's step on the parameter's
    device, float32); the update is bitwise the one from lazily made state
    (``tests/unit/test_adam_state.py``). Optimizers that already have state, parameters
    that are DTensors (Megatron-FSDP) and other optimizers (SGD, the CPU-offload
    optimizer, which makes its own) are left alone. Returns how many were given state.
    """
    given = 0
    for inner in grad_clip.sub_optimizers(optimizer):
        torch_opt = getattr(inner, "optimizer", None)
        if not isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)) or torch_opt.state:
            continue
        params = [p for g in torch_opt.param_groups for p in g["params"]]
        if not params or any(isinstance(p, DTensor) for p in params):
            continue
        zero_adam_state(torch_opt)
        given += 1
    return given


def build_scheduler(config: RunConfig, optimizer):
    """Megatron-LM's OptimizerParamScheduler, counted in samples."""
    args = config.args
    gbs = config.global_batch_size
    wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters else None
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=config.lr_warmup_iters * gbs,
        lr_decay_steps=config.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant", wsd_decay_steps=wsd,
        lr_wsd_decay_style=args.lr_wsd_decay_style)


def finalize_grads_without_token_division(model, num_tokens=None, **kwargs) -> None:
    """megatron-core's ``finalize_model_grads`` (the DP x CP reduction, the embedding and
    sequence-parallel sums) without its division by the global number of loss tokens: the
    grads stay sums over the global batch's tokens, and :func:`guarded_optimizer_step`
    divides them by :func:`reduce_lm_loss`'s count (the same global count:
    the schedule's ``num_tokens`` are the loss function's, broadcast from the last pipeline
    stage and summed over DP x CP), in the fused Adam kernel where it can."""
    del num_tokens
    finalize_model_grads(model, None, **kwargs)


def _wire_grad_sync(model) -> None:
    """Hand megatron-core's schedules the DDP hooks (gradient accumulation without
    reduction until the last micro-batch, then the DP x CP reduction)."""
    config = model[0].config
    config.no_sync_func = model[0].no_sync
    config.finalize_model_grads_func = finalize_grads_without_token_division
    if model[0].ddp_config.overlap_grad_reduce:
        config.grad_sync_func = model[0].start_grad_sync


def dataset_sizes(config: RunConfig) -> List[Optional[int]]:
    """Samples asked of the (train, valid, test) datasets; megatron-core's shuffle depends on
    them, so whoever rebuilds a run's samples (``tools/bench_e2e.py --docs``) asks the same."""
    args, gbs = config.args, config.global_batch_size
    evals = args.train_iters // args.eval_interval + 1
    return [args.train_iters * gbs, evals * args.eval_iters * gbs if args.eval_iters else None,
            None]


def build_data_iterators(config: RunConfig, rt: Runtime, state: TrainState):
    """(train, valid) iterators of full-sequence micro-batches for this DP rank."""
    args = config.args
    train_ds, valid_ds, _ = build_gpt_datasets(rt.data_config, rt.tokenizer,
                                               dataset_sizes(config))
    dp_rank, dp_size = dist.get_rank(rt.groups.dp), dist.get_world_size(rt.groups.dp)
    loader_args = {"worker_start_method": worker_start_method(bool(args.optimizer_cpu_offload))}
    if args.reset_attention_mask:
        loader_args["collate_fn"] = DocumentBatching(
            int(rt.tokenizer.eod), rt.groups.dims.ulysses, rt.groups.dims.ring,
            args.chunk_assignment)
    # The (persistent) DataLoader workers start here; a group-wide SIGTERM or SIGINT is the
    # rank's to handle (it saves at the end of the iteration), not theirs to die of, but the
    # rank itself must still be able to stop them.
    loader_args["worker_init_fn"] = partial(stop_with_the_rank, os.getpid())
    with children_ignore_stop_signals():
        train = build_data_iterator(train_ds, args.micro_batch_size, dp_rank, dp_size,
                                    state.consumed_train_samples, args.num_workers,
                                    **loader_args)
        valid = None
        if args.eval_iters and valid_ds is not None:
            valid = build_data_iterator(valid_ds, args.micro_batch_size, dp_rank, dp_size,
                                        state.consumed_valid_samples, args.num_workers,
                                        **loader_args)
    return train, valid


def batch_context(rt: Runtime, config: RunConfig) -> batch_mod.BatchContext:
    g, args = rt.groups, config.args
    pp_rank, pp_size = dist.get_rank(g.pp), dist.get_world_size(g.pp)
    agreement = (batch_mod.BatchAgreement(g.same_batch, args.batch_agreement_interval)
                 if g.same_batch is not None and args.batch_agreement_interval > 0 else None)
    window, share = model_window(config)
    return batch_mod.BatchContext(cp_rank=g.cp_rank, cp_size=dist.get_world_size(g.cp),
                                  device=rt.device, first_stage=pp_rank == 0,
                                  last_stage=pp_rank == pp_size - 1, ring_rank=g.ring_rank,
                                  ring_size=g.ring_size,
                                  documents=documents_enabled(args.reset_attention_mask,
                                                              args.reset_position_ids),
                                  agreement=agreement, window=window,
                                  window_share=share)


def model_window(config: RunConfig) -> Tuple[Optional[int], float]:
    """The left window when some layer of the model is windowed, and the share of the layers
    that are; ``(None, 0.0)`` without one. Each layer is decided as its attention decides it
    (:func:`megatron.usp.core_attention.layer_window`)."""
    layers = range(1, config.args.num_layers + 1)
    windows = [w for w in (layer_window(config, n) for n in layers) if w is not None]
    if not windows:
        return None, 0.0
    return windows[0], len(windows) / len(layers)


def flops_count_label(config: RunConfig) -> str:
    """What the step's FLOP count counts (``flops_count`` of the metrics)."""
    args = config.args
    label = ("documents" if documents_enabled(args.reset_attention_mask, args.reset_position_ids)
             else "dense causal")
    window, share = model_window(config)
    if window is not None:
        label += (f", window {window} on {round(share * args.num_layers)} of "
                  f"{args.num_layers} layers")
    return label


# --------------------------------------------------------------------------- one step
def reduce_lm_loss(losses: List[Dict[str, torch.Tensor]], groups: USPGroups,
                   device: torch.device) -> torch.Tensor:
    """[loss sum, loss tokens, attention pairs] over micro-batches and DP x CP, on every rank.

    Only the last pipeline stage holds losses; it all-reduces over its DP x CP group and
    broadcasts the result to the other stages of its pipeline. The pairs (what the
    micro-batches' core attention computes, :func:`megatron.training.data.batch.attention_pairs`)
    ride in the same float32 all-reduce; every rank of a CP group reports its micro-batch's,
    so they are divided by CP here (0 where no report carries them).
    """
    total = torch.zeros(3, dtype=torch.float32, device=device)
    for report in losses:
        total[:2] += report["lm loss"].to(device=device, dtype=torch.float32)
        if "attention pairs" in report:
            total[2:] += report["attention pairs"].to(device=device, dtype=torch.float32)
    dist.all_reduce(total, group=groups.dp_cp)
    pp_size = dist.get_world_size(groups.pp)
    if pp_size > 1:
        last = dist.get_global_rank(groups.pp, pp_size - 1)
        dist.broadcast(total, src=last, group=groups.pp)
    total[2:] /= groups.dims.cp
    return total


def _num_microbatches() -> int:
    return get_num_microbatches()


def forward_backward(config: RunConfig, step_fn: Callable, data_iterator, model,
                     forward_only: bool):
    args = config.args
    return get_forward_backward_func()(
        forward_step_func=step_fn, data_iterator=data_iterator, model=model,
        num_microbatches=_num_microbatches(), seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
        forward_only=forward_only)


def train_step(config: RunConfig, rt: Runtime, step_fn: Callable, data_iterator, model,
               optimizer, iteration: int, more_steps: bool = False):
    """One optimizer step; returns (lm loss, grad norm or None, skipped, attention pairs of
    the global batch, 0.0 where not reported). With ``more_steps`` and a
    :class:`~megatron.training.data.batch.PreparedBatches` iterator, the next step's first
    micro-batch is prepared once this step's work is queued, before the host waits for it."""
    args = config.args
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = forward_backward(config, step_fn, data_iterator, model, forward_only=False)
    total = reduce_lm_loss(losses, rt.groups, rt.device)
    prepare = (data_iterator.prepare_next
               if more_steps and isinstance(data_iterator, batch_mod.PreparedBatches)
               else _nothing)
    updated, loss, grad_norm, pairs = guarded_optimizer_step(optimizer, model, total, rt.device,
                                                             before_read=prepare)
    if not math.isfinite(loss):
        if not args.skip_nan_steps:
            raise NonFiniteLossError(
                f"iteration {iteration}: lm loss is {loss}; stopping before the optimizer "
                f"step (lower --lr, check the data, or pass --skip-nan-steps to skip such "
                f"steps)")
        return loss, None, True, pairs
    if not math.isfinite(grad_norm):
        if not args.skip_nan_steps:
            raise NonFiniteLossError(nonfinite_grad_message(iteration, grad_norm, loss,
                                                            args.clip_grad))
        return loss, grad_norm, True, pairs
    return loss, grad_norm, not updated, pairs


def _has_loss_scaler(optimizer) -> bool:
    return any(getattr(sub, "grad_scaler", None) is not None
               for sub in grad_clip.sub_optimizers(optimizer))


def _copy_to_host(*values: torch.Tensor) -> Callable[[], List[float]]:
    """Queue the device-to-host copy of scalar tensors of one device now; the returned
    function waits for that copy only (not for work queued after it) and gives the values
    as Python floats. On the CPU the copy is made at once."""
    return _queued_read(torch.stack([v.float().to(values[0].device) for v in values]))


def _queued_read(t: torch.Tensor) -> Callable[[], List[float]]:
    """:func:`_copy_to_host` of a 1-d tensor: pinned memory, a non-blocking copy, an event."""
    if not t.is_cuda:
        return t.tolist
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> List[float]:
        copied.synchronize()
        return host.tolist()
    return read


def _nothing() -> None:
    pass


def guarded_optimizer_step(optimizer, model, total: torch.Tensor, device: torch.device,
                           before_read: Callable[[], None] = _nothing):
    """megatron-core's optimizer step, refused for a non-finite loss or grad norm.

    ``total`` is :func:`reduce_lm_loss`'s [loss sum, loss tokens, attention pairs] of the
    global batch, on ``device`` (where the norm is computed too); the grads are still the sums
    over its tokens (:func:`finalize_grads_without_token_division`).
    The steps of ``MegatronOptimizer.step`` (``prepare_grads``, the grad norm over the model-
    and data-parallel groups, clipping by that norm, ``step_with_ready_grads``), with the
    division by the number of loss tokens that megatron-core's ``finalize_model_grads`` does,
    and with the loss and the norm checked so that a non-finite one changes no weight
    (megatron-core applies a NaN step unless a loss scaler found it). The norm and clipping
    are :mod:`megatron.training.optim.grad_clip`'s (megatron-core's definition, without its
    per-tensor host reads when apex / TransformerEngine are missing).

    When every sub-optimizer steps with PyTorch's fused Adam (``grad_clip.fused_adams``:
    the default), the division, the clip and the skip all happen inside that kernel
    (``grad_clip.scaled_in_adam``), and the loss, the norm and the pairs are copied to the
    host in one transfer queued before the step and read after it is queued: the host waits
    neither before the step (the GPU would idle while it queues the step) nor for it, and
    goes on to the next step (its batch, its document plan, its first layers) while the GPU
    runs the optimizer. Otherwise the grads are
    divided first (megatron-core's ``scale_gradients``, its order), the loss and the norm read
    in one transfer, and the clip and step follow; with a loss scaler (fp16) the loss is read
    first, as before (its ``prepare_grads`` updates the scale).

    ``before_read`` (the next micro-batch's preparation) runs on the host just before the
    first read, while the GPU still works through the queued step.

    Returns (updated, loss, grad norm, attention pairs); the norm is the same on every rank
    (it is all-reduced), so every rank skips alike; a non-finite loss comes back with a NaN
    norm.
    """
    mean_loss = total[0] / total[1]
    num_tokens = total[1].float().clamp_min(1.0)   # no loss token: no gradient, loss NaN
    adams = grad_clip.fused_adams(optimizer)
    if adams is not None:
        optimizer.prepare_grads()      # no loss scaler: views / copies of the grads only
        norm = grad_clip.grad_norm(optimizer, device) / num_tokens
        ok = torch.isfinite(norm) & torch.isfinite(mean_loss)
        read = _copy_to_host(mean_loss, norm, total[2])
        with grad_clip.scaled_in_adam(optimizer, adams, num_tokens, norm, ok):
            optimizer.step_with_ready_grads()
        before_read()
        loss, grad_norm, pairs = read()
        if not math.isfinite(loss):
            return False, loss, float("nan"), pairs
        return math.isfinite(grad_norm), loss, grad_norm, pairs
    for chunk in model:
        chunk.scale_gradients(1.0 / num_tokens)
    if _has_loss_scaler(optimizer):
        read = _copy_to_host(mean_loss, total[2])
        before_read()
        loss, pairs = read()
        if not math.isfinite(loss):
            return False, loss, float("nan"), pairs
        if optimizer.prepare_grads():  # the loss scaler found inf/nan
            return False, loss, float("nan"), pairs
        norm = grad_clip.grad_norm(optimizer, device)
        grad_norm = norm.item()
    else:
        optimizer.prepare_grads()
        norm = grad_clip.grad_norm(optimizer, device)
        read = _copy_to_host(mean_loss, norm, total[2])
        before_read()
        loss, grad_norm, pairs = read()
        if not math.isfinite(loss):
            return False, loss, float("nan"), pairs
    if not math.isfinite(grad_norm):
        return False, loss, grad_norm, pairs
    grad_clip.clip_grads(optimizer, grad_norm)
    return optimizer.step_with_ready_grads(), loss, grad_norm, pairs


def nonfinite_grad_message(iteration: int, grad_norm: float, loss: float,
                           clip_grad: float) -> str:
    """The stop message for a NaN/inf grad norm under a finite loss."""
    if clip_grad > 0:
        advice = (f"--clip-grad {clip_grad} is set, but clipping cannot mend a NaN/inf "
                  f"gradient; lower --lr, check the data, or pass --skip-nan-steps")
    else:
        advice = "lower --lr, set --clip-grad 1.0, or pass --skip-nan-steps"
    return (f"iteration {iteration}: grad norm is {grad_norm} with a finite lm loss {loss}; "
            f"stopping before the optimizer step (the weights are unchanged): {advice}")


def evaluate(config: RunConfig, rt: Runtime, step_fn: Callable, data_iterator, model) -> float:
    """Mean lm loss over ``--eval-iters`` global batches of the validation split."""
    args = config.args
    for chunk in model:
        chunk.eval()
    total = torch.zeros(2, dtype=torch.float32, device=rt.device)
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses = forward_backward(config, step_fn, data_iterator, model, forward_only=True)
            total += reduce_lm_loss(losses, rt.groups, rt.device)[:2]
    for chunk in model:
        chunk.train()
    return (total[0] / total[1]).item()


# --------------------------------------------------------------------------- signals
class StopSignalFlag:
    """Records a SIGTERM or SIGINT (torchrun passes a Ctrl-C on as SIGINT) in
    :attr:`received` (the highest signal number, 0 for none); the loop makes every rank learn
    of it at the same iteration through :class:`RankMaxima`, so all stop together instead of
    one rank's KeyboardInterrupt cutting the others' collectives."""

    def __init__(self) -> None:
        self.received = 0
        self._previous: Dict[int, object] = {}

    def install(self, with_sigterm: bool) -> None:
        """Catch SIGINT, and SIGTERM too when ``with_sigterm`` (a run that saves on it)."""
        for sig in (signal.SIGTERM, signal.SIGINT) if with_sigterm else (signal.SIGINT,):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = max(self.received, int(signum))

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


class RankMaxima:
    """The maximum over all ranks of a few host numbers each iteration (the stop signal
    received, the minutes since start-up), read one iteration late.

    An all-reduce on the GPU read at once by the host would wait for everything queued
    before it, the optimizer step included, and the GPU would then idle while the host
    prepares the next step. :meth:`exchange` queues the all-reduce after the step, copies
    its result to pinned memory without blocking, and returns the result queued by the
    previous call: by then the current step's own loss read has waited past it. Every rank
    reads the same reduction at the same iteration, so all stop together, one iteration
    after the event; ``now=True`` (the last iteration, or a stop already decided) reduces and
    reads at once. One process needs no collective and returns its own values at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: Optional[Callable[[], List[float]]] = None

    def exchange(self, values: Sequence[float], now: bool = False) -> Optional[List[float]]:
        """Queue the maxima of ``values`` over the ranks; return those queued by the previous
        call (None on the first), or with ``now`` this call's."""
        if dist.get_world_size() == 1:
            return [float(v) for v in values]
        previous = self._pending
        # through pinned memory: a copy from pageable memory would make PyTorch wait for the
        # stream, the very wait this class avoids
        t = pinned_to_device(torch.tensor([float(v) for v in values], dtype=torch.float64),
                             device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if now:
            self._pending = None
            return t.tolist()
        self._pending = _queued_read(t)
        return None if previous is None else previous()


# --------------------------------------------------------------------------- the loop
def _max_over_ranks(value: float, device: torch.device) -> float:
    if dist.get_world_size() == 1:     # no collective: nothing waits for the queued step
        return value
    t = torch.tensor([value], dtype=torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


@contextlib.contextmanager
def params_in_sync(config: RunConfig, model):
    """With ``--overlap-param-gather`` the distributed optimizer's parameter all-gather is
    deferred to the next forward pass (forward pre-hooks); finish it, and switch the hooks
    off, while the model is evaluated or saved (Megatron-LM does the same)."""
    args = config.args
    if not (args.use_distributed_optimizer and args.overlap_param_gather):
        yield
        return
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in model:
            chunk.enable_forward_pre_hook()


class _Loop:
    """State of one training run; :meth:`run` is the loop."""

    def __init__(self, config: RunConfig, rt: Runtime, model, optimizer, scheduler,
                 state: TrainState, step_fn: Callable, writer: MetricsWriter,
                 result: TrainResult, memory: Optional[MemoryHistory] = None,
                 started: Optional[float] = None) -> None:
        self.config, self.rt, self.model = config, rt, model
        self.started = time.monotonic() if started is None else started
        self.optimizer, self.scheduler, self.state = optimizer, scheduler, state
        self.step_fn, self.writer, self.result = step_fn, writer, result
        self.stop_signal = StopSignalFlag()
        self.maxima = RankMaxima(rt.device)
        args = config.args
        self.profiler = StepProfiler(
            bool(args.profile) and rt.rank in args.profile_ranks, args.profile_step_start,
            args.profile_step_end, config.profile_dir, rt.rank, rt.device)
        self.memory = memory
        self.costs_logged = False

    def _save(self) -> None:
        with params_in_sync(self.config, self.model):
            path = save_checkpoint(self.config, self.state, self.model, self.optimizer,
                                   self.scheduler, self.rt.groups, self.rt.device,
                                   resolved_args=self.rt.data_source.resolved_args())
        self.result.saved.append(path)
        print_rank_0(self.rt, f"saved checkpoint at iteration {self.state.iteration} to {path}")

    def _one_iteration(self, train_iter) -> None:
        config, st = self.config, self.state
        args = config.args
        it = st.iteration + 1
        self.profiler.before(it)
        shapes_before = batched_shapes() if args.reset_attention_mask else 0
        t0 = time.perf_counter()
        loss, grad_norm, skipped, pairs = train_step(config, self.rt, self.step_fn, train_iter,
                                                     self.model, self.optimizer, it,
                                                     more_steps=it < args.train_iters)
        step_time = time.perf_counter() - t0
        new_shapes = batched_shapes() - shapes_before if args.reset_attention_mask else None
        if self.profiler.after(it):
            print(f"rank {self.rt.rank}: profile of iterations {self.profiler.start}-"
                  f"{it} written to {self.profiler.written}.txt/.json", flush=True)
        if self.memory is not None and self.memory.after(it):
            print(f"rank {self.rt.rank}: memory snapshot after iteration {it} written to "
                  f"{self.memory.written} (summary: {self.memory.written}.txt)", flush=True)
        st.iteration = it
        st.consumed_train_samples += config.global_batch_size
        if not self.costs_logged and args.reset_attention_mask:
            self.costs_logged = True           # the first step measured them, if anything did
            for key, costs in cost_tables():
                print_rank_0(self.rt, describe_costs(key, costs))
        if skipped:
            st.skipped_iterations += 1
            self.result.skipped_iterations.append(it)
            what = f"grad norm {grad_norm}" if math.isfinite(loss) else f"lm loss {loss}"
            print_rank_0(self.rt, f"iteration {it}: {what}, optimizer step skipped "
                                  f"(--skip-nan-steps)")
        else:
            self.scheduler.step(increment=config.global_batch_size)
        self.result.losses[it] = loss
        mem = peak_memory_gib(self.rt.device)
        at_log = it % args.log_interval == 0 or it == args.train_iters
        max_mem = _max_over_ranks(mem, self.rt.device) if at_log else None
        self.writer.train_step(StepStats(
            iteration=it, consumed_samples=st.consumed_train_samples, lm_loss=loss,
            grad_norm=grad_norm, lr=self.optimizer.param_groups[0]["lr"],
            step_time_s=step_time, skipped=skipped, mem_gib=mem,
            host_mem_gib=peak_host_memory_gib(), attention_pairs=pairs or None,
            new_plan_shapes=new_shapes), max_mem)

    def _stop_reasons(self, last: bool) -> Tuple[int, Optional[float]]:
        """(the stop signal any rank received, 0 for none; the minutes since start-up on the
        slowest rank, or None when they do not stop the run yet), each the same on every
        rank (:class:`RankMaxima`: as of the previous iteration, or of this one when
        ``last``)."""
        limit = self.config.args.exit_duration_in_mins
        minutes = (time.monotonic() - self.started) / 60 if limit is not None else 0.0
        maxima = self.maxima.exchange([self.stop_signal.received, minutes], now=last)
        if maxima is None:
            return 0, None
        received, minutes = int(maxima[0]), maxima[1]
        return received, (minutes if limit is not None and minutes >= limit else None)

    def _validate(self, valid_iter) -> None:
        config = self.config
        with params_in_sync(config, self.model):
            value = evaluate(config, self.rt, self.step_fn, valid_iter, self.model)
        self.state.consumed_valid_samples += config.args.eval_iters * config.global_batch_size
        self.result.valid_losses[self.state.iteration] = value
        self.writer.validation(self.state.iteration, value)

    def run(self, train_iter, valid_iter) -> TrainResult:
        args, st = self.config.args, self.state
        if threading.current_thread() is threading.main_thread():
            self.stop_signal.install(with_sigterm=bool(args.save))
        try:
            while st.iteration < args.train_iters:
                self._one_iteration(train_iter)
                it = st.iteration
                if valid_iter is not None and it % args.eval_interval == 0:
                    self._validate(valid_iter)
                saved_now = bool(args.save_interval) and it % args.save_interval == 0
                if saved_now:
                    self._save()
                stop = bool(args.exit_interval) and it % args.exit_interval == 0
                received, minutes = self._stop_reasons(last=stop or it >= args.train_iters)
                if minutes is not None:
                    stop = self.result.stopped_by_time = True
                    limit = args.exit_duration_in_mins
                    what = ("saving at iteration {} and exiting" if args.save else
                            "stopping at iteration {} without a checkpoint (no --save)")
                    print_rank_0(self.rt, f"--exit-duration-in-mins {limit:g} reached "
                                          f"({minutes:.2f} min since start-up): " +
                                          what.format(it))
                if received:
                    stop = self.result.stopped_by_signal = True
                    self.result.stop_signal = received
                    name = signal.Signals(received).name
                    print_rank_0(self.rt, f"{name} received: saving at iteration {it} and "
                                          f"exiting" if args.save else
                                          f"{name} received: stopping at iteration {it} "
                                          f"without a checkpoint (no --save)")
                if stop:
                    if args.save and not saved_now:
                        self._save()
                    return self.result
            if valid_iter is not None and st.iteration % args.eval_interval != 0:
                self._validate(valid_iter)
            if args.save and not (args.save_interval and st.iteration % args.save_interval == 0):
                self._save()
            return self.result
        finally:
            self.profiler.close()
            self.stop_signal.restore()


def _log_setup(config: RunConfig, rt: Runtime, model, loaded: Optional[str],
               state: TrainState) -> None:
    args = config.args
    print_rank_0(rt, f"layout {rt.groups.dims.short()} on {rt.world_size} {rt.device.type} "
                     f"process(es); {config.num_microbatches} micro-batch(es) of "
                     f"{args.micro_batch_size} per step; global batch "
                     f"{config.global_batch_size}")
    for reason in rt.plan_reasons:
        print_rank_0(rt, f"  planner: {reason}")
    print_rank_0(rt, f"number of parameters on rank 0 (its TP shard of its stage): "
                     f"{count_parameters(model)}")
    if loaded:
        print_rank_0(rt, f"loaded checkpoint {loaded} at iteration {state.iteration} "
                         f"(consumed samples {state.consumed_train_samples})")


def _make_writer(config: RunConfig, rt: Runtime, start_iteration: int) -> MetricsWriter:
    args = config.args
    peak = args.peak_tflops or peak_tflops_for_device(rt.device_name)
    throughput = Throughput(config.model_shape(), config.args.seq_length,
                            config.global_batch_size, rt.world_size, peak,
                            count=flops_count_label(config))
    return MetricsWriter(rt.is_logging_rank, args.train_iters, args.log_interval, throughput,
                         metrics_file=config.metrics_file, tensorboard_dir=args.tensorboard_dir,
                         start_iteration=start_iteration)


def pretrain(args: argparse.Namespace,
             forward_step_func: Optional[Callable] = None) -> TrainResult:
    """Validate, initialise, build, resume, train, save; see the module docstring.

    ``forward_step_func(ctx, data_iterator, model)`` replaces
    :func:`megatron.training.data.batch.forward_step` (same contract). Works inside an already
    initialised process group (tests) or creates one (torchrun, or a single process).
    Raises the start-up errors of :func:`megatron.training.cli.arguments.validate_args`, the
    data and checkpoint checks, :class:`NonFiniteLossError`, and
    :class:`~megatron.training.peer_faults.PeerLostError` for a collective that failed
    because another rank died or went silent.
    """
    iterators: List = []
    try:
        return _pretrain(args, forward_step_func, iterators)
    except RuntimeError as exc:
        lost = None if isinstance(exc, RUN_ERRORS) else peer_lost(
            exc, launch_env()[0], args.distributed_timeout_minutes)
        if lost is None:
            raise
        raise lost from exc
    finally:
        # On every way out: an exception's traceback would keep the iterators, and their
        # workers, alive until the interpreter exits.
        shut_down_data_iterators(*iterators)


def _pretrain(args: argparse.Namespace, forward_step_func: Optional[Callable],
              iterators: List) -> TrainResult:
    """:func:`pretrain`'s body; the data iterators it builds go into ``iterators``."""
    started = time.monotonic()   # --exit-duration-in-mins counts from here
    rt = None
    writer = None
    memory = None
    try:
        rt = initialize(args)
        config = rt.config
        memory = MemoryHistory(args.record_memory_history, args.memory_snapshot_iteration,
                               args.memory_snapshot_path, args.seq_length, rt.rank, rt.device)
        if args.save:
            start_writer_manager()
        model = build_model(config, rt.groups)
        _wire_grad_sync(model)
        for line in configure_float8(config, model, rt.device, dist.group.WORLD):
            print_rank_0(rt, line)
        # Where memory goes before the first step (long sequences: the model, the
        # optimizer's state and its start-up copies, then the pinned offload buffers).
        print_rank_0(rt, f"memory after building the model: {memory_report(rt.device)}")
        optimizer = build_optimizer(config, model)
        scheduler = build_scheduler(config, optimizer)
        resume = load_checkpoint(config, model, optimizer, scheduler)
        print_rank_0(rt, f"memory after building the optimizer"
                         f"{' and loading' if resume.path else ''}: {memory_report(rt.device)}")
        pinned = reserve_offload_buffers(config, model)
        if pinned:
            print_rank_0(rt, f"memory after reserving {pinned / 2**30:.1f} GiB of host buffers "
                             f"for --recompute-cpu-offload: {memory_report(rt.device)}")
        state = resume.state
        _log_setup(config, rt, model, resume.path, state)
        result = TrainResult(iteration=state.iteration, loaded_from=resume.path)
        if state.iteration >= args.train_iters:
            print_rank_0(rt, f"the checkpoint is at iteration {state.iteration} >= "
                             f"--train-iters {args.train_iters}: nothing to train")
            return result
        train_iter, valid_iter = build_data_iterators(config, rt, state)
        iterators += [train_iter, valid_iter]
        if resume.rng_state is not None:
            set_rng_state(resume.rng_state, rt.device)
        writer = _make_writer(config, rt, state.iteration)
        writer.run_header(rt.groups.dims.short(), rt.world_size,
                          plain_args(config, rt.data_source.resolved_args()))
        ctx = batch_context(rt, config)
        step_fn = partial(forward_step_func or batch_mod.forward_step, ctx)
        _Loop(config, rt, model, optimizer, scheduler, state, step_fn, writer, result,
              memory, started).run(batch_mod.PreparedBatches(train_iter, ctx), valid_iter)
        result.iteration = state.iteration
        return result
    except BaseException:
        keep_own_exit_status()
        raise
    finally:
        if memory is not None:
            memory.close()
        if writer is not None:
            writer.close()
        shutdown(rt)
