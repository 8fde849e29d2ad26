"""The ``pretrain_gpt.py`` command line of one benchmark run."""

from __future__ import annotations

import sys
from typing import List

from megatron.bench.e2e.config import E2EConfig, RunSpec, global_batch_size
from megatron.bench.e2e.documents import data_flags
from megatron.bench.models import model_flags


def recompute_flags(recompute: str) -> List[str]:
    """pretrain_gpt.py flags: none, selective (MLP only) or Megatron's full recompute of
    every layer (``uniform``, one layer per chunk)."""
    if recompute == "none":
        return []
    if recompute == "selective":
        return ["--recompute-granularity", "selective", "--recompute-modules", "mlp"]
    if recompute == "lean":
        return ["--recompute-granularity", "selective", "--recompute-modules", "layernorm",
                "swiglu"]
    if recompute == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"]
    raise ValueError(f"recompute {recompute!r}: a run uses none, selective, lean or full")


def pretrain_args(cfg: E2EConfig, spec: RunSpec, metrics_path: str) -> List[str]:
    """The ``pretrain_gpt.py`` arguments of one run."""
    args = model_flags(cfg.bench_model) + [
        "--seq-length", str(spec.seq_len), "--max-position-embeddings", str(spec.seq_len),
        "--micro-batch-size", str(cfg.micro_batch_size),
        "--global-batch-size", str(global_batch_size(cfg, spec)),
        "--train-iters", str(spec.train_iters), "--eval-iters", "0",
        "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "0", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--ulysses-degree", str(spec.ulysses), "--ring-degree", str(spec.ring),
        "--attention-backend", cfg.attention_backend,
        "--log-interval", "1", "--seed", str(cfg.seed),
        "--metrics-file", metrics_path,
    ] + data_flags(cfg.docs, cfg.log_dir) + recompute_flags(spec.recompute)
    if cfg.device != "auto":
        args += ["--device", cfg.device]
    if cfg.peak_tflops is not None:
        args += ["--peak-tflops", str(cfg.peak_tflops)]
    if cfg.use_cuda():
        args += ["--bf16", "--use-distributed-optimizer"]
    if spec.profile_step:
        k = str(spec.train_iters)
        args += ["--profile", "--profile-step-start", k, "--profile-step-end",
                 str(spec.train_iters + 1), "--profile-ranks", "0",
                 "--profile-dir", spec.profile_dir(cfg.log_dir)]
    return args + list(cfg.extra_args)


def launch_command(cfg: E2EConfig, spec: RunSpec, metrics_path: str, port: int) -> List[str]:
    """``python -m torch.distributed.run ... pretrain_gpt.py ...`` for one run."""
    return [sys.executable, "-m", "torch.distributed.run",
            "--nproc-per-node", str(cfg.nproc_per_node),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            cfg.pretrain_script] + pretrain_args(cfg, spec, metrics_path)
