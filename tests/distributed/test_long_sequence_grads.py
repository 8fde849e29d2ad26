"""Full recompute with kept attention, activation offload and the tiled MLP: the gradients of
plain full recompute, on USP layouts (float64, CPU, gloo).

A 3-layer Llama-style GPT (GQA 8 / 2 heads, SwiGLU, RoPE) per layout, built like
``pretrain_gpt.py`` builds it (:func:`get_usp_gpt_block_spec`, megatron-core's full recompute,
``uniform``, one layer per unit), in variants that share one set of weights:

* ``plain``: no recompute: the reference; ``full``: megatron-core's full recompute (to 1e-12);
* ``keep``: + ``--recompute-keep-core-attn``; ``keep_offload``: + ``--recompute-cpu-offload
  layer_input core_attn``: both bitwise equal to ``full`` (every tensor the backward sees is
  a copy or a permutation of what the recompute would compute);
* ``keep_offload_tiled``: + ``--mlp-tile-tokens`` (4 tiles): equal to ``full`` to float64
  rounding (1e-12).

Two micro-batches run forward and backward in turn, so each kept item is taken by its own
backward. The counters prove the paths ran: every recompute replayed a kept output (none ran
attention again), every layer input and kept output went to the (CPU stand-in for) host
memory, and none had to be reloaded on demand (the prefetch brought each one back first).
Layouts (TP, U, R): 1x2x1 and 1x1x2 (world 2); TP 2 with sequence parallelism and the tiled
MLP is covered by the training test (test_long_sequence_training.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.memory.activation_offload import (
    ActivationOffloader,
    OffloadConfig,
    install_recompute_offload,
)
from megatron.memory.kept_attention import AttentionKeeper, RecomputeKeep
from megatron.training.cpu_shims import apply_cpu_shims
from megatron.usp import token_order
from megatron.usp.parallel_dims import ParallelDims
from megatron.usp.parallel_state import destroy_usp_parallel, initialize_usp_parallel
from tests.helpers import gpt_config

SEQ, BATCH, VOCAB, SEED, LAYERS = 64, 2, 96, 1234, 3
TOL = dict(atol=1e-12, rtol=1e-12)
LAYOUTS = [(1, 2, 1, False), (1, 1, 2, False)]
VARIANTS = {  # name -> (full recompute, keep, offload, tile)
    "plain": (False, False, (), None), "full": (True, False, (), None),
    "keep": (True, True, (), None),
    "keep_offload": (True, True, ("layer_input", "core_attn"), None),
    "keep_offload_tiled": (True, True, ("layer_input", "core_attn"), 4),
}


def _config(tp, ulysses, ring, sp, full):
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1) if full else {}
    return gpt_config(tp, ulysses, ring, sp, num_layers=LAYERS, **recompute)


def _build(variant, layout, groups):
    from megatron.core.models.gpt.gpt_model import GPTModel  # megatron-core on first use
    from megatron.core.tensor_parallel import (
        model_parallel_cuda_manual_seed,  # megatron-core on first use
    )

    from megatron.training.model.layer_specs import (  # megatron-core on first use
        LayerSpecOptions,
        get_usp_gpt_block_spec,
    )

    tp, ulysses, ring, sp = layout
    full, keep, offload, tiles = VARIANTS[variant]
    config = _config(tp, ulysses, ring, sp, full)
    offloader = recompute_keep = None
    if keep or offload:
        oc = OffloadConfig(layer_input="layer_input" in offload, core_attn="core_attn" in offload,
                           keep_core_attn=keep)
        offloader = ActivationOffloader(torch.device("cpu"), oc, min_offload_bytes=0)
        recompute_keep = RecomputeKeep(offloader, to_host=oc.core_attn) if keep else None
    local = SEQ // (ulysses * ring) // (tp if sp else 1)
    model_parallel_cuda_manual_seed(SEED)
    spec = get_usp_gpt_block_spec(config, pp_rank=0, options=LayerSpecOptions(
        mlp_tile_tokens=local // tiles if tiles else None, recompute_keep=recompute_keep,
        mlp_tp_group=groups.tp))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False,
                     pg_collection=groups.pg_collection).double()
    if offloader is not None:
        install_recompute_offload(model.decoder, offloader)
    return model, offloader


def _grads(model, batches, cp_rank, cp):
    def shard(t):
        return token_order.shard_for_cp_rank(t, 1, cp_rank, cp)

    model.train()
    for tokens, labels in batches:
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ).contiguous()
        loss = model(shard(tokens), shard(position_ids), None, labels=shard(labels))
        (loss.sum() * 1e-2).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _check_layout(layout):
    tp, ulysses, ring, sp = layout
    groups = initialize_usp_parallel(ParallelDims(dist.get_world_size(), tp=tp, ulysses=ulysses,
                                                  ring=ring))
    gen = torch.Generator().manual_seed(SEED)
    batches = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
                torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)) for _ in range(2)]
    state, grads = None, {}
    for variant in VARIANTS:
        model, offloader = _build(variant, layout, groups)
        if state is None:
            state = model.state_dict()
        model.load_state_dict(state)
        grads[variant] = _grads(model, batches, groups.cp_rank, ulysses * ring)
        keepers = [m.keeper for m in model.modules() if isinstance(getattr(m, "keeper", None),
                                                                   AttentionKeeper)]
        full, keep, offload, _ = VARIANTS[variant]
        assert len(keepers) == (LAYERS if keep else 0), (variant, len(keepers))
        for k in keepers:   # each micro-batch's recompute reused the kept output
            assert k.replayed == len(batches) and k.pending == 0, (variant, k.replayed)
        if offloader is not None:
            st = offloader.stats
            items = len(batches) * LAYERS * (2 if "layer_input" in offload else 1)
            assert st.kept == st.taken == items, (variant, st)
            assert st.offloaded == (items if offload else 0), (variant, st)
            assert st.reloaded_on_demand == 0, (variant, st)
    where = f"TP{tp} U{ulysses} R{ring} SP{sp}"
    for name, grad in grads["plain"].items():
        torch.testing.assert_close(grads["full"][name], grad, **TOL,
                                   msg=lambda m, n=name: f"{where} full vs plain {n}: {m}")
        for variant in ("keep", "keep_offload"):
            assert torch.equal(grads[variant][name], grads["full"][name]), (where, variant, name)
        torch.testing.assert_close(grads["keep_offload_tiled"][name], grads["full"][name], **TOL,
                                   msg=lambda m, n=name: f"{where} tiled vs full {n}: {m}")
    destroy_usp_parallel()


def _run(rank, world_size):
    apply_cpu_shims()
    for layout in LAYOUTS:
        _check_layout(layout)


def test_kept_attention_offload_and_tiles_match_full_recompute(dist_run):
    dist_run(_run, 2, timeout=300)
