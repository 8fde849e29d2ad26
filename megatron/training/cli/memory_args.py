"""Flags for training very long sequences, and their start-up checks.

Three groups, each mapped onto what megatron-core 0.16.1 provides or onto Megatron-USP's own
modules (``README.md``, "Training very long sequences"):

* activations under full recompute: ``--recompute-keep-core-attn`` (attention runs once,
  :mod:`megatron.memory.kept_attention`), ``--recompute-cpu-offload layer_input core_attn`` (what
  waits in pinned host memory for the backward, :mod:`megatron.memory.activation_offload`),
  ``--mlp-tile-tokens N`` (:mod:`megatron.memory.tiled_mlp`);
* optimizer state in host memory: Megatron-LM's ``--optimizer-cpu-offload``,
  ``--optimizer-offload-fraction``, ``--use-precision-aware-optimizer``,
  ``--overlap-cpu-optimizer-d2h-h2d`` (megatron-core's ``HybridDeviceOptimizer``);
* sharded training state: Megatron-LM's ``--use-megatron-fsdp`` and
  ``--data-parallel-sharding-strategy`` (megatron-core's Megatron-FSDP; ``optim`` /
  ``optim_grads`` / ``optim_grads_params`` are ZeRO-1 / 2 / 3).

:func:`validate_memory_args` runs inside ``validate_args`` after the layout is known, raises
``ArgumentsError`` naming the flag and a valid alternative, and returns the defaults it
resolved.
"""

from __future__ import annotations

import argparse
from typing import Optional, Tuple

from megatron.training.cli.errors import ArgumentsError
from megatron.usp.backend_names import OFFLOAD_CHOICES, backend_installed
from megatron.usp.parallel_dims import ParallelDims

FSDP_SHARDING = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DEFAULT_OFFLOAD_FRACTION = 1.0


def add_memory_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "long sequences and memory", "activation keeping / offload under full recompute, "
                                     "tiled MLP, optimizer offload, Megatron-FSDP")
    g.add_argument("--recompute-keep-core-attn", action="store_true",
                   help="with --recompute-granularity full: keep each layer's core-attention "
                        "output from the forward, so the recompute does not run attention "
                        "again (costs the output, s*h values per layer, and a float32 "
                        "log-sum-exp per query head and token)")
    g.add_argument("--recompute-cpu-offload", nargs="+", default=None, choices=OFFLOAD_CHOICES,
                   metavar="WHAT",
                   help="with --recompute-granularity full: what waits in pinned host memory "
                        "between the forward and the recompute, copied on side streams and "
                        "prefetched ahead of the backward: layer_input (each recompute unit's "
                        "saved input) and/or core_attn (the outputs kept by "
                        "--recompute-keep-core-attn)")
    g.add_argument("--mlp-tile-tokens", type=int, default=None, metavar="N",
                   help="run the MLP over tiles of N local tokens (seq / (U*R), divided by TP "
                        "with --sequence-parallel; N must divide it), each tile recomputed in "
                        "the backward, so the [N, ffn] intermediates never exist for the "
                        "whole sequence")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="optimizer state and step on the CPU (megatron-core's "
                        "HybridDeviceOptimizer); needs --use-distributed-optimizer "
                        "--use-precision-aware-optimizer and a GPU")
    g.add_argument("--optimizer-offload-fraction", type=float, default=None,
                   help="with --optimizer-cpu-offload: fraction of the parameters whose state "
                        f"and update live on the CPU, in [0, 1] (default "
                        f"{DEFAULT_OFFLOAD_FRACTION})")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="main parameters held by the optimizer (here: the CPU optimizer of "
                        "--optimizer-cpu-offload; otherwise TransformerEngine's FusedAdam)")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
                   help="with --optimizer-cpu-offload: overlap the gradient copies to the host "
                        "and the parameter copies back with the CPU optimizer step")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="megatron-core's Megatron-FSDP in place of DDP (GPU only); shard what "
                        "--data-parallel-sharding-strategy says over DP x CP")
    g.add_argument("--data-parallel-sharding-strategy", default=None, choices=FSDP_SHARDING,
                   help="with --use-megatron-fsdp: optim (ZeRO-1), optim_grads (ZeRO-2), "
                        "optim_grads_params (ZeRO-3) or no_shard (default optim_grads_params)")


def _error(msg: str) -> Exception:
    return ArgumentsError(msg)


def _validate_recompute_memory(args) -> None:
    full = args.recompute_granularity == "full"
    offload = args.recompute_cpu_offload
    if args.recompute_keep_core_attn and not full:
        raise _error("--recompute-keep-core-attn keeps attention outputs for the recompute of "
                     "--recompute-granularity full; add --recompute-granularity full "
                     "--recompute-method uniform --recompute-num-layers 1 (or use "
                     "--recompute-granularity selective --recompute-modules mlp)")
    if offload:
        if not full:
            raise _error(f"--recompute-cpu-offload {' '.join(offload)} offloads what full "
                         f"recompute keeps; add --recompute-granularity full "
                         f"--recompute-method uniform --recompute-num-layers 1")
        if "core_attn" in offload and not args.recompute_keep_core_attn:
            raise _error("--recompute-cpu-offload core_attn offloads the outputs kept by "
                         "--recompute-keep-core-attn; add --recompute-keep-core-attn (or "
                         "offload layer_input only)")


def _divisors_up_to(n: int, limit: int):
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _validate_mlp_tiles(args, cp: int, sequence_parallel: bool) -> None:
    n = args.mlp_tile_tokens
    if n is None:
        return
    if n < 1:
        raise _error(f"--mlp-tile-tokens {n} must be >= 1, e.g. --mlp-tile-tokens 8192")
    local = args.seq_length // cp
    where = f"--seq-length {args.seq_length} / (U*R = {cp})"
    if sequence_parallel:
        local //= args.tensor_model_parallel_size
        where += f" / (TP = {args.tensor_model_parallel_size}, --sequence-parallel)"
    if local % n:
        below = _divisors_up_to(local, n)[-1]
        raise _error(f"--mlp-tile-tokens {n} does not divide the MLP's {local} local tokens "
                     f"({where}); use a divisor, e.g. --mlp-tile-tokens {below}")


def _optimizer_offload_fraction(args, device: str) -> Optional[float]:
    """The optimizer-offload flags' checks; ``--optimizer-offload-fraction`` or its default
    under ``--optimizer-cpu-offload``."""
    offload = args.optimizer_cpu_offload
    if not offload:
        for flag, value in (("--optimizer-offload-fraction", args.optimizer_offload_fraction),
                            ("--overlap-cpu-optimizer-d2h-h2d",
                             args.overlap_cpu_optimizer_d2h_h2d or None)):
            if value is not None:
                raise _error(f"{flag} has no effect without --optimizer-cpu-offload; add "
                             f"--optimizer-cpu-offload (or drop {flag})")
        if args.use_precision_aware_optimizer and not backend_installed("te"):
            raise _error("--use-precision-aware-optimizer without --optimizer-cpu-offload "
                         "needs TransformerEngine's FusedAdam (not installed); add "
                         "--optimizer-cpu-offload or drop --use-precision-aware-optimizer")
        return args.optimizer_offload_fraction
    if device != "cuda":
        raise _error("--optimizer-cpu-offload moves optimizer state from the GPU to the host "
                     "(megatron-core's HybridDeviceOptimizer is CUDA-only); on --device cpu "
                     "everything is already in host memory: drop --optimizer-cpu-offload")
    missing = [f for f, on in (("--use-distributed-optimizer", args.use_distributed_optimizer),
                               ("--use-precision-aware-optimizer",
                                args.use_precision_aware_optimizer)) if not on]
    if missing:
        raise _error(f"--optimizer-cpu-offload needs {' and '.join(missing)} (megatron-core's "
                     f"HybridDeviceOptimizer works through the distributed optimizer's "
                     f"precision-aware path); add {' '.join(missing)}")
    if args.optimizer != "adam":
        raise _error(f"--optimizer-cpu-offload with --optimizer {args.optimizer}: megatron-core's "
                     f"distributed optimizer offloads Adam only; use --optimizer adam")
    fraction = args.optimizer_offload_fraction
    if fraction is None:
        fraction = DEFAULT_OFFLOAD_FRACTION
    if not 0.0 <= fraction <= 1.0:
        raise _error(f"--optimizer-offload-fraction {fraction} must be in "
                     f"[0, 1], e.g. --optimizer-offload-fraction 1.0")
    return fraction


def _fsdp_strategy(args, dims: ParallelDims, device: str) -> Optional[str]:
    """The Megatron-FSDP flags' checks; ``--data-parallel-sharding-strategy`` or its default
    under ``--use-megatron-fsdp``."""
    strategy = args.data_parallel_sharding_strategy
    if not args.use_megatron_fsdp:
        if strategy is not None:
            raise _error(f"--data-parallel-sharding-strategy {strategy} has no effect without "
                         f"--use-megatron-fsdp; add --use-megatron-fsdp (ZeRO-1 alone: "
                         f"--use-distributed-optimizer)")
        return None
    if strategy is None:
        strategy = "optim_grads_params"
    reasons = [
        (device != "cuda", "needs --device cuda (Megatron-FSDP builds CUDA device meshes "
                                "and streams)"),
        (not args.use_distributed_optimizer, "needs --use-distributed-optimizer (megatron-core "
                                             "steps FSDP shards with its distributed optimizer)"),
        (args.pipeline_model_parallel_size > 1, "is not wired with --pipeline-model-parallel-size "
                                                "> 1 here; use PP 1"),
        (args.optimizer_cpu_offload, "is not combined with --optimizer-cpu-offload in "
                                     "megatron-core 0.16.1's HybridDeviceOptimizer (it offloads "
                                     "plain tensors, FSDP holds DTensor shards); drop one"),
        (args.save is not None or args.load is not None,
         "checkpoints need megatron-core's fsdp_dtensor format, which Megatron-USP's "
         "checkpointing does not write; drop --save / --load"),
        # Measured on one GPU (tools/gpu_long_sequence_check.py's diagnosis cases): over
        # one rank, megatron-core 0.16.1's reduce-scatter writes each
        # micro-batch's gradients into the very buffer it then adds them to, so the
        # gradients double at every micro-batch (grad norm 2x with one micro-batch per step,
        # ~3x with two, and different losses from the first update on).
        (dims.dp * dims.cp == 1,
         "shards over the data-parallel x context-parallel ranks and this run has one: there "
         "is nothing to shard, and megatron-core 0.16.1's Megatron-FSDP then adds every "
         "micro-batch's gradients twice (measured); drop --use-megatron-fsdp "
         "(--use-distributed-optimizer keeps one copy of the state), or run on more GPUs"),
        (args.recompute_cpu_offload is not None, "is not verified with --recompute-cpu-offload "
                                                 "(FSDP frees and re-gathers parameters inside "
                                                 "the recompute); drop one"),
    ]
    for bad, why in reasons:
        if bad:
            raise _error(f"--use-megatron-fsdp {why}")
    return strategy


def validate_memory_args(args, dims: ParallelDims, sequence_parallel: bool,
                         device: str) -> Tuple[Optional[float], Optional[str]]:
    """The checks of this module's flags under the layout ``dims`` (``sequence_parallel``
    as resolved, ``device`` ``cuda`` or ``cpu``); returns the optimizer offload fraction and
    the Megatron-FSDP sharding strategy, each the flag or its default (None when off)."""
    _validate_recompute_memory(args)
    _validate_mlp_tiles(args, dims.cp, sequence_parallel)
    return _optimizer_offload_fraction(args, device), _fsdp_strategy(args, dims, device)


__all__ = ["add_memory_args", "validate_memory_args", "FSDP_SHARDING"]
