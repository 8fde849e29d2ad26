"""Predicted vs measured step times (and memory) for layouts that were actually run.

Input: a JSON file of measured runs (schema ``megatron-usp-measurements/1``, documented
in ``docs/planner.md``). A ``"train"`` run names a model, a sequence length, a cluster
shape, a layout and its measured step time (median of timed steps, warm-up excluded)
and optionally its measured peak memory (``torch.cuda.max_memory_allocated``). An
``"attention"`` run names one USP attention call (heads, KV heads, head dim, sequence,
Ulysses x Ring, forward or forward+backward) and its measured time, as
``tools/bench_attention.py`` reports it.

Output: one row per run with predicted / measured, whether it is within the tolerance
(25% by default), and the predicted time breakdown so a gap can be explained.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Union

from megatron.planner.cost_model import (
    DEFAULT_ASSUMPTIONS,
    Assumptions,
    AttentionEstimate,
    AttentionWorkload,
    Estimate,
    Layout,
    Workload,
    estimate,
    estimate_attention,
)
from megatron.planner.errors import PlannerError
from megatron.planner.hardware import (
    HardwareSpec,
    apply_calibration,
    attention_bench_mask_problem,
    get_hardware,
    load_calibration,
    read_json,
)
from megatron.planner.models import load_model, model_from_mapping
from megatron.shapes import ModelShape
from megatron.usp.parallel_dims import MEGATRON_NAMES

MEASUREMENTS_SCHEMA = "megatron-usp-measurements/1"
DEFAULT_TOLERANCE = 0.25

_RUN_KEYS = {"name", "kind", "model", "seq_length", "gpus", "gpus_per_node",
             "micro_batch_size", "global_batch_size", "layout", "measured_step_time_s",
             "measured_memory_gib", "notes"}
_ATTENTION_KEYS = {"name", "kind", "heads", "kv_heads", "head_dim", "seq_length", "batch",
                   "backward", "gpus", "gpus_per_node", "layout", "measured_step_time_s",
                   "notes"}
# A run's "layout" object: megatron's names for the degrees, plus ZeRO and recompute.
_LAYOUT_KEYS = {**{name: axis for name, axis in MEGATRON_NAMES.items() if axis not in ("cp", "dp")},
                "zero_stage": "zero_stage", "recompute": "recompute"}


@dataclass
class RunComparison:
    name: str
    estimate: Union[Estimate, AttentionEstimate]
    measured_step_time_s: float
    measured_memory_gib: Optional[float]
    tolerance: float

    @property
    def time_ratio(self) -> float:
        """predicted / measured."""
        return self.estimate.step_time_s / self.measured_step_time_s

    @property
    def predicted_memory_gib(self) -> Optional[float]:
        return self.estimate.memory.total if isinstance(self.estimate, Estimate) else None

    @property
    def memory_ratio(self) -> Optional[float]:
        if self.measured_memory_gib is None or self.predicted_memory_gib is None:
            return None
        return self.predicted_memory_gib / self.measured_memory_gib

    @property
    def ok(self) -> bool:
        good = abs(self.time_ratio - 1) <= self.tolerance
        if self.memory_ratio is not None:
            good = good and abs(self.memory_ratio - 1) <= self.tolerance
        return good


@dataclass
class ValidationReport:
    hardware: HardwareSpec
    runs: List[RunComparison] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.runs)

    def format(self) -> str:
        lines = self.hardware.describe() + [""]
        head = (f"{'run':<44} {'layout':<34} {'pred ms':>10} {'meas ms':>10} {'pred/meas':>9} "
                f"{'pred GiB':>8} {'meas GiB':>8}  verdict")
        lines += [head, "-" * len(head)]
        for r in self.runs:
            pred_mem = r.predicted_memory_gib
            lines.append(
                f"{r.name[:44]:<44} {_layout_text(r.estimate):<34} "
                f"{r.estimate.step_time_s * 1e3:10.1f} {r.measured_step_time_s * 1e3:10.1f} "
                f"{r.time_ratio:9.2f} "
                f"{_num(pred_mem)} {_num(r.measured_memory_gib)}  "
                f"{'ok' if r.ok else 'OUTSIDE ' + format(r.tolerance, '.0%')}")
        for r in self.runs:
            if r.ok:
                continue
            lines.append(f"\n{r.name}: predicted breakdown (s) to explain the gap:")
            times = (asdict(r.estimate.time) if isinstance(r.estimate, Estimate)
                     else asdict(r.estimate.times))
            for key, value in times.items():
                if value:
                    lines.append(f"  {key:<14} {value:9.4f}")
            if isinstance(r.estimate, Estimate):
                lines.append("  memory (GiB): " + ", ".join(
                    f"{k} {v:.1f}" for k, v in asdict(r.estimate.memory).items() if v))
        tol = self.runs[0].tolerance if self.runs else DEFAULT_TOLERANCE
        verdict = "all within" if self.ok else "NOT all within"
        lines.append(f"\n{len(self.runs)} runs, {verdict} {tol:.0%} of the measurement")
        return "\n".join(lines)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "hardware": self.hardware.name,
            "ok": self.ok,
            "runs": [
                {
                    "name": r.name,
                    "layout": asdict(r.estimate.layout),
                    "predicted_step_time_s": r.estimate.step_time_s,
                    "measured_step_time_s": r.measured_step_time_s,
                    "time_ratio": r.time_ratio,
                    "predicted_memory_gib": r.predicted_memory_gib,
                    "measured_memory_gib": r.measured_memory_gib,
                    "memory_ratio": r.memory_ratio,
                    "ok": r.ok,
                    "prediction": (r.estimate.to_dict() if isinstance(r.estimate, Estimate)
                                   else asdict(r.estimate.times)),
                }
                for r in self.runs
            ],
        }


def _layout_text(e: Union[Estimate, AttentionEstimate]) -> str:
    if isinstance(e, Estimate):
        return e.layout.short()
    return (f"attention U{e.layout.ulysses} x R{e.layout.ring} "
            f"{'fwd+bwd' if e.times.bwd else 'fwd'}")


def _num(x: Optional[float]) -> str:
    return f"{x:8.1f}" if x is not None else f"{'-':>8}"


def _model_of(run: Dict[str, Any], where: str) -> ModelShape:
    spec = run.get("model")
    if isinstance(spec, str):
        return load_model(spec)
    if isinstance(spec, dict):
        return model_from_mapping(spec, where)
    raise PlannerError(f"{where}: 'model' must be a preset name or an object of model fields")


def _layout_of(run: Dict[str, Any], gpus: int, where: str) -> Layout:
    lay = run.get("layout")
    if not isinstance(lay, dict):
        raise PlannerError(f"{where}: 'layout' must be an object with {sorted(_LAYOUT_KEYS)}")
    unknown = sorted(set(lay) - set(_LAYOUT_KEYS))
    if unknown:
        raise PlannerError(f"{where}: layout has unknown key(s) {unknown}; allowed "
                           f"{sorted(_LAYOUT_KEYS)}")
    kw = {"tp": 1, "ulysses": 1, "ring": 1, "pp": 1, "zero_stage": 1, "recompute": "none",
          **{_LAYOUT_KEYS[k]: v for k, v in lay.items()}}
    mp = kw["tp"] * kw["ulysses"] * kw["ring"] * kw["pp"]
    if gpus % mp:
        raise PlannerError(f"{where}: layout needs a multiple of {mp} GPUs, 'gpus' is {gpus}")
    return Layout.of(kw["tp"], kw["ulysses"], kw["ring"], gpus // mp, kw["pp"],
                     kw["zero_stage"], kw["recompute"])


def _positive_number(run: Dict[str, Any], key: str, where: str) -> float:
    v = run.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise PlannerError(f"{where}: '{key}' must be a number > 0, got {v!r}")
    return float(v)


def _int(run: Dict[str, Any], key: str, where: str, default: Optional[int] = None) -> int:
    v = run.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PlannerError(f"{where}: '{key}' must be an integer >= 1, got {v!r}")
    return v


def compare_attention_run(run: Dict[str, Any], hw: HardwareSpec, where: str,
                          tolerance: float = DEFAULT_TOLERANCE,
                          assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> RunComparison:
    """Predict one measured attention call (``"kind": "attention"``)."""
    unknown = sorted(set(run) - _ATTENTION_KEYS)
    if unknown:
        raise PlannerError(f"{where}: unknown key(s) {unknown}; allowed {sorted(_ATTENTION_KEYS)}")
    gpus = _int(run, "gpus", where)
    lay = run.get("layout") or {}
    u, r = lay.get("ulysses_degree", 1), lay.get("ring_degree", 1)
    aw = AttentionWorkload(
        heads=_int(run, "heads", where), kv_heads=_int(run, "kv_heads", where, run.get("heads")),
        head_dim=_int(run, "head_dim", where), seq_length=_int(run, "seq_length", where),
        world_size=gpus, gpus_per_node=_int(run, "gpus_per_node", where, gpus),
        batch=_int(run, "batch", where, 1), backward=bool(run.get("backward", True)))
    return RunComparison(
        name=str(run.get("name", where)),
        estimate=estimate_attention(aw, u, r, hw, assumptions),
        measured_step_time_s=_positive_number(run, "measured_step_time_s", where),
        measured_memory_gib=None,
        tolerance=tolerance,
    )


def compare_run(run: Dict[str, Any], hw: HardwareSpec, where: str,
                tolerance: float = DEFAULT_TOLERANCE,
                assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> RunComparison:
    """Predict one measured run and pair the prediction with the measurement."""
    kind = run.get("kind", "train")
    if kind == "attention":
        return compare_attention_run(run, hw, where, tolerance, assumptions)
    if kind != "train":
        raise PlannerError(f"{where}: 'kind' must be 'train' or 'attention', got {kind!r}")
    unknown = sorted(set(run) - _RUN_KEYS)
    if unknown:
        raise PlannerError(f"{where}: unknown key(s) {unknown}; allowed {sorted(_RUN_KEYS)}")
    gpus = _int(run, "gpus", where)
    w = Workload(
        model=_model_of(run, where),
        seq_length=_int(run, "seq_length", where),
        world_size=gpus,
        gpus_per_node=_int(run, "gpus_per_node", where, gpus),
        micro_batch_size=_int(run, "micro_batch_size", where, 1),
        global_batch_size=run.get("global_batch_size"),
    )
    layout = _layout_of(run, gpus, where)
    mem = run.get("measured_memory_gib")
    return RunComparison(
        name=str(run.get("name", where)),
        estimate=estimate(w, layout, hw, assumptions),
        measured_step_time_s=_positive_number(run, "measured_step_time_s", where),
        measured_memory_gib=None if mem is None else _positive_number(run, "measured_memory_gib", where),
        tolerance=tolerance,
    )


def validate_measurements(path: str, hardware: Union[HardwareSpec, str, None] = None,
                          tolerance: float = DEFAULT_TOLERANCE,
                          assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> ValidationReport:
    """Compare every run of a measurements file with the cost model.

    The hardware is ``hardware`` if given, else the file's ``"hardware"`` preset, with
    the file's ``"calibration"`` files (paths relative to the measurements file)
    applied on top.
    """
    data = read_json(path, "--validate")
    if isinstance(data, dict) and data.get("tool") == "bench_attention":
        return validate_attention_bench(path, data, hardware, tolerance, assumptions)
    if not isinstance(data, dict) or data.get("schema") != MEASUREMENTS_SCHEMA:
        raise PlannerError(f"--validate {path}: expected an object with schema "
                           f"{MEASUREMENTS_SCHEMA!r}")
    hw = get_hardware(hardware if hardware is not None else data.get("hardware", "h200-measured"))
    cal_paths = data.get("calibration") or []
    if isinstance(cal_paths, str):
        cal_paths = [cal_paths]
    if cal_paths:
        base = os.path.dirname(os.path.abspath(path))
        hw = apply_calibration(hw, load_calibration(
            [p if os.path.isabs(p) else os.path.join(base, p) for p in cal_paths]))
    runs = data.get("runs")
    if not isinstance(runs, list) or not runs:
        raise PlannerError(f"--validate {path}: 'runs' must be a non-empty list")
    report = ValidationReport(hw)
    for i, run in enumerate(runs):
        if not isinstance(run, dict):
            raise PlannerError(f"--validate {path}: runs[{i}] must be an object")
        report.runs.append(compare_run(run, hw, f"{path} runs[{i}]", tolerance, assumptions))
    return report


def attention_bench_runs(data: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The USP cases of a ``tools/bench_attention.py`` results file as measurement runs:
    one forward and one forward+backward run per case that succeeded."""
    cfg = data.get("config") or {}
    meta = data.get("metadata") or {}
    runs = []
    for res in data.get("results") or []:
        if not isinstance(res, dict) or res.get("method") != "usp" or res.get("status") != "ok":
            continue
        for backward, key in ((False, "fwd_ms"), (True, "fwd_bwd_ms")):
            if not res.get(key):
                continue
            runs.append({
                "kind": "attention",
                "name": f"{res.get('label', 'usp')} S={res['seq_len']} "
                        f"{'fwd+bwd' if backward else 'fwd'}",
                "heads": cfg.get("heads", 32), "kv_heads": cfg.get("kv_heads", cfg.get("heads", 32)),
                "head_dim": cfg.get("head_dim", 128), "batch": cfg.get("batch", 1),
                "seq_length": res["seq_len"], "backward": backward, "gpus": res["gpus"],
                "gpus_per_node": max(res["gpus"], int(meta.get("world_size") or res["gpus"])),
                "layout": {"ulysses_degree": res["ulysses"], "ring_degree": res["ring"]},
                "measured_step_time_s": res[key] / 1e3,
            })
    return runs


def validate_attention_bench(path: str, data: Dict[str, Any],
                             hardware: Union[HardwareSpec, str, None] = None,
                             tolerance: float = DEFAULT_TOLERANCE,
                             assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> ValidationReport:
    """Predicted vs measured for every USP case of a ``tools/bench_attention.py`` file.

    The kernel rates are taken from the same file's single-GPU kernel cases (measured in
    the same run, as the anchors ask); links come from ``hardware`` (default the measured
    2xH200 preset) or its calibration. What is validated is the communication and
    overlap model on top of the measured kernel.
    """
    problem = attention_bench_mask_problem(data.get("config") or {})
    if problem:
        raise PlannerError(f"--validate {path}: {problem}")
    hw = get_hardware(hardware if hardware is not None else "h200-measured")
    try:
        hw = apply_calibration(hw, load_calibration(path))
    except PlannerError as exc:
        raise PlannerError(f"--validate {path}: {exc}") from None
    runs = attention_bench_runs(data)
    if not runs:
        raise PlannerError(f"--validate {path}: no successful 'usp' case to compare")
    report = ValidationReport(hw)
    for run in runs:
        report.runs.append(compare_attention_run(run, hw, f"{path} {run['name']}", tolerance,
                                                 assumptions))
    return report

