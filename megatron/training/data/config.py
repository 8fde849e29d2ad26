"""The data flags and files of a training run, checked before anything is built.

:class:`DataConfig` holds the data flags (Megatron-LM names); :func:`validate_data_config`
checks them, the tokenizer and every ``--data-path`` dataset on every rank alike and raises
:class:`DataConfigError` naming the flag or file at fault, with a fix; non-fatal findings
come back in a :class:`DataReport`. :func:`parse_data_path` and :func:`parse_split` read
Megatron's ``--data-path`` and ``--split`` formats.

Packed documents: ``--reset-position-ids``, ``--reset-attention-mask`` and
``--eod-mask-loss`` have Megatron-LM's meaning (:mod:`megatron.training.data.documents`).
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from megatron.training.data.errors import DataConfigError
from megatron.training.data.indexed_files import (
    IndexedDatasetInfo,
    inspect_indexed_dataset,
    scan_token_ids,
)
from megatron.usp.token_order import check_seq_divisible

logger = logging.getLogger(__name__)


@dataclass
class DataConfig:
    """Data flags of GPT pretraining (Megatron-LM names).

    Attributes:
        data_path: ``--data-path``: prefixes of ``.bin/.idx`` pairs, optionally weighted:
            ``["prefix"]`` or ``["w1", "prefix1", "w2", "prefix2", ...]``; an entry holding
            spaces is split, so ``["0.3 a 0.7 b"]`` also works.
        split: ``--split``: train/valid/test weights, e.g. ``"969,30,1"``.
        mock_data: ``--mock-data``: synthetic tokens from ``MockGPTDataset``, no files.
        seq_length: ``--seq-length``: tokens per sample; divisible by ``2*U*R``.
        seed: ``--seed``: drives the document and sample shuffles.
        reset_position_ids: ``--reset-position-ids``: positions restart after each EOD.
        reset_attention_mask: ``--reset-attention-mask``: attention within documents.
        eod_mask_loss: ``--eod-mask-loss``: no loss on predicting from an EOD token.
        num_workers: ``--num-workers``: DataLoader worker processes per rank.
        data_cache_path: ``--data-cache-path``: where megatron-core caches its sample
            indices; ``None`` keeps megatron-core's default, ``PREFIX/cache/`` (a folder
            named like each prefix, beside its ``.bin``).
        micro_batch_size: ``--micro-batch-size``.
        global_batch_size: ``--global-batch-size``; ``None`` means micro x DP.
    """

    data_path: Optional[List[str]] = None
    split: str = "969,30,1"
    mock_data: bool = False
    seq_length: int = 1024
    seed: int = 1234
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    num_workers: int = 2
    data_cache_path: Optional[str] = None
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None


@dataclass
class DataReport:
    """What :func:`validate_data_config` found: per-prefix facts and non-fatal warnings."""

    prefixes: List[str] = field(default_factory=list)
    weights: Optional[List[float]] = None
    datasets: List[IndexedDatasetInfo] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)


def parse_data_path(data_path: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """``--data-path`` -> (prefixes, weights or None), Megatron's "[w1] p1 [w2] p2" format."""
    items = [tok for entry in data_path for tok in str(entry).split()]
    if not items:
        raise DataConfigError("--data-path is empty; pass one or more dataset prefixes")

    def as_weight(s: str) -> Optional[float]:
        try:
            return float(s)
        except ValueError:
            return None

    numeric = [as_weight(s) is not None for s in items]
    if len(items) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2]):
        weights = [as_weight(s) for s in items[0::2]]
        bad = [w for w in weights if not (w > 0 and math.isfinite(w))]
        if bad:
            raise DataConfigError(
                f"--data-path weights must be positive numbers; got {bad[0]} in {items}"
            )
        return items[1::2], weights
    if any(numeric):
        raise DataConfigError(
            f"--data-path {' '.join(items)}: expected either prefixes only, or 'weight prefix' "
            f"pairs, e.g. --data-path 0.7 /data/a_text_document 0.3 /data/b_text_document"
        )
    return items, None


def parse_split(split: str) -> List[float]:
    """``--split`` "969,30,1" -> normalised [train, valid, test] weights."""
    parts = [p for p in re.split(r"[,/]", str(split).strip()) if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 or not math.isfinite(v) for v in values):
        raise DataConfigError(
            f"--split {split!r}: expected up to three non-negative train,valid,test weights, "
            f"e.g. --split 969,30,1"
        )
    values += [0.0] * (3 - len(values))
    if values[0] <= 0:
        raise DataConfigError(f"--split {split!r}: the train weight must be > 0; e.g. 969,30,1")
    total = sum(values)
    return [v / total for v in values]


def split_ranges(split: str, num_sequences: int) -> List[Tuple[int, int]]:
    """The ``[begin, end)`` sequence ranges of the train, valid and test splits of a prefix of
    ``num_sequences`` sequences under ``--split``: megatron-core's
    ``[round(lo * n), round(hi * n))`` over the normalised cumulative weights."""
    bounds = [0.0]
    for w in parse_split(split):
        bounds.append(bounds[-1] + w)
    return [(int(round(lo * num_sequences)), int(round(hi * num_sequences)))
            for lo, hi in zip(bounds, bounds[1:])]


def _check_cache_dir(cfg: DataConfig, prefixes: Sequence[str]) -> None:
    """The folder(s) megatron-core will write its sample indices to must be writable."""
    if cfg.data_cache_path is not None:
        try:
            os.makedirs(cfg.data_cache_path, exist_ok=True)
        except OSError as exc:
            raise DataConfigError(f"--data-cache-path {cfg.data_cache_path}: {exc}") from None
        targets = [cfg.data_cache_path]
    else:
        targets = sorted({os.path.dirname(os.path.abspath(p)) for p in prefixes})
    for target in targets:
        if not os.access(target, os.W_OK):
            raise DataConfigError(
                f"--data-cache-path: the sample-index cache would be written under {target}, "
                f"which is not writable; pass --data-cache-path DIR with a writable DIR"
            )


def _validate_scalars(cfg: DataConfig, tokenizer, cp_size: int) -> None:
    if not isinstance(cfg.seq_length, int) or cfg.seq_length < 1:
        raise DataConfigError(f"--seq-length {cfg.seq_length!r} must be a positive integer")
    try:
        check_seq_divisible(cfg.seq_length, cp_size, "--seq-length")
    except ValueError as exc:
        raise DataConfigError(str(exc)) from None
    if cfg.micro_batch_size < 1:
        raise DataConfigError(f"--micro-batch-size {cfg.micro_batch_size} must be >= 1")
    gbs = cfg.global_batch_size
    if gbs is not None and (gbs < cfg.micro_batch_size or gbs % cfg.micro_batch_size):
        raise DataConfigError(
            f"--global-batch-size {gbs} must be a multiple of --micro-batch-size "
            f"{cfg.micro_batch_size} (times the data-parallel size)"
        )
    if cfg.num_workers < 0:
        raise DataConfigError(f"--num-workers {cfg.num_workers} must be >= 0 (0: load in-line)")
    eod, vocab = tokenizer.eod, tokenizer.vocab_size
    if eod is None or not 0 <= int(eod) < vocab:
        raise DataConfigError(
            f"the tokenizer's EOD id {eod} is outside its vocabulary of {vocab}; check "
            f"--tokenizer-model"
        )


def _check_dataset(info: IndexedDatasetInfo, tokenizer, report: DataReport) -> None:
    bin_path = info.prefix + ".bin"
    if info.num_tokens == 0:
        raise DataConfigError(
            f"{bin_path}: the dataset has no tokens ({info.num_documents} documents, all "
            f"empty); re-create it from non-empty text with tools/preprocess_data.py"
        )
    scan_token_ids(info, eod=tokenizer.eod)
    vocab = tokenizer.vocab_size
    if info.min_token_id < 0:
        raise DataConfigError(f"{bin_path} holds a negative token id: corrupt; re-create it")
    if info.max_token_id >= vocab:
        raise DataConfigError(
            f"{bin_path} holds token id {info.max_token_id}, but the tokenizer "
            f"({getattr(tokenizer, 'path', None) or type(tokenizer).__name__}) has {vocab} ids: "
            f"the dataset was made with another tokenizer. Pass the --tokenizer-model used by "
            f"tools/preprocess_data.py, or re-run it with this one"
        )
    if info.empty_documents:
        report.warnings.append(
            f"{bin_path}: {info.empty_documents} of {info.num_documents} documents are empty "
            f"(they contribute no tokens)"
        )
    if info.eod_checked and info.eod_endings == 0:
        report.warnings.append(
            f"{bin_path}: none of the first {info.eod_checked} documents ends with the "
            f"tokenizer's EOD id {tokenizer.eod}: it was preprocessed with --no-append-eod or "
            f"with a different tokenizer"
        )


def validate_data_config(cfg: DataConfig, tokenizer, cp_size: int) -> DataReport:
    """Check every data input before any dataset is built; raise :class:`DataConfigError`.

    Checked, in order: ``--seq-length`` positive and divisible
    by ``2*cp_size`` (``cp_size = U*R``); batch sizes; the tokenizer's EOD; ``--mock-data``
    versus ``--data-path``; ``--split``; the ``--data-path`` format and weights; for each
    prefix, :func:`inspect_indexed_dataset` (files present, ``.idx`` header and size,
    ``.bin`` size) and :func:`scan_token_ids` (largest token id below the tokenizer's
    vocabulary size; the whole ``.bin`` up to 4M tokens, 64 windows of 64K tokens beyond);
    a dataset with no tokens is an error, empty documents and missing EODs are warnings
    in the returned report; finally that the index cache directory is writable.
    """
    _validate_scalars(cfg, tokenizer, cp_size)
    report = DataReport()
    if cfg.mock_data:
        if cfg.data_path:
            raise DataConfigError(
                "--mock-data and --data-path exclude one another; drop one of them"
            )
        return report
    if not cfg.data_path:
        raise DataConfigError(
            "no data: pass --data-path PREFIX (a .bin/.idx pair from tools/preprocess_data.py), "
            "--mock-data, or neither flag to train on the built-in default corpus"
        )
    parse_split(cfg.split)
    report.prefixes, report.weights = parse_data_path(cfg.data_path)
    for prefix in report.prefixes:
        info = inspect_indexed_dataset(prefix, "--data-path")
        _check_dataset(info, tokenizer, report)
        report.datasets.append(info)
    _check_cache_dir(cfg, report.prefixes)
    for msg in report.warnings:
        logger.warning(msg)
    return report


__all__ = [
    "DataConfig", "DataConfigError", "DataReport", "parse_data_path", "parse_split",
    "split_ranges", "validate_data_config",
]
