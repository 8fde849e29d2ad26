"""Perplexity by position: how well a model predicts token t of a long document as t grows.

Each document of at least ``length + 1`` tokens gives one window, its first ``length + 1``
tokens (positions keep their meaning: position t is t tokens into the document). The loss at
position t predicts token t + 1 from tokens 0..t. Positions are grouped into buckets
``[0, w), [w, 2w), ...`` (the last one may be shorter) and each bucket reports the mean
negative log-likelihood over its tokens of every window and its perplexity ``exp(nll)``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable, Iterable, List, Sequence, Tuple

import torch


def position_buckets(length: int, width: int) -> List[Tuple[int, int]]:
    """``[(0, w), (w, 2w), ..., (k*w, length)]``: half-open position ranges covering
    ``0..length-1``."""
    return [(start, min(start + width, length)) for start in range(0, length, width)]


def token_nll(logits: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """Float64 ``[len(ids) - 1]`` negative log-likelihoods of ``ids[1:]`` from ``logits
    [len(ids) - 1 or more, V]`` (row t predicts ``ids[t + 1]``)."""
    targets = torch.tensor(ids[1:], dtype=torch.long)
    logp = logits[:len(targets)].double().log_softmax(-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class Bucket:
    start: int
    end: int
    tokens: int
    nll: float

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


def bucket_means(nll: torch.Tensor, buckets: Sequence[Tuple[int, int]]) -> List[Bucket]:
    """Mean of ``nll [windows, length]`` over each bucket's positions of every window."""
    return [Bucket(a, b, nll[:, a:b].numel(), nll[:, a:b].mean().item()) for a, b in buckets]


def long_windows(token_lists: Iterable[List[int]], length: int, limit: int) -> List[List[int]]:
    """The first ``length + 1`` tokens of each document that has that many, at most
    ``limit`` of them, in the order given."""
    out = []
    for ids in token_lists:
        if len(ids) > length:
            out.append(list(ids[:length + 1]))
            if len(out) == limit:
                break
    return out


def read_documents(path: str) -> List[str]:
    """A ``.jsonl`` file's ``text`` fields, one document per line; any other file is one
    document."""
    with open(path, encoding="utf-8") as f:
        if not path.endswith(".jsonl"):
            return [f.read()]
        return [json.loads(line)["text"] for line in f if line.strip()]


def evaluate_perplexity(logits_fn: Callable[[List[int]], torch.Tensor],
                        windows: Sequence[List[int]], width: int) -> List[Bucket]:
    """Per-bucket loss of ``logits_fn(ids) -> [len(ids), V]`` over ``windows`` (each of
    ``length + 1`` tokens)."""
    nll = torch.stack([token_nll(logits_fn(ids[:-1]), ids) for ids in windows])
    return bucket_means(nll, position_buckets(nll.shape[1], width))
