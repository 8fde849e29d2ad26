"""The parallel layout of a job, in one frozen object: :class:`ParallelDims`.

The grid has five axes, ordered from fastest- to slowest-varying rank (:data:`ORDER`)::

    tp -> ulysses -> ring -> dp -> pp

so the global rank of the process with coordinates (t, u, r, d, p) is::

    rank = t + TP * (u + U * (r + R * (d + DP * p)))

Ulysses ranks are adjacent inside each context-parallel group and Ring ranks are strided by
U: exactly megatron-core's groups for ``context_parallel_size = U*R`` with
``hierarchical_context_parallel_sizes = [U, R]`` on its ``tp-cp-ep-dp-pp`` order.

:class:`ParallelDims` takes TP, U, R, PP and the world size, derives DP and CP, owns the rank
arithmetic (pure functions of integers: no process group, no torch), and has one check,
:meth:`ParallelDims.violations`, of a layout against a model, a sequence length and a batch.
``pretrain_gpt.py``'s argument validation and :func:`megatron.usp.parallel_state.initialize_usp_parallel`
raise from it; the layout planner filters its candidates with it. Every message names the
flag at fault and a valid value.

Names: inside this module the axes are ``tp, ulysses, ring, dp, pp`` (and ``cp = U*R``); at
the boundary, :data:`MEGATRON_NAMES` maps them to megatron's argument names
(``ulysses_degree``, ``context_parallel_size``, ...) and :data:`FLAGS` to the command line.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from megatron.errors import UsageError
from megatron.shapes.model import ModelShape

ORDER: Tuple[str, ...] = ("tp", "ulysses", "ring", "dp", "pp")

FLAGS: Dict[str, str] = {
    "tp": "--tensor-model-parallel-size",
    "ulysses": "--ulysses-degree",
    "ring": "--ring-degree",
    "cp": "--context-parallel-size",
    "dp": "--data-parallel-size",
    "pp": "--pipeline-model-parallel-size",
}

# megatron's argument names -> axis names (the one copy of this mapping).
MEGATRON_NAMES: Dict[str, str] = {
    "tensor_model_parallel_size": "tp",
    "ulysses_degree": "ulysses",
    "ring_degree": "ring",
    "context_parallel_size": "cp",
    "data_parallel_size": "dp",
    "pipeline_model_parallel_size": "pp",
}

# Composite groups megatron-core and the training loop need, named by their axes.
GROUP_AXES: Dict[str, Tuple[str, ...]] = {
    "tp": ("tp",),
    "ulysses": ("ulysses",),
    "ring": ("ring",),
    "cp": ("ulysses", "ring"),
    "dp": ("dp",),
    "dp_cp": ("ulysses", "ring", "dp"),
    "pp": ("pp",),
    "tp_cp": ("tp", "ulysses", "ring"),
    "tp_dp": ("tp", "dp"),
    "tp_dp_cp": ("tp", "ulysses", "ring", "dp"),
    "model_parallel": ("tp", "pp"),
}


class USPConfigError(UsageError, ValueError):
    """Bad parallel-layout input. The message names the flag and a valid value."""


def divisors(n: int) -> List[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Violation:
    """One rule a layout breaks: the rule's id (the planner counts rejections by it) and a
    message naming the flag and a valid value."""

    rule: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the TP -> Ulysses -> Ring -> DP -> PP grid; DP is derived from the world.

    Construction checks that the degrees are positive integers that tile the world and raises
    :class:`USPConfigError` naming the flag otherwise; :meth:`violations` checks the rest.
    """

    world_size: int
    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for axis in ("tp", "ulysses", "ring", "pp"):
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise USPConfigError(f"{FLAGS[axis]}={value!r} must be an integer >= 1; try "
                                     f"{FLAGS[axis]} 1")
        if (isinstance(self.world_size, bool) or not isinstance(self.world_size, int)
                or self.world_size < 1):
            raise USPConfigError(f"world size {self.world_size!r} must be an integer >= 1")
        need = self.model_and_context_size
        if self.world_size % need:
            raise USPConfigError(self._untiled_message(need))

    def _untiled_message(self, need: int) -> str:
        others = self.tp * self.ulysses * self.pp
        rings = [r for r in divisors(self.world_size) if self.world_size % (others * r) == 0]
        ulysses = [u for u in divisors(self.world_size)
                   if self.world_size % (self.tp * u * self.ring * self.pp) == 0]
        if rings:
            fix = f"with the other degrees kept, --ring-degree could be one of {rings}"
        elif ulysses:
            fix = (f"with the other degrees kept, --ulysses-degree could be one of {ulysses} "
                   f"with --ring-degree {self.ring}")
        else:
            fix = self._other_context_splits()
        larger = -(-self.world_size // need) * need
        return (f"world size {self.world_size} is not divisible by --tensor-model-parallel-size "
                f"{self.tp} x --ulysses-degree {self.ulysses} x --ring-degree {self.ring} x "
                f"--pipeline-model-parallel-size {self.pp} = {need}; {fix}, or launch a "
                f"multiple of {need} processes (e.g. {larger})")

    def _other_context_splits(self) -> str:
        """What fits when neither degree alone can change: other U x R pairs at this TP and
        PP, or other TP x PP."""
        model = self.tp * self.pp
        if self.world_size % model:
            return (f"--tensor-model-parallel-size {self.tp} x --pipeline-model-parallel-size "
                    f"{self.pp} = {model} alone does not divide it")
        room = self.world_size // model
        pairs = [f"--ulysses-degree {u} --ring-degree {room // u}" for u in divisors(room)]
        return f"a context-parallel split that fits is one of: {'; '.join(pairs)}"

    @classmethod
    def from_flags(cls, world_size: int, tensor_model_parallel_size: int = 1,
                   ulysses_degree: int = 1, ring_degree: int = 1,
                   pipeline_model_parallel_size: int = 1,
                   context_parallel_size: Optional[int] = None) -> "ParallelDims":
        """From megatron's argument names; ``--context-parallel-size``, when given, must be U*R."""
        dims = cls(world_size, tp=tensor_model_parallel_size, ulysses=ulysses_degree,
                   ring=ring_degree, pp=pipeline_model_parallel_size)
        if context_parallel_size is not None and context_parallel_size != dims.cp:
            raise USPConfigError(
                f"--context-parallel-size={context_parallel_size} disagrees with "
                f"--ulysses-degree {dims.ulysses} x --ring-degree {dims.ring} = {dims.cp}; drop "
                f"--context-parallel-size (it is derived as U*R) or pass "
                f"--context-parallel-size {dims.cp}")
        return dims

    # ------------------------------------------------------------------ sizes
    @property
    def cp(self) -> int:
        """Context-parallel size: U * R."""
        return self.ulysses * self.ring

    @property
    def model_and_context_size(self) -> int:
        return self.tp * self.ulysses * self.ring * self.pp

    @property
    def dp(self) -> int:
        return self.world_size // self.model_and_context_size

    def size(self, axis: str) -> int:
        return self.cp if axis == "cp" else getattr(self, axis)

    @property
    def sizes(self) -> Tuple[int, ...]:
        return tuple(self.size(a) for a in ORDER)

    def short(self) -> str:
        """``TP1 U2 R2 DP1 PP1``: how logs and metrics name the layout."""
        return f"TP{self.tp} U{self.ulysses} R{self.ring} DP{self.dp} PP{self.pp}"

    def megatron_kwargs(self) -> Dict[str, Any]:
        """The degrees in megatron-core's names (``initialize_model_parallel`` and
        ``TransformerConfig``): CP is U*R, its hierarchy [Ulysses, Ring]."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "context_parallel_size": self.cp,
            "hierarchical_context_parallel_sizes": [self.ulysses, self.ring],
        }

    # ------------------------------------------------------------------ heads
    def kv_heads_per_tp_rank(self, kv_heads: int) -> int:
        """``max(1, g/TP)``: megatron replicates a KV head over TP ranks when g < TP."""
        return max(1, kv_heads // self.tp)

    def kv_heads_into_all_to_all(self, kv_heads: int) -> int:
        """KV heads per TP rank as they enter the Ulysses all-to-all: split when U divides
        them, replicated up to U when they divide U."""
        kv_t = self.kv_heads_per_tp_rank(kv_heads)
        return kv_t if kv_t % self.ulysses == 0 else self.ulysses

    # ------------------------------------------------------------------ the check
    def violations(self, model: Optional[ModelShape] = None, seq_length: Optional[int] = None,
                   micro_batch_size: Optional[int] = None,
                   global_batch_size: Optional[int] = None,
                   sequence_parallel: bool = False) -> List[Violation]:
        """Every rule this layout breaks for what is given (``None``: not checked).

        Rules (ids in brackets): heads split over TP then U [ulysses-heads]; KV groups divide
        the heads, split or replicate evenly over TP and U [ulysses-kv-heads]; the sequence
        cuts into 2*U*R chunks [seq-divisible] and, with Megatron sequence parallelism, each
        CP rank's tokens split over TP [sequence-parallel]; PP divides the layers [pp-layers];
        micro-batch x DP divides the global batch [batch].
        """
        out: List[Violation] = []
        if model is not None:
            out += self._head_violations(model)
            if model.num_layers is not None and model.num_layers % self.pp:
                out.append(Violation("pp-layers", (
                    f"--num-layers {model.num_layers} is not divisible by "
                    f"--pipeline-model-parallel-size {self.pp}; use one of "
                    f"{divisors(model.num_layers)}")))
        if seq_length is not None:
            # Imported here: token_order needs torch, which `pretrain_gpt.py --help` should
            # not wait for.
            from megatron.usp.token_order import seq_length_problem  # torch-free module

            problem = seq_length_problem(seq_length, self.cp, "--seq-length")
            if problem:
                out.append(Violation("seq-divisible", problem))
            elif sequence_parallel and self.tp > 1 and (seq_length // self.cp) % self.tp:
                out.append(Violation("sequence-parallel",
                                     self._sequence_parallel_message(seq_length)))
        if micro_batch_size is not None and global_batch_size is not None:
            per_step = micro_batch_size * self.dp
            if global_batch_size % per_step:
                lo = max(per_step, global_batch_size // per_step * per_step)
                out.append(Violation("batch", (
                    f"--global-batch-size {global_batch_size} is not divisible by "
                    f"--micro-batch-size {micro_batch_size} x data-parallel size {self.dp} = "
                    f"{per_step}; try --global-batch-size {lo} or {lo + per_step}")))
        return out

    def check(self, model: Optional[ModelShape] = None, seq_length: Optional[int] = None,
              micro_batch_size: Optional[int] = None, global_batch_size: Optional[int] = None,
              sequence_parallel: bool = False) -> None:
        """Raise :class:`USPConfigError` with the first of :meth:`violations`."""
        found = self.violations(model, seq_length, micro_batch_size, global_batch_size,
                                sequence_parallel)
        if found:
            raise USPConfigError(found[0].message)

    def _head_violations(self, model: ModelShape) -> List[Violation]:
        heads, groups, tp, u = model.num_attention_heads, model.kv_heads, self.tp, self.ulysses
        if heads % tp:
            return [Violation("ulysses-heads", (
                f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size "
                f"{tp}; valid TP sizes: {divisors(heads)}"))]
        heads_tp = heads // tp
        if heads_tp % u:
            return [Violation("ulysses-heads", (
                f"attention heads per TP rank ({heads}/{tp} = {heads_tp}) are not divisible by "
                f"--ulysses-degree {u}; --ulysses-degree must divide {heads_tp}: one of "
                f"{divisors(heads_tp)} (move the rest of the parallelism to --ring-degree)"))]
        if heads % groups:
            return [Violation("ulysses-kv-heads", (
                f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}; "
                f"use a divisor of {heads}"))]
        if groups % tp and tp % groups:
            fit = max(d for d in divisors(heads) if d % tp == 0 or tp % d == 0)
            return [Violation("ulysses-kv-heads", (
                f"--num-query-groups {groups} and --tensor-model-parallel-size {tp} must divide "
                f"one another; try --num-query-groups {fit}"))]
        kv_t = self.kv_heads_per_tp_rank(groups)
        if kv_t % u and u % kv_t:
            ok = [d for d in divisors(heads_tp) if kv_t % d == 0 or d % kv_t == 0]
            return [Violation("ulysses-kv-heads", (
                f"KV heads per TP rank ({kv_t}) and --ulysses-degree {u} must divide one another "
                f"(KV heads are split when more, replicated when fewer); --ulysses-degree could "
                f"be one of {ok}"))]
        return []

    def _sequence_parallel_message(self, seq_length: int) -> str:
        cp, tp = self.cp, self.tp
        step = math.lcm(2 * cp if cp > 1 else 1, cp * tp)
        lower = seq_length // step * step
        sugg = f"{lower + step}" if lower == 0 else f"{lower} or {lower + step}"
        return (f"--sequence-parallel: the {seq_length // cp} tokens per context-parallel rank "
                f"(--seq-length {seq_length} / U*R {cp}) do not split over "
                f"--tensor-model-parallel-size {tp}; try --seq-length {sugg}, or drop "
                f"--sequence-parallel")

    # ------------------------------------------------------------------ rank arithmetic
    def coords(self, rank: int) -> Dict[str, int]:
        """Coordinates of ``rank`` on each axis (``tp`` varies fastest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        out, rest = {}, rank
        for axis in ORDER:
            out[axis] = rest % self.size(axis)
            rest //= self.size(axis)
        return out

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """Inverse of :meth:`coords` (missing axes count as 0)."""
        rank, stride = 0, 1
        for axis in ORDER:
            c = coords.get(axis, 0)
            if not 0 <= c < self.size(axis):
                raise ValueError(f"coordinate {axis}={c} outside [0, {self.size(axis)})")
            rank += c * stride
            stride *= self.size(axis)
        return rank

    def rank_groups(self, axes: Sequence[str]) -> List[List[int]]:
        """All groups that vary ``axes`` and fix the others.

        Within a group the axis that comes first in :data:`ORDER` varies fastest (so a group's
        local rank follows the grid order, e.g. CP rank ``c = u + U * r``); groups are listed
        with the fixed axes enumerated the same way, the order megatron-core's
        ``RankGenerator`` produces.
        """
        unknown = [a for a in axes if a not in ORDER]
        if unknown:
            raise ValueError(f"unknown axes {unknown}; known: {ORDER}")
        varying = [a for a in ORDER if a in axes]
        fixed = [a for a in ORDER if a not in axes]
        groups = []
        for fixed_vals in itertools.product(*(range(self.size(a)) for a in reversed(fixed))):
            base = dict(zip(reversed(fixed), fixed_vals))
            group = []
            for var_vals in itertools.product(*(range(self.size(a)) for a in reversed(varying))):
                group.append(self.rank_of({**base, **dict(zip(reversed(varying), var_vals))}))
            groups.append(group)
        return groups

    def all_groups(self) -> Dict[str, List[List[int]]]:
        """Every named group (:data:`GROUP_AXES`) plus the (position-)embedding groups: first
        and last pipeline stage, and the first stage, of each PP group."""
        groups = {name: self.rank_groups(axes) for name, axes in GROUP_AXES.items()}
        pp_groups = groups["pp"]
        groups["embedding"] = [[g[0]] if len(g) == 1 else [g[0], g[-1]] for g in pp_groups]
        groups["position_embedding"] = [[g[0]] for g in pp_groups]
        return groups


def group_containing(groups: List[List[int]], rank: int) -> List[int]:
    """The one group in ``groups`` that contains ``rank``."""
    found = [g for g in groups if rank in g]
    if len(found) != 1:
        raise ValueError(f"rank {rank} is in {len(found)} groups, expected exactly 1")
    return found[0]


def ring_neighbours(ring_rank: int, ring_size: int) -> Tuple[int, int]:
    """(send_to, recv_from) ring-group ranks for one step of a ring pass."""
    return (ring_rank + 1) % ring_size, (ring_rank - 1) % ring_size
