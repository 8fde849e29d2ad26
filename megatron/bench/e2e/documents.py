"""Packed documents for ``tools/bench_e2e.py --docs MIX``: the data, the flags, and the
documents each iteration trained (the useful-FLOP count).

``mock`` trains on megatron-core's mock documents (``--mock-data``: lengths uniform in
1..4095); the other mixes (``fixed:N``, ``uniform:N``, ``lognormal``, ``corpus``: the lengths
of :func:`megatron.bench.document_bench.mix_lengths`, the attention benchmark's) are written
once per benchmark as an indexed dataset under ``--log-dir``: random token ids below the
end-of-document id, each document closed by it, and trained with ``--data-path``. Either way
the runs add ``--reset-attention-mask --reset-position-ids --eod-mask-loss``.

The documents each iteration trained are not guessed: :func:`trained_batches` parses the
run's own ``pretrain_gpt.py`` arguments and rebuilds its train dataset through the same
functions the training loop calls (megatron-core's ``GPTDataset`` / ``MockGPTDataset``, its
seeded shuffle and the same sample count), then reads samples ``i*B .. (i+1)*B - 1`` of
iteration ``i`` (Megatron's sampler, ``B`` the global batch) and cuts them at the EOD tokens as
the data loader does (:func:`megatron.usp.document_mask.segment_ids_from_tokens`). The count is
therefore exact, for the mock documents too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.bench.cli import BenchConfigError
from megatron.shapes import document_pairs
from megatron.training.cli.arguments import parse_args, validate_args

DOCUMENT_FLAGS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
DATA_FLAGS = ("--mock-data", "--data-path", "--split", "--reset-attention-mask",
              "--reset-position-ids", "--eod-mask-loss")
MIX_HINT = ("mock (megatron-core's mock documents), uniform:4k, fixed:N (e.g. fixed:2k), "
            "lognormal or corpus")


def parse_docs(text: Optional[str]) -> Optional[str]:
    """``--docs``: one mix, or None without the flag."""
    from megatron.bench.document_bench import parse_doc_mixes  # torch only when called

    if text is None:
        return None
    mix = text.strip()
    if mix == "mock":
        return mix
    if "," in mix:
        raise BenchConfigError(f"--docs {text!r}: one mix per run, e.g. --docs fixed:2k")
    try:
        parse_doc_mixes(mix)
    except BenchConfigError:
        raise BenchConfigError(f"--docs {text!r}: use {MIX_HINT}") from None
    return mix


def check_extra_args(docs: Optional[str], extra_args: Sequence[str]) -> None:
    """``--docs`` chooses the data and the document flags; ``--extra-args`` may not."""
    clash = [a for a in extra_args if a in DATA_FLAGS]
    if docs is not None and clash:
        raise BenchConfigError(f"--extra-args {' '.join(clash)}: --docs {docs} sets the data "
                               f"and the document flags itself; drop them from --extra-args")


def dataset_prefix(log_dir: str, mix: str) -> str:
    """Where the documents of ``mix`` are written: ``LOG_DIR/docs-MIX/documents``."""
    return str(Path(log_dir) / f"docs-{mix.replace(':', '-')}" / "documents")


def data_flags(docs: Optional[str], log_dir: str) -> List[str]:
    """``pretrain_gpt.py`` data flags: ``--mock-data`` (dense, or ``--docs mock``), else the
    written dataset, all of it in the train split; plus the document flags with ``--docs``."""
    if docs is None:
        return ["--mock-data"]
    data = (["--mock-data"] if docs == "mock" else
            ["--data-path", dataset_prefix(log_dir, docs), "--split", "100,0,0"])
    return data + DOCUMENT_FLAGS


# --------------------------------------------------------------------------- writing
def lengths_for_tokens(mix: str, tokens: int, seed: int) -> np.ndarray:
    """Document lengths of ``mix`` adding up to at least ``tokens`` (the generator's own
    lengths, repeated when it gives fewer, cut after the first that reaches ``tokens``)."""
    from megatron.bench.document_bench import mix_lengths  # torch only when called

    lengths = mix_lengths(mix, tokens, seed)
    if lengths is None:
        raise BenchConfigError(f"--docs {mix}: the embedded corpus cannot be built here "
                               f"(training/data/corpus.py); try --docs lognormal")
    lengths = np.asarray(lengths, dtype=np.int64)
    reps = -(-tokens // max(1, int(lengths.sum())))
    lengths = np.tile(lengths, reps)
    return lengths[:int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]


def write_documents(prefix: str, lengths: np.ndarray, eod: int, seed: int) -> int:
    """An indexed dataset (``PREFIX.bin/.idx``, megatron-core's ``IndexedDatasetBuilder``):
    one document per length, ``n - 1`` random ids in ``[0, eod)`` and then ``eod``.
    Returns the tokens written."""
    import torch  # torch only when called
    from megatron.core.datasets.indexed_dataset import (  # torch only when called
        DType,
        IndexedDatasetBuilder,
    )

    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    dtype = DType.optimal_dtype(eod + 1)
    ids = np.random.default_rng(seed).integers(0, eod, int(lengths.sum()), dtype=np.int64)
    ends = np.cumsum(lengths)
    ids[ends - 1] = eod
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for start, end in zip(ends - lengths, ends):
        builder.add_document(torch.from_numpy(ids[start:end]), [int(end - start)])
    builder.finalize(prefix + ".idx")
    return int(ends[-1])


def prepare_documents(docs: Optional[str], log_dir: str, eod: int, tokens: int,
                      seed: int) -> Optional[dict]:
    """Write the dataset of ``--docs`` (none for mock); what was written, for the JSON."""
    if docs is None or docs == "mock":
        return None if docs is None else {"mix": docs, "data": "--mock-data"}
    prefix = dataset_prefix(log_dir, docs)
    lengths = lengths_for_tokens(docs, tokens, seed)
    written = write_documents(prefix, lengths, eod, seed)
    return {"mix": docs, "data": prefix, "documents": int(lengths.size), "tokens": written,
            "mean_document_tokens": float(lengths.mean())}


# --------------------------------------------------------------------------- trained batches
@dataclass
class TrainedBatches:
    """The samples a run trained, in order: ``tokens`` / ``position_ids`` ``[iters * B, S]``,
    ``lengths`` the documents of each sample (cut at its ends), ``B`` samples per iteration."""

    tokens: np.ndarray
    position_ids: np.ndarray
    lengths: List[np.ndarray]
    global_batch: int
    eod: int

    def pairs_per_iteration(self) -> List[float]:
        """Useful attention pairs of each iteration: ``sum n^2/2`` over its documents."""
        b = self.global_batch
        return [sum(document_pairs(x) for x in self.lengths[i:i + b])
                for i in range(0, len(self.lengths), b)]

    def documents_per_iteration(self) -> List[int]:
        b = self.global_batch
        return [sum(x.size for x in self.lengths[i:i + b]) for i in range(0, len(self.lengths), b)]


def sample_lengths(tokens: np.ndarray, eod: int) -> np.ndarray:
    """Document lengths of one sample ``[S]`` as the data loader cuts it: an EOD closes its
    document, and the sample's ends cut the first and last ones."""
    import torch  # torch only when called

    from megatron.usp.document_mask import segment_ids_from_tokens  # torch only when called

    seg = segment_ids_from_tokens(torch.from_numpy(np.asarray(tokens)), eod).numpy()
    return np.bincount(seg)


_CACHE: Dict[Tuple[str, ...], TrainedBatches] = {}


def trained_batches(pretrain_args: Sequence[str], world: int, cuda: bool) -> TrainedBatches:
    """The samples a ``pretrain_gpt.py`` run with these arguments trains (module docstring);
    on the CPU, in this process. Cached by the arguments."""
    key = tuple(pretrain_args)
    if key not in _CACHE:
        _CACHE[key] = _rebuild(list(pretrain_args), world, cuda)
    return _CACHE[key]


def _rebuild(pretrain_args: List[str], world: int, cuda: bool) -> TrainedBatches:
    from megatron.training.data.loader import build_gpt_datasets  # torch only when called
    from megatron.training.initialize import (
        build_tokenizer_for,
        data_config_from_args,
        resolve_data_source,
    )  # torch only when called
    from megatron.training.loop import dataset_sizes  # torch only when called

    config = validate_args(parse_args(pretrain_args), world, cuda_available=cuda)
    args = config.args
    source = resolve_data_source(args)
    tokenizer = build_tokenizer_for(config, source)
    train, _, _ = build_gpt_datasets(data_config_from_args(config, source), tokenizer,
                                     dataset_sizes(config))
    count = args.train_iters * config.global_batch_size
    samples = [train[i] for i in range(count)]
    tokens = np.stack([np.asarray(s["tokens"]) for s in samples])
    positions = np.stack([np.asarray(s["position_ids"]) for s in samples])
    eod = int(tokenizer.eod)
    return TrainedBatches(tokens, positions, [sample_lengths(t, eod) for t in tokens],
                          config.global_batch_size, eod)
