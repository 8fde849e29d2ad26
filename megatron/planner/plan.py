"""The planner's answer: :class:`Plan`, :func:`choose_layout` (the contract
``pretrain_gpt.py --ulysses-degree auto`` uses) and the JSON form of a search.

Top floor of the planner: it reads the search (:mod:`.search`) and its explanations
(:mod:`.explain`); neither imports it.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from megatron.planner.capabilities import (
    PRECISION_FLAGS,
    Capabilities,
    installed_capabilities,
    layout_flags,
    loss_flags,
    model_flags,
    runnable,
)
from megatron.planner.cost_model import DEFAULT_ASSUMPTIONS, Assumptions, Estimate, Workload
from megatron.planner.documents import DOCUMENT_FLAGS, Documents, describe
from megatron.planner.explain import reasons_for
from megatron.planner.hardware import HardwareSpec
from megatron.planner.search import RankedLayout, SearchResult, plan_layouts
from megatron.shapes import ModelShape


@dataclass
class Plan:
    """The chosen layout, as ``pretrain_gpt.py --ulysses-degree auto`` consumes it."""

    tensor_model_parallel_size: int
    ulysses_degree: int
    ring_degree: int
    data_parallel_size: int
    pipeline_model_parallel_size: int
    zero_stage: int
    recompute: str
    predicted_step_time_s: float
    memory_gib: float
    reasons: List[str]
    estimate: Optional[Estimate] = field(default=None, repr=False, compare=False)
    recompute_modules: Tuple[str, ...] = ("mlp",)
    pretrain_flags: List[str] = field(default_factory=list)
    gpus_per_node: int = 0

    @property
    def context_parallel_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    def megatron_config(self) -> Dict[str, Any]:
        """The plan in megatron-core's config field names
        (``TransformerConfig`` / ``DistributedDataParallelConfig``).

        ZeRO-1 is the distributed optimizer; ZeRO-2/3 are Megatron-FSDP's
        ``optim_grads`` / ``optim_grads_params`` sharding. Selective recompute is
        ``recompute_modules`` (``["mlp"]``, with ``"layernorm"`` where TransformerEngine
        is installed: what the cost model assumed); full is uniform, one layer per
        checkpoint.
        """
        cfg: Dict[str, Any] = {
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "ulysses_degree": self.ulysses_degree,
            "ring_degree": self.ring_degree,
            "context_parallel_size": self.context_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "sequence_parallel": self.tensor_model_parallel_size > 1,
            "use_distributed_optimizer": self.zero_stage == 1,
            "use_megatron_fsdp": self.zero_stage >= 2,
            "data_parallel_sharding_strategy": {0: "no_shard", 1: "optim", 2: "optim_grads",
                                                3: "optim_grads_params"}[self.zero_stage],
            "recompute_granularity": None,
            "recompute_method": None,
            "recompute_num_layers": None,
            "recompute_modules": None,
        }
        if self.recompute == "selective":
            cfg.update(recompute_granularity="selective",
                       recompute_modules=list(self.recompute_modules))
        elif self.recompute == "full":
            cfg.update(recompute_granularity="full", recompute_method="uniform",
                       recompute_num_layers=1)
        return cfg

    def command(self) -> str:
        """The launch line: ``torchrun`` over the plan's nodes and ``pretrain_gpt.py`` with
        :attr:`pretrain_flags` (model shape and architecture with its sliding window,
        precision, degrees, ZeRO, recompute, loss, batch, the document flags of a ``--docs``
        plan), each quoted for a POSIX shell
        (a window pattern ``[1,0,1,0]`` stays one word)."""
        if not self.pretrain_flags:
            return "(not runnable by pretrain_gpt.py in this installation)"
        world = (self.tensor_model_parallel_size * self.context_parallel_size
                 * self.data_parallel_size * self.pipeline_model_parallel_size)
        per_node = min(self.gpus_per_node or world, world)
        nodes = world // per_node
        launch = f"torchrun --nproc-per-node {per_node}"
        if nodes > 1:
            launch += f" --nnodes {nodes} --node-rank NODE_RANK --master-addr HOST --master-port PORT"
        return f"{launch} pretrain_gpt.py {shlex.join(self.pretrain_flags)}"

    def to_dict(self) -> Dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "estimate"}
        d["context_parallel_size"] = self.context_parallel_size
        if self.estimate is not None:
            d["prediction"] = self.estimate.to_dict()
        d["megatron_config"] = self.megatron_config()
        d["command"] = self.command()
        return d


def plan_flags(result: SearchResult, e: Estimate) -> List[str]:
    """``pretrain_gpt.py`` flags that run estimate ``e`` of ``result``: everything the cost
    model counted (model and architecture, ``--bf16``, layout, loss, the document flags
    with packed documents, and the global batch
    it assumed); the data, LR and output flags are the user's."""
    w, a, lay = result.workload, result.assumptions, e.layout
    if runnable(lay, installed_capabilities()):
        return []  # planned for another stack (capabilities=FULL_MEGATRON): no flags here
    return (model_flags(w.model, w.seq_length) + PRECISION_FLAGS
            + layout_flags(lay, a.selective_recompute_modules, a.tp_sequence_parallel)
            + loss_flags(a.loss_chunk_tokens)
            + (list(DOCUMENT_FLAGS) if w.documents is not None else [])
            + ["--micro-batch-size", str(w.micro_batch_size),
               "--global-batch-size", str(w.global_batch(lay, a))])


def plan_from(result: SearchResult, ranked: RankedLayout) -> Plan:
    e = ranked.estimate
    lay = e.layout
    return Plan(
        tensor_model_parallel_size=lay.tp,
        ulysses_degree=lay.ulysses,
        ring_degree=lay.ring,
        data_parallel_size=lay.dp,
        pipeline_model_parallel_size=lay.pp,
        zero_stage=lay.zero_stage,
        recompute=lay.recompute,
        predicted_step_time_s=e.step_time_s,
        memory_gib=e.memory.total,
        reasons=reasons_for(result, ranked),
        estimate=e,
        recompute_modules=tuple(result.assumptions.selective_recompute_modules),
        pretrain_flags=plan_flags(result, e),
        gpus_per_node=result.workload.gpus_per_node,
    )


def choose_layout(
    model: ModelShape,
    seq_length: int,
    world_size: int,
    gpus_per_node: int,
    hardware: Union[HardwareSpec, str],
    micro_batch_size: int = 1,
    global_batch_size: Optional[int] = None,
    fixed: Optional[Dict[str, Any]] = None,
    assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
    capabilities: Optional[Capabilities] = None,
    documents: Union[None, str, Documents] = None,
) -> Plan:
    """The best layout for ``model`` at ``seq_length`` on ``world_size`` GPUs.

    ``fixed`` holds degrees the user gave explicitly, in megatron's argument names
    (see :data:`FIXED_KEYS`; None values mean "choose"); ``assumptions`` what the run will
    do that the cost model cannot choose (e.g. whether TP uses sequence parallelism);
    ``capabilities`` what the training script can run (default: ``pretrain_gpt.py`` in
    this installation, :mod:`.capabilities`); ``documents`` the packed documents of a run
    with ``--reset-attention-mask`` (a mix's name or :class:`~.documents.Documents`; None:
    dense sequences).
    Raises :class:`PlannerError` naming the binding limit and the smallest change that
    would fit when no layout is feasible.
    """
    w = Workload(model, seq_length, world_size, gpus_per_node, micro_batch_size,
                 global_batch_size, documents)
    result = plan_layouts(w, hardware, fixed, top=1, assumptions=assumptions,
                          capabilities=capabilities)
    return plan_from(result, result.best)


def documents_json(w: Workload) -> Union[None, str, Dict[str, Any]]:
    """The workload's documents in JSON: a mix's name, or the lengths' name and summary."""
    d = w.documents
    if d is None or d.mix is not None:
        return None if d is None else d.mix
    return {"name": d.name(), "summary": describe(d, w.seq_length, w.micro_batch_size)}


def result_to_json(result: SearchResult) -> Dict[str, Any]:
    w = result.workload
    return {
        "workload": {
            "model": w.model.to_dict(),
            "seq_length": w.seq_length,
            "world_size": w.world_size,
            "gpus_per_node": w.gpus_per_node,
            "micro_batch_size": w.micro_batch_size,
            "global_batch_size": w.global_batch_size,
            "documents": documents_json(w),
        },
        "hardware": {
            "name": result.hardware.name,
            "description": result.hardware.describe(),
            "sources": dict(result.hardware.sources),
        },
        "fixed": result.fixed,
        "evaluated": len(result.evaluated),
        "feasible": len(result.feasible()),
        "rejections": {k: {"count": v, "example": result.rejections.examples[k]}
                       for k, v in result.rejections.counts.items()},
        "plans": [
            dict(plan_from(result, r).to_dict(), rank=r.rank,
                 tie_break_rule=r.decided_by.id if r.decided_by else None)
            for r in result.ranked
        ],
    }
