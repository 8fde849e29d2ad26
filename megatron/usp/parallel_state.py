"""Live USP process groups, built on top of ``megatron.core.parallel_state``.

:func:`initialize_usp_parallel` asks megatron-core for its usual groups with
``context_parallel_size = U*R`` and ``hierarchical_context_parallel_sizes = [U, R]``
(order ``tp-cp-ep-dp-pp``), so megatron-core's own gradient and loss reductions over
DP x CP keep working. Level 0 of the hierarchy is the Ulysses group (U adjacent
ranks), level 1 the Ring group (R ranks strided by U): the same lists that
:class:`megatron.usp.parallel_dims.ParallelDims` computes.

The groups are returned in a :class:`USPGroups` value and also as a megatron-core
``ProcessGroupCollection`` (``hcp = [ulysses, ring]``), which is what the model is
given, so the attention module receives its groups explicitly. The module-level
getters below exist for tools and tests that want them; model code does not use them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron.usp.parallel_dims import ParallelDims, USPConfigError

_USP_GROUPS: Optional["USPGroups"] = None


@dataclass
class USPGroups:
    """Process groups of this rank, plus the layout they came from."""

    dims: ParallelDims
    tp: dist.ProcessGroup
    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup
    pp: dist.ProcessGroup
    pg_collection: ProcessGroupCollection
    # gloo over the TP x CP ranks of this DP rank and stage, the ranks that read the same
    # micro-batch; None when that is this rank alone. On the host, so the batch check
    # (megatron.training.data.batch.BatchAgreement) never waits for the device.
    same_batch: Optional[dist.ProcessGroup] = None

    @property
    def ulysses_size(self) -> int:
        return dist.get_world_size(self.ulysses)

    @property
    def ulysses_rank(self) -> int:
        return dist.get_rank(self.ulysses)

    @property
    def ring_size(self) -> int:
        return dist.get_world_size(self.ring)

    @property
    def ring_rank(self) -> int:
        return dist.get_rank(self.ring)

    @property
    def cp_rank(self) -> int:
        return dist.get_rank(self.cp)


def initialize_usp_parallel(
    dims: ParallelDims,
    distributed_timeout_minutes: int = 30,
    create_gloo_process_groups: bool = True,
) -> USPGroups:
    """Create all groups of the layout ``dims``; call once, after
    ``torch.distributed.init_process_group``.

    ``dims.world_size`` must be the job's world size (checked, so a layout built for another
    world fails on every rank with the same message instead of hanging in a group creation).
    """
    global _USP_GROUPS
    if not dist.is_initialized():
        raise RuntimeError("initialize torch.distributed before initialize_usp_parallel()")
    world = dist.get_world_size()
    if dims.world_size != world:
        raise USPConfigError(f"the parallel layout {dims.short()} is for a world of "
                             f"{dims.world_size} processes, but this job has {world}")
    mpu.initialize_model_parallel(
        **dims.megatron_kwargs(),
        order="tp-cp-ep-dp-pp",
        distributed_timeout_minutes=distributed_timeout_minutes,
        create_gloo_process_groups=create_gloo_process_groups,
    )
    ulysses, ring = mpu.get_hierarchical_context_parallel_groups()
    same_batch = None
    if dims.tp * dims.cp > 1:
        # every rank creates every group (new_group is collective over the world)
        timeout = datetime.timedelta(minutes=distributed_timeout_minutes)
        for ranks in dims.rank_groups(("tp", "ulysses", "ring")):
            group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if dist.get_rank() in ranks:
                same_batch = group
    _USP_GROUPS = USPGroups(
        dims=dims,
        tp=mpu.get_tensor_model_parallel_group(),
        ulysses=ulysses,
        ring=ring,
        cp=mpu.get_context_parallel_group(),
        dp=mpu.get_data_parallel_group(),
        dp_cp=mpu.get_data_parallel_group(with_context_parallel=True),
        pp=mpu.get_pipeline_model_parallel_group(),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        same_batch=same_batch,
    )
    return _USP_GROUPS


def destroy_usp_parallel() -> None:
    """Tear down megatron-core's groups and ours."""
    global _USP_GROUPS
    _USP_GROUPS = None
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()


def get_usp_groups() -> USPGroups:
    if _USP_GROUPS is None:
        raise RuntimeError("USP groups are not initialized; call initialize_usp_parallel()")
    return _USP_GROUPS


def get_ulysses_group() -> dist.ProcessGroup:
    return get_usp_groups().ulysses


def get_ring_group() -> dist.ProcessGroup:
    return get_usp_groups().ring


def get_ulysses_world_size() -> int:
    return get_usp_groups().ulysses_size


def get_ulysses_rank() -> int:
    return get_usp_groups().ulysses_rank


def get_ring_world_size() -> int:
    return get_usp_groups().ring_size


def get_ring_rank() -> int:
    return get_usp_groups().ring_rank
