"""Room for one checkpoint in ``--save``, checked at start-up.

A checkpoint holds every parameter once as a weight and once per optimizer state, in the
dtypes megatron-core writes them:

=========================================  =======  ================  =====
run                                        weight   optimizer state   total
=========================================  =======  ================  =====
``--bf16``                                 2        4 + 4 + 4         14
float32, ``--use-distributed-optimizer``   4        4 + 4 + 4         16
float32, plain optimizer                   4        4 + 4             12
=========================================  =======  ================  =====

(optimizer state: Adam's two moments, plus the float32 main weights where the optimizer
keeps its own copy: always under ``--bf16``, and the distributed optimizer saves its
``param`` shard even in float32). :func:`checkpoint_bytes` is that tensor payload, a lower
bound: serialisation adds a little (about 10 % for a model of 0.1M parameters, nothing
measurable for real ones), so a run refused here could never have saved.
"""

from __future__ import annotations

from typing import Optional

from megatron.training.checkpoint.faults import free_bytes, size_text
from megatron.training.cli.config import RunConfig
from megatron.training.cli.errors import ArgumentsError


def parameter_count(config: RunConfig) -> int:
    """Every parameter of the model (padded vocabulary): the shape's count plus the learned
    position table, whose size is the run's (``--max-position-embeddings``)."""
    shape = config.model_shape()
    count = shape.total_params()
    if shape.position_embedding_type == "learned_absolute":
        count += config.max_position_embeddings * shape.hidden_size
    return count


def bytes_per_parameter(config: RunConfig) -> int:
    """Weight plus optimizer-state bytes per parameter (the module docstring's table)."""
    if config.args.bf16:
        return 2 + 12
    return 4 + (12 if config.args.use_distributed_optimizer else 8)


def checkpoint_bytes(config: RunConfig) -> int:
    """The tensor bytes of one checkpoint of this run (needs the padded vocabulary)."""
    return parameter_count(config) * bytes_per_parameter(config)


def room_problem(save: str, needed: int, free: Optional[int]) -> Optional[str]:
    """The one-line refusal when ``free`` bytes cannot take ``needed``, else None."""
    if free is None or free >= needed:
        return None
    return (f"--save {save}: one checkpoint of this model needs about {size_text(needed)} "
            f"(weights and optimizer state) and {save} has {size_text(free)} free; free "
            f"{size_text(needed - free)} there or pass --save on a disk with room")


def check_room(config: RunConfig, free: Optional[int] = None) -> None:
    """Raise :class:`ArgumentsError` when ``--save``'s filesystem (``free`` bytes, default
    what ``shutil.disk_usage`` says) has no room for one checkpoint."""
    save = config.args.save
    if not save:
        return
    problem = room_problem(save, checkpoint_bytes(config),
                           free_bytes(save) if free is None else free)
    if problem:
        raise ArgumentsError(problem)


__all__ = ["bytes_per_parameter", "check_room", "checkpoint_bytes", "parameter_count",
           "room_problem"]
