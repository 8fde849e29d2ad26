"""Pure rank arithmetic for the USP process grid.

The grid has five axes, ordered from fastest- to slowest-varying rank::

    tp -> ulysses -> ring -> dp -> pp          (USP_ORDER)

so the global rank of a process with coordinates (t, u, r, d, p) is::

    rank = t + TP * (u + U * (r + R * (d + DP * p)))

Ulysses ranks are therefore adjacent inside each context-parallel group and Ring
ranks are strided by U, which is what megatron-core's hierarchical context-parallel
groups give for ``hierarchical_context_parallel_sizes=[U, R]`` on top of the
``tp-cp-ep-dp-pp`` order: the context-parallel axis of size U*R is split into an inner
(Ulysses) level and an outer (Ring) level.

Every function here is a pure function of integers: no process group, no torch.
``tests/unit/test_grid.py`` checks them against megatron-core's ``RankGenerator``
and ``tests/distributed/test_parallel_state.py`` checks the live groups against them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

USP_ORDER: Tuple[str, ...] = ("tp", "ulysses", "ring", "dp", "pp")

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


@dataclass(frozen=True)
class GridShape:
    """Sizes of the five axes. ``dp`` is derived from the world size."""

    world_size: int
    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "ulysses", "ring", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"grid size {name}={value!r} must be a positive integer")
        if self.world_size % self.model_and_context_size:
            raise ValueError(
                f"world size {self.world_size} is not divisible by "
                f"TP*U*R*PP = {self.tp}*{self.ulysses}*{self.ring}*{self.pp} "
                f"= {self.model_and_context_size}"
            )

    @property
    def model_and_context_size(self) -> int:
        return self.tp * self.ulysses * self.ring * self.pp

    @property
    def cp(self) -> int:
        """Context-parallel size: U * R."""
        return self.ulysses * self.ring

    @property
    def dp(self) -> int:
        return self.world_size // self.model_and_context_size

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    @property
    def sizes(self) -> Tuple[int, ...]:
        return tuple(self.size(a) for a in USP_ORDER)


def coords_of_rank(shape: GridShape, rank: int) -> Dict[str, int]:
    """Coordinates of ``rank`` on each axis (``tp`` varies fastest)."""
    if not 0 <= rank < shape.world_size:
        raise ValueError(f"rank {rank} outside world of size {shape.world_size}")
    coords = {}
    rest = rank
    for axis in USP_ORDER:
        size = shape.size(axis)
        coords[axis] = rest % size
        rest //= size
    return coords


def rank_of_coords(shape: GridShape, coords: Dict[str, int]) -> int:
    """Inverse of :func:`coords_of_rank`."""
    rank = 0
    stride = 1
    for axis in USP_ORDER:
        size = shape.size(axis)
        c = coords.get(axis, 0)
        if not 0 <= c < size:
            raise ValueError(f"coordinate {axis}={c} outside [0, {size})")
        rank += c * stride
        stride *= size
    return rank


def rank_groups(shape: GridShape, axes: Sequence[str]) -> List[List[int]]:
    """All groups that vary ``axes`` and fix the other axes.

    Within a group, ranks are listed with the axis that comes first in
    :data:`USP_ORDER` varying fastest (so a group's local rank follows the grid
    order, e.g. CP-group rank ``c = u + U * r``). Groups are listed with the fixed
    axes enumerated the same way, which is the order megatron-core's
    ``RankGenerator`` produces.
    """
    unknown = [a for a in axes if a not in USP_ORDER]
    if unknown:
        raise ValueError(f"unknown axes {unknown}; known: {USP_ORDER}")
    varying = [a for a in USP_ORDER if a in axes]
    fixed = [a for a in USP_ORDER if a not in axes]
    groups = []
    for fixed_vals in itertools.product(*(range(shape.size(a)) for a in reversed(fixed))):
        fixed_coords = dict(zip(reversed(fixed), fixed_vals))
        group = []
        for var_vals in itertools.product(*(range(shape.size(a)) for a in reversed(varying))):
            coords = dict(fixed_coords)
            coords.update(zip(reversed(varying), var_vals))
            group.append(rank_of_coords(shape, coords))
        groups.append(group)
    return groups


def embedding_groups(shape: GridShape) -> List[List[int]]:
    """Ranks holding tied word embeddings: first and last pipeline stage of each PP group."""
    out = []
    for pp_ranks in rank_groups(shape, ("pp",)):
        out.append([pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]])
    return out


def position_embedding_groups(shape: GridShape) -> List[List[int]]:
    """Ranks holding learned position embeddings: the first pipeline stage."""
    return [[pp_ranks[0]] for pp_ranks in rank_groups(shape, ("pp",))]


def all_groups(shape: GridShape) -> Dict[str, List[List[int]]]:
    """Every named group of the grid (see :data:`GROUP_AXES`) plus the embedding groups."""
    groups = {name: rank_groups(shape, axes) for name, axes in GROUP_AXES.items()}
    groups["embedding"] = embedding_groups(shape)
    groups["position_embedding"] = position_embedding_groups(shape)
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
