"""Parallel-layout configuration of Megatron-USP and its start-up validation.

Every check raises :class:`USPConfigError` naming the command-line flag at fault and a
valid alternative, before any process group is created, so bad input never reaches a
collective (where it would hang) or a kernel (where it would give a wrong result).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megatron.usp.layout import check_seq_divisible


class USPConfigError(ValueError):
    """Bad parallel-layout input. The message names the flag and a valid value."""


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class USPParallelConfig:
    """Sizes of the parallel grid, ordered TP -> Ulysses -> Ring -> DP -> PP.

    Attributes:
        tensor_model_parallel_size: TP, ``--tensor-model-parallel-size``.
        ulysses_degree: U, ``--ulysses-degree``: all-to-all sequence parallelism.
        ring_degree: R, ``--ring-degree``: ring attention sequence parallelism.
        pipeline_model_parallel_size: PP, ``--pipeline-model-parallel-size``.
        context_parallel_size: megatron-core's ``--context-parallel-size``; optional,
            and when given it must equal U*R (it is derived otherwise).
    """

    tensor_model_parallel_size: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: Optional[int] = None

    @property
    def cp_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    def model_and_context_size(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.cp_size
            * self.pipeline_model_parallel_size
        )

    def data_parallel_size(self, world_size: int) -> int:
        self.validate_sizes(world_size)
        return world_size // self.model_and_context_size()

    # ------------------------------------------------------------------ checks
    def validate_sizes(self, world_size: int) -> None:
        """Check degrees are positive and that they tile the world."""
        for flag, value in (
            ("--tensor-model-parallel-size", self.tensor_model_parallel_size),
            ("--ulysses-degree", self.ulysses_degree),
            ("--ring-degree", self.ring_degree),
            ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise USPConfigError(f"{flag}={value!r} must be an integer >= 1; try {flag} 1")
        if self.context_parallel_size is not None and self.context_parallel_size != self.cp_size:
            raise USPConfigError(
                f"--context-parallel-size={self.context_parallel_size} disagrees with "
                f"--ulysses-degree {self.ulysses_degree} x --ring-degree {self.ring_degree} "
                f"= {self.cp_size}; drop --context-parallel-size (it is derived as U*R) "
                f"or pass --context-parallel-size {self.cp_size}"
            )
        need = self.model_and_context_size()
        if world_size % need:
            fits = [
                r
                for r in _divisors(world_size)
                if world_size
                % (self.tensor_model_parallel_size * self.ulysses_degree * r
                   * self.pipeline_model_parallel_size) == 0
            ]
            raise USPConfigError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                f"{self.tensor_model_parallel_size} x --ulysses-degree {self.ulysses_degree} x "
                f"--ring-degree {self.ring_degree} x --pipeline-model-parallel-size "
                f"{self.pipeline_model_parallel_size} = {need}; with the other degrees kept, "
                f"--ring-degree could be one of {fits}, or launch a multiple of {need} processes"
            )

    def validate_heads(self, num_attention_heads: int, num_query_groups: Optional[int]) -> None:
        """Heads must split over TP then U; KV groups must split or replicate evenly."""
        tp, u = self.tensor_model_parallel_size, self.ulysses_degree
        if num_attention_heads % tp:
            raise USPConfigError(
                f"--num-attention-heads {num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}; valid TP sizes: "
                f"{_divisors(num_attention_heads)}"
            )
        heads_per_tp = num_attention_heads // tp
        if heads_per_tp % u:
            ok = [d for d in _divisors(heads_per_tp)]
            raise USPConfigError(
                f"attention heads per TP rank ({num_attention_heads}/{tp} = {heads_per_tp}) are "
                f"not divisible by --ulysses-degree {u}; --ulysses-degree must divide "
                f"{heads_per_tp}: one of {ok} (move the rest of the parallelism to --ring-degree)"
            )
        groups = num_query_groups or num_attention_heads
        if num_attention_heads % groups:
            raise USPConfigError(
                f"--num-attention-heads {num_attention_heads} is not divisible by "
                f"--num-query-groups {groups}; use a divisor of {num_attention_heads}"
            )
        if groups % tp and tp % groups:
            raise USPConfigError(
                f"--num-query-groups {groups} and --tensor-model-parallel-size {tp} must divide "
                f"one another; try --num-query-groups {max(d for d in _divisors(num_attention_heads) if d % tp == 0 or tp % d == 0)}"
            )
        kv_per_tp = max(1, groups // tp)
        if kv_per_tp % u and u % kv_per_tp:
            ok = sorted(set(d for d in range(1, heads_per_tp + 1)
                            if heads_per_tp % d == 0 and (kv_per_tp % d == 0 or d % kv_per_tp == 0)))
            raise USPConfigError(
                f"KV heads per TP rank ({kv_per_tp}) and --ulysses-degree {u} must divide one "
                f"another (KV heads are split when more, replicated when fewer); "
                f"--ulysses-degree could be one of {ok}"
            )

    def validate_seq_length(self, seq_length: int) -> None:
        check_seq_divisible(seq_length, self.cp_size, "--seq-length")

    def validate(
        self,
        world_size: int,
        num_attention_heads: Optional[int] = None,
        num_query_groups: Optional[int] = None,
        seq_length: Optional[int] = None,
    ) -> None:
        """Run every check that the given information allows."""
        self.validate_sizes(world_size)
        if num_attention_heads is not None:
            self.validate_heads(num_attention_heads, num_query_groups)
        if seq_length is not None:
            try:
                self.validate_seq_length(seq_length)
            except ValueError as exc:
                raise USPConfigError(str(exc)) from None
