"""The model of ``pretrain_gpt.py``: megatron-core ``GPTModel`` with USP attention, in DDP.

:func:`transformer_config_from_args` maps Megatron-LM flags onto megatron-core's
``TransformerConfig``; :func:`build_model` builds this pipeline stage's ``GPTModel`` with the
block spec of :func:`megatron.usp.layer_specs.get_usp_gpt_block_spec` (USP core attention and
the norms of :mod:`megatron.usp.norms`, final norm included; used for every layout, U = R = 1
included, so the DP baseline runs the same kernels) and the process groups of
:func:`megatron.usp.parallel_state.initialize_usp_parallel` (``pg_collection``: attention finds
its Ulysses and Ring groups in ``pg_collection.hcp``), then wraps it in megatron-core's
``DistributedDataParallel``, which reduces gradients over the DP x CP group.

Megatron sequence parallelism (``--sequence-parallel``, TP > 1): outside attention and the MLP
a rank holds ``[s/(CP*TP), b, h]``, its 1/TP of its CP rank's tokens (megatron-core's
embedding scatters, its column- / row-parallel linears all-gather / reduce-scatter over TP);
USP attention sees ``[s/CP, b, heads/TP, d]`` exactly as without it. The norms' weight
gradients are partial per TP rank and are summed over TP by ``finalize_model_grads``, which
finds them by their ``sequence_parallel`` attribute.

Loss scaling contract: ``calculate_per_token_loss=True``. Each rank back-propagates the *sum*
of its tokens' losses; DDP sums gradients over DP x CP and ``finalize_model_grads`` divides
by the number of loss tokens of the whole global batch. The gradient is therefore that of
the mean loss over every loss-masked token of the global batch, whatever the layout.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from megatron.usp.parallel_dims import ParallelDims
from megatron.usp.parallel_state import USPGroups


def params_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float32


def transformer_config_from_args(args):
    """megatron-core ``TransformerConfig`` for the validated arguments."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = args.device == "cuda"
    add_bias = not args.disable_bias_linear
    dtype = params_dtype(args)
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=add_bias,
        add_qkv_bias=add_bias,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        **ParallelDims.from_args(args).megatron_kwargs(),
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        use_cpu_initialization=args.use_cpu_initialization,
        calculate_per_token_loss=True,
        recompute_granularity=args.recompute_granularity,
        recompute_modules=list(args.recompute_modules) if args.recompute_modules else None,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        deallocate_pipeline_outputs=True,
        # Fusions: the pure-PyTorch ones on GPU; none needs apex or TransformerEngine.
        bias_activation_fusion=on_gpu and (args.swiglu or add_bias),
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def _pipeline_stage(groups: USPGroups):
    """(pp_rank, pre_process, post_process) of this rank's pipeline stage."""
    import torch.distributed as dist

    rank, size = dist.get_rank(groups.pp), dist.get_world_size(groups.pp)
    return rank, rank == 0, rank == size - 1


def build_gpt_model(args, config, groups: USPGroups):
    """This pipeline stage's ``GPTModel`` (unwrapped), on ``args.device``.

    A :class:`~megatron.training.gpt_model.USPGPTModel` (``GPTModel`` whose RoPE follows
    ``position_ids``: packed documents, any chunk assignment). With
    ``--fused-linear-cross-entropy`` it is a
    :class:`~megatron.training.fused_loss_model.FusedLossGPTModel`: the same model whose
    last stage computes the output layer and the loss together over chunks of
    ``--linear-cross-entropy-chunk-tokens`` tokens.
    """
    from megatron.training.gpt_model import USPGPTModel
    from megatron.usp.layer_specs import get_usp_gpt_block_spec

    pp_rank, pre_process, post_process = _pipeline_stage(groups)
    chunks = getattr(args, "usp_overlap_chunks", "auto")
    spec = get_usp_gpt_block_spec(config, pp_rank=pp_rank,
                                  attention_backend=args.attention_backend,
                                  overlap_chunks=None if chunks == "auto" else chunks,
                                  document_kernel=getattr(args, "document_attention_kernel",
                                                          "auto"))
    model_class, loss_kwargs = USPGPTModel, {}
    if getattr(args, "fused_linear_cross_entropy", False):
        from megatron.training.fused_loss_model import FusedLossGPTModel

        model_class = FusedLossGPTModel
        loss_kwargs = {"loss_chunk_tokens": args.linear_cross_entropy_chunk_tokens}
    model = model_class(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        pg_collection=groups.pg_collection,
        **loss_kwargs,
    )
    return model.to(torch.device(args.device, torch.cuda.current_device())
                    if args.device == "cuda" else torch.device("cpu"))


def ddp_config_from_args(args):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32 or not args.bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # NaN/inf is checked on the loss by the training loop, which can skip the step.
        check_for_nan_in_grad=False,
    )


def build_model(args, groups: USPGroups) -> List[torch.nn.Module]:
    """``[DistributedDataParallel([Float16Module](GPTModel))]``: this stage's model chunk.

    One chunk per pipeline stage (no virtual pipeline stages). Gradients of the chunk are
    reduced over ``groups.dp_cp`` by DDP; ``config.no_sync_func`` /
    ``finalize_model_grads_func`` are set by the training loop.
    """
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    config = transformer_config_from_args(args)
    module = build_gpt_model(args, config, groups)
    for param in module.parameters():
        # megatron-core's optimizer expects every param to carry the TP attributes.
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if args.bf16:
        # bf16 weights and inputs, float32 losses out of the last stage (Megatron-LM's way);
        # the optimizer keeps float32 main params.
        module = Float16Module(config, module)
    # Every DP x CP replica initialises identically (same seeds), so no broadcast is needed.
    ddp = DistributedDataParallel(config, ddp_config_from_args(args), module,
                                  pg_collection=groups.pg_collection)
    return [ddp]


def unwrap(model_chunk) -> torch.nn.Module:
    """The ``GPTModel`` inside the DDP (and, with bf16, ``Float16Module``) wrappers."""
    module = model_chunk
    while hasattr(module, "module"):
        module = module.module
    return module


def count_parameters(model: List[torch.nn.Module]) -> int:
    """Parameters held by this rank (its TP shard of its pipeline stage)."""
    return sum(p.numel() for chunk in model for p in unwrap(chunk).parameters())
