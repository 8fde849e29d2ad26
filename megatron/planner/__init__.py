"""Layout planner: pick TP, Ulysses, Ring, DP, PP, ZeRO and recompute for a model, a
sequence length and a cluster.

Modules, one concern each:

* :mod:`.models`     ``--model``: a preset of :data:`megatron.shapes.PRESETS` or a file.
* :mod:`.hardware`   kernel rates, memory, link levels, presets, calibration files.
* :mod:`.cost_model` per-layer FLOPs, communication volumes, memory; step-time model.
* :mod:`.rules`      the USP paper's practice as constraints and tie-breakers.
* :mod:`.search`     enumeration, ranking, diagnosis.
* :mod:`.explain`    reasons and the ranked table.
* :mod:`.plan`       the chosen :class:`Plan`, :func:`choose_layout`, the search as JSON.
* :mod:`.validate`   predicted vs measured step times.
* :mod:`.capabilities` what ``pretrain_gpt.py`` can run here, and the flags that run a plan.
* :mod:`.documents`  packed documents (a ``--docs`` mix or a run's lengths): packed samples,
                     their pairs and ring.
* :mod:`.errors`     :class:`PlannerError`, the planner's one error.

Pure Python: nothing here imports torch at import time (packed documents import the mixes
and the chunk assignment, which do, inside :mod:`.documents`' functions). Entry points: ``tools/plan_parallel.py`` and
``pretrain_gpt.py --ulysses-degree auto --ring-degree auto`` (via :func:`choose_layout`).
"""

from megatron.planner.cost_model import (
    DEFAULT_ASSUMPTIONS,
    Assumptions,
    Estimate,
    Layout,
    Workload,
    estimate,
)
from megatron.planner.documents import Documents
from megatron.planner.errors import PlannerError
from megatron.planner.hardware import (
    CALIBRATION_SCHEMA,
    HARDWARE_PRESETS,
    Calibration,
    HardwareSpec,
    LinkLevel,
    apply_calibration,
    get_hardware,
    load_calibration,
    with_overrides,
)
from megatron.planner.models import check_model, load_model
from megatron.planner.plan import Plan, choose_layout
from megatron.planner.search import SearchResult, plan_layouts

__all__ = [
    "Assumptions",
    "CALIBRATION_SCHEMA",
    "Calibration",
    "DEFAULT_ASSUMPTIONS",
    "Documents",
    "Estimate",
    "HARDWARE_PRESETS",
    "HardwareSpec",
    "Layout",
    "LinkLevel",
    "Plan",
    "PlannerError",
    "SearchResult",
    "Workload",
    "apply_calibration",
    "check_model",
    "choose_layout",
    "estimate",
    "get_hardware",
    "load_calibration",
    "load_model",
    "plan_layouts",
    "with_overrides",
]
