"""Small helpers the test tiers share: a free port, a relative error, the tiny model.

* ``free_port()``: a loopback TCP port free now (a rendezvous for torchrun or gloo).
* ``rel_err(got, want)``: ``||got - want|| / ||want||`` in float64.
* ``tiny_gpt_flags(**overrides)``: ``pretrain_gpt.py`` flags of the tiny Llama-style model
  the CPU runs train (2 layers, hidden 64, 4 heads in 2 query groups, 64 tokens).
* ``document_offsets(segment_ids)``: the position of each token inside its document.
* ``ring_owners``, ``ring_tokens_needed``: the ring rank holding each position under a chunk
  assignment, and the keys each ring rank's queries see on every other (the document ring's
  traffic counted from the segment ids alone).
* ``gpt_config``, ``attention_config``, ``swiglu_mlp_config``: megatron-core
  ``TransformerConfig`` objects for the same tiny model, for one core-attention module and
  for one SwiGLU MLP, initialised on the CPU in float64 unless overridden.

Nothing here imports torch or megatron at module level, so a test that only needs the
flags stays cheap to collect.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from typing import Any, Dict, List, Optional

import numpy as np


def load_tool(name: str):
    """``tools/NAME.py`` as a module (the tools are scripts, not a package)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rel_err(got, want, floor: Optional[float] = None) -> float:
    """``||got - want|| / ||want||`` (Frobenius norms) computed in float64.

    ``floor`` bounds the denominator from below, for references that may be all zeros.
    """
    got, want = got.double(), want.double()
    den = want.norm()
    if floor is not None:
        den = den.clamp_min(floor)
    return ((got - want).norm() / den).item()


# ------------------------------------------------------------------ pretrain_gpt.py flags
# What validate_args requires of any model (each test adds its run flags).
REQUIRED_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "seq_length": 64}
# The Llama-style architecture every CPU training test uses on top.
LLAMA = {"group_query_attention": True, "num_query_groups": 2, "max_position_embeddings": 64,
         "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
         "disable_bias_linear": True}


def flag_list(spec: Dict[str, Any]) -> List[str]:
    """``{"hidden_size": 64, "swiglu": True, "bf16": None}`` -> ``["--hidden-size", "64",
    "--swiglu"]``: True is a switch, None or False leaves the flag out, a list or tuple
    gives several values, anything else one value."""
    argv: List[str] = []
    for key, value in spec.items():
        if value is None or value is False:
            continue
        argv.append("--" + key.replace("_", "-"))
        if isinstance(value, (list, tuple)):
            argv.extend(str(v) for v in value)
        elif value is not True:
            argv.append(str(value))
    return argv


def tiny_gpt_flags(llama: bool = True, **overrides: Any) -> List[str]:
    """The tiny model's flags: the required model flags, the Llama-style ones unless
    ``llama=False``, then ``overrides`` (underscored flag names, ``flag_list`` values;
    an override of a flag already present replaces its value in place)."""
    spec = dict(REQUIRED_MODEL)
    if llama:
        spec.update(LLAMA)
    spec.update(overrides)
    return flag_list(spec)


# ------------------------------------------------------------------ TransformerConfig
def _cpu_float64(**overrides: Any):
    import torch  # torch-free module
    from megatron.core.transformer.transformer_config import (
        TransformerConfig,  # megatron-core on first use
    )

    kwargs = dict(use_cpu_initialization=True, params_dtype=torch.float64)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


NO_DROPOUT = {"attention_dropout": 0.0, "hidden_dropout": 0.0}


def gpt_config(tp: int = 1, ulysses: int = 1, ring: int = 1, sequence_parallel: bool = False,
               **overrides: Any):
    """The tiny Llama-style GPT (2 layers, hidden 64, 8 heads in 2 groups of width 8, SwiGLU
    96, RMSNorm, no biases, no fused kernels) on a TP x Ulysses x Ring layout."""
    import torch.nn.functional as F  # torch-free module

    cp = ulysses * ring
    kwargs = dict(
        num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, kv_channels=8,
        ffn_hidden_size=96, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False, **NO_DROPOUT,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        context_parallel_size=cp,
        hierarchical_context_parallel_sizes=[ulysses, ring] if cp > 1 else None,
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
    kwargs.update(overrides)
    return _cpu_float64(**kwargs)


def attention_config(num_heads: int, head_dim: int, num_kv_heads: Optional[int] = None,
                     dims=None, **overrides: Any):
    """One core-attention layer's config: ``num_heads`` heads of ``head_dim`` (K/V in
    ``num_kv_heads`` groups), the CP sizes of ``dims`` (a ``ParallelDims``) when given."""
    kwargs: Dict[str, Any] = dict(num_layers=1, hidden_size=num_heads * head_dim,
                                  num_attention_heads=num_heads, num_query_groups=num_kv_heads,
                                  kv_channels=head_dim, **NO_DROPOUT)
    if dims is not None:
        kwargs.update(context_parallel_size=dims.cp,
                      hierarchical_context_parallel_sizes=[dims.ulysses, dims.ring])
    kwargs.update(overrides)
    return _cpu_float64(**kwargs)


def swiglu_mlp_config(hidden_size: int, ffn_hidden_size: int, **overrides: Any):
    """One SwiGLU MLP's config (4 heads, no biases, unfused bias-activation and weight
    gradients) in megatron-core's local layer spec."""
    import torch.nn.functional as F  # torch-free module

    kwargs = dict(num_layers=1, hidden_size=hidden_size, num_attention_heads=4,
                  ffn_hidden_size=ffn_hidden_size, gated_linear_unit=True,
                  activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
                  gradient_accumulation_fusion=False)
    kwargs.update(overrides)
    return _cpu_float64(**kwargs)


# ------------------------------------------------------------------ references
def document_offsets(segment_ids):
    """Position of every token inside its document (what ``--reset-position-ids`` gives).

    ``segment_ids`` [..., s] non-decreasing along the last dim; returns int64 of the same shape.
    """
    import torch  # torch-free module

    s = segment_ids.shape[-1]
    idx = torch.arange(s, device=segment_ids.device).expand(segment_ids.shape)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx))
    first = torch.cummax(first, dim=-1).values
    return idx - first


def ring_owners(seq_len, ring, assignment):
    """Ring rank holding each position (int64 ``[seq_len]``): zigzag (``assignment`` None)
    gives rank j chunks j and 2R-1-j of 2R; an assignment lists each ring rank's chunks."""
    if assignment is None:
        chunk_owner = np.concatenate([np.arange(ring), np.arange(ring)[::-1]])
    else:
        chunk_owner = np.empty(assignment.num_chunks, dtype=np.int64)
        for j, chunks in enumerate(assignment.ring_chunks):
            chunk_owner[list(chunks)] = j
    return np.repeat(chunk_owner, seq_len // chunk_owner.size)


def ring_tokens_needed(seg, owner, ring):
    """``n[r][j]``: keys of ring rank j some query of ring rank r sees (r != j; a key at
    position p is seen iff r holds a position q >= p of p's document in some sample of
    ``seg`` [b, s])."""
    pos = np.arange(seg.shape[1])
    n = np.zeros((ring, ring), dtype=np.int64)
    for r in range(ring):
        seen = np.zeros(seg.shape[1], dtype=bool)
        for row in seg:
            last = np.full(row.max() + 1, -1)             # r's last position in each document
            np.maximum.at(last, row[owner == r], pos[owner == r])
            seen |= pos <= last[row]
        for j in range(ring):
            if j != r:
                n[r, j] = int((seen & (owner == j)).sum())
    return n
