"""The peers of a length: each trained by :mod:`megatron.bench.hf_peer` in a process of
its own, and its JSON turned into a report row."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import List

import numpy as np

from megatron.bench.cli import BenchConfigError
from megatron.bench.e2e.config import E2EConfig, E2EResult, RunSpec, round_suffix
from megatron.bench.e2e.launch import is_oom_log, run_to_end, trained_batches_of
from megatron.bench.hf_peer import PEERS


def run_peer(cfg: E2EConfig, peer: str, seq_len: int, recompute: str,
             round_: int = 1) -> E2EResult:
    """Train ``peer`` (:mod:`megatron.bench.hf_peer`) at ``seq_len`` in a process of its own."""
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    name = f"S{seq_len}_{peer}_{recompute}{round_suffix(round_)}"
    out, log_path = log_dir / f"{name}.json", log_dir / f"{name}.log"
    if out.exists():
        out.unlink()
    cmd = [sys.executable, "-m", "megatron.bench.hf_peer", "--peer", peer, "--model", cfg.model,
           "--seq-len", str(seq_len), "--iters", str(cfg.iters), "--warmup", str(cfg.warmup),
           "--recompute", recompute, "--seed", str(cfg.seed), "--out", str(out)]
    if cfg.num_layers is not None:
        cmd += ["--num-layers", str(cfg.num_layers)]
    if cfg.peak_tflops is not None:
        cmd += ["--peak-tflops", str(cfg.peak_tflops)]
    if cfg.docs is not None:
        cmd += ["--documents", peer_documents(cfg, seq_len)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        rc = run_to_end(cmd, env, log, cfg.timeout_s)
    data = json.loads(out.read_text()) if out.exists() else None
    if data is None:
        text = log_path.read_text(errors="replace")
        status = "timeout" if rc is None else "oom" if is_oom_log(text) else "error"
        tail = " / ".join(t.strip()[:160] for t in text.splitlines()[-3:] if t.strip())
        data = {"status": status, "note": f"exit {rc}: {tail}"}
    res = peer_result(peer, seq_len, recompute, data, str(log_path),
                      " ".join(shlex.quote(c) for c in cmd), round_)
    res.docs = cfg.docs
    return res


def peer_documents(cfg: E2EConfig, seq_len: int) -> str:
    """The token sequences of ``--docs`` for the peers at ``seq_len``: the first ``--iters``
    samples the first split's run trains (its sequences one by one when its global batch is
    1), as ``LOG_DIR/S{seq_len}_documents.npz``."""
    u, r = cfg.splits[0]
    batches = trained_batches_of(cfg, RunSpec(seq_len, u, r, "none", cfg.iters))
    path = Path(cfg.log_dir) / f"S{seq_len}_documents.npz"
    np.savez(path, tokens=batches.tokens[:cfg.iters],
             position_ids=batches.position_ids[:cfg.iters], eod=batches.eod)
    return str(path)


def peer_result(peer: str, seq_len: int, recompute: str, data: dict, log_path: str,
                command: str, round_: int = 1) -> E2EResult:
    """A report row from a peer's JSON (:class:`megatron.bench.hf_peer.PeerResult` keys)."""
    res = E2EResult(seq_len, 1, 1, recompute, 1, 1, data.get("status", "error"),
                    data.get("note"), log_path=log_path, command=command, stack=peer,
                    round=round_)
    for key in ("iterations_measured", "iter_ms", "tokens_per_s", "tflops_per_gpu", "mfu",
                "peak_mem_gib", "flops_per_iteration", "peak_tflops", "last_loss",
                "num_layers", "attention_path", "flops_count", "attention_pairs",
                "documents_per_iteration"):
        if data.get(key) is not None:
            setattr(res, key, data[key])
    steps = data.get("step_times_s") or []
    if res.iterations_measured and len(steps) >= res.iterations_measured:
        res.iter_ms_each = [1e3 * t for t in steps[len(steps) - res.iterations_measured:]]
    res.tokens_per_s_per_gpu = res.tokens_per_s
    return res


def peer_recompute_order(recompute: str) -> List[str]:
    """Recompute settings to try for a peer, in order, given ``--recompute``."""
    if recompute in ("auto", "lean"):
        return ["none", "full"]  # lean: Hugging Face has no elementwise-only recompute
    if recompute == "selective":
        return ["none"]          # Hugging Face has no MLP-only recompute
    return [recompute]


def parse_peers(text: str) -> List[str]:
    """``hf,hf-liger`` -> ["hf", "hf-liger"]; ``none`` or empty -> []."""
    names = [p.strip() for p in text.split(",") if p.strip() and p.strip() != "none"]
    unknown = [p for p in names if p not in PEERS]
    if unknown:
        raise BenchConfigError(f"--peers {text!r}: unknown {unknown}; choose from "
                               f"{list(PEERS)} or none, e.g. --peers hf,hf-liger")
    if len(set(names)) != len(names):
        raise BenchConfigError(f"--peers {text!r} names a peer twice")
    return names
