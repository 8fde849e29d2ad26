"""Both checkpoint formats on disk: read and write Hugging Face directories, write and read
this project's checkpoints through the model (so the files are exactly what training
writes and reads, and load under any TP / PP / U x R).

Import (:func:`import_hf`): ``config.json`` + ``*.safetensors`` -> a one-rank TP = 1 model
built from the flags of :func:`~megatron.convert.hf_config.model_flags` -> a weights-only
checkpoint (``iter_0000000``, loaded with ``--load DIR --finetune``), plus ``DIR/model_flags.txt``
(the flags, one line) and ``DIR/hf_config.json`` (the source config, which the export reads
back for the model type, the unpadded vocabulary and the token ids).

Export (:func:`export_hf`): a checkpoint (any layout it was saved under) -> the one-rank model
-> ``model.safetensors`` + ``config.json`` that transformers loads.

Both run on one CPU process: they start a one-rank gloo group when none exists.
"""

from __future__ import annotations

import json
import os
import shlex
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.convert import hf_config, hf_weights
from megatron.convert.hf_config import ConversionError, PretrainedConfig
from megatron.training.cli.arguments import padded_vocab_size, parse_args, validate_args
from megatron.training.cpu_shims import apply_cpu_shims

FLAGS_FILE = "model_flags.txt"
SOURCE_CONFIG_FILE = "hf_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Flags the one-rank model needs beyond the model's own: none of them is a model shape.
SINGLE_RANK_FLAGS = ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters",
                     "1", "--lr", "1e-4", "--device", "cpu", "--mock-data", "--seed", "1234"]


def read_hf_config(hf_dir: str) -> Dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        return json.load(f)


def read_hf_weights(hf_dir: str) -> Dict[str, torch.Tensor]:
    """Every tensor of ``hf_dir``'s safetensors files (one file or an index of shards)."""
    from safetensors.torch import load_file  # optional: safetensors

    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, WEIGHTS_FILE)):
        files = [WEIGHTS_FILE]
    else:
        raise ConversionError(f"{hf_dir}: no {WEIGHTS_FILE} or {INDEX_FILE} (safetensors "
                         f"checkpoints only)")
    state = {}
    for name in files:
        state.update(load_file(os.path.join(hf_dir, name)))
    return state


def write_hf(out_dir: str, model: PretrainedConfig, state: Dict[str, torch.Tensor]) -> None:
    """``out_dir/model.safetensors`` and ``out_dir/config.json``."""
    from safetensors.torch import save_file  # optional: safetensors

    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config.to_hf_config(model), f, indent=2)


@dataclass
class SingleRankModel:
    """A ``GPTModel`` of a validated run (``config``, a
    :class:`~megatron.training.cli.config.RunConfig`) on this process (``groups``: its
    parallel groups); ``vocab_size``: the model's own vocabulary (its rows that are not
    padding) when a loaded checkpoint records one (``--vocab-size``), else None."""

    config: object
    model: torch.nn.Module
    groups: object
    vocab_size: Optional[int] = None


def _ensure_process_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@contextmanager
def single_rank_model(model_flags: List[str], padded_vocab: int, seq_length: int,
                      layout_flags: Sequence[str] = ()) -> Iterator[SingleRankModel]:
    """The float32 CPU model of ``model_flags`` with ``padded_vocab`` embedding rows, with
    its parallel groups for the duration of the ``with`` block: one rank, or this rank's
    part of ``layout_flags`` (``--tensor-model-parallel-size``, ``--ring-degree``, ...) over
    the existing process group."""
    from megatron.training.initialize import set_random_seed  # megatron-core on first use
    from megatron.training.model.build import (  # megatron-core on first use
        build_gpt_model,
        transformer_config_from_args,
    )
    from megatron.usp.parallel_state import (  # megatron-core on first use
        destroy_usp_parallel,
        initialize_usp_parallel,
    )

    _ensure_process_group()
    apply_cpu_shims()
    world = dist.get_world_size()
    args = parse_args(model_flags + SINGLE_RANK_FLAGS + [
        "--seq-length", str(seq_length), "--vocab-size", str(padded_vocab),
        "--global-batch-size", str(world)] + list(layout_flags))
    config = validate_args(args, world, cuda_available=False).with_padded_vocab(padded_vocab)
    groups = initialize_usp_parallel(config.dims)
    set_random_seed(args.seed, groups)
    try:
        model = build_gpt_model(config, transformer_config_from_args(config), groups)
        yield SingleRankModel(config, model, groups)
    finally:
        destroy_usp_parallel()


def load_into(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model``; every parameter must be given, nothing else."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ConversionError(f"weights do not fit the model: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")


def seq_length_for(model: PretrainedConfig) -> int:
    """The ``--seq-length`` recorded with an import: the model's context, whose multiple of
    2 (zigzag halves) any layout of 2*U*R divides at the sizes used."""
    return model.max_position_embeddings


def import_hf(hf_dir: str, out_dir: str,
              vocab_divisible_by: Optional[int] = None) -> List[str]:
    """Write ``hf_dir``'s model as a weights-only checkpoint in ``out_dir`` (module docstring);
    returns the model flags (also in ``out_dir/model_flags.txt``)."""
    from megatron.training.checkpoint.save_load import (  # megatron-core on first use
        TrainState,
        save_checkpoint,
    )

    source = read_hf_config(hf_dir)
    model = hf_config.from_hf_config(source)
    flags = hf_config.model_flags(model, vocab_divisible_by)
    divisor = int(flags[flags.index("--make-vocab-size-divisible-by") + 1])
    padded = padded_vocab_size(model.vocab_size, divisor, 1)
    state = hf_weights.hf_to_megatron(_as_float32(read_hf_weights(hf_dir)), model, padded)
    os.makedirs(out_dir, exist_ok=True)
    if dist.is_initialized() and dist.get_world_size() != 1:
        raise ConversionError("the import runs on one process; start it without torchrun")
    with single_rank_model(flags, padded, seq_length_for(model), ["--save", out_dir]) as built:
        load_into(built.model, state)
        save_checkpoint(built.config, TrainState(), [built.model], None, None, built.groups,
                        torch.device("cpu"))
    with open(os.path.join(out_dir, FLAGS_FILE), "w") as f:
        f.write(shlex.join(flags) + "\n")
    with open(os.path.join(out_dir, SOURCE_CONFIG_FILE), "w") as f:
        json.dump(source, f, indent=2)
    return flags


def _as_float32(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    # The model is built in float32; bf16 / fp16 weights widen exactly.
    return {k: v.float() for k, v in state.items()}


def _saved_args(path: str) -> Dict:
    from megatron.core import dist_checkpointing  # megatron-core on first use

    return dist_checkpointing.load_common_state_dict(path)["args"]


def _checkpoint_path(ckpt_dir: str, iteration: Optional[int]) -> Tuple[int, str]:
    from megatron.training.checkpoint.save_load import (  # megatron-core on first use
        locate_checkpoint,  # megatron-core on first use
    )

    found = locate_checkpoint(ckpt_dir, None, iteration)
    if found is None:
        raise ConversionError(f"{ckpt_dir}: no checkpoint")
    return found


def export_model_config(saved_args: Dict, source: Optional[Dict] = None) -> PretrainedConfig:
    """The HF shape of a checkpoint's arguments; ``source`` (the import's ``config.json``)
    gives the model type, the unpadded vocabulary and the token ids."""
    if source is None:
        return hf_config.from_args(saved_args)
    original = hf_config.from_hf_config(source)
    extra = dict(original.extra or {}, vocab_size=original.vocab_size)
    return hf_config.from_args(saved_args, original.model_type, extra)


def _source_config(ckpt_dir: str, hf_config_path: Optional[str]) -> Optional[Dict]:
    path = hf_config_path or os.path.join(ckpt_dir, SOURCE_CONFIG_FILE)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


@contextmanager
def loaded_checkpoint(ckpt_dir: str, iteration: Optional[int] = None,
                      layout_flags: Sequence[str] = ()) -> Iterator[SingleRankModel]:
    """The model of a checkpoint's recorded arguments, its weights loaded (megatron-core
    reshards whatever layout the checkpoint was saved under), as :func:`single_rank_model`
    (TP = 1 on one rank unless ``layout_flags`` say otherwise)."""
    from megatron.core import dist_checkpointing  # megatron-core on first use

    _, path = _checkpoint_path(ckpt_dir, iteration)
    saved = _saved_args(path)
    flags = hf_config.model_flags(hf_config.from_args(saved),
                                  saved["make_vocab_size_divisible_by"])
    with single_rank_model(flags, saved["padded_vocab_size"], saved["seq_length"],
                           layout_flags) as built:
        loaded = dist_checkpointing.load({"model": built.model.sharded_state_dict()}, path)
        with torch.no_grad():
            built.model.load_state_dict(loaded["model"])
        built.vocab_size = saved.get("vocab_size")
        yield built


def export_hf(ckpt_dir: str, out_dir: str, iteration: Optional[int] = None,
              hf_config_path: Optional[str] = None,
              dtype: torch.dtype = torch.float32) -> PretrainedConfig:
    """Write the checkpoint of ``ckpt_dir`` as an HF directory in ``out_dir``; returns its
    shape. ``hf_config_path``: the source ``config.json`` (or its directory), default the
    import's copy in ``ckpt_dir`` when there is one."""
    saved = _saved_args(_checkpoint_path(ckpt_dir, iteration)[1])
    model = export_model_config(saved, _source_config(ckpt_dir, hf_config_path))
    with loaded_checkpoint(ckpt_dir, iteration) as built:
        state = {k: v.detach() for k, v in built.model.state_dict().items()
                 if not k.endswith("_extra_state")}
    hf = hf_weights.megatron_to_hf(state, model)
    write_hf(out_dir, model, {k: v.to(dtype) for k, v in hf.items()})
    return model
