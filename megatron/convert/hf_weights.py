"""Hugging Face state dict <-> megatron-core ``GPTModel`` state dict (TP = 1), and TP shards.

Name map, per layer ``i`` (HF ``model.layers.i.`` -> megatron ``decoder.layers.i.``)::

    input_layernorm.weight               -> input_layernorm.weight
    self_attn.{q,k,v}_proj.{weight,bias} -> self_attention.linear_qkv.{weight,bias}  (fused)
    self_attn.o_proj.weight              -> self_attention.linear_proj.weight
    self_attn.{q,k}_norm.weight          -> self_attention.{q,k}_layernorm.weight      (Qwen3)
    post_attention_layernorm.weight      -> pre_mlp_layernorm.weight
    mlp.{gate,up}_proj.weight            -> mlp.linear_fc1.weight                      (fused)
    mlp.down_proj.weight                 -> mlp.linear_fc2.weight

plus ``model.embed_tokens`` -> ``embedding.word_embeddings``, ``model.norm`` ->
``decoder.final_layernorm``, ``lm_head`` -> ``output_layer`` (untied models only).

Fused QKV rows (megatron-core's ``SelfAttention`` splits them this way): one block per KV
group ``g`` holding its ``heads/groups`` query heads, then its key head, then its value head::

    q [heads*d, h], k [groups*d, h], v [groups*d, h]
      -> [groups, heads/groups + 2, d, h] -> linear_qkv [(heads + 2*groups)*d, h]

Fused FC1 rows: ``[gate; up]`` ([2*ffn, h]); megatron-core shards it with stride 2, so TP
rank ``r`` holds ``[gate_r; up_r]`` (:func:`tp_shard` follows ``partition_stride``).

Vocabulary: the embedding and output rows are padded with zeros up to the padded vocabulary
(``--make-vocab-size-divisible-by`` x TP) on import and cut back on export. A padded row
of the output layer gives logit 0, which enters the softmax of the loss; the converter's
default divisor avoids padding altogether (:func:`megatron.convert.hf_config.vocab_divisor`).
"""

from __future__ import annotations

from typing import Dict, Iterator, Tuple

import torch

from megatron.convert.hf_config import PretrainedConfig

StateDict = Dict[str, torch.Tensor]
LAYER_NAMES = (  # (HF name, megatron name) inside one layer, tensors copied as they are
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
)
QK_NORM_NAMES = (("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                 ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             model: PretrainedConfig) -> torch.Tensor:
    """Megatron's fused QKV rows (module docstring) from HF's three projections (weights
    ``[rows, h]`` or biases ``[rows]``)."""
    groups, d = model.num_query_groups, model.kv_channels
    per_group = model.num_attention_heads // groups
    tail = q.shape[1:]
    q = q.reshape(groups, per_group * d, *tail)
    k, v = k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, model: PretrainedConfig
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's (q, k, v) from megatron's fused QKV rows; the inverse of :func:`fuse_qkv`."""
    groups, d = model.num_query_groups, model.kv_channels
    per_group = model.num_attention_heads // groups
    tail = qkv.shape[1:]
    blocks = qkv.reshape(groups, (per_group + 2) * d, *tail)
    q, k, v = torch.split(blocks, [per_group * d, d, d], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


def pad_vocab(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight [V, h]`` with zero rows appended up to ``rows``."""
    if rows < weight.shape[0]:
        raise ValueError(f"vocab_size={weight.shape[0]} is larger than the padded vocabulary "
                         f"{rows}; check --make-vocab-size-divisible-by")
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _mc_layer(i: int) -> str:
    return f"decoder.layers.{i}."


def _layer_pairs(model: PretrainedConfig) -> Iterator[Tuple[str, str]]:
    """(HF name, megatron name) of every tensor copied unchanged, all layers."""
    names = LAYER_NAMES + (QK_NORM_NAMES if model.qk_layernorm else ())
    for i in range(model.num_layers):
        for hf, mc in names:
            yield _hf_layer(i) + hf, _mc_layer(i) + mc


def _take(state: StateDict, name: str) -> torch.Tensor:
    if name not in state:
        raise ValueError(f"the checkpoint has no tensor {name!r} (expected by the config)")
    return state[name]


def hf_to_megatron(hf: StateDict, model: PretrainedConfig, padded_vocab: int) -> StateDict:
    """The TP = 1 ``GPTModel`` state dict of an HF state dict (module docstring)."""
    out = {mc: _take(hf, name) for name, mc in _layer_pairs(model)}
    for i in range(model.num_layers):
        attn, mlp = _hf_layer(i) + "self_attn.", _hf_layer(i) + "mlp."
        out[_mc_layer(i) + "self_attention.linear_qkv.weight"] = fuse_qkv(
            *(_take(hf, f"{attn}{p}_proj.weight") for p in "qkv"), model)
        if model.qkv_bias:
            out[_mc_layer(i) + "self_attention.linear_qkv.bias"] = fuse_qkv(
                *(_take(hf, f"{attn}{p}_proj.bias") for p in "qkv"), model)
        out[_mc_layer(i) + "mlp.linear_fc1.weight"] = torch.cat(
            [_take(hf, mlp + "gate_proj.weight"), _take(hf, mlp + "up_proj.weight")])
    embed = _take(hf, "model.embed_tokens.weight")
    out["embedding.word_embeddings.weight"] = pad_vocab(embed, padded_vocab)
    out["decoder.final_layernorm.weight"] = _take(hf, "model.norm.weight")
    if not model.tied_embeddings:
        out["output_layer.weight"] = pad_vocab(_take(hf, "lm_head.weight"), padded_vocab)
    return out


def megatron_to_hf(mc: StateDict, model: PretrainedConfig) -> StateDict:
    """The HF state dict of a TP = 1 ``GPTModel`` state dict; the vocabulary is cut to
    ``model.vocab_size``. Tied models get no ``lm_head.weight`` (transformers ties it)."""
    out = {name: _take(mc, m) for name, m in _layer_pairs(model)}
    for i in range(model.num_layers):
        attn, mlp = _hf_layer(i) + "self_attn.", _hf_layer(i) + "mlp."
        qkv = _take(mc, _mc_layer(i) + "self_attention.linear_qkv.weight")
        out.update(zip((f"{attn}{p}_proj.weight" for p in "qkv"), split_qkv(qkv, model)))
        if model.qkv_bias:
            bias = _take(mc, _mc_layer(i) + "self_attention.linear_qkv.bias")
            out.update(zip((f"{attn}{p}_proj.bias" for p in "qkv"), split_qkv(bias, model)))
        gate, up = _take(mc, _mc_layer(i) + "mlp.linear_fc1.weight").chunk(2)
        out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = gate, up
    vocab = model.vocab_size
    out["model.embed_tokens.weight"] = _take(mc, "embedding.word_embeddings.weight")[:vocab]
    out["model.norm.weight"] = _take(mc, "decoder.final_layernorm.weight")
    if not model.tied_embeddings:
        out["lm_head.weight"] = _take(mc, "output_layer.weight")[:vocab]
    return {k: v.contiguous() for k, v in out.items()}


def tp_shard(full: torch.Tensor, param: torch.nn.Parameter, tp_rank: int,
             tp: int) -> torch.Tensor:
    """This TP rank's part of a full (TP = 1) tensor for ``param``, split the way
    megatron-core splits it: along ``partition_dim`` in ``partition_stride`` pieces per rank,
    strided over the ranks (FC1: ``[gate_r; up_r]``). Unsplit parameters are returned whole."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, param.partition_stride
    pieces = torch.split(full, full.shape[dim] // (stride * tp), dim=dim)
    return torch.cat(pieces[tp_rank::tp], dim=dim)


def shard_state_dict(full: StateDict, module: torch.nn.Module, tp_rank: int,
                     tp: int) -> StateDict:
    """``full`` (a TP = 1 state dict) cut to ``module``'s TP shards (its parameters tell
    how); names ``module`` does not hold as parameters pass through whole."""
    params = dict(module.named_parameters())
    return {k: tp_shard(v, params[k], tp_rank, tp) if k in params else v
            for k, v in full.items()}
