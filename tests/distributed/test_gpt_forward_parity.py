"""A whole GPT forward on TP x U x R ranks equals the single-rank forward on the whole sequence.

Reference: one rank, megatron-core's own local GPT layer spec (``DotProductAttention``, no
Megatron-USP code in the attention path), Llama-style model (RMSNorm, SwiGLU, RoPE, GQA, no
bias) in float64 with CPU initialisation. It saves its weights, the batch, the logits, the
per-token losses and the weight gradients of ``(logits * probe).sum()`` for a fixed random
``probe [b, s, V]``: a float64 functional of the logits (megatron-core's vocab-parallel cross
entropy computes in float32, so its gradient would carry float32 rounding).

USP: TP*U*R ranks build the same model with :func:`get_usp_gpt_block_spec` (USP attention,
Megatron-USP's norms, final norm included) and the groups of :func:`initialize_usp_parallel`
(``pg_collection``), load the reference weights (TP-sharded the way megatron-core's CPU
initialisation splits them: ``partition_dim`` / ``partition_stride`` of each parameter), feed
each CP rank its shard of tokens / labels / position ids (``token_order.shard_for_cp_rank``),
gather the vocab-parallel logits over TP and logits and losses over the CP group, rebuild the
full sequence (``token_order.unshard_from_cp_ranks``) and compare. Each rank back-propagates its
(CP, TP) block of the probe functional. Weight gradients are summed over
the CP group (what DDP's gradient all-reduce over DP x CP does) and, for parameters marked
``sequence_parallel`` (the norms, with ``--sequence-parallel``), over the TP group (what
``finalize_model_grads`` does), then compared with the reference's TP shard.

Tolerance: float64, 1e-9 absolute and relative (a 2-layer model; ~1e-14 observed), except the
per-token losses with TP > 1: megatron-core's cross entropy casts the logits to float32 and
the TP split changes the order of its sum over the vocabulary, so they agree to float32
rounding (1e-6 relative; ~2e-7 observed).
Layouts (TP, U, R, sequence parallel): 1x1x2, 1x2x1 (world 2), 1x2x2 and 2x2x1 with sequence
parallelism (world 4), 1x4x2 and 1x2x4 (world 8). With 8 query heads and 2 KV heads, U = 4
and TP2 x U2 (1 KV head per TP rank) exercise the KV-head replication path.

Elementwise recompute (the layouts marked ``lean``, on top of ``fused``): the norms before
QKV and FC1 run inside those linear layers and the SwiGLU inside FC2
(:mod:`megatron.layers.fused_linears`), each recomputed in the backward; the reference weights
load under the names the local spec's checkpoint map gives the norms
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``). The layouts marked
``usp`` do the same with ``fused_kernels="usp"``: :mod:`megatron.layers.lean_kernels` (their
plain-math path on the CPU) drops the norm and SwiGLU outputs and refills them in place from
the linear layers' gradient hooks, and RoPE is the fused QKV split of
:mod:`megatron.layers.qkv_rope`.

Fused-kernel plumbing (the layouts marked ``fused``): the block spec is built with
``fused_kernels="compile"`` and ``config.use_te_activation_func``, so RoPE runs in
:class:`~megatron.layers.self_attention.USPSelfAttention` (not megatron-core's attention), the
SwiGLU in the MLP's ``activation_func`` submodule and the norms through
:func:`megatron.layers.fused_kernels.rms_norm`; ``torch.compile`` is replaced by the identity on
these CPU ranks, so the plain functions run eagerly and must reproduce megatron-core's own
path to the same float64 tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron.training.cpu_shims import apply_cpu_shims
from megatron.usp import token_order
from megatron.usp.parallel_dims import ParallelDims
from megatron.usp.parallel_state import destroy_usp_parallel, initialize_usp_parallel
from tests.harness import run_on_ranks
from tests.helpers import gpt_config

TOL = dict(atol=1e-9, rtol=1e-9)
FLOAT32_LOSS_TOL = dict(atol=1e-9, rtol=1e-6)
SEQ, BATCH, VOCAB, SEED = 64, 2, 96, 1234
# world size -> [(TP, U, R, sequence parallel, fused-kernel plumbing)]
LAYOUTS = {2: [(1, 1, 2, False, "plain"), (1, 2, 1, False, "plain"),
               (1, 2, 1, False, "fused"), (1, 1, 2, False, "lean"), (1, 2, 1, False, "usp")],
           4: [(1, 2, 2, False, "plain"), (2, 2, 1, True, "plain"), (2, 2, 1, True, "fused"),
               (2, 2, 1, True, "lean"), (2, 2, 1, True, "usp")],
           8: [(1, 4, 2, False, "plain"), (1, 2, 4, False, "plain")]}
# mode -> (--fused-kernels choice, norms and SwiGLU inside the linear layers)
MODES = {"plain": ("torch", False), "fused": ("compile", False), "lean": ("compile", True),
         "usp": ("usp", True)}
# The norms' parameter names inside the lean linear layers (the local spec's checkpoint map).
LEAN_NAMES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
              "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _lean_name(name: str) -> str:
    for old, new in LEAN_NAMES.items():
        name = name.replace(old, new)
    return name


def _model(spec, config, pg_collection):
    from megatron.core.models.gpt.gpt_model import GPTModel  # megatron-core on first use

    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope", share_embeddings_and_output_weights=False,
        pg_collection=pg_collection,
    ).double()


def _forward(model, tokens, position_ids, labels, probe):
    """(logits [b, s, V], per-token loss [b, s]) for one batch; (logits * probe).sum()
    back-propagated (shapes: this rank's sequence shard and vocabulary shard)."""
    logits = model(tokens, position_ids, None)
    (logits * probe).sum().backward()
    loss = model(tokens, position_ids, None, labels=labels)
    return logits.detach(), loss.detach()


def _reference(rank, world_size, out_dir):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,  # megatron-core on first use
    )
    from megatron.core.tensor_parallel import (
        model_parallel_cuda_manual_seed,  # megatron-core on first use
    )

    apply_cpu_shims()
    groups = initialize_usp_parallel(ParallelDims(dist.get_world_size()))
    model_parallel_cuda_manual_seed(SEED)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = _model(spec, gpt_config(), groups.pg_collection)
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ).contiguous()
    probe = torch.randn(BATCH, SEQ, VOCAB, generator=gen, dtype=torch.float64)
    logits, loss = _forward(model, tokens, position_ids, labels, probe)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.save(dict(state=model.state_dict(), tokens=tokens, labels=labels,
                    position_ids=position_ids, probe=probe, logits=logits, loss=loss,
                    grads=grads),
               os.path.join(out_dir, "reference.pt"))


def _gather(x: torch.Tensor, group, size: int) -> list:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _gather_seq(x: torch.Tensor, groups) -> torch.Tensor:
    """All-gather [b, s_local, ...] over the CP group and rebuild the full sequence."""
    return token_order.unshard_from_cp_ranks(_gather(x, groups.cp, groups.dims.cp), seq_dim=1)


def _gather_vocab(logits: torch.Tensor, groups) -> torch.Tensor:
    """All-gather vocab-parallel logits [b, s_local, V/TP] over TP: [b, s_local, V]."""
    return torch.cat(_gather(logits, groups.tp, groups.dims.tp), dim=-1)


def _tp_shard(full: torch.Tensor, param: torch.nn.Parameter, tp_rank: int, tp: int):
    """This TP rank's part of a full (TP = 1) tensor, split as megatron-core's CPU
    initialisation splits it: ``partition_stride`` slices per rank, strided over ranks."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim, stride = param.partition_dim, param.partition_stride
    pieces = torch.split(full, param.shape[dim] // stride, dim=dim)
    return torch.cat(pieces[tp_rank::tp], dim=dim)


def _check_norms(model, sequence_parallel: bool, lean: bool = False) -> None:
    from megatron.layers.norms import RMSNorm  # megatron-core on first use

    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert model.decoder.final_layernorm in norms
    assert len(norms) == (1 if lean else 2 * len(model.decoder.layers) + 1)
    for norm in norms:
        assert norm.weight.sequence_parallel is sequence_parallel
    marked = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    assert all("layernorm" in n or "layer_norm" in n for n in marked), marked
    if sequence_parallel:
        assert len(marked) == 2 * len(model.decoder.layers) + 1, marked


def _check_fused_modules(model, mode: str) -> None:
    from megatron.core.transformer.identity_op import IdentityOp  # megatron-core on first use

    from megatron.layers.fused_kernels import SwiGLU, op_impl  # megatron-core on first use
    from megatron.layers.fused_linears import (  # megatron-core on first use
        NormColumnParallelLinear,
        SwiGLURowParallelLinear,
    )
    from megatron.layers.self_attention import USPSelfAttention  # megatron-core on first use

    for layer in model.decoder.layers:
        assert isinstance(layer.self_attention, USPSelfAttention)
        choice, lean = MODES[mode]
        assert layer.self_attention.rope_impl == op_impl(choice, "rope")
        if not lean:
            assert isinstance(layer.mlp.activation_func, SwiGLU)
            assert layer.input_layernorm.impl == op_impl(choice, "rms_norm")
        else:
            assert layer.self_attention.linear_qkv.norm_impl == op_impl(choice, "rms_norm")
            assert layer.mlp.linear_fc2.swiglu_impl == op_impl(choice, "swiglu")
            assert isinstance(layer.input_layernorm, IdentityOp)
            assert isinstance(layer.self_attention.linear_qkv, NormColumnParallelLinear)
            assert isinstance(layer.mlp.linear_fc1, NormColumnParallelLinear)
            assert isinstance(layer.mlp.linear_fc2, SwiGLURowParallelLinear)


def _check_layout(tp: int, ulysses: int, ring: int, sp: bool, mode: str, ref: dict) -> None:
    from megatron.core.tensor_parallel import (
        model_parallel_cuda_manual_seed,  # megatron-core on first use
    )

    from megatron.layers import fused_kernels  # megatron-core on first use
    from megatron.training.model.layer_specs import (  # megatron-core on first use
        LayerSpecOptions,
        get_usp_gpt_block_spec,
    )

    groups = initialize_usp_parallel(ParallelDims(dist.get_world_size(), tp=tp,
                                                  ulysses=ulysses, ring=ring))
    model_parallel_cuda_manual_seed(SEED)
    cp, cp_rank, tp_rank = ulysses * ring, groups.cp_rank, dist.get_rank(groups.tp)
    choice, lean = MODES[mode]
    fused = mode != "plain"
    config = gpt_config(tp, ulysses, ring, sp, use_te_activation_func=fused)
    if fused:
        fused_kernels._compiled = lambda fn: fn   # the plain functions, eagerly (CPU ranks)
    spec = get_usp_gpt_block_spec(config, pp_rank=0, options=LayerSpecOptions(
        fused_kernels=choice, lean_norms=lean, lean_swiglu=lean))
    model = _model(spec, config, groups.pg_collection)
    _check_norms(model, sp, lean)
    if fused:
        _check_fused_modules(model, mode)
    params = dict(model.named_parameters())
    rename = _lean_name if lean else (lambda n: n)
    state = {rename(k): v for k, v in ref["state"].items()}
    model.load_state_dict({k: _tp_shard(v, params[k], tp_rank, tp) if k in params else v
                           for k, v in state.items()})
    ref_grads = {rename(k): v for k, v in ref["grads"].items()}
    where = f"TP={tp} U={ulysses} R={ring} SP={sp} mode={mode}"

    def shard(t):
        return token_order.shard_for_cp_rank(t, 1, cp_rank, cp)

    def close(got, want, what, tol=TOL):
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{where} {what}: {m}")

    probe = shard(ref["probe"]).chunk(tp, dim=-1)[tp_rank]
    logits, loss = _forward(model, shard(ref["tokens"]), shard(ref["position_ids"]),
                            shard(ref["labels"]), probe)
    close(_gather_seq(_gather_vocab(logits, groups), groups), ref["logits"], "logits")
    close(_gather_seq(loss, groups), ref["loss"], "loss", TOL if tp == 1 else FLOAT32_LOSS_TOL)
    for name, param in params.items():
        grad = param.grad.detach().clone()
        dist.all_reduce(grad, group=groups.cp)
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad, group=groups.tp)
        close(grad, _tp_shard(ref_grads[name], param, tp_rank, tp), f"grad {name}")
    destroy_usp_parallel()


def _usp_layouts(rank, world_size, layouts, out_dir):
    apply_cpu_shims()
    ref = torch.load(os.path.join(out_dir, "reference.pt"))
    for tp, ulysses, ring, sp, mode in layouts:
        _check_layout(tp, ulysses, ring, sp, mode, ref)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("gpt_reference"))
    run_on_ranks(_reference, 1, out_dir, timeout=120)
    return out_dir


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_gpt_forward_matches_single_rank(dist_run, reference_dir, world_size):
    dist_run(_usp_layouts, world_size, LAYOUTS[world_size], reference_dir, timeout=300)


def _checkpoint_keys(rank, world_size):
    from megatron.core.tensor_parallel import (
        model_parallel_cuda_manual_seed,  # megatron-core on first use
    )

    from megatron.layers import fused_kernels  # megatron-core on first use
    from megatron.training.model.layer_specs import (  # megatron-core on first use
        LayerSpecOptions,
        get_usp_gpt_block_spec,
    )

    apply_cpu_shims()
    groups = initialize_usp_parallel(ParallelDims(world_size))
    model_parallel_cuda_manual_seed(SEED)
    fused_kernels._compiled = lambda fn: fn
    keys = {}
    for mode, (choice, lean) in MODES.items():
        config = gpt_config(use_te_activation_func=mode != "plain")
        spec = get_usp_gpt_block_spec(config, pp_rank=0, options=LayerSpecOptions(
            fused_kernels=choice, lean_norms=lean, lean_swiglu=lean))
        sd = _model(spec, config, groups.pg_collection).sharded_state_dict()
        # The checkpoint's own key of each tensor (ShardedTensor.key), not the module path.
        keys[mode] = {v.key: tuple(v.global_shape) for v in sd.values()
                      if hasattr(v, "global_shape")}
    for mode in ("fused", "lean", "usp"):
        assert keys["plain"] == keys[mode], (mode, set(keys["plain"]) ^ set(keys[mode]))
    assert any("linear_qkv.layer_norm_weight" in k for k in keys["lean"])
    destroy_usp_parallel()


def test_lean_layers_checkpoint_under_the_same_names(dist_run):
    """Distributed-checkpoint keys and shapes do not depend on --fused-kernels or
    --recompute-modules layernorm / swiglu, so a checkpoint saved with them loads without
    them and back (and every module of those layers can be checkpointed)."""
    dist_run(_checkpoint_keys, 1, timeout=120)
