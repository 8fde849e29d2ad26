"""Start-up of a training run, in the order that keeps bad input away from collectives.

1. :func:`launch_env` reads rank and world size (torchrun's environment, an already
   initialised process group, or a single process);
2. ``validate_args`` checks every flag on every rank, before any process group exists,
   and returns the run's :class:`~megatron.training.cli.config.RunConfig`;
   :func:`~megatron.training.cli.input_paths.check_input_paths` that each ``--data-path``
   prefix has its files and a tokenizer; and
   :func:`~megatron.training.cli.output_paths.check_output_paths` that ``--save``,
   the metrics file's folder and ``--tensorboard-dir`` can be written;
3. :func:`init_process_group` (gloo on CPU, NCCL on GPU) unless the caller already did;
4. the CPU shims (:func:`megatron.training.cpu_shims.apply_cpu_shims`) on a machine without CUDA;
5. the data source (:func:`resolve_data_source`: the default corpus is built here when no
   data is given; ``args`` keeps the flags as given), the tokenizer, the padded vocabulary,
   the ``auto`` layout, room for one checkpoint in ``--save`` (:func:`check_save_room`),
   and the data checks, on every rank alike;
6. the USP process groups and the random seeds.
"""

from __future__ import annotations

import datetime
import importlib.util
import logging
import os
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    init_num_microbatches_calculator,
)

from megatron.training.cli.arguments import ArgumentsError, padded_vocab_size, validate_args
from megatron.training.cli.auto_layout import resolve_auto_layout
from megatron.training.cli.config import RunConfig
from megatron.training.cli.input_paths import check_input_paths
from megatron.training.cli.output_paths import check_output_paths
from megatron.training.cpu_shims import apply_cpu_shims
from megatron.training.data.config import DataConfig, validate_data_config
from megatron.training.data.corpus import ensure_default_corpus
from megatron.training.data.tokenizer import build_tokenizer, model_vocab_size
from megatron.usp.parallel_state import USPGroups, destroy_usp_parallel, initialize_usp_parallel

if TYPE_CHECKING:
    from megatron.training.data.config import DataConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataSource:
    """Where the run's tokens come from: ``--data-path`` and ``--tokenizer-model`` as given,
    or, without ``--data-path`` and ``--mock-data``, the default corpus's."""

    data_path: Optional[List[str]]
    tokenizer_model: Optional[str]

    def resolved_args(self) -> Dict[str, Any]:
        """These values under their argument names: what the run records for those flags
        (the metrics file's "run" record, the checkpoint's args)."""
        return {"data_path": self.data_path, "tokenizer_model": self.tokenizer_model}


@dataclass
class Runtime:
    """This process's place in the job, and what start-up built: ``config`` is the run's
    validated configuration (layout resolved, vocabulary padded); ``data_source`` and
    ``data_config`` hold the resolved data flags (read them, not ``args.data_path``)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    device_name: Optional[str]
    owns_process_group: bool
    config: Optional[RunConfig] = None
    groups: Optional[USPGroups] = None
    tokenizer: object = None
    data_source: Optional[DataSource] = None
    data_config: Optional[DataConfig] = None
    plan_reasons: List[str] = field(default_factory=list)

    @property
    def is_logging_rank(self) -> bool:
        """The last rank (last pipeline stage) prints iteration logs, as in Megatron-LM."""
        return self.rank == self.world_size - 1


def launch_env() -> Tuple[int, int, int]:
    """(rank, world size, local rank) from a live process group, torchrun, or defaults."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        return rank, world, int(os.environ.get("LOCAL_RANK", rank))
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def init_process_group(config: RunConfig, rank: int, world: int,
                       local_rank: int) -> Tuple[torch.device, bool]:
    """Join the job's default process group (if not joined yet); returns (device, created)."""
    if config.device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device, False
    timeout = datetime.timedelta(minutes=config.args.distributed_timeout_minutes)
    if world == 1 and "MASTER_ADDR" not in os.environ:
        # A plain `python pretrain_gpt.py ...`: a one-process group, no rendezvous needed.
        dist.init_process_group(config.distributed_backend, store=dist.HashStore(), rank=0,
                                world_size=1, timeout=timeout)
    else:
        dist.init_process_group(config.distributed_backend, rank=rank, world_size=world,
                                timeout=timeout)
    return device, True


def resolve_data_source(args) -> DataSource:
    """The data flags as given; without data flags, the default corpus (built on first use)."""
    if not args.data_path and not args.mock_data:
        corpus = ensure_default_corpus(args.corpus_cache_dir)
        return DataSource([corpus.data_prefix], corpus.tokenizer_model)
    return DataSource(args.data_path, args.tokenizer_model)


def build_tokenizer_for(config: RunConfig, source: DataSource):
    """The tokenizer of ``--tokenizer-type`` with ``source``'s tokenizer model."""
    return build_tokenizer(config.tokenizer_type, source.tokenizer_model,
                           config.args.vocab_size)


def check_optional_packages(args) -> None:
    """Packages a flag needs, checked on every rank before any collective."""
    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise ArgumentsError(f"--tensorboard-dir {args.tensorboard_dir} needs the tensorboard "
                             f"package: pip install tensorboard (or drop the flag)")


def data_config_from_args(config: RunConfig, source: DataSource) -> DataConfig:
    """The data flags of the run, with ``source``'s (resolved) data path."""
    args = config.args
    return DataConfig(
        data_path=source.data_path or None, split=args.split, mock_data=args.mock_data,
        seq_length=args.seq_length, seed=args.seed,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        num_workers=args.num_workers, data_cache_path=args.data_cache_path,
        micro_batch_size=args.micro_batch_size, global_batch_size=config.global_batch_size)


def set_random_seed(seed: int, groups: USPGroups) -> None:
    """Megatron-LM's seeding: seed + 100 * pipeline rank for Python, NumPy, torch, and
    megatron-core's RNG tracker (TP-rank offsets inside it)."""
    seed = seed + 100 * dist.get_rank(groups.pp)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tp_rank = dist.get_rank(groups.tp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0,
                                                    etp_rank=tp_rank, force_reset_rng=True)


def initialize(args) -> Runtime:
    """Steps 1-6 of the module docstring; returns the runtime with its config, groups and
    tokenizer."""
    rank, world, local_rank = launch_env()
    config = validate_args(args, world)
    check_input_paths(config)
    check_output_paths(config)
    device, owns = init_process_group(config, rank, world, local_rank)
    rt = Runtime(rank=rank, world_size=world, local_rank=local_rank, device=device,
                 device_name=torch.cuda.get_device_name(device) if device.type == "cuda"
                 else None, owns_process_group=owns)
    if device.type == "cpu":
        apply_cpu_shims()
    check_optional_packages(args)
    rt.data_source = resolve_data_source(args)
    rt.tokenizer = build_tokenizer_for(config, rt.data_source)
    vocab = model_vocab_size(config.tokenizer_type, rt.data_source.tokenizer_model,
                             rt.tokenizer.vocab_size, args.vocab_size)
    if config.dims is None:   # --ulysses-degree auto
        config, rt.plan_reasons = resolve_auto_layout(config, vocab, rt.device_name,
                                                      rt.data_source.data_path, rt.tokenizer)
    rt.config = config = config.with_padded_vocab(padded_vocab_size(
        vocab, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size))
    check_save_room(config, device)
    rt.data_config = data_config_from_args(config, rt.data_source)
    validate_data_config(rt.data_config, rt.tokenizer, config.dims.cp)
    rt.groups = initialize_usp_parallel(
        config.dims, distributed_timeout_minutes=args.distributed_timeout_minutes)
    set_random_seed(args.seed, rt.groups)
    init_num_microbatches_calculator(rank, None, config.global_batch_size,
                                     args.micro_batch_size, config.dims.dp)
    return rt


def check_save_room(config: RunConfig, device: torch.device) -> None:
    """Refuse a ``--save`` without room for one checkpoint (needs the padded vocabulary).

    Every rank decides from the least free space any rank sees (one int64 all-reduce), so
    all refuse together: a rank that alone raised would leave the others waiting in the
    next collective.
    """
    if not config.args.save:
        return
    from megatron.training.checkpoint.faults import free_bytes  # only with --save
    from megatron.training.checkpoint.room import check_room  # only with --save

    free = free_bytes(config.args.save)
    least = torch.tensor([2**62 if free is None else free], dtype=torch.int64, device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    check_room(config, int(least.item()))


def shutdown(rt: Optional[Runtime]) -> None:
    """Undo :func:`initialize`'s global state (groups, calculator, owned process group)."""
    destroy_num_microbatches_calculator()
    destroy_usp_parallel()
    if rt is not None and rt.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
