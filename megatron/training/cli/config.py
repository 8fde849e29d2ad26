"""The validated run: :class:`RunConfig`, built once by ``validate_args``.

It holds the namespace exactly as parsed (``args``: never written; plain flags such as
``--lr`` are read from it) and, as typed fields, every value derived from the flags: the
layout (one :class:`~megatron.usp.parallel_dims.ParallelDims`), the model shape, the
resolved device and kernels, the batch and schedule sizes, the default paths. Library
modules get the small pieces they need from it (:attr:`RunConfig.offload`, the layer-spec
options), never the namespace.

Torch-free, like the rest of the CLI (``--help`` and the flag checks import no torch).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from megatron.layers.float8_options import Float8Options
from megatron.shapes import ModelShape, RopeScaling
from megatron.usp.parallel_dims import ParallelDims


@dataclass(frozen=True)
class RunConfig:
    """The flags of one run and what validation derived from them (identical on every rank).

    Attributes:
        args: the parsed namespace, read-only: validation writes nothing onto it.
        world_size: processes in the job.
        device / distributed_backend: ``--device`` / ``--distributed-backend`` resolved
            (``cuda`` or ``cpu``; ``nccl`` or ``gloo``).
        use_cpu_initialization: ``--use-cpu-initialization``, always on for the CPU.
        fused_kernels_impl: ``--fused-kernels`` resolved for this device (the flag keeps
            ``auto``).
        grad_reduce_in_fp32: gradients accumulate and reduce in float32 (all but
            ``--bf16 --grad-reduce-in-bf16``).
        kv_channels / ffn_hidden_size / max_position_embeddings: the flags or their defaults.
        rope: the RoPE scaling of the RoPE flags (:mod:`megatron.shapes.rope`; kind
            ``none`` without).
        shape: the model flags as one :class:`~megatron.shapes.ModelShape` (its vocabulary
            unknown here: :meth:`model_shape` has it once the tokenizer is built).
        lr_decay_iters / lr_warmup_iters: the schedule in iterations (``--lr-warmup-fraction``
            converted).
        loss_chunk_tokens: ``--linear-cross-entropy-chunk-tokens`` or its default with
            ``--fused-linear-cross-entropy``; None without.
        tokenizer_type: ``--tokenizer-type`` or its default.
        metrics_file / profile_dir: the flags or their defaults (None: none written).
        sequence_parallel: ``--sequence-parallel``, off at TP 1 (as Megatron-LM).
        dims: the layout; None while ``--ulysses-degree auto`` waits for the planner
            (:mod:`megatron.training.cli.auto_layout`).
        global_batch_size / num_microbatches: the global batch (default micro x DP) and the
            micro-batches per step; None while the layout is auto.
        optimizer_offload_fraction / data_parallel_sharding_strategy: the flags or their
            defaults under ``--optimizer-cpu-offload`` / ``--use-megatron-fsdp``.
        padded_vocab_size: the tokenizer's vocabulary padded (:meth:`with_padded_vocab`,
            once the tokenizer is known); None before.
        window_size / window_attn_skip_freq: megatron-core's sliding-window fields from
            ``--window-size`` / ``--window-attn-skip-freq`` (None: full attention); ``shape``
            carries them too (its ``window_size`` is the left ``W``).
        fp8: the float8 flags (:class:`~megatron.layers.float8_options.Float8Options`);
            None without ``--fp8-format``.
    """

    args: argparse.Namespace
    world_size: int
    device: str
    distributed_backend: str
    use_cpu_initialization: bool
    fused_kernels_impl: str
    grad_reduce_in_fp32: bool
    kv_channels: int
    ffn_hidden_size: int
    max_position_embeddings: int
    rope: RopeScaling
    shape: ModelShape
    lr_decay_iters: int
    lr_warmup_iters: int
    loss_chunk_tokens: Optional[int]
    tokenizer_type: str
    metrics_file: Optional[str]
    profile_dir: Optional[str]
    sequence_parallel: bool
    dims: Optional[ParallelDims]
    global_batch_size: Optional[int]
    num_microbatches: Optional[int]
    optimizer_offload_fraction: Optional[float]
    data_parallel_sharding_strategy: Optional[str]
    padded_vocab_size: Optional[int] = None
    window_size: Optional[Tuple[int, int]] = None
    window_attn_skip_freq: Optional[Union[int, List[int]]] = None
    fp8: Optional[Float8Options] = None

    @property
    def params_dtype(self) -> str:
        """``bfloat16`` with ``--bf16``, else ``float32``."""
        return "bfloat16" if self.args.bf16 else "float32"

    @property
    def offload(self):
        """The activation keeping / offload of full recompute
        (:class:`~megatron.memory.activation_offload.OffloadConfig`)."""
        from megatron.memory.activation_offload import OffloadConfig  # torch-free --help

        what = set(self.args.recompute_cpu_offload or ())
        return OffloadConfig(layer_input="layer_input" in what, core_attn="core_attn" in what,
                             keep_core_attn=bool(self.args.recompute_keep_core_attn))

    def model_shape(self) -> ModelShape:
        """The model's shape with the padded vocabulary (after :meth:`with_padded_vocab`)."""
        return dataclasses.replace(self.shape, vocab_size=self.padded_vocab_size)

    def with_padded_vocab(self, padded_vocab_size: int) -> "RunConfig":
        """This config with the tokenizer's vocabulary padded (known after start-up has
        built the tokenizer)."""
        return dataclasses.replace(self, padded_vocab_size=padded_vocab_size)

    def flag_values(self) -> Dict[str, Any]:
        """Every flag under its argument name with the value the run uses, plus the derived
        sizes: what checkpoints and metrics files record, and what a checkpoint's recorded
        arguments are compared with."""
        out = dict(vars(self.args))
        if self.args.position_embedding_type in ("rope", "yarn"):
            out.update(self.rope.flag_values())    # the defaults resolved
        out.update(
            world_size=self.world_size, device=self.device,
            distributed_backend=self.distributed_backend,
            use_cpu_initialization=self.use_cpu_initialization,
            params_dtype=self.params_dtype, fused_kernels_impl=self.fused_kernels_impl,
            accumulate_allreduce_grads_in_fp32=self.grad_reduce_in_fp32,
            kv_channels=self.kv_channels, ffn_hidden_size=self.ffn_hidden_size,
            max_position_embeddings=self.max_position_embeddings,
            lr_decay_iters=self.lr_decay_iters, lr_warmup_iters=self.lr_warmup_iters,
            lr_warmup_fraction=None,   # converted into lr_warmup_iters
            linear_cross_entropy_chunk_tokens=self.loss_chunk_tokens,
            tokenizer_type=self.tokenizer_type, metrics_file=self.metrics_file,
            profile_dir=self.profile_dir, sequence_parallel=self.sequence_parallel,
            optimizer_offload_fraction=self.optimizer_offload_fraction,
            data_parallel_sharding_strategy=self.data_parallel_sharding_strategy)
        if self.dims is not None:
            out.update(ulysses_degree=self.dims.ulysses, ring_degree=self.dims.ring,
                       context_parallel_size=self.dims.cp, data_parallel_size=self.dims.dp,
                       global_batch_size=self.global_batch_size,
                       num_microbatches=self.num_microbatches)
        if self.padded_vocab_size is not None:
            out["padded_vocab_size"] = self.padded_vocab_size
        return out


__all__ = ["RunConfig"]
