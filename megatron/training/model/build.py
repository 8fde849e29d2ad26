"""The model of ``pretrain_gpt.py``: megatron-core ``GPTModel`` with USP attention, in DDP.

:func:`transformer_config_from_args` maps the run's configuration onto megatron-core's
``TransformerConfig``; :func:`build_model` builds this pipeline stage's ``GPTModel`` with the
block spec of :func:`megatron.training.model.layer_specs.get_usp_gpt_block_spec` (USP core attention and
the norms of :mod:`megatron.layers.norms`, final norm included; used for every layout, U = R = 1
included, so the DP baseline runs the same kernels) and the process groups of
:func:`megatron.usp.parallel_state.initialize_usp_parallel` (``pg_collection``: attention finds
its Ulysses and Ring groups in ``pg_collection.hcp``), then wraps it in megatron-core's
``DistributedDataParallel``, which reduces gradients over the DP x CP group.

Float8 (``--fp8-format``): the layer spec gives QKV, the projection, FC1 and FC2 this project's
linear classes, and :func:`configure_float8`, called once the model is built, chooses which of
them run in float8 (:mod:`megatron.layers.float8_policy`).

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
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.layers.float8_policy import OUTPUT_KIND, apply_float8
from megatron.memory.activation_offload import ActivationOffloader, install_recompute_offload
from megatron.memory.kept_attention import RecomputeKeep
from megatron.training.cli.arguments import SPEC_RECOMPUTE_MODULES
from megatron.training.cli.config import RunConfig
from megatron.training.model.fused_loss_model import FusedLossGPTModel
from megatron.training.model.gpt_model import USPGPTModel
from megatron.training.model.layer_specs import LayerSpecOptions, get_usp_gpt_block_spec
from megatron.usp.parallel_state import USPGroups


def params_dtype(config: RunConfig) -> torch.dtype:
    return torch.bfloat16 if config.args.bf16 else torch.float32


def spec_recompute(config: RunConfig):
    """(norm outputs recomputed, SwiGLU output recomputed): the ``--recompute-modules``
    the layer spec implements (:mod:`megatron.layers.fused_linears`)."""
    args = config.args
    modules = (args.recompute_modules or []) if args.recompute_granularity == "selective" \
        else []
    return "layernorm" in modules, "swiglu" in modules   # SPEC_RECOMPUTE_MODULES


def transformer_config_from_args(config: RunConfig):
    """megatron-core ``TransformerConfig`` for the validated run."""
    args = config.args
    on_gpu = config.device == "cuda"
    add_bias = not args.disable_bias_linear
    dtype = params_dtype(config)
    # --fused-kernels: the layer spec's SwiGLU module replaces megatron-core's activation
    # (its activation_func slot, read when use_te_activation_func is set) for a bias-free
    # SwiGLU MLP; with "torch" megatron-core's own (TorchScript-fused on GPU) path stays.
    fused_swiglu = config.fused_kernels_impl != "torch" and args.swiglu and not add_bias
    lean_norms, lean_swiglu = spec_recompute(config)
    granularity, mcore_modules = args.recompute_granularity, None   # None: megatron's default
    if args.recompute_modules is not None:
        mcore_modules = [m for m in args.recompute_modules if m not in SPEC_RECOMPUTE_MODULES]
        if granularity == "selective" and not mcore_modules:
            granularity = None      # all of it is done by the layer spec
    config_out = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=config.shape.num_query_groups,
        kv_channels=config.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=add_bias,
        add_qkv_bias=add_bias or args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        **config.dims.megatron_kwargs(),
        sequence_parallel=config.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        use_cpu_initialization=config.use_cpu_initialization,
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
        window_size=config.window_size,
        window_attn_skip_freq=config.window_attn_skip_freq,
    )
    _set_yarn_fields(config_out, config.rope)
    return config_out


def _set_yarn_fields(transformer_config, rope) -> None:
    """YaRN's parameters where megatron-core 0.16.1 reads them: attributes of the
    ``TransformerConfig`` (not fields of the dataclass; ``GPTModel`` builds its
    ``YarnRotaryEmbedding`` from them and attention takes the cos/sin factor from them), set
    as Megatron-LM sets them. Nothing is set for the other kinds, whose absence is how
    megatron-core tells plain RoPE."""
    if rope.kind != "yarn":
        return
    for name, value in (("rotary_scaling_factor", rope.factor),
                        ("original_max_position_embeddings",
                         rope.original_max_position_embeddings),
                        ("beta_fast", rope.beta_fast), ("beta_slow", rope.beta_slow),
                        ("mscale", rope.mscale), ("mscale_all_dim", rope.mscale_all_dim),
                        ("correction_range_round_to_int", True)):
        setattr(transformer_config, "yarn_" + name, value)


def _pipeline_stage(groups: USPGroups):
    """(pp_rank, pre_process, post_process) of this rank's pipeline stage."""
    rank, size = dist.get_rank(groups.pp), dist.get_world_size(groups.pp)
    return rank, rank == 0, rank == size - 1


def layer_spec_options(config: RunConfig, groups: USPGroups, recompute_keep=None):
    """The run's :class:`~megatron.training.model.layer_specs.LayerSpecOptions`."""
    args = config.args
    lean_norms, lean_swiglu = spec_recompute(config)
    chunks = args.usp_overlap_chunks
    return LayerSpecOptions(
        attention_backend=args.attention_backend,
        overlap_chunks=None if chunks == "auto" else chunks,
        fused_kernels=config.fused_kernels_impl, lean_norms=lean_norms,
        lean_swiglu=lean_swiglu, mlp_tile_tokens=args.mlp_tile_tokens,
        recompute_keep=recompute_keep, mlp_tp_group=groups.tp,
        document_kernel=args.document_attention_kernel,
        fuse_wgrad=args.gradient_accumulation_fusion, document_costs_group=groups.same_batch,
        float8_linears=config.fp8 is not None)


def build_gpt_model(config: RunConfig, transformer_config, groups: USPGroups):
    """This pipeline stage's ``GPTModel`` (unwrapped), on the run's device.

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
    args = config.args
    pp_rank, pre_process, post_process = _pipeline_stage(groups)
    device = (torch.device("cuda", torch.cuda.current_device())
              if config.device == "cuda" else torch.device("cpu"))
    offloader, keep = _recompute_offloader(config, device)
    spec = get_usp_gpt_block_spec(transformer_config, pp_rank=pp_rank,
                                  options=layer_spec_options(config, groups, keep))
    model_class, loss_kwargs = USPGPTModel, {}
    if config.loss_chunk_tokens is not None:   # --fused-linear-cross-entropy

        model_class = FusedLossGPTModel
        loss_kwargs = {"loss_chunk_tokens": config.loss_chunk_tokens}
    model = model_class(
        config=transformer_config,
        transformer_layer_spec=spec,
        vocab_size=config.padded_vocab_size,
        max_sequence_length=config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        **_rope_scaling_kwargs(config),
        pg_collection=groups.pg_collection,
        **loss_kwargs,
    )
    if offloader is not None:
        install_recompute_offload(model.decoder, offloader)
        model.activation_offloader = offloader
    return model.to(device)


def _rope_scaling_kwargs(config: RunConfig) -> dict:
    """``GPTModel``'s arguments of llama3 and linear RoPE scaling (YaRN's are config
    attributes: :func:`_set_yarn_fields`)."""
    rope = config.rope
    if rope.kind == "llama3":
        return {"rope_scaling": True, "rope_scaling_factor": rope.factor}
    if rope.kind == "linear":
        return {"seq_len_interpolation_factor": rope.factor}
    return {}


def _recompute_offloader(config: RunConfig, device: torch.device):
    """(offloader, RecomputeKeep or None) for ``--recompute-cpu-offload`` /
    ``--recompute-keep-core-attn`` (full recompute), or (None, None)."""
    offload = config.offload
    if not offload.active:
        return None, None
    offloader = ActivationOffloader(device, offload)
    keep = RecomputeKeep(offloader, to_host=offload.core_attn) if offload.keep_core_attn else None
    return offloader, keep


def reserve_offload_buffers(config: RunConfig, model_chunks) -> int:
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
            _reserve_host_buffers(config, offloader)
            total += offloader.pool.allocated_bytes - before
    return total


def _reserve_host_buffers(config: RunConfig, offloader) -> None:
    """Pin the host buffers of one micro-batch's offloaded items: layer inputs
    ``[s/CP (/TP with SP), b, h]``, kept attention outputs ``[s/CP, b, heads/TP, d]``; one of
    each per layer of this stage (more are allocated if micro-batches overlap, PP > 1)."""
    args, offload, dims = config.args, offloader.config, config.dims
    layers = args.num_layers // dims.pp
    local = args.seq_length // dims.cp
    dtype = params_dtype(config)
    if offload.layer_input:
        tokens = local // dims.tp if config.sequence_parallel else local
        offloader.reserve((tokens, args.micro_batch_size, args.hidden_size), dtype, layers)
    if offload.core_attn:
        offloader.reserve((local, args.micro_batch_size, args.num_attention_heads // dims.tp,
                           config.kv_channels), dtype, layers)


def grad_buffer_dtype(config: RunConfig) -> torch.dtype:
    """Dtype of DDP's gradient buffer: where micro-batch gradients accumulate and what the
    DP x CP all-reduce (reduce-scatter with ZeRO-1) sums.

    float32 (4 bytes per parameter), as Megatron-LM forces under ``--bf16``, unless
    ``--bf16 --grad-reduce-in-bf16`` (2 bytes; every accumulation and reduction step then
    rounds to bf16). With ``--gradient-accumulation-fusion`` (the default) the linear
    layers of the transformer layers add their weight gradients into it inside the GEMM
    (:mod:`megatron.layers.linear_wgrad`); the other weights' gradients leave autograd in the
    parameter dtype and DDP adds them; see docs/numerics.md.
    """
    return torch.float32 if config.grad_reduce_in_fp32 else torch.bfloat16


def ddp_config_from_args(config: RunConfig):
    args = config.args
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=config.grad_reduce_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # NaN/inf is checked on the loss by the training loop, which can skip the step.
        check_for_nan_in_grad=False,
        **_fsdp_kwargs(config),
    )


def _fsdp_kwargs(config: RunConfig) -> dict:
    """DistributedDataParallelConfig fields of ``--use-megatron-fsdp``."""
    if not config.args.use_megatron_fsdp:
        return {}
    return {"use_megatron_fsdp": True,
            "data_parallel_sharding_strategy": config.data_parallel_sharding_strategy}


def build_model(config: RunConfig, groups: USPGroups) -> List[torch.nn.Module]:
    """``[DistributedDataParallel([Float16Module](GPTModel))]``: this stage's model chunk
    (``FullyShardedDataParallel`` in place of DDP with ``--use-megatron-fsdp``).

    One chunk per pipeline stage (no virtual pipeline stages). Gradients of the chunk are
    reduced over ``groups.dp_cp`` by DDP; ``config.no_sync_func`` /
    ``finalize_model_grads_func`` are set by the training loop.
    """
    transformer_config = transformer_config_from_args(config)
    module = build_gpt_model(config, transformer_config, groups)
    for param in module.parameters():
        # megatron-core's optimizer expects every param to carry the TP attributes.
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if config.args.bf16:
        # bf16 weights and inputs, float32 losses out of the last stage (Megatron-LM's way);
        # the optimizer keeps float32 main params.
        module = Float16Module(transformer_config, module)
    # Every DP x CP replica initialises identically (same seeds), so no broadcast is needed.
    wrapper = DistributedDataParallel
    if config.args.use_megatron_fsdp:
        # Megatron-FSDP (GPU only, memory_args.py): shards over DP x CP, units of one layer.

        wrapper = FullyShardedDataParallel
    ddp = wrapper(transformer_config, ddp_config_from_args(config), module,
                  pg_collection=groups.pg_collection)
    return [ddp]


def float8_tokens(config: RunConfig) -> dict:
    """GEMM rows per micro-batch of each float8 candidate (QKV, proj, FC1, FC2, output): this
    rank's ``s/CP * b`` tokens (sequence parallelism gathers them before QKV and FC1; the
    projection and FC2 take them whole), FC1 and FC2 over tiles of ``--mlp-tile-tokens``,
    the output layer over the fused loss's chunks (``--linear-cross-entropy-chunk-tokens``;
    the chunk's shape without the fused loss, where the output layer is no candidate)."""
    args = config.args
    tokens = args.seq_length // config.dims.cp * args.micro_batch_size
    mlp = min(tokens, args.mlp_tile_tokens) if args.mlp_tile_tokens else tokens
    chunk = min(tokens, config.loss_chunk_tokens) if config.loss_chunk_tokens else tokens
    return {"QKV": tokens, "proj": tokens, "FC1": mlp, "FC2": mlp, OUTPUT_KIND: chunk}


def configure_float8(config: RunConfig, model_chunks, device: torch.device,
                     group) -> List[str]:
    """Choose which linear layers of ``model_chunks`` run in float8 (``--fp8-format``;
    :func:`megatron.layers.float8_policy.apply_float8`, timings agreed over ``group``) and
    return the start-up report; nothing without ``--fp8-format``."""
    if config.fp8 is None:
        return []
    outputs = []
    if config.fp8.output_layer:
        # every pipeline stage's model, so that all ranks time the same shapes
        outputs = [m for chunk in model_chunks for m in chunk.modules()
                   if isinstance(m, FusedLossGPTModel)]
    return apply_float8(model_chunks, config.fp8, float8_tokens(config), device,
                        params_dtype(config), group, output_models=outputs)


def unwrap(model_chunk) -> torch.nn.Module:
    """The ``GPTModel`` inside the DDP (and, with bf16, ``Float16Module``) wrappers."""
    module = model_chunk
    while hasattr(module, "module"):
        module = module.module
    return module


def count_parameters(model: List[torch.nn.Module]) -> int:
    """Parameters held by this rank (its TP shard of its pipeline stage)."""
    return sum(p.numel() for chunk in model for p in unwrap(chunk).parameters())
