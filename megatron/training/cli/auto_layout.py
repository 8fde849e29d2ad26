"""``--ulysses-degree auto --ring-degree auto``: the layout planner chooses the degrees.

The bridge from the command line to :mod:`megatron.planner`: the planner is given the model
and the run as configured (TP, PP, ``--context-parallel-size``, recompute, sequence
parallelism, gradient dtype and the fused loss stay the user's), and its choice is validated
like degrees given on the command line.
"""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Tuple

from megatron.planner import DEFAULT_ASSUMPTIONS
from megatron.planner.hardware import preset_for_device
from megatron.planner.models import check_model
from megatron.training.cli.arguments import validate_args
from megatron.training.cli.config import RunConfig
from megatron.training.cli.errors import ArgumentsError


def _planner_inputs(config: RunConfig, vocab_size: int):
    """(model, fixed degrees, assumptions) of the run as configured, for the planner."""
    args = config.args
    model = check_model(dataclasses.replace(config.shape, vocab_size=vocab_size))
    fixed = {"tensor_model_parallel_size": args.tensor_model_parallel_size,
             "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
             "zero_stage": 1 if args.use_distributed_optimizer else 0,
             "recompute": args.recompute_granularity or "none"}
    if args.context_parallel_size is not None:
        fixed["context_parallel_size"] = args.context_parallel_size
    # The memory model must describe the run as configured: Megatron sequence parallelism is
    # the user's flag, not the planner's to switch on; so are the gradient buffer's dtype
    # (float32 unless --grad-reduce-in-bf16) and the loss (the fused output layer and loss
    # over its chunks, or megatron-core's).
    grad_bytes = 4 if config.grad_reduce_in_fp32 else 2
    assumptions = dataclasses.replace(
        DEFAULT_ASSUMPTIONS, tp_sequence_parallel=config.sequence_parallel,
        main_grad_bytes=grad_bytes, grad_reduce_bytes=grad_bytes,
        loss_chunk_tokens=config.loss_chunk_tokens)
    return model, fixed, assumptions


def resolve_auto_layout(config: RunConfig, vocab_size: int,
                        device_name: Optional[str]) -> Tuple[RunConfig, List[str]]:
    """The run with the planner's degrees in place of ``auto``, and the plan's reasons (to log
    on rank 0).

    Degrees the user gave explicitly (TP, PP, ``--context-parallel-size``) are kept fixed.
    Deterministic, so every rank chooses the same layout without communicating. Raises
    :class:`ArgumentsError` naming the flags when no preset or no layout fits.
    """
    from megatron.planner import (  # per call: tests replace choose_layout
        PlannerError,
        choose_layout,
    )

    args, world_size = config.args, config.world_size
    hardware = args.hardware or preset_for_device(device_name)
    if hardware is None:
        raise ArgumentsError(
            f"--ulysses-degree auto: no planner preset matches the device {device_name!r}; "
            f"pass --hardware (one of the presets of tools/plan_parallel.py), or give "
            f"--ulysses-degree and --ring-degree as integers")
    gpus_per_node = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    try:
        model, fixed, assumptions = _planner_inputs(config, vocab_size)
        plan = choose_layout(model, args.seq_length, world_size, gpus_per_node, hardware,
                             micro_batch_size=args.micro_batch_size,
                             global_batch_size=args.global_batch_size, fixed=fixed,
                             assumptions=assumptions)
    except PlannerError as exc:
        raise ArgumentsError(f"--ulysses-degree auto --ring-degree auto: {exc}") from None
    planned = validate_args(args, world_size, cuda_available=config.device == "cuda",
                            degrees=(plan.ulysses_degree, plan.ring_degree))
    notes = []
    if args.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        notes.append(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} without "
                     f"--sequence-parallel: planned with each TP rank holding the full "
                     f"activations of its tokens; add --sequence-parallel to shard them")
    return planned, [f"planner chose TP{plan.tensor_model_parallel_size} U{plan.ulysses_degree} "
                     f"R{plan.ring_degree} DP{plan.data_parallel_size} "
                     f"PP{plan.pipeline_model_parallel_size}"] + notes + list(plan.reasons)


__all__ = ["resolve_auto_layout"]
