"""One run's report row from its metrics records: the mean iteration time after
``--warmup``, tokens/s, TFLOP/s and MFU (the one FLOP count,
:func:`megatron.shapes.training_flops`: dense causal sequences, or with ``--docs`` the pairs
of the documents each measured iteration trained), and the memory peaks."""

from __future__ import annotations

import math
import shlex
from typing import List, Optional

from megatron.bench.e2e.config import (
    USEFUL_COUNT,
    E2EConfig,
    E2EResult,
    RunOutcome,
    RunSpec,
    global_batch_size,
)
from megatron.bench.flops import tflops_per_gpu
from megatron.shapes import dense_training_flops, training_flops


def train_steps(records: List[dict]) -> List[dict]:
    """The ``kind == "train"`` records in iteration order, the last one of each iteration.

    Schema of :mod:`megatron.training.observe.metrics`: ``iteration``, ``step_time_s``, ``lm_loss``,
    ``tokens_per_s``, ``tflops_per_gpu``, ``mfu``, ``mem_gib`` (peak allocated so far on the
    logging rank); a resumed run appends, so a later record of an iteration wins.
    """
    last = {r["iteration"]: r for r in records
            if r.get("kind") == "train" and isinstance(r.get("iteration"), int)}
    return [last[i] for i in sorted(last)]


def _number(record: dict, key: str) -> Optional[float]:
    v = record.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _peak(steps: List[dict], key: str) -> Optional[float]:
    values = [v for v in (_number(r, key) for r in steps) if v is not None]
    return max(values) if values else None


def peak_tflops_of_run(steps: List[dict]) -> Optional[float]:
    """The MFU denominator the training loop used (its device table): tflops / mfu."""
    for r in steps:
        tflops, mfu = _number(r, "tflops_per_gpu"), _number(r, "mfu")
        if tflops and mfu:
            return tflops / mfu
    return None


def summarize(cfg: E2EConfig, spec: RunSpec, outcome: RunOutcome) -> E2EResult:
    """Turn a run into a report row: the mean iteration time after ``--warmup``.

    FLOPs per iteration are the one count (:func:`megatron.shapes.dense_training_flops`,
    the training loop's too; with ``--docs`` :func:`megatron.shapes.training_flops` of the
    trained documents' pairs, ``res.flops_count`` says which); MFU uses
    ``--peak-tflops`` or else the peak the training loop itself used (none on the CPU).
    """
    gbs = global_batch_size(cfg, spec)
    res = E2EResult(spec.seq_len, spec.ulysses, spec.ring, spec.recompute, cfg.nproc_per_node,
                    gbs, outcome.status, outcome.note, log_path=outcome.log_path,
                    command=" ".join(shlex.quote(c) for c in outcome.command),
                    round=spec.round)
    res.flops_per_iteration = dense_training_flops(cfg.shape, spec.seq_len, gbs)
    res.docs = cfg.docs
    steps = train_steps(outcome.records)
    if steps:
        res.last_loss = _number(steps[-1], "lm_loss")
    res.num_layers = cfg.shape.num_layers
    res.peak_mem_gib = _peak(steps, "mem_gib")
    res.peak_host_gib = _peak(steps, "host_mem_gib")
    res.step_gemm_ms = outcome.step_gemm_ms
    # after --warmup, up to --iters: a profiled iteration after them is not timed
    measured = [r for r in steps[cfg.warmup:spec.iters] if _number(r, "step_time_s")]
    times = [_number(r, "step_time_s") for r in measured]
    if outcome.status != "ok" or not times:
        if outcome.status == "ok":
            res.status, res.note = "error", "no timed iterations after --warmup"
        return res
    res.iterations_measured = len(times)
    seconds = sum(times) / len(times)
    if cfg.docs is not None:
        if not _count_useful(cfg, spec, gbs, outcome, measured, res):
            return res
    _count_window(cfg, measured, res)
    res.iter_ms = 1e3 * seconds
    res.iter_ms_each = [1e3 * t for t in times]
    _count_steady(measured, times, res)
    res.tokens_per_s = gbs * spec.seq_len / seconds
    res.tokens_per_s_per_gpu = res.tokens_per_s / cfg.nproc_per_node
    res.tflops_per_gpu = tflops_per_gpu(res.flops_per_iteration, seconds, cfg.nproc_per_node)
    res.peak_tflops = cfg.peak_tflops or peak_tflops_of_run(steps)
    res.mfu = res.tflops_per_gpu / res.peak_tflops if res.peak_tflops else None
    return res


def _count_steady(measured: List[dict], times: List[float], res: E2EResult) -> None:
    """Packed documents: which measured iterations built no cuDNN plan (the loop's
    ``new_plan_shapes`` is 0) and their mean time; left None when the records lack the field
    (dense sequences, or a loop that does not record it)."""
    if not measured or any(not isinstance(r.get("new_plan_shapes"), int) for r in measured):
        return
    res.iter_steady = [r["new_plan_shapes"] == 0 for r in measured]
    steady = [t for flag, t in zip(res.iter_steady, times) if flag]
    res.steady_iterations = len(steady)
    res.iter_ms_steady = 1e3 * sum(steady) / len(steady) if steady else None


def _count_window(cfg: E2EConfig, measured: List[dict], res: E2EResult) -> None:
    """A sliding window from ``--extra-args`` (``--window-size``): the training loop counts the
    pairs inside the window (``flops_count`` "..., window W on k of L layers"), which this tool
    cannot rebuild; FLOPs per iteration are then the loop's own, the mean over the measured
    iterations of its TFLOP/s x step time x GPUs."""
    labels = {r.get("flops_count") for r in measured}
    label = next((x for x in labels if x and "window" in x), None)
    if label is None:
        return
    flops = [_number(r, "tflops_per_gpu") * 1e12 * _number(r, "step_time_s") * cfg.nproc_per_node
             for r in measured if _number(r, "tflops_per_gpu") and _number(r, "step_time_s")]
    if not flops:
        return
    res.flops_per_iteration = sum(flops) / len(flops)
    res.flops_count = label


def _count_useful(cfg: E2EConfig, spec: RunSpec, gbs: int, outcome: RunOutcome,
                  measured: List[dict], res: E2EResult) -> bool:
    """With ``--docs``: FLOPs per iteration from the documents the measured iterations trained
    (their mean, so TFLOP/s = their FLOPs over their time). False, with the row an error, when
    the run's documents were not counted."""
    pairs, docs = outcome.attention_pairs, outcome.documents or []
    index = [int(r["iteration"]) - 1 for r in measured]
    if pairs is None or not index or max(index) >= len(pairs):
        res.status, res.note = "error", "--docs: the trained documents were not counted"
        return False
    chosen = [pairs[i] for i in index]
    res.flops_count = USEFUL_COUNT
    res.attention_pairs = sum(chosen) / len(chosen)
    if docs:
        res.documents_per_iteration = sum(docs[i] for i in index) / len(index)
    res.flops_per_iteration = sum(training_flops(cfg.shape, gbs * spec.seq_len, p)
                                  for p in chosen) / len(chosen)
    return True
