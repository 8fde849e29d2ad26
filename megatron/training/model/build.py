"""The model of ``pretrain_gpt.py``: megatron-core ``GPTModel`` with USP attention, in DDP.

:func:`transformer_config_from_args` maps Megatron-LM flags onto megatron-core's
``TransformerConfig``; :func:`build_model` builds this pipeline stage's ``GPTModel`` with the
block spec of :func:`megatron.training.model.layer_specs.get_usp_gpt_block_spec` (USP core attention and
the norms of :mod:`megatron.layers.norms`, final norm included; used for every layout, U = R = 1
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
of its tokens' losses; DDP sums gradients over DP x CP and the optimizer step divides them
by the number of loss tokens of the whole global batch (``finalize_model_grads``' division,
done inside the fused Adam kernel: ``training.guarded_optimizer_step``). The gradient is
therefore that of the mean loss over every loss-masked token of the global batch, whatever
the layout.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from megatron.training.cli.arguments import SPEC_RECOMPUTE_MODULES
from megatron.usp.parallel_dims import ParallelDims
from megatron.usp.parallel_state import USPGroups


def params_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float32


def spec_recompute(args):
    """(norm outputs recomputed, SwiGLU output recomputed): the ``--recompute-modules``
    the layer spec implements (:mod:`megatron.layers.fused_linears`)."""
    modules = (args.recompute_modules or []) if args.recompute_granularity == "selective" \
        else []
    return "layernorm" in modules, "swiglu" in modules   # SPEC_RECOMPUTE_MODULES


def fused_kernels_impl(args) -> str:
    """The ``--fused-kernels`` implementation ``validate_args`` resolved (``torch`` when
    ``args`` did not go through it)."""
    return getattr(args, "fused_kernels_impl", "torch")


def transformer_config_from_args(args):
    """megatron-core ``TransformerConfig`` for the validated arguments."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = args.device == "cuda"
    add_bias = not args.disable_bias_linear
    dtype = params_dtype(args)
    # --fused-kernels: the layer spec's SwiGLU module replaces megatron-core's activation
    # (its activation_func slot, read when use_te_activation_func is set) for a bias-free
    # SwiGLU MLP; with "torch" megatron-core's own (TorchScript-fused on GPU) path stays.
    fused_swiglu = fused_kernels_impl(args) != "torch" and args.swiglu and not add_bias
    lean_norms, lean_swiglu = spec_recompute(args)
    granularity, mcore_modules = args.recompute_granularity, None   # None: megatron's default
    if args.recompute_modules is not None:
        mcore_modules = [m for m in args.recompute_modules if m not in SPEC_RECOMPUTE_MODULES]
        if granularity == "selective" and not mcore_modules:
            granularity = None      # all of it is done by the layer spec
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
        add_qkv_bias=add_bias or getattr(args, "add_qkv_bias", False),
        qk_layernorm=getattr(args, "qk_layernorm", False),
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        **ParallelDims.from_args(args).megatron_kwargs(),
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        use_cpu_initialization=args.use_cpu_initialization,
        calculate_per_token_loss=True,
        recompute_granularity=granularity,
        recompute_modules=mcore_modules if granularity == "selective" else None,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        deallocate_pipeline_outputs=True,
        # Fusions: the pure-PyTorch ones on GPU; none needs apex or TransformerEngine.
        bias_activation_fusion=(on_gpu and (args.swiglu or add_bias) and not fused_swiglu
                                and not lean_swiglu),
        use_te_activation_func=fused_swiglu or lean_swiglu,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # No CUDA graphs: megatron-core's default scope "full" only earns a deprecation
        # warning per model build; [] is its non-deprecated spelling of the same.
        cuda_graph_scope=[],
    )


def _pipeline_stage(groups: USPGroups):
    """(pp_rank, pre_process, post_process) of this rank's pipeline stage."""
    import torch.distributed as dist

    rank, size = dist.get_rank(groups.pp), dist.get_world_size(groups.pp)
    return rank, rank == 0, rank == size - 1


def build_gpt_model(args, config, groups: USPGroups):
    """This pipeline stage's ``GPTModel`` (unwrapped), on ``args.device``.

    A :class:`~megatron.training.model.gpt_model.USPGPTModel` (``GPTModel`` whose RoPE follows
    ``position_ids``: packed documents, any chunk assignment). With
    ``--fused-linear-cross-entropy`` it is a
    :class:`~megatron.training.model.fused_loss_model.FusedLossGPTModel`: the same model whose
    last stage computes the output layer and the loss together over chunks of
    ``--linear-cross-entropy-chunk-tokens`` tokens. ``--mlp-tile-tokens`` tiles the MLP
    (:mod:`megatron.memory.tiled_mlp`); ``--recompute-keep-core-attn`` /
    ``--recompute-cpu-offload`` give the model an
    :class:`~megatron.memory.activation_offload.ActivationOffloader` (``model.activation_offloader``)
    hooked to its decoder.
    """
    from megatron.training.model.gpt_model import USPGPTModel
    from megatron.training.model.layer_specs import get_usp_gpt_block_spec

    pp_rank, pre_process, post_process = _pipeline_stage(groups)
    chunks = getattr(args, "usp_overlap_chunks", "auto")
    device = (torch.device(args.device, torch.cuda.current_device())
              if args.device == "cuda" else torch.device("cpu"))
    offloader, keep = _recompute_offloader(args, device)
    spec = get_usp_gpt_block_spec(config, pp_rank=pp_rank,
                                  attention_backend=args.attention_backend,
                                  overlap_chunks=None if chunks == "auto" else chunks,
                                  fused_kernels=fused_kernels_impl(args),
                                  lean_norms=spec_recompute(args)[0],
                                  lean_swiglu=spec_recompute(args)[1],
                                  mlp_tile_tokens=getattr(args, "mlp_tile_tokens", None),
                                  recompute_keep=keep, mlp_tp_group=groups.tp,
                                  document_kernel=getattr(args, "document_attention_kernel",
                                                          "auto"),
                                  fuse_wgrad=getattr(args, "gradient_accumulation_fusion", False))
    model_class, loss_kwargs = USPGPTModel, {}
    if getattr(args, "fused_linear_cross_entropy", False):
        from megatron.training.model.fused_loss_model import FusedLossGPTModel

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
    if offloader is not None:
        from megatron.memory.activation_offload import install_recompute_offload

        install_recompute_offload(model.decoder, offloader)
        model.activation_offloader = offloader
    return model.to(device)


def _recompute_offloader(args, device: torch.device):
    """(offloader, RecomputeKeep or None) for ``--recompute-cpu-offload`` /
    ``--recompute-keep-core-attn`` (full recompute), or (None, None)."""
    from megatron.memory.activation_offload import ActivationOffloader, OffloadConfig
    from megatron.memory.kept_attention import RecomputeKeep

    config = OffloadConfig.from_args(args)
    if not config.active:
        return None, None
    offloader = ActivationOffloader(device, config)
    keep = RecomputeKeep(offloader, to_host=config.core_attn) if config.keep_core_attn else None
    return offloader, keep


def reserve_offload_buffers(args, model_chunks) -> int:
    """Pin the host buffers of ``--recompute-cpu-offload`` now; returns the bytes reserved.

    Called at start-up after the optimizer is built (and the checkpoint loaded), not with
    the model, so that what the optimizer's set-up allocates for a moment (float32 copies of
    the parameters: ``offload_optimizer.install_staged_offload``) comes and goes before tens
    of GiB are pinned here rather than on top of it (Llama-3-8B at 256K on one H200 was killed
    at the host's 125 GiB in that phase when the buffers came first). Without this call the
    buffers are allocated at their first use.
    """
    total = 0
    for chunk in model_chunks:
        offloader = getattr(unwrap(chunk), "activation_offloader", None)
        if offloader is not None:
            before = offloader.pool.allocated_bytes
            _reserve_host_buffers(args, offloader)
            total += offloader.pool.allocated_bytes - before
    return total


def _reserve_host_buffers(args, offloader) -> None:
    """Pin the host buffers of one micro-batch's offloaded items: layer inputs
    ``[s/CP (/TP with SP), b, h]``, kept attention outputs ``[s/CP, b, heads/TP, d]``; one of
    each per layer of this stage (more are allocated if micro-batches overlap, PP > 1)."""
    config = offloader.config
    layers = args.num_layers // args.pipeline_model_parallel_size
    local = args.seq_length // args.context_parallel_size
    tp = args.tensor_model_parallel_size
    dtype = params_dtype(args)
    if config.layer_input:
        tokens = local // tp if args.sequence_parallel else local
        offloader.reserve((tokens, args.micro_batch_size, args.hidden_size), dtype, layers)
    if config.core_attn:
        offloader.reserve((local, args.micro_batch_size, args.num_attention_heads // tp,
                           args.kv_channels), dtype, layers)


def grad_buffer_dtype(args) -> torch.dtype:
    """Dtype of DDP's gradient buffer: where micro-batch gradients accumulate and what the
    DP x CP all-reduce (reduce-scatter with ZeRO-1) sums.

    float32 (4 bytes per parameter), as Megatron-LM forces under ``--bf16``, unless
    ``--bf16 --grad-reduce-in-bf16`` (2 bytes; every accumulation and reduction step then
    rounds to bf16). With ``--gradient-accumulation-fusion`` (the default) the linear
    layers of the transformer layers add their weight gradients into it inside the GEMM
    (:mod:`megatron.layers.linear_wgrad`); the other weights' gradients leave autograd in the
    parameter dtype and DDP adds them; see docs/numerics.md.
    """
    if args.bf16 and getattr(args, "grad_reduce_in_bf16", False):
        return torch.bfloat16
    return torch.float32


def ddp_config_from_args(args):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_buffer_dtype(args) == torch.float32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # NaN/inf is checked on the loss by the training loop, which can skip the step.
        check_for_nan_in_grad=False,
        **_fsdp_kwargs(args),
    )


def _fsdp_kwargs(args) -> dict:
    """DistributedDataParallelConfig fields of ``--use-megatron-fsdp``."""
    if not getattr(args, "use_megatron_fsdp", False):
        return {}
    return {"use_megatron_fsdp": True,
            "data_parallel_sharding_strategy": args.data_parallel_sharding_strategy}


def build_model(args, groups: USPGroups) -> List[torch.nn.Module]:
    """``[DistributedDataParallel([Float16Module](GPTModel))]``: this stage's model chunk
    (``FullyShardedDataParallel`` in place of DDP with ``--use-megatron-fsdp``).

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
    wrapper = DistributedDataParallel
    if getattr(args, "use_megatron_fsdp", False):
        # Megatron-FSDP (GPU only, memory_args.py): shards over DP x CP, units of one layer.
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        wrapper = FullyShardedDataParallel
    ddp = wrapper(config, ddp_config_from_args(args), module, pg_collection=groups.pg_collection)
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
