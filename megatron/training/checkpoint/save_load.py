"""Checkpoints: megatron-core distributed checkpoints, published atomically.

Format: megatron-core ``dist_checkpointing`` with the ``torch_dist`` backend (PyTorch
Distributed Checkpoint files underneath). The model and optimizer are saved as sharded
state dicts, so a checkpoint loads under another layout: any U x R / DP split at the same
TP x PP with either optimizer, and other TP / PP sizes too for the plain optimizer, or for
the distributed optimizer saved with ``--dist-ckpt-optim-fully-reshardable``.

Files on disk::

    SAVE/
      latest_checkpointed_iteration.txt    "<iteration>\\n", names only complete checkpoints
      iter_0000100/                        a complete checkpoint (megatron-core files)
      iter_0000200.tmp/                    a save in progress, or one a crash interrupted

Publishing protocol (:func:`save_checkpoint`), so a crash at any point never leaves a
checkpoint that loads as valid:

1. rank 0 empties ``iter_N.tmp``; barrier;
2. every rank writes its shards into ``iter_N.tmp`` (:mod:`.shard_writer`: on the CPU in
   the rank's own process; each file fsync-ed, ``metadata.json`` last, behind a barrier);
3. barrier; every rank hashes its share of the files (XXH3-128,
   :mod:`megatron.training.checkpoint.checksums`) and rank 0 writes ``checksums.json``;
4. rank 0 fsyncs every file and the directory, renames ``iter_N.tmp`` to
   ``iter_N`` (atomic on POSIX), fsyncs ``SAVE``, then writes the tracker to a temporary
   file, fsyncs it and ``os.replace``-s it over ``latest_checkpointed_iteration.txt``;
5. barrier.

A failure at any step (a full disk, a read-only remount) raises
:class:`~megatron.training.checkpoint.faults.CheckpointSaveError` on every rank (rank-0-only
steps broadcast their outcome), whose message names the directory, the room needed and
the last complete checkpoint, which nothing touched; rank 0 removes ``iter_N.tmp``. A
write that dies or makes no progress for half of ``--distributed-timeout-minutes`` raises
it on the rank where that happened (:mod:`.writer_watch`). A rank that died or went silent
during the save is not a storage fault: its peers' communication error goes up as it is
(:mod:`megatron.training.peer_faults`).

Loading (:func:`load_checkpoint`) only ever opens a directory without the ``.tmp``
suffix, named by the tracker (or ``--ckpt-step``), after rank 0 checked that it is complete
(every file PyTorch's ``.metadata`` refers to exists and is long enough) and broadcast the
verdict, and every rank verified its share of the checksums, so a bad ``--load`` fails on
every rank with the same message (naming the file, and the newest older checkpoint that
is intact, its checksums verified, with the ``--ckpt-step`` that loads it, or that none is)
before any collective of the load itself. A
checkpoint of another model shape is refused naming the flags (:func:`check_model_matches`).

Saved beside model and optimizer: the LR scheduler, the iteration, the consumed train and
validation samples (the data position), the arguments, and each rank's RNG states
(Python, NumPy, torch CPU, CUDA, megatron-core's RNG tracker), restored only when the
saved grid (TP, U, R, DP, PP) equals the current one.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import random
import shutil
import signal
import sys
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from megatron.errors import UsageError
from megatron.shapes.rope import RopeScaling
from megatron.training.checkpoint import checksums, shard_writer
from megatron.training.checkpoint.faults import (
    CheckpointSaveError,
    directory_bytes,
    save_failure_message,
)
from megatron.training.checkpoint.writer_watch import (
    WriterDiedError,
    WriterStuckError,
    stall_bound_s,
)
from megatron.training.cli.config import RunConfig
from megatron.training.model.build import unwrap
from megatron.training.peer_faults import peer_lost
from megatron.training.process_guard import children_ignore_stop_signals
from megatron.usp.parallel_dims import ORDER, ParallelDims
from megatron.usp.parallel_state import USPGroups

logger = logging.getLogger(__name__)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
TMP_SUFFIX = ".tmp"
CHECKPOINT_VERSION = 1


class CheckpointError(UsageError, RuntimeError):
    """An unreadable ``--load`` (missing, incomplete, corrupt) or a failed save."""


@dataclass
class TrainState:
    """Loop state that is not in the model or the optimizer."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


# --------------------------------------------------------------------------- files
def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(os.path.join(dirpath, name))
        _fsync_path(dirpath)


def write_tracker(root: str, iteration: int) -> None:
    """Atomically make ``root/latest_checkpointed_iteration.txt`` say ``iteration``."""
    final = os.path.join(root, TRACKER_FILENAME)
    tmp = final + TMP_SUFFIX
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_path(root)


def read_tracker(root: str) -> Optional[int]:
    """The iteration the tracker names; None without a tracker; CheckpointError if corrupt."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(
            f"--load {root}: {TRACKER_FILENAME} is corrupt (holds {text[:40]!r}, not an "
            f"iteration number); fix it or pass --ckpt-step N") from None
    if iteration < 0:
        raise CheckpointError(f"--load {root}: {TRACKER_FILENAME} names iteration {iteration}")
    return iteration


def published_iterations(root: str) -> List[int]:
    """Iterations with a published (renamed, hence complete) directory under ``root``."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith("iter_") and not name.endswith(TMP_SUFFIX):
            try:
                out.append(int(name[len("iter_"):]))
            except ValueError:
                continue
    return sorted(out)


def verify_complete(path: str) -> None:
    """Raise CheckpointError unless ``path`` is a complete megatron-core checkpoint.

    Checks ``metadata.json`` and ``common.pt``, reads PyTorch's ``.metadata`` and checks
    every data file it refers to exists and holds the byte ranges it promises.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    for name in ("metadata.json", "common.pt", ".metadata"):
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: {name} is "
                                  f"missing")
    try:
        meta = FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any parse failure means corrupt
        raise CheckpointError(f"checkpoint {path} is corrupt: cannot read .metadata ({exc})"
                              ) from None
    needed: Dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for rel, end in sorted(needed.items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint {path} is incomplete: {rel} is missing")
        if os.path.getsize(file) < end:
            raise CheckpointError(f"checkpoint {path} is corrupt: {rel} holds "
                                  f"{os.path.getsize(file)} bytes, {end} expected")


def locate_checkpoint(load: str, save: Optional[str], ckpt_step: Optional[int]
                      ) -> Optional[Tuple[int, str]]:
    """(iteration, directory) to resume from, None for a fresh start; file checks only.

    A missing or empty ``load`` is a fresh start only when it is also the ``--save``
    directory (the resume-if-present pattern of the launch scripts); otherwise, and for a
    tracker naming a missing or incomplete directory, CheckpointError.
    """
    auto_resume = save is not None and os.path.abspath(save) == os.path.abspath(load)
    if not os.path.isdir(load):
        if auto_resume:
            return None
        raise CheckpointError(f"--load {load}: no such directory (to start fresh, drop --load "
                              f"or pass the same directory as --save)")
    if ckpt_step is not None:
        iteration = ckpt_step
    else:
        iteration = read_tracker(load)
        if iteration is None:
            found = published_iterations(load)
            if not found and auto_resume:
                return None
            hint = (f"published iterations: {found}; pass --ckpt-step {found[-1]}" if found
                    else "it holds no checkpoint")
            raise CheckpointError(f"--load {load}: no {TRACKER_FILENAME} ({hint})")
    path = iteration_dir(load, iteration)
    try:
        verify_complete(path)
    except CheckpointError as exc:
        raise CheckpointError(f"--load {load} (iteration {iteration}): {exc}"
                              f"{older_hint(load, iteration)}") from None
    return iteration, path


def intact_problem(path: str) -> Optional[str]:
    """Why the checkpoint at ``path`` cannot be loaded (its files against its ``.metadata``,
    then every file against ``checksums.json``), or None when it is intact. One process
    reads the whole checkpoint; only the corruption path calls it."""
    try:
        verify_complete(path)
        manifest = checksums.read_manifest(path)
        if manifest is None:   # saved before checksums: the sizes are all there is to check
            return None
        return checksums.verify_files(path, manifest, sorted(manifest))
    except (CheckpointError, checksums.ChecksumMismatch, OSError) as exc:
        return str(exc)


def older_hint(root: str, iteration: int) -> str:
    """The sentence that ends a corrupt-checkpoint error: the newest older checkpoint that
    is intact (verified, checksums included, before it is suggested) with the
    ``--ckpt-step`` that loads it, or that none is. Older ones are checked newest first,
    and the search stops at the first intact one."""
    corrupt = []
    for it in reversed([i for i in published_iterations(root) if i < iteration]):
        if intact_problem(iteration_dir(root, it)) is None:
            also = (f" (iteration(s) {', '.join(map(str, corrupt))} between are corrupt too)"
                    if corrupt else "")
            return (f"; the newest intact older checkpoint in {root} is iteration {it}, its "
                    f"checksums verified{also}; to resume from it, pass --load {root} "
                    f"--ckpt-step {it}")
        corrupt.append(it)
    if corrupt:
        return (f"; {root} holds no intact older checkpoint (iteration(s) "
                f"{', '.join(map(str, corrupt))} are corrupt too)")
    return f"; {root} holds no older checkpoint"


def verify_checksums_on_all_ranks(load: str, iteration: int, path: str) -> None:
    """Every rank verifies its share of the checkpoint's files against ``checksums.json``;
    a mismatch raises the same CheckpointError, naming the file, on every rank. A
    checkpoint saved before checksums existed loads with a warning."""
    problem: Optional[str] = None
    try:
        manifest = checksums.read_manifest(path)
        if manifest is None:
            if dist.get_rank() == 0:
                logger.warning("%s has no %s (saved before checksums): its bytes are not "
                               "verified", path, checksums.MANIFEST)
            return
        names = sorted(manifest)
        problem = checksums.verify_files(
            path, manifest, checksums.files_of_rank(names, dist.get_rank(),
                                                    dist.get_world_size()))
    except (checksums.ChecksumMismatch, OSError) as exc:
        problem = str(exc)
    found: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    problems = [p for p in found if p]
    if problems:
        hint = older_hint(load, iteration) if dist.get_rank() == 0 else ""
        box = [hint]
        dist.broadcast_object_list(box, src=0)
        raise CheckpointError(f"--load {load} (iteration {iteration}): checkpoint {path} is "
                              f"corrupt: {problems[0]}{box[0]}")


def locate_checkpoint_on_all_ranks(load: str, save: Optional[str],
                                   ckpt_step: Optional[int]) -> Optional[Tuple[int, str]]:
    """:func:`locate_checkpoint` on rank 0, verdict broadcast; every rank raises alike."""
    verdict: List[Any] = [None]
    if dist.get_rank() == 0:
        try:
            verdict[0] = ("ok", locate_checkpoint(load, save, ckpt_step))
        except (CheckpointError, OSError) as exc:
            verdict[0] = ("error", str(exc))
    dist.broadcast_object_list(verdict, src=0)
    status, value = verdict[0]
    if status == "error":
        raise CheckpointError(value)
    if value is not None:
        verify_checksums_on_all_ranks(load, *value)
    return value


# --------------------------------------------------------------------------- RNG
def get_rng_state(device: torch.device) -> Dict[str, Any]:
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: Dict[str, Any], device: torch.device) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    get_cuda_rng_tracker().set_states(state["tracker"])


# --------------------------------------------------------------------------- state dicts
def _sharding_metadata(fully_reshardable: bool) -> Dict[str, Any]:
    return {
        "distrib_optim_sharding_type": ("fully_reshardable" if fully_reshardable
                                        else "dp_reshardable"),
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }


def grid_of(dims: ParallelDims) -> Dict[str, int]:
    """The layout's degrees by axis, as a checkpoint records them."""
    return {axis: dims.size(axis) for axis in ORDER}


def plain_args(config: RunConfig,
               resolved: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The run's flag values (:meth:`~megatron.training.cli.config.RunConfig.flag_values`)
    that are plain values (what checkpoints and metrics files record).

    ``resolved`` replaces the values of flags that start-up resolved later
    (:meth:`megatron.training.initialize.DataSource.resolved_args`: the default corpus's data
    path and tokenizer); the keys keep their places.
    """
    simple = (int, float, str, bool, type(None))
    resolved = resolved or {}
    out = {}
    for key, value in config.flag_values().items():
        value = resolved.get(key, value)
        if isinstance(value, simple) or (isinstance(value, (list, tuple))
                                         and all(isinstance(v, simple) for v in value)):
            out[key] = value
    return out


def _rng_sharded_object(rng: Optional[Dict[str, Any]]):
    world, rank = dist.get_world_size(), dist.get_rank()
    return ShardedObject("rng_state", rng, (world,), (rank,), replica_id=0)


def _state_dict(config: RunConfig, model, optimizer, scheduler,
                train_state: Optional[TrainState], rng: Optional[Dict[str, Any]],
                is_loading: bool, with_optimizer: bool, with_rng: bool,
                resolved_args: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    meta = _sharding_metadata(config.args.dist_ckpt_optim_fully_reshardable)
    model_sd = unwrap(model[0]).sharded_state_dict(metadata=meta)
    state: Dict[str, Any] = {"model": model_sd, "checkpoint_version": CHECKPOINT_VERSION}
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                          metadata=meta)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_sharded_object(rng)
    if train_state is not None:
        state["train_state"] = asdict(train_state)
        state["grid"] = grid_of(config.dims)
        state["args"] = plain_args(config, resolved_args)
    return state


def _prime_distributed_optimizer_state(optimizer) -> None:
    """Give a not-yet-stepped distributed optimizer its (zero) Adam state before loading.

    Without Apex or TransformerEngine, megatron-core 0.16.1's ``DistributedOptimizer``
    uses ``torch.optim.Adam(W)`` and its ``state_dict()`` reads the common ``step`` from
    the per-parameter state, which is empty before the first step (it asserts). The zero
    moments written here are overwritten by the load, the step by
    :func:`_restore_adam_steps`. With Apex or TransformerEngine nothing is done. An
    optimizer from ``training.build_optimizer`` already has its state
    (``training.allocate_adam_state``) and is skipped; this serves one built otherwise.
    """
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, DistributedOptimizer) or inner is None or inner.state:
            continue
        if callable(getattr(inner, "dummy_step", None)):
            # --optimizer-cpu-offload: megatron-core's HybridDeviceOptimizer has no
            # init_state_fn; its own dummy_step() (one step on random gradients, meant for
            # exactly this: state to load into) creates the state, and the load then
            # overwrites the moments, the step and the fp32 main params it touched.
            inner.dummy_step()
            continue
        if opt.init_state_fn is None:
            continue
        opt.init_state_fn(inner, opt.config)
        for param_state in inner.state.values():
            param_state.setdefault("step", torch.tensor(0.0))


def _restore_adam_steps(optimizer, loaded: Any) -> None:
    """Give each parameter of a loaded distributed optimizer its own, correct Adam ``step``.

    Without Apex or TransformerEngine, megatron-core 0.16.1's ``DistributedOptimizer``
    keeps ``torch.optim.Adam(W)``'s per-parameter ``step`` only in its param groups: its
    ``load_state_dict`` puts one shared tensor into every parameter's state, which
    ``load_parameter_state_from_dp_reshardable`` then overwrites with the loading
    template's value, and Adam's foreach path would increment the shared tensor once per
    parameter. The step saved in the param groups is the true one; it is restored here,
    one tensor per parameter. With Apex or TransformerEngine nothing is done.
    """
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return

    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    per_sub = [loaded] if len(subs) == 1 else [loaded[i] for i in range(len(subs))]
    for opt, sd in zip(subs, per_sub):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, DistributedOptimizer) or not isinstance(inner, torch.optim.Optimizer):
            continue
        steps = {g.get("step") for g in sd["optimizer"]["param_groups"]}
        steps.discard(None)
        if len(steps) != 1:
            continue  # Apex/TE optimizers keep their own step; nothing to restore
        step = float(steps.pop())
        # --optimizer-cpu-offload: megatron-core's HybridDeviceOptimizer shares each state dict
        # with a sub-optimizer that steps another tensor (the CPU copy, or the float32 master)
        # of the model's parameter: the step goes with that tensor (a CPU fused Adam refuses a
        # CUDA step: "Tensors of the same index must be on the same device", seen on one H200).
        stepped = getattr(inner, "param_to_inner_param", None) or {}
        for group in inner.param_groups:
            for param in group["params"]:
                param_state = inner.state.get(param)
                if param_state and "step" in param_state:
                    param_state["step"] = adam_step_tensor(step, group,
                                                           stepped.get(param, param))


def adam_step_tensor(step: float, group: Dict[str, Any], param: torch.Tensor) -> torch.Tensor:
    """Adam's per-parameter ``step`` where ``torch.optim.Adam(W)`` expects it: on the
    parameter's device for a ``fused`` or ``capturable`` param group (the fused CUDA kernel
    refuses a CPU step: "state_steps is on cpu", as a resumed bf16 run on one H200 showed),
    on the CPU otherwise (PyTorch's default)."""
    on_device = bool(group.get("fused") or group.get("capturable"))
    return torch.tensor(step, dtype=torch.float32, device=param.device if on_device else "cpu")


def zero_adam_state(opt: torch.optim.Optimizer) -> None:
    """Give every parameter of the PyTorch Adam(W) ``opt`` that has no state yet the state
    Adam makes at its first step: a zero ``step`` (placed by :func:`adam_step_tensor`) and
    zero moments (``max_exp_avg_sq`` too under ``amsgrad``)."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if state:
                continue
            state["step"] = adam_step_tensor(0.0, group, p)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# Flags that shape the model's tensors: a checkpoint loads only into the same values.
MODEL_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "kv_heads", "kv_channels", "swiglu", "normalization",
                    "disable_bias_linear", "untie_embeddings_and_output_weights",
                    "position_embedding_type", "padded_vocab_size", "add_qkv_bias",
                    "qk_layernorm")


def _shape_value(values: Dict[str, Any], key: str):
    if key == "kv_heads":  # --num-query-groups counts only with --group-query-attention
        return (values.get("num_query_groups") if values.get("group_query_attention")
                else values.get("num_attention_heads"))
    return values.get(key)


def _shape_class(key: str, value):
    """What of a flag's value the tensors depend on: rope and yarn rotate the same weights
    (YaRN only rescales the rotation, which :func:`rope_mismatches` compares on a resume)."""
    if key == "position_embedding_type" and value in ("rope", "yarn"):
        return "rotary"
    return value


def _flag_text(key: str, value) -> str:
    if key == "kv_heads":
        return f"--group-query-attention --num-query-groups {value}"
    if key == "padded_vocab_size":
        return (f"a padded vocabulary of {value} (--vocab-size, default the tokenizer's "
                f"length, rounded up to --make-vocab-size-divisible-by x TP)")
    flag = "--" + key.replace("_", "-")
    return flag if value is True else f"no {flag}" if value is False else f"{flag} {value}"


def model_mismatches(saved_args: Mapping[str, Any], now: Mapping[str, Any]) -> List[str]:
    """'--hidden-size 64 (this run: 128)' for each model flag that differs from the
    checkpoint's (flags the checkpoint did not record are not compared); ``now``: this
    run's flag values (:meth:`~megatron.training.cli.config.RunConfig.flag_values`)."""
    out = []
    for key in MODEL_SHAPE_ARGS:
        if key != "kv_heads" and key not in saved_args:
            continue
        saved, current = _shape_value(saved_args, key), _shape_value(now, key)
        if saved is not None and _shape_class(key, saved) != _shape_class(key, current):
            out.append(f"{_flag_text(key, saved)} (this run: {_flag_text(key, current)})")
    if (saved_args.get("position_embedding_type") == "learned_absolute"
            and saved_args.get("max_position_embeddings") not in (
                None, now["max_position_embeddings"])):
        out.append(f"--max-position-embeddings {saved_args['max_position_embeddings']} (this "
                   f"run: {now['max_position_embeddings']})")
    return out


def _rope_text(values: Mapping[str, Any]) -> str:
    flags = RopeScaling.from_flag_values(values).flags()
    if values.get("position_embedding_type") == "yarn":
        flags = ["--position-embedding-type yarn", *flags]
    return f"--rotary-base {values.get('rotary_base')}" + "".join(" " + f for f in flags)


def rope_mismatches(saved_args: Mapping[str, Any], now: Mapping[str, Any]) -> List[str]:
    """The RoPE flags (theta and scaling) of the checkpoint when they differ from this
    run's: a resume continues the same positions' rotation. A checkpoint written before
    the scaling flags existed counts as unscaled."""
    same_theta = saved_args.get("rotary_base") in (None, now.get("rotary_base"))
    if same_theta and (RopeScaling.from_flag_values(saved_args)
                       == RopeScaling.from_flag_values(now)):
        return []
    return [f"RoPE {_rope_text(saved_args)} (this run: {_rope_text(now)}; --finetune may "
            f"change RoPE)"]


def check_model_matches(saved_args: Mapping[str, Any], now: Mapping[str, Any],
                        path: str, finetune: bool = False) -> None:
    """Refuse a checkpoint of another model shape before megatron-core's load (which
    would fail with a "Global shape mismatch" traceback per tensor, naming no flag), and a
    resume (not ``finetune``: context extension starts from a checkpoint with other RoPE)
    with other RoPE flags; say in one line when only ``--seq-length`` changed."""
    wrong = model_mismatches(saved_args, now)
    if not finetune and saved_args.get("position_embedding_type") in ("rope", "yarn"):
        wrong += rope_mismatches(saved_args, now)
    if wrong:
        raise CheckpointError(
            f"--load {path}: the checkpoint holds another model; it was saved with "
            f"{'; '.join(wrong)}. Pass the checkpoint's values, or --load another checkpoint")
    saved_seq = saved_args.get("seq_length")
    if saved_seq is not None and saved_seq != now["seq_length"] and dist.get_rank() == 0:
        print(f"note: the checkpoint was trained with --seq-length {saved_seq}; this run "
              f"continues it with --seq-length {now['seq_length']}", flush=True)


def _check_optimizer_compatible(saved_args: Mapping[str, Any], now: Mapping[str, Any],
                                path: str) -> None:
    """The optimizer state of a checkpoint loads into the same kind of optimizer only
    (``now``: this run's flag values)."""
    saved = bool(saved_args.get("use_distributed_optimizer"))
    if saved != bool(now["use_distributed_optimizer"]):
        flag = "--use-distributed-optimizer"
        raise CheckpointError(
            f"--load {path}: the checkpoint's optimizer state was saved "
            f"{'with' if saved else 'without'} {flag} and this run is "
            f"{'without' if saved else 'with'} it; {'add' if saved else 'drop'} {flag}, or pass "
            f"--no-load-optim to load the weights only")
    if not saved:
        return
    # megatron-core's distributed-optimizer checkpoint keys its state by the gradient
    # buffer's (param dtype, grad dtype): another --bf16 or gradient-buffer setting finds no
    # key to load (a KeyError from deep inside dist_checkpointing, seen on one H200).
    was, now = _grad_buffer_dtypes(saved_args), _grad_buffer_dtypes(now)
    if was == now:
        return
    if was[0] != now[0]:
        fix = f"{'add' if was[0] == 'bf16' else 'drop'} --bf16"
    elif was[1] == "fp32":
        fix = "drop --grad-reduce-in-bf16"
    else:
        fix = ("add --grad-reduce-in-bf16 (the checkpoint was saved with it, or before "
               "float32 gradient accumulation became the default under --bf16)")
    raise CheckpointError(
        f"--load {path}: the checkpoint's distributed-optimizer state was saved with "
        f"{was[0]} parameters and {was[1]} gradient buffers, this run has {now[0]} and "
        f"{now[1]}: megatron-core stores that state per buffer dtype, so it loads only into "
        f"the same; {fix}, or pass --no-load-optim to load the weights only")


def _grad_buffer_dtypes(values: Dict[str, Any]) -> Tuple[str, str]:
    """(parameter dtype, gradient-buffer dtype) of a run's arguments, as ``model.py`` sets
    them: fp32 gradients unless --bf16 without float32 accumulation (--grad-reduce-in-bf16,
    or a checkpoint of before float32 became the default that did not ask for it)."""
    bf16 = bool(values.get("bf16"))
    fp32_grads = not bf16 or bool(values.get("accumulate_allreduce_grads_in_fp32"))
    return ("bf16" if bf16 else "fp32", "fp32" if fp32_grads else "bf16")


def _save_strategy(groups: USPGroups):
    # Replicas over DP x CP share the writing of replicated tensors (Megatron-LM's default).
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                            groups.dp_cp, do_cache_distribution=True)


# --------------------------------------------------------------------------- save / load
def _on_rank_0(step) -> None:
    """Run ``step()`` on rank 0 and raise its error on every rank (a rank-0-only file
    operation that fails must not leave the others waiting in the next barrier)."""
    verdict: List[Any] = [None]
    if dist.get_rank() == 0:
        try:
            step()
        except OSError as exc:
            verdict[0] = exc
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        verdict[0].raised_on_rank_0 = True  # the other ranks only relay it
        raise verdict[0]


def _prepare_tmp(root: str, final: str, tmp: str) -> None:
    os.makedirs(root, exist_ok=True)
    for stale in (tmp, final):
        if os.path.exists(stale):
            shutil.rmtree(stale)
    os.makedirs(tmp)


def _publish(root: str, final: str, tmp: str, iteration: int) -> None:
    _fsync_tree(tmp)
    os.rename(tmp, final)
    _fsync_path(root)
    write_tracker(root, iteration)


def write_checksums(tmp: str) -> None:
    """Hash the checkpoint's files (each rank its share, :func:`checksums.files_of_rank`)
    and write the manifest on rank 0. Collective."""
    names = checksums.checkpoint_files(tmp) if dist.get_rank() == 0 else None
    box = [names]
    dist.broadcast_object_list(box, src=0)
    mine = checksums.files_of_rank(box[0], dist.get_rank(), dist.get_world_size())
    parts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, checksums.hash_files(tmp, mine))
    entries = {k: v for part in parts for k, v in part.items()}
    _on_rank_0(lambda: checksums.write_manifest(tmp, entries))


def _last_words(iteration: int, final: str, root: str, previous: Optional[str], tmp: str,
                exc: BaseException) -> str:
    """The line of a rank that ends itself because its write failed and could not be
    interrupted: the failed save's message, as ``pretrain_gpt.py`` prints it."""
    message, _ = save_failure_message(iteration, final, root, previous, exc,
                                      directory_bytes(tmp))
    return f"{os.path.basename(sys.argv[0])}: error: {message}"


def save_checkpoint(config: RunConfig, train_state: TrainState, model, optimizer, scheduler,
                    groups: USPGroups, device: torch.device,
                    resolved_args: Optional[Dict[str, Any]] = None,
                    with_checksums: bool = True) -> str:
    """Write ``SAVE/iter_N`` (with its checksums) and point the tracker at it (see the
    module docstring). ``with_checksums=False`` only serves to measure their cost
    (megatron/bench/checkpoint_cost.py); such a checkpoint loads unverified. With
    ``optimizer`` None (an imported pretrained model: ``megatron.convert``) the checkpoint
    holds the weights only (no optimizer, scheduler or RNG states) and loads with
    ``--finetune``.

    The stored args are :func:`plain_args` of ``args`` and ``resolved_args``. Collective
    over the world; returns the published directory. A failure (a full disk, a read-only
    ``--save``) raises :class:`CheckpointSaveError` on every rank, naming the directory,
    the room needed and the last complete checkpoint, which is untouched.
    """
    root, it = config.args.save, train_state.iteration
    final = iteration_dir(root, it)
    tmp = final + TMP_SUFFIX
    published = [i for i in published_iterations(root) if i != it]
    previous = iteration_dir(root, published[-1]) if published else None
    try:
        _on_rank_0(lambda: _prepare_tmp(root, final, tmp))
        weights_only = optimizer is None
        state = _state_dict(config, model, optimizer, scheduler, train_state,
                            get_rng_state(device), is_loading=False,
                            with_optimizer=not weights_only, with_rng=not weights_only,
                            resolved_args=resolved_args)
        if weights_only:
            state["weights_only"] = True
        # The writer's helpers must outlive a group-wide stop signal; a write that dies or
        # stalls ends the save here (shard_writer) instead of in a wait with no end.
        with children_ignore_stop_signals():
            request = dist_checkpointing.save(state, tmp, sharded_strategy=_save_strategy(groups),
                                              async_sharded_save=True)
            shard_writer.run(request, own_process=device.type == "cpu",
                             stall_s=stall_bound_s(config.args.distributed_timeout_minutes),
                             last_words=functools.partial(_last_words, it, final, root,
                                                          previous, tmp))
        dist.barrier()
        if with_checksums:
            write_checksums(tmp)
        _on_rank_0(lambda: _publish(root, final, tmp, it))
    except (OSError, RuntimeError, CheckpointException) as exc:
        written = directory_bytes(tmp)
        if dist.get_rank() == 0:   # nothing will ever load it; the next save would empty it
            shutil.rmtree(tmp, ignore_errors=True)
        lost = peer_lost(exc, dist.get_rank(), config.args.distributed_timeout_minutes)
        if lost is not None:   # a rank died or went silent: not a storage fault
            raise lost from exc
        message, storage = save_failure_message(it, final, root, previous, exc, written)
        # Rank 0 holds every rank's failure (megatron-core gathers them there); a rank
        # that met a storage error itself also says so, in case rank 0 did not, and so
        # does a rank whose writer died or stalled (the others only lose contact with it).
        if isinstance(exc, (WriterDiedError, WriterStuckError)):
            raise CheckpointSaveError(message, primary=True) from exc
        own = dist.get_rank() == 0 or (isinstance(exc, OSError)
                                        and not getattr(exc, "raised_on_rank_0", False))
        raise CheckpointSaveError(message, primary=storage and own) from exc
    dist.barrier()
    return final


def start_writer_manager() -> None:
    """Start megatron-core's checkpoint-writer ``Manager`` now, with SIGTERM ignored.

    megatron-core spawns it at the first save (``filesystem_async._get_write_results_queue``)
    and keeps it for the life of the rank; a spawned process starts with default signal
    handlers, but an ignored signal stays ignored across exec. Started here (main thread,
    before the loop's SIGTERM handler exists), it outlives the group-wide SIGTERM of
    torchrun's shutdown or Slurm's time limit, so the save the rank then makes works; it
    ends with the rank (or by its guard). Without that function (another megatron-core)
    nothing is done and the Manager starts at the first save, as before.
    """
    start = getattr(filesystem_async, "_get_write_results_queue", None)
    if start is None or multiprocessing.current_process().daemon:
        return  # (a daemonic test rank may not start processes; it saves under torchrun)
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        start()
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class Resume:
    """What :func:`load_checkpoint` restored.

    ``rng_state`` is applied by the caller with :func:`set_rng_state` *after* building the
    data iterators: creating a ``DataLoader`` iterator draws from the torch generator, and
    the uninterrupted run created its iterators before its first iteration.
    """

    state: TrainState
    path: Optional[str] = None
    rng_state: Optional[Dict[str, Any]] = None


def load_checkpoint(config: RunConfig, model, optimizer, scheduler) -> Resume:
    """Restore model, optimizer and scheduler from ``--load`` (fresh state when there is
    nothing to load). Collective over the world."""
    args = config.args
    if args.load is None:
        return Resume(TrainState())
    found = locate_checkpoint_on_all_ranks(args.load, args.save, args.ckpt_step)
    if found is None:
        return Resume(TrainState())
    iteration, path = found
    common = dist_checkpointing.load_common_state_dict(path)
    now = config.flag_values()
    check_model_matches(common.get("args", {}), now, path, finetune=args.finetune)
    if common.get("weights_only") and not config.args.finetune:
        raise CheckpointError(f"--load {path} holds model weights only (an imported "
                              f"pretrained model); add --finetune to start training from it")
    same_grid = common.get("grid") == grid_of(config.dims)
    with_optimizer = not (args.finetune or args.no_load_optim)
    if with_optimizer:
        _check_optimizer_compatible(common.get("args", {}), now, path)
    with_rng = same_grid and not (args.finetune or args.no_load_rng)
    if not same_grid and dist.get_rank() == 0 and not args.finetune:
        logger.warning("checkpoint grid %s differs from this run's %s: model and optimizer "
                       "are resharded; RNG states start from --seed", common.get("grid"),
                       grid_of(config.dims))
    if with_optimizer:
        _prime_distributed_optimizer_state(optimizer)
    state = _state_dict(config, model, optimizer, scheduler, None, None, is_loading=True,
                        with_optimizer=with_optimizer, with_rng=with_rng)
    loaded = dist_checkpointing.load(state, path)
    # No autograd while copying into parameters (the distributed optimizer's fp32 main
    # params are views of the model's leaf parameters).
    with torch.no_grad():
        unwrap(model[0]).load_state_dict(loaded["model"])
        if with_optimizer:
            optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_steps(optimizer, loaded["optimizer"])
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
        else:
            optimizer.reload_model_params()  # main (fp32) params from the loaded weights
    if args.finetune:
        return Resume(TrainState(), path)
    saved = TrainState(**common["train_state"])
    if saved.iteration != iteration:
        raise CheckpointError(f"checkpoint {path} records iteration {saved.iteration}, but its "
                              f"directory says {iteration}: corrupt")
    return Resume(saved, path, loaded["rng_state"] if with_rng else None)
