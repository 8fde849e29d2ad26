"""Launching one configuration: run ``torchrun pretrain_gpt.py`` to its end (or its
timeout), keep its log, read its metrics file and say how it ended (ok, oom, error,
timeout) and why."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

from megatron.bench import trace_summary
from megatron.bench.e2e.command import launch_command, pretrain_args
from megatron.bench.e2e.config import REPO_ROOT, E2EConfig, RunOutcome, RunSpec
from megatron.bench.e2e.documents import trained_batches
from megatron.bench.e2e.summary import train_steps
from megatron.training.launch import free_port

# Log lines that mean "out of memory" (CUDA caching allocator, NCCL, host).
OOM_MARKERS = ("outofmemoryerror", "out of memory", "cudaerrormemoryallocation",
               "cannot allocate memory")


def is_oom_log(text: str) -> bool:
    low = text.lower()
    return any(m in low for m in OOM_MARKERS)


def read_metrics(path: str) -> List[dict]:
    """Per-iteration records of a JSONL metrics file (missing file: none)."""
    p = Path(path)
    if not p.exists():
        return []
    records = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue                         # a line cut short by a crash
    return records


def run_to_end(cmd: List[str], env: dict, log, timeout_s: float) -> Optional[int]:
    """Run ``cmd`` in its own session; its exit code, or None after killing it on timeout.

    torchrun's workers are its children: on timeout the whole session is stopped (SIGTERM,
    then SIGKILL), so no worker is left holding a GPU.
    """
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return None


def run_training(cfg: E2EConfig, spec: RunSpec) -> RunOutcome:
    """Launch one run, wait for it, classify how it ended; the log goes to ``--log-dir``."""
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    metrics = log_dir / f"{spec.name}.metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    log_path = log_dir / f"{spec.name}.log"
    cmd = launch_command(cfg, spec, str(metrics), free_port())
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        rc = run_to_end(cmd, env, log, cfg.timeout_s)
    records = read_metrics(str(metrics))
    outcome = classify(rc, Path(log_path).read_text(errors="replace"), records, str(log_path),
                       cmd, spec.iters)
    if cfg.docs is not None and outcome.status == "ok":
        count_documents(cfg, spec, outcome)
    if spec.profile_step and outcome.status == "ok":
        outcome.step_gemm_ms = profiled_gemm_ms(spec.profile_trace(cfg.log_dir))
    return outcome


def profiled_gemm_ms(trace_path: str) -> Optional[float]:
    """Device time of the GEMM kernels in the Chrome trace of one profiled iteration
    (:func:`megatron.bench.trace_summary.category`), None without a trace or a GEMM in it;
    the trace's summary goes beside it (``.summary.txt``)."""
    if not os.path.exists(trace_path):
        return None
    with open(trace_path) as fh:
        summary = trace_summary.summarize(json.load(fh))
    Path(trace_path).with_suffix(".summary.txt").write_text(
        trace_summary.render(trace_path, summary, kernels=3) + "\n")
    gemm = summary["by_category_ms"].get("gemm")
    return gemm if gemm else None


def trained_batches_of(cfg: E2EConfig, spec: RunSpec):
    """The samples the run of ``spec`` trains (:func:`megatron.bench.e2e.documents.trained_batches`)."""
    # Neither the metrics path nor recompute plays a part in the data: fixed, so that runs
    # differing only there share one rebuild.
    args = pretrain_args(cfg, replace(spec, recompute="none", round=1), "metrics.jsonl")
    return trained_batches(args, cfg.nproc_per_node, cfg.use_cuda())


def count_documents(cfg: E2EConfig, spec: RunSpec, outcome: RunOutcome) -> None:
    """Attach each iteration's documents and useful pairs to a run that trained; a run whose
    documents cannot be counted is an error rather than a row with the dense count."""
    try:
        batches = trained_batches_of(cfg, spec)
    except Exception as exc:  # noqa: BLE001 - the run trained; say why it cannot be counted
        outcome.status = "error"
        outcome.note = f"counting the trained documents failed: {type(exc).__name__}: {exc}"[:300]
        return
    outcome.attention_pairs = batches.pairs_per_iteration()
    outcome.documents = batches.documents_per_iteration()


def classify(returncode: Optional[int], log_text: str, records: List[dict], log_path: str,
             cmd: List[str], iters: int) -> RunOutcome:
    """ok: exit 0 and every iteration logged; oom / timeout / error otherwise."""
    if returncode is None:
        return RunOutcome("timeout", None, records, log_path, cmd, "timed out (--timeout)")
    if returncode == 0 and _iterations(records) >= iters:
        return RunOutcome("ok", 0, records, log_path, cmd)
    if is_oom_log(log_text):
        return RunOutcome("oom", returncode, records, log_path, cmd, "out of memory")
    note = (f"exit {returncode}, {_iterations(records)}/{iters} iterations logged: "
            + failure_cause(log_text))
    return RunOutcome("error", returncode, records, log_path, cmd, note)


def _iterations(records: List[dict]) -> int:
    return len(train_steps(records))


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception)\b(?::|$)")


_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")   # torchrun's per-rank log prefix


def failure_cause(log_text: str) -> str:
    """The line of a failed run's log that says why: a bad-input message
    (``pretrain_gpt.py: error: ...``), else the last exception line of a traceback other than
    torchrun's own ``ChildFailedError`` (which ends every failed log and says nothing), else
    the last three lines."""
    lines = [_RANK_PREFIX.sub("", ln).strip() for ln in log_text.splitlines()]
    lines = [ln for ln in lines if ln]
    for ln in lines:
        if ": error: " in ln and ln.split(": error: ", 1)[0].endswith(".py"):
            return ln[:300]
    causes = [ln for ln in lines if _EXCEPTION_LINE.match(ln) and "ChildFailedError" not in ln]
    if causes:
        return causes[-1][:300]
    return " / ".join(t[:160] for t in lines[-3:])
