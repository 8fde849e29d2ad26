"""USPGPTModel (RoPE from position_ids) is bit-identical to megatron-core's GPTModel for the
default token order, which is why every run uses it (megatron/training/model/gpt_model.py).

2 gloo ranks, U2xR1 and U1xR2, float32 on the CPU: both models are built from the same seed
with the USP block spec, get the same CP-rank shard of tokens and positions, and must return
the same logits, per-token losses and weight gradients bit for bit. With reset positions the
logits differ (the path does use the positions). The same holds with RoPE scaling: llama3,
linear interpolation and YaRN (whose factor on cos and sin both paths leave to attention; on
the CPU megatron-core's YaRN table comes through the CPU shim, which shares the frequencies
of ``rope_inv_freq``: tests/unit/test_rope_scaling.py checks those against transformers).
"""

from __future__ import annotations

import torch

from megatron.training.cpu_shims import apply_cpu_shims
from megatron.usp import token_order
from megatron.usp.parallel_dims import ParallelDims
from megatron.usp.parallel_state import destroy_usp_parallel, initialize_usp_parallel
from tests.distributed.test_gpt_forward_parity import SEED, VOCAB
from tests.helpers import gpt_config

SEQ, BATCH = 32, 2


# name -> (position_embedding_type, GPTModel's scaling arguments, YaRN's config attributes)
SCALINGS = {
    "none": ("rope", {}, {}),
    "llama3": ("rope", dict(rope_scaling=True, rope_scaling_factor=8.0), {}),
    "linear": ("rope", dict(seq_len_interpolation_factor=4.0), {}),
    "yarn": ("yarn", {}, dict(yarn_rotary_scaling_factor=4.0,
                              yarn_original_max_position_embeddings=8, yarn_beta_fast=8.0,
                              yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=0.0,
                              yarn_correction_range_round_to_int=True)),
}


def _build(cls, config, groups, scaling="none"):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron.training.model.layer_specs import (
        get_usp_gpt_block_spec,  # megatron-core on first use
    )

    kind, kwargs, attributes = SCALINGS[scaling]
    for name, value in attributes.items():
        setattr(config, name, value)
    model_parallel_cuda_manual_seed(SEED)
    return cls(config=config, transformer_layer_spec=get_usp_gpt_block_spec(config, pp_rank=0),
               vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type=kind,
               rotary_base=500000, share_embeddings_and_output_weights=False,
               pg_collection=groups.pg_collection, **kwargs)


def _run(model, tokens, position_ids, labels):
    logits = model(tokens, position_ids, None)
    logits.float().square().mean().backward()
    loss = model(tokens, position_ids, None, labels=labels)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def _check(rank, world_size):
    from megatron.core.models.gpt.gpt_model import GPTModel  # megatron-core on first use

    from megatron.training.model.gpt_model import USPGPTModel  # megatron-core on first use

    apply_cpu_shims()
    for (ulysses, ring), scaling in zip(((2, 1), (1, 2), (2, 1), (1, 2)), SCALINGS):
        groups = initialize_usp_parallel(ParallelDims(world_size, ulysses=ulysses, ring=ring))
        config = gpt_config(ulysses=ulysses, ring=ring)
        config.params_dtype = torch.float32
        gen = torch.Generator().manual_seed(SEED)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        position_ids = torch.arange(SEQ).repeat(BATCH, 1)

        def shard(t, cp_rank=groups.cp_rank):
            return token_order.shard_for_cp_rank(t, 1, cp_rank, 2)

        ref = _run(_build(GPTModel, config, groups, scaling), shard(tokens),
                   shard(position_ids), shard(labels))
        ours_model = _build(USPGPTModel, config, groups, scaling)
        ours = _run(ours_model, shard(tokens), shard(position_ids), shard(labels))
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
        for name, grad in ref[2].items():
            assert torch.equal(ours[2][name], grad), (scaling, name)
        reset = position_ids % 8                                 # documents of 8 tokens
        moved = ours_model(shard(tokens), shard(reset), None).detach()
        assert not torch.equal(moved, ours[0])
        destroy_usp_parallel()


def test_position_rope_is_bit_identical_for_the_default_token_order(dist_run):
    dist_run(_check, 2, timeout=240)
