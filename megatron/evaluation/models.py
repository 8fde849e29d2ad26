"""A model as one function ``token ids -> logits [len(ids), V]`` (float32, on the CPU, the
unpadded vocabulary), the same on every rank.

* :func:`checkpoint_logits`: this project's model (``megatron.convert.checkpoint_io.
  loaded_checkpoint``) on this rank's part of the parallel layout. The sequence is padded at
  the end to a multiple of ``2 * U * R`` (causal attention: the padding changes no earlier
  logit), each CP rank is fed its load-balanced shard, and the vocab-parallel logits are
  gathered over TP and CP.
* :func:`transformers_logits`: a transformers causal LM, for comparison.
"""

from __future__ import annotations

import os
from typing import Callable, List

import torch
import torch.distributed as dist

LogitsFn = Callable[[List[int]], torch.Tensor]


def init_distributed() -> None:
    """Join torchrun's gloo group when started by torchrun with more than one process
    (``loaded_checkpoint`` starts a one-rank group otherwise)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _gather(x: torch.Tensor, group) -> List[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def checkpoint_logits(model: torch.nn.Module, groups, vocab: int) -> LogitsFn:
    """Logits of ``model`` (a ``GPTModel`` of :class:`~megatron.convert.checkpoint_io.
    SingleRankModel`) whose ranks all call with the same ids; ``groups``: its USP groups.
    Talks to the TP and CP groups: one all-gather of ``[s/CP, V/TP]`` float32 logits each."""
    from megatron.usp.token_order import (  # only for a checkpoint on a U x R layout
        shard_for_cp_rank,
        unshard_from_cp_ranks,
    )

    cp, cp_rank = groups.dims.cp, groups.cp_rank
    model.eval()

    def logits(ids: List[int]) -> torch.Tensor:
        padded = -(-len(ids) // (2 * cp)) * 2 * cp
        tokens = torch.tensor([ids + [0] * (padded - len(ids))])         # [1, s]
        positions = torch.arange(padded).unsqueeze(0)

        def shard(x):                                                    # [1, s/CP]
            return shard_for_cp_rank(x, 1, cp_rank, cp)

        with torch.no_grad():
            local = model(shard(tokens), shard(positions), None)          # [1, s/CP, V/TP]
        local = torch.cat(_gather(local.float(), groups.tp), dim=-1)     # [1, s/CP, V]
        full = unshard_from_cp_ranks(_gather(local, groups.cp), 1)       # [1, s, V]
        return full[0, :len(ids), :vocab]

    return logits


def transformers_logits(model: torch.nn.Module, device: torch.device) -> LogitsFn:
    """Logits of a transformers causal LM run on ``device``."""
    model.eval()

    def logits(ids: List[int]) -> torch.Tensor:
        with torch.no_grad():
            out = model(torch.tensor([ids], device=device)).logits[0]
        return out.float().cpu()

    return logits


def load_transformers(path: str, gguf_file, device: torch.device) -> torch.nn.Module:
    """A causal LM from a local directory (``gguf_file``: a GGUF file in it, dequantised to
    float32 by transformers)."""
    from transformers import AutoModelForCausalLM  # optional: transformers

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                **kwargs).to(device)
