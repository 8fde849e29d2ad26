"""GPT datasets and the micro-batch iterator: indexed datasets -> samples -> micro-batches.

:func:`build_gpt_datasets` builds megatron-core ``GPTDataset`` splits (or
``MockGPTDataset``) through ``BlendedMegatronDatasetBuilder``; :func:`build_data_iterator`
yields this DP rank's full-sequence micro-batches with Megatron's pretraining sampler
semantics (:class:`PretrainingSampler`, :func:`collate_samples`). Check the inputs first
with :func:`megatron.training.data.config.validate_data_config`; each rank then keeps its
context-parallel part with :func:`megatron.training.data.batch.shard_batch_for_cp`.

Batch keys (names used throughout)::

    tokens       [b, s] int64   input ids
    labels       [b, s] int64   tokens shifted left by one (next-token targets)
    loss_mask    [b, s] float32 1.0 where the label counts in the loss
    position_ids [b, s] int64   positions 0..s-1 (--reset-position-ids: restarting after
                                each EOD, megatron-core's GPTDataset)
    attention_mask None         attention is causal by construction; no [s, s] mask
    segment_ids  [b, s] int32   --reset-attention-mask only: document index per token, and
    chunk_assignment            the micro-batch's chunk assignment (None: zigzag)
                                (:class:`megatron.training.data.documents.DocumentBatching`)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron.training.data.config import (
    DataConfig,
    DataConfigError,
    parse_data_path,
    parse_split,
    split_ranges,
)
from megatron.training.data.indexed_files import inspect_indexed_dataset


def _check_split_tokens(
    prefixes: Sequence[str], split: str, sizes: Sequence[Optional[int]]
) -> None:
    """Each split that will be sampled must own tokens, or megatron-core loops forever.

    Mirrors megatron-core's document ranges: split ``i`` of a prefix with ``n`` documents
    is ``[round(lo_i * n), round(hi_i * n))``.
    """
    weights = parse_split(split)
    names = ("train", "valid", "test")
    for prefix in prefixes:
        info = inspect_indexed_dataset(prefix, "--data-path")
        n = info.num_sequences
        for i, (name, (beg, end)) in enumerate(zip(names, split_ranges(split, n))):
            if weights[i] == 0 or sizes[i] is None:
                continue
            tokens = int(info.sequence_lengths[beg:end].sum(dtype=np.int64))
            if tokens == 0:
                raise DataConfigError(
                    f"--split {split}: the {name} split of {prefix} gets documents "
                    f"[{beg}, {end}) of {n}, which hold no tokens. Give {name} a larger share "
                    f"(e.g. --split 90,5,5), set its weight to 0, or use more documents"
                )


def build_gpt_datasets(
    cfg: DataConfig,
    tokenizer,
    train_valid_test_num_samples: Sequence[Optional[int]],
    is_built_on_rank: Optional[Callable[[], bool]] = None,
):
    """Build (train, valid, test) ``GPTDataset`` splits; a split of weight 0 is ``None``.

    Uses ``BlendedMegatronDatasetBuilder`` with ``GPTDatasetConfig`` (``MockGPTDataset``
    when ``cfg.mock_data``); a weighted ``--data-path`` gives ``BlendedDataset`` splits.
    Samples are ``seq_length`` tokens (plus one for the shifted labels), documents packed
    back to back; no ``[s, s]`` attention mask is built (at 128K it would be 64 GiB).

    Must be called on every rank (megatron-core builds the index cache on global rank 0
    behind a barrier). ``is_built_on_rank`` defaults to every rank: each rank of a CP
    group (and of a TP group) reads the same samples itself, no broadcast.

    Call :func:`validate_data_config` first; this also refuses splits that would be
    sampled but own no tokens.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )  # megatron-core on first use
    from megatron.core.datasets.gpt_dataset import (  # megatron-core on first use
        GPTDataset,
        GPTDatasetConfig,
        MockGPTDataset,
    )

    sizes = list(train_valid_test_num_samples)
    if len(sizes) != 3:
        raise ValueError("train_valid_test_num_samples must have three entries")
    blend = None
    if not cfg.mock_data:
        prefixes, weights = parse_data_path(cfg.data_path or [])
        _check_split_tokens(prefixes, cfg.split, sizes)
        blend = (prefixes, weights)
    config = GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=cfg.seq_length,
        blend=blend,
        split=None if cfg.mock_data else cfg.split,
        path_to_cache=cfg.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=cfg.reset_position_ids,
        reset_attention_mask=cfg.reset_attention_mask,
        eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
    cls = MockGPTDataset if cfg.mock_data else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        cls, sizes, is_built_on_rank or (lambda: True), config
    )
    with _process_group_for_single_process_build():
        train, valid, test = builder.build()
    return train, valid, test


@contextlib.contextmanager
def _process_group_for_single_process_build():
    """Outside a distributed job, run the build inside a one-process gloo group.

    megatron-core 0.16.1's ``BlendedDataset._build_indices`` calls
    ``torch.distributed.get_rank()`` without checking that a process group exists, so a
    weighted blend cannot be built by a single-process tool (a benchmark, a notebook).
    The group lives only for the build; inside a distributed job nothing is created.
    """
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="usp-data-pg-") as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


class PretrainingSampler:
    """Megatron's pretraining batch sampler: each DP rank's slice of each global batch.

    Sample indices ``consumed, consumed+1, ...`` are cut into groups of
    ``micro_batch_size * dp_size``; DP rank ``d`` takes positions
    ``[d*micro, (d+1)*micro)`` of each group. A trailing partial group is dropped. Resuming
    from ``consumed_samples`` continues exactly where an uninterrupted run would be.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size {micro_batch_size} must be >= 1")
        if total_samples <= 0:
            raise DataConfigError("the dataset has no samples; check --data-path and --split")
        if consumed_samples >= total_samples:
            raise DataConfigError(
                f"consumed samples {consumed_samples} (from the checkpoint) are past the "
                f"dataset's {total_samples} samples: the dataset was built for a shorter run; "
                f"rebuild it with the new --train-iters/--train-samples"
            )
        self.total = total_samples
        self.consumed = consumed_samples
        self.micro = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.micro * self.dp_size)

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro * self.dp_size
        first = self.consumed + self.dp_rank * self.micro
        for k in range(len(self)):
            start = first + k * step
            yield list(range(start, start + self.micro))


def collate_samples(samples: Sequence[Dict]) -> Dict[str, Optional[torch.Tensor]]:
    """Stack per-sample ``[s]`` tensors to ``[b, s]``; ``attention_mask`` is None."""
    batch: Dict[str, Optional[torch.Tensor]] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if isinstance(values[0], torch.Tensor):
            batch[key] = torch.stack(values)
        else:  # e.g. BlendedDataset's numpy "dataset_id"
            batch[key] = torch.as_tensor(np.asarray(values))
    batch["attention_mask"] = None
    return batch


def build_data_iterator(
    dataset,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    consumed_samples: int = 0,
    num_workers: int = 2,
    collate_fn: Callable[[Sequence[Dict]], Dict] = collate_samples,
    worker_start_method: Optional[str] = None,
    worker_init_fn: Optional[Callable[[int], None]] = None,
) -> Optional[Iterator[Dict[str, Optional[torch.Tensor]]]]:
    """An iterator over this DP rank's full-sequence micro-batches (None for no dataset).

    Each ``next()`` gives a dict of ``[micro_batch_size, seq_length]`` tensors (see the
    module docstring for the keys). DP slicing follows :class:`PretrainingSampler`; the
    order is deterministic (megatron-core's shuffle is seeded) and independent of
    ``num_workers``. Every rank of one CP group (and TP group) has the same DP rank, so
    gets the same full micro-batch and keeps its part with
    :func:`megatron.training.data.batch.shard_batch_for_cp`. Iteration ends after the last
    complete global batch. ``collate_fn`` builds a micro-batch from its samples
    (:func:`collate_samples`; with packed documents
    :class:`megatron.training.data.documents.DocumentBatching`). ``worker_start_method``
    (``"forkserver"``, ``"spawn"``; None: the platform's default, fork on Linux) is how the
    workers start: a forked worker shares the trainer's memory copy-on-write, so every page
    the trainer writes afterwards is duplicated while the worker lives (see
    :func:`worker_start_method`). ``worker_init_fn(worker_id)`` runs first in each worker.
    Stop the workers with :func:`shut_down_data_iterators`.
    """
    if dataset is None:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        multiprocessing_context=worker_start_method if num_workers > 0 else None,
        worker_init_fn=worker_init_fn if num_workers > 0 else None,
    )
    return iter(loader)


def shut_down_data_iterators(*iterators) -> None:
    """Stop the worker processes of :func:`build_data_iterator`'s iterators now (None and
    iterators without workers are skipped); each worker is joined for a few seconds, then
    terminated.

    Why not leave it to garbage collection: an exception's traceback keeps the iterator
    alive until the interpreter exits, and multiprocessing's exit handler then joins the
    workers with no timeout. ``_shutdown_workers`` is the DataLoader iterator's own
    shutdown (what its ``__del__`` calls); it may be called more than once.
    """
    for it in iterators:
        stop = getattr(it, "_shutdown_workers", None)
        if stop is not None:
            stop()


def worker_start_method(host_state_on_cpu: bool) -> Optional[str]:
    """How the DataLoader workers start: ``"forkserver"`` when the trainer keeps optimizer
    state in host memory (``--optimizer-cpu-offload``), else the default (fork).

    The workers are started after the optimizer is built. Forked then, each shares the
    float32 masters and Adam moments copy-on-write, and the first optimizer step, which
    writes all of them, makes the kernel copy every page: Llama-3-8B with 30 % of its state
    on the CPU gained ~25 GB of host memory in that step on one H200 and was killed at 128 GB
    (docs/long_sequences.md). Workers started by a fork server share nothing
    with the trainer. (Pinned buffers are shared mappings, not copied on write.)
    """
    return "forkserver" if host_state_on_cpu else None


__all__ = ["PretrainingSampler", "build_data_iterator", "build_gpt_datasets", "collate_samples",
           "shut_down_data_iterators", "worker_start_method"]
