"""One forward/backward of a small bf16 GPT on one GPU with a given ``--fused-kernels`` choice
(shared by the GPU tests; not a test module)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, Tuple

import torch
import torch.distributed as dist

from megatron.usp.parallel_dims import ParallelDims
from tests.helpers import gpt_config

SEQ, BATCH, VOCAB, SEED = 1024, 2, 512, 1234


def _config(fused_swiglu: bool):
    """The tiny model four times wider, in bf16, initialised on the GPU."""
    return gpt_config(hidden_size=256, kv_channels=32, ffn_hidden_size=512,
                      bias_activation_fusion=not fused_swiglu,
                      use_te_activation_func=fused_swiglu, use_cpu_initialization=False,
                      params_dtype=torch.bfloat16, bf16=True, pipeline_dtype=torch.bfloat16)


def _plain_name(name: str) -> str:
    """The separate norms' names of the lean layers' norm weights (the local spec's map)."""
    from tests.distributed.test_gpt_forward_parity import LEAN_NAMES  # megatron-core on first use

    for plain, lean in LEAN_NAMES.items():
        name = name.replace(lean, plain)
    return name


@contextmanager
def small_gpt(fused_swiglu: bool, options) -> Iterator[Tuple[torch.nn.Module, Tuple]]:
    """The small bf16 GPT on GPU 0 with the layer spec of ``options`` (a
    ``LayerSpecOptions``), seeded, and its fixed batch ``(tokens, labels, position_ids)``;
    the USP groups live for the ``with`` block."""
    from megatron.core.models.gpt.gpt_model import GPTModel  # megatron-core on first use
    from megatron.core.tensor_parallel import (
        model_parallel_cuda_manual_seed,  # megatron-core on first use
    )

    from megatron.training.model.layer_specs import (
        get_usp_gpt_block_spec,  # megatron-core on first use
    )
    from megatron.usp.parallel_state import (  # megatron-core on first use
        destroy_usp_parallel,
        initialize_usp_parallel,
    )

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.set_device(0)
    groups = initialize_usp_parallel(ParallelDims(1))
    try:
        model_parallel_cuda_manual_seed(SEED)
        torch.manual_seed(SEED)
        config = _config(fused_swiglu)
        spec = get_usp_gpt_block_spec(config, pp_rank=0, options=options)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                         max_sequence_length=SEQ, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False,
                         pg_collection=groups.pg_collection).cuda()
        gen = torch.Generator().manual_seed(SEED)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).cuda()
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).cuda()
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ).cuda()
        yield model, (tokens, labels, position_ids)
    finally:
        destroy_usp_parallel()


def one_gpt_step(impl: str, lean: bool = False,
                 fuse_wgrad: bool = False) -> Tuple[float, Dict[str, torch.Tensor]]:
    """(mean loss, {parameter name: gradient}) with fused kernels ``impl``, fixed seed;
    ``lean``: the norm and SwiGLU outputs dropped and recomputed (``--recompute-modules
    layernorm swiglu``), gradients under the plain model's parameter names;
    ``fuse_wgrad``: the linear layers add their weight gradients into float32 ``main_grad``
    buffers given as megatron-core's DDP gives them (``--gradient-accumulation-fusion``);
    those parameters' gradients are read from there."""
    from megatron.training.model.layer_specs import (
        LayerSpecOptions,  # megatron-core on first use
    )

    options = LayerSpecOptions(fused_kernels=impl, lean_norms=lean, lean_swiglu=lean,
                               fuse_wgrad=fuse_wgrad)
    with small_gpt(impl != "torch" or lean, options) as (model, (tokens, labels, position_ids)):
        if fuse_wgrad:
            for p in model.parameters():
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                p.grad_added_to_main_grad = False
        loss = model(tokens, position_ids, None, labels=labels).float().mean()
        loss.backward()
        grads = {_plain_name(n): (p.main_grad if getattr(p, "grad_added_to_main_grad", False)
                                  else p.grad).detach().float().clone()
                 for n, p in model.named_parameters()}
        return float(loss.detach()), grads
