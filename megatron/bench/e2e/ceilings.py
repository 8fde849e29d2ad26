"""The zero-overhead ceiling of each length (:mod:`megatron.bench.ceiling`, timed in a
process of its own before the training runs) and its place in the report rows. With
``--docs`` it is the documents ceiling: the attention of the documents the measured
iterations train, at the fastest single-GPU document kernel. A sliding window in
``--extra-args`` (``--window-size``, ``--window-attn-skip-freq``) reaches it too: its layers
are timed through the window kernel."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron.bench.e2e.config import PROGRESS_PREFIX, E2EConfig, E2EResult, RunSpec
from megatron.bench.e2e.launch import run_to_end, trained_batches_of
from megatron.shapes.window import SKIP_FREQ_FLAG, WINDOW_FLAG


def run_ceiling(cfg: E2EConfig) -> Dict[int, dict]:
    """:mod:`megatron.bench.ceiling` for every length, in a process of its own; by length."""
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    out, log_path = log_dir / "ceiling.json", log_dir / "ceiling.log"
    lengths = ",".join(str(s) for s in cfg.seq_lens)
    cmd = [sys.executable, "-m", "megatron.bench.ceiling", "--model", cfg.model,
           "--seq-lens", lengths, "--out", str(out)]
    if cfg.num_layers is not None:
        cmd += ["--num-layers", str(cfg.num_layers)]
    if cfg.peak_tflops is not None:
        cmd += ["--peak-tflops", str(cfg.peak_tflops)]
    cmd += window_args(cfg.extra_args)
    if cfg.docs is not None:
        lengths = log_dir / "ceiling_documents.json"
        lengths.write_text(json.dumps(measured_documents(cfg)))
        cmd += ["--doc-lengths", str(lengths)]
    with open(log_path, "w") as log:
        rc = run_to_end(cmd, dict(os.environ), log, cfg.timeout_s)
    if rc != 0 or not out.exists():
        print(f"{PROGRESS_PREFIX} ceiling measurement failed (log {log_path})", flush=True)
        return {}
    return {int(c["seq_len"]): c for c in json.loads(out.read_text())}


def window_args(extra_args: Sequence[str]) -> List[str]:
    """The sliding-window flags of the training runs' ``--extra-args`` (the last of each, as
    the training's parser takes them), ``--flag value`` or ``--flag=value``."""
    found: Dict[str, str] = {}
    for i, arg in enumerate(extra_args):
        for flag in (WINDOW_FLAG, SKIP_FREQ_FLAG):
            if arg == flag and i + 1 < len(extra_args):
                found[flag] = extra_args[i + 1]
            elif arg.startswith(flag + "="):
                found[flag] = arg[len(flag) + 1:]
    return [x for flag in (WINDOW_FLAG, SKIP_FREQ_FLAG) if flag in found
            for x in (flag, found[flag])]


def measured_documents(cfg: E2EConfig) -> Dict[int, list]:
    """Per length, the document lengths of every sequence the measured iterations (after
    ``--warmup``, up to ``--iters``) of the first split's run train."""
    u, r = cfg.splits[0]
    out = {}
    for seq_len in cfg.seq_lens:
        spec = RunSpec(seq_len, u, r, "none", cfg.iters, profile_step=profiles_step(cfg))
        batches = trained_batches_of(cfg, spec)
        first, end = cfg.warmup * batches.global_batch, cfg.iters * batches.global_batch
        out[seq_len] = [x.tolist() for x in batches.lengths[first:end]]
    return out


def profiles_step(cfg: E2EConfig) -> bool:
    """Whether the training runs profile one iteration after the measured ones for the
    ceiling (:func:`apply_ceiling`): with a ceiling, on one GPU, the rows it applies to."""
    return ceiling_enabled(cfg) and cfg.nproc_per_node == 1


def gemm_ms(c: dict) -> Optional[float]:
    """The ceiling's GEMMs of a step, timed alone: every layer's linears and the output
    layer (None for a ceiling that does not list them)."""
    parts = [c.get(k) for k in ("num_layers", "linears_ms_per_layer", "output_layer_ms")]
    if any(p is None for p in parts):
        return None
    return parts[0] * parts[1] + parts[2]


def apply_ceiling(res: E2EResult, ceilings: Dict[int, dict]) -> None:
    """Ceiling MFU and the share of it reached, for rows of one GPU that trained.

    The ceiling's GEMMs are timed alone on random data; where the same GEMMs ran faster
    inside the run's profiled iteration (``res.step_gemm_ms``), the ceiling counts them at
    that time instead, so that no share reads high because the isolated timing was slow."""
    c = ceilings.get(res.seq_len)
    if c is None or res.gpus != 1 or res.status != "ok" or not res.iter_ms:
        return
    res.ceiling_gemm_ms = gemm_ms(c)
    faster = 0.0
    if res.step_gemm_ms is not None and res.ceiling_gemm_ms is not None:
        faster = max(0.0, res.ceiling_gemm_ms - res.step_gemm_ms)
    ceiling_ms = c["ceiling_ms"] - faster
    mfu = c.get("ceiling_mfu")
    res.ceiling_mfu = None if mfu is None else mfu * c["ceiling_ms"] / ceiling_ms
    res.ceiling_share = ceiling_ms / res.iter_ms
    res.ceiling_share_steady = steady_share(res, c, faster)


def steady_share(res: E2EResult, c: dict, faster: float = 0.0):
    """Packed documents: the share of the ceiling over the measured iterations that built no
    cuDNN plan, against the ceiling of those iterations' own documents (its GEMMs ``faster``
    ms quicker, as :func:`apply_ceiling` counts them). None unless each measured iteration
    trained one sequence whose ceiling was timed, and some iteration was steady."""
    per_seq, flags = c.get("ceiling_ms_per_sequence"), res.iter_steady
    if not per_seq or not flags or len(per_seq) != len(flags) or not res.iter_ms_steady:
        return None
    steady = [ms - faster for ms, flag in zip(per_seq, flags) if flag]
    return sum(steady) / len(steady) / res.iter_ms_steady if steady else None


def ceiling_enabled(cfg: E2EConfig) -> bool:
    return cfg.ceiling == "on" or (cfg.ceiling == "auto" and cfg.use_cuda())
