"""A whole GPT forward on U x R ranks equals the single-rank forward on the whole sequence.

Reference: one rank, megatron-core's own local GPT layer spec (``DotProductAttention``, no
Megatron-USP code in the attention path), Llama-style model (RMSNorm, SwiGLU, RoPE, GQA, no
bias) in float64 with CPU initialisation. It saves its weights, the batch, the logits, the
per-token losses and the weight gradients of ``loss.sum()``.

USP: U*R ranks build the same model with :func:`get_usp_gpt_layer_spec` and the groups of
:func:`initialize_usp_parallel` (``pg_collection``), load the reference weights, feed each CP
rank its shard of tokens / labels / position ids (``layout.shard_for_cp_rank``), gather the
logits and losses over the CP group, rebuild the full sequence
(``layout.unshard_from_cp_ranks``) and compare. Weight gradients are summed over the CP group
(what DDP's gradient all-reduce over DP x CP does) and compared too.

Tolerance: float64, 1e-9 absolute and relative (a 2-layer model; ~1e-14 observed).
Layouts: 1x2, 2x1 (world 2), 2x2 (world 4), 4x2 and 2x4 (world 8). With 8 query heads and
2 KV heads, U = 4 also exercises the KV-head replication path.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron.usp import layout
from megatron.usp.config import USPParallelConfig
from megatron.usp.parallel_state import destroy_usp_parallel, initialize_usp_parallel

TOL = dict(atol=1e-9, rtol=1e-9)
SEQ, BATCH, VOCAB, SEED = 64, 2, 96, 1234
LAYOUTS = {2: [(1, 2), (2, 1)], 4: [(2, 2)], 8: [(4, 2), (2, 4)]}


def _config(cp: int, ulysses: int, ring: int):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
        kv_channels=8, ffn_hidden_size=96, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, use_cpu_initialization=True, params_dtype=torch.float64,
        context_parallel_size=cp,
        hierarchical_context_parallel_sizes=[ulysses, ring] if cp > 1 else None,
    )


def _model(spec, config, pg_collection):
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope", share_embeddings_and_output_weights=False,
        pg_collection=pg_collection,
    ).double()


def _forward(model, tokens, position_ids, labels):
    """(logits [b, s, V], per-token loss [b, s]) for one batch, loss.sum() back-propagated."""
    logits = model(tokens, position_ids, None)
    loss = model(tokens, position_ids, None, labels=labels)
    loss.sum().backward()
    return logits.detach(), loss.detach()


def _reference(rank, world_size, out_dir):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron.usp.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    groups = initialize_usp_parallel(USPParallelConfig())
    model_parallel_cuda_manual_seed(SEED)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = _model(spec, _config(1, 1, 1), groups.pg_collection)
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ).contiguous()
    logits, loss = _forward(model, tokens, position_ids, labels)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.save(dict(state=model.state_dict(), tokens=tokens, labels=labels,
                    position_ids=position_ids, logits=logits, loss=loss, grads=grads),
               os.path.join(out_dir, "reference.pt"))


def _gather_seq(x: torch.Tensor, groups) -> torch.Tensor:
    """All-gather [b, s_local, ...] over the CP group and rebuild the full sequence."""
    parts = [torch.empty_like(x) for _ in range(groups.shape.cp)]
    dist.all_gather(parts, x.contiguous(), group=groups.cp)
    return layout.unshard_from_cp_ranks(parts, seq_dim=1)


def _check_layout(ulysses: int, ring: int, ref: dict) -> None:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron.usp.layer_specs import get_usp_gpt_layer_spec

    groups = initialize_usp_parallel(USPParallelConfig(ulysses_degree=ulysses, ring_degree=ring))
    model_parallel_cuda_manual_seed(SEED)
    cp, cp_rank = ulysses * ring, groups.cp_rank
    model = _model(get_usp_gpt_layer_spec(), _config(cp, ulysses, ring), groups.pg_collection)
    model.load_state_dict(ref["state"])

    def shard(t):
        return layout.shard_for_cp_rank(t, 1, cp_rank, cp)

    def close(got, want, what):
        torch.testing.assert_close(got, want, **TOL,
                                   msg=lambda m: f"U={ulysses} R={ring} {what}: {m}")

    logits, loss = _forward(model, shard(ref["tokens"]), shard(ref["position_ids"]),
                            shard(ref["labels"]))
    close(_gather_seq(logits, groups), ref["logits"], "logits")
    close(_gather_seq(loss, groups), ref["loss"], "loss")
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        dist.all_reduce(grad, group=groups.cp)
        close(grad, ref["grads"][name], f"grad {name}")
    destroy_usp_parallel()


def _usp_layouts(rank, world_size, layouts, out_dir):
    from megatron.usp.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    ref = torch.load(os.path.join(out_dir, "reference.pt"))
    for ulysses, ring in layouts:
        _check_layout(ulysses, ring, ref)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    from tests.harness import run_on_ranks

    out_dir = str(tmp_path_factory.mktemp("gpt_reference"))
    run_on_ranks(_reference, 1, out_dir, timeout=120)
    return out_dir


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_gpt_forward_matches_single_rank(dist_run, reference_dir, world_size):
    dist_run(_usp_layouts, world_size, LAYOUTS[world_size], reference_dir, timeout=300)
