"""Document lengths of a run's training data, for the layout planner's packed documents
(``--ulysses-degree auto`` with ``--reset-attention-mask``).

``--mock-data``: megatron-core's ``MockGPTLowLevelDataset`` (:func:`mock_mix`, lengths uniform
in ``1..max_sequence_length-1``), each document cut where the ``--reset-attention-mask`` mask
cuts it (:func:`cut_at_inner_eods`).

``--data-path``: only the ``.idx`` files are read (:func:`~megatron.training.data.indexed_files.inspect_indexed_dataset`:
the sequence lengths, no token). From each ``--data-path`` prefix's train split
(:func:`~megatron.training.data.config.split_ranges`) documents are drawn at random, with
``--seed``, until they fill the prefix's share of ``tokens``: its blend weight, or without
weights its share of the train splits' tokens (megatron-core blends unweighted prefixes by
size). megatron-core's ``GPTDataset`` packs a shuffled epoch of the same documents; a random
draw has the same distribution of lengths without building its index. The draw depends on
the files, ``--split`` and ``--seed`` alone, so every rank draws the same lengths.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from megatron.training.data.config import parse_data_path, split_ranges
from megatron.training.data.errors import DataConfigError
from megatron.training.data.indexed_files import inspect_indexed_dataset


def mock_mix() -> Tuple[str, int]:
    """(the ``--docs`` mix, the longest document + 1) of megatron-core's mock documents:
    ``MockGPTLowLevelDataset`` draws each length uniformly in ``1..max_sequence_length-1``."""
    from megatron.core.datasets.gpt_dataset import (  # megatron-core (torch) on first use
        MockGPTLowLevelDataset,
    )

    n = int(MockGPTLowLevelDataset.max_sequence_length)
    return (f"uniform:{n // 1024}k" if n % 1024 == 0 else f"uniform:{n}"), n


def inner_eod_cuts(length: int, vocab_size: int, eod: int) -> List[int]:
    """Where a mock document of ``length`` tokens holds the EOD id before its end: token ``j``
    of ``MockGPTLowLevelDataset`` is ``(j + 1) % vocab_size`` and the last one the EOD, so
    ids ``k = j + 1`` with ``k % vocab_size == eod`` end a document at ``k`` (exclusive)."""
    first = eod % vocab_size or vocab_size  # the smallest k >= 1 with k % vocab == eod
    return list(range(first, length, vocab_size)) if eod < vocab_size else []


def cut_at_inner_eods(lengths: Sequence[int], vocab_size: int, eod: int) -> List[int]:
    """The mock documents of ``lengths`` as ``--reset-attention-mask`` sees them: each cut
    after every EOD id inside it (:func:`inner_eod_cuts`); unchanged when the tokenizer's
    EOD is outside the ids a mock document holds (``NullTokenizer``'s, with a vocabulary
    larger than the longest document)."""
    out: List[int] = []
    for n in lengths:
        ends = inner_eod_cuts(int(n), vocab_size, eod) + [int(n)]
        out += [b - a for a, b in zip([0] + ends[:-1], ends)]
    return out


def train_split_lengths(prefix: str, split: str) -> np.ndarray:
    """Lengths of the documents of ``prefix``'s train split (a view of its ``.idx``)."""
    lengths = inspect_indexed_dataset(prefix, "--data-path").sequence_lengths
    begin, end = split_ranges(split, len(lengths))[0]
    return lengths[begin:end]


def draw_lengths(lengths: np.ndarray, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """Documents of ``lengths`` drawn at random (with replacement) until they hold at least
    ``tokens`` tokens, in the order drawn. ``lengths`` must hold a token."""
    mean = float(lengths.sum(dtype=np.int64)) / len(lengths)
    drawn: List[np.ndarray] = []
    held = 0
    while held < tokens:
        count = min(int((tokens - held) / mean) + 64, 1 << 20)
        batch = lengths[rng.integers(0, len(lengths), count)]
        total = np.cumsum(batch, dtype=np.int64) + held
        cut = int(np.searchsorted(total, tokens)) + 1  # through the first that reaches it
        drawn.append(batch[:cut])
        held = int(total[min(cut, len(batch)) - 1])
    return np.concatenate(drawn).astype(np.int64)


def training_document_lengths(data_path: Sequence[str], split: str, seed: int,
                              tokens: int) -> np.ndarray:
    """Document lengths of the run's training data holding at least ``tokens`` tokens: each
    prefix's draw (module docstring), the blend's draws together in a seeded random order.

    Raises :class:`DataConfigError` naming ``--split`` when a prefix's train split holds
    no token (or naming the file when an ``.idx`` is missing or corrupt)."""
    prefixes, weights = parse_data_path(data_path)
    splits = [train_split_lengths(p, split) for p in prefixes]
    held = [int(s.sum(dtype=np.int64)) for s in splits]
    for prefix, n in zip(prefixes, held):
        if n == 0:
            raise DataConfigError(f"--split {split}: the train split of {prefix} holds no "
                                  f"tokens; give train a larger share, e.g. --split 969,30,1")
    shares = np.asarray(weights if weights is not None else held, dtype=np.float64)
    shares = shares / shares.sum()
    rng = np.random.default_rng(seed)
    drawn = [draw_lengths(s, max(1, int(np.ceil(tokens * w))), rng)
             for s, w in zip(splits, shares)]
    return rng.permutation(np.concatenate(drawn))


__all__ = ["cut_at_inner_eods", "draw_lengths", "inner_eod_cuts", "mock_mix",
           "train_split_lengths", "training_document_lengths"]
